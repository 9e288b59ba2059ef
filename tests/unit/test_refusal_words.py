"""A refusal in the kernel's own words (issue 36, verdict defect 9): the ``error_log`` entry
each kind of line leaves (subsystem, message, caret column) and the errno, on the host
side (predicted) and on the events side (read back), in ``harness.records.Outcome``."""
from __future__ import annotations

import errno
import os

import pytest

from harness.backends.events import (logged_words,
                                     reader_script_text, refusal_outcome, write_error,
                                     written_column)
from harness.backends.tracelayer import refused
from harness.errors import ProbeSpecError
from harness.kernel.dynevent import (FAIL_REG_PROBE, UNKNOWN_WORDS, WORDS_MODULE, EventTable,
                                     Refusal, arg_column, events_file, events_file_of,
                                     line_files, subsystem_of)
from harness.kernel.grammar import (KernelView, error_subsystem, format_error, guest_line,
                                    line_subsystem, parse)
from harness.kernel.rules import SOURCES, rules_for
from harness.records import Outcome


def view(series: str) -> KernelView:
    return KernelView(rules_for(series))


def test_outcome_defaults_say_nothing_was_logged():
    o = Outcome("kprobes/x", True)
    assert (o.subsystem, o.column, o.words) == ("", -1, "")
    r = Outcome.rejected("kprobes/x", errno.EINVAL, "Invalid register name", index=3,
                         subsystem="trace_kprobe", column=23)
    assert r.error_log() == ("trace_kprobe", "Invalid register name", 23)
    assert (r.accepted, r.errno, r.index, r.words) == (False, errno.EINVAL, 3, "")


def test_the_unknowable_cases_are_named_in_one_place_with_their_source():
    assert WORDS_MODULE in UNKNOWN_WORDS
    assert all("kernel/" in why for why in UNKNOWN_WORDS.values())


@pytest.mark.parametrize("line,series,subsystem", [
    ("p:k vfs_read", "6.1", "trace_kprobe"),
    ("r:k vfs_read", "7.3", "trace_kprobe"),
    ("p:u /bin/sh:0x10", "6.12", "trace_uprobe"),
    ("f:f vfs_read", "6.12", "trace_fprobe"),
    ("t:t sched_switch", "7.3", "trace_fprobe"),
    ("e:e sched.sched_switch", "7.3", "event_probe"),
])
def test_each_kind_logs_under_its_parsers_name(line, series, subsystem):
    spec = parse(line, kernel=view(series), uprobe_symbols=False)
    assert subsystem_of(spec) == subsystem
    assert line_subsystem(line.split()) == subsystem


@pytest.mark.parametrize("series,line,subsystem,message,column", [
    ("6.1", "p:bad do_sys_openat2 x=%zz", "trace_kprobe", "Invalid register name", 23),
    ("7.3", "p:bad  do_sys_openat2   x=%zz", "trace_kprobe", "Invalid register name", 23),
    ("6.12", "r:bad vfs_read $arg1 $zz", "trace_kprobe", "Invalid $-variable specified", 21),
    ("7.3", "p:u /bin/sh:0x10 %zz", "trace_uprobe", "Invalid register name", 17),
    ("6.12", "f:f vfs_read %ax", "trace_fprobe", "Invalid fetch argument", 13),
    ("7.3", "f:f vfs_read %ax", "trace_fprobe", "Invalid $-variable specified", 13),
    ("7.3", "f:f vfs_read @+10", "trace_fprobe",
     "File offset is not available for kernel probes", 13),
    ("6.12", "f:f vfs_read @+10", "trace_fprobe", "File offset is not available with kprobe", 13),
    ("7.3", "t:t sched-switch", "trace_fprobe", "Invalid character in tracepoint name", 9),
    ("6.12", "e:e sched", "event_probe", "This requires both group and event name to attach", 4),
    # the filter is the command of its own entry, its caret in the filter
    ("7.3", "e:e sched.sched_switch if prev_pid ===", "event filter parse error",
     "Invalid value (did you forget quotes)?", 12),
    # create_dyn_event(): no kind takes an 'f' head alone; 7.3 logs it at 0
    ("7.3", "f", "dynevent", "No matching dynamic event type", 0),
])
def test_parse_refusals_carry_the_subsystem_message_and_caret(series, line, subsystem,
                                                               message, column):
    with pytest.raises(ProbeSpecError) as ei:
        parse(line, kernel=view(series), uprobe_symbols=False)
    err = ei.value
    assert (error_subsystem(err), str(err), err.column) == (subsystem, message, column)
    first = format_error(err).splitlines()[0]
    assert first == f"{subsystem}: error: {message}"


def test_a_refusal_the_kernel_does_not_log_has_no_subsystem():
    with pytest.raises(ProbeSpecError) as ei:
        parse("f", kernel=view("6.12"))         # 6.12: -EINVAL, nothing logged
    assert not ei.value.logged and error_subsystem(ei.value) == ""
    # shown under its kind's parser all the same
    assert format_error(ei.value).startswith("trace_fprobe: error: ")


def test_format_error_of_an_error_raised_elsewhere_takes_the_lines_kind():
    err = ProbeSpecError("Invalid register name", "p:x /bin/sh:0x10 %zz", 17)
    assert format_error(err).startswith("trace_uprobe: error: ")
    err = ProbeSpecError("Invalid register name", "f:x vfs_read %zz", 13)
    assert format_error(err).startswith("trace_fprobe: error: ")
    assert format_error(err, "trace_kprobe").startswith("trace_kprobe: error: ")


def test_registration_refusals_take_the_subsystem_of_the_lines_kind():
    k = parse("p:kprobes/x   do_int3", kernel=view("7.3"))
    f = parse("f:fprobes/x non_exist_func", kernel=view("7.3"))
    r = Refusal(errno.EINVAL, FAIL_REG_PROBE, arg_column(k, 1))
    assert r.words(k) == ("trace_kprobe", FAIL_REG_PROBE, 12)
    o = refused("fprobes/x", f, Refusal(errno.EINVAL, "Invalid probed address or symbol",
                                        arg_column(f, 1)), index=0, reason="no match")
    assert o.error_log() == ("trace_fprobe", "Invalid probed address or symbol", 12)
    assert (o.errno, o.reason, o.words) == (errno.EINVAL, "no match", "")


def test_a_silent_refusal_is_its_strerror_without_subsystem_or_caret():
    spec = parse("p:kprobes/x vfs_read")
    o = refused("kprobes/x", spec, Refusal.silent(errno.ENOENT), index=1, reason="why")
    assert o.error_log() == ("", "No such file or directory", -1)
    assert o.reason == "why"


def test_a_reference_counter_mismatch_logs_nothing():
    table = EventTable()
    a = parse("p:uprobes/a /bin/sh:0x10(0x20)", uprobe_symbols=False)
    table.add(a)
    b = parse("p:uprobes/b /bin/sh:0x10(0x28)", uprobe_symbols=False)
    r = table.check(b)
    assert r is not None and not r.logged
    assert r.words(b) == ("", "Invalid argument", -1)


def test_an_existing_events_argument_is_logged_at_that_argument():
    table = EventTable()
    table.add(parse("p:kprobes/d do_sys_openat2 a=%di"))
    b = parse("p:kprobes/d   do_sys_openat2  a=%si:u32")
    assert table.check(b).words(b) == (
        "trace_kprobe", "Argument type or name is different from existing probe", 27)


def test_fprobe_at_symbols_are_resolved_at_enable_on_7_3_only():
    assert rules_for("7.3").fprobe_register_at_enable
    assert not rules_for("6.12").fprobe_register_at_enable
    assert "fprobe_register_at_enable" in SOURCES["7.3"]


# ---------------------------------------------------------------- the events side

def _entry(sub: str, msg: str, command: str, caret: int) -> list[str]:
    """What kph_log prints for an error_log entry (the caret line as its length)."""
    return [f"[  123.456789] {sub}: error: {msg}", f"  Command: {command}",
            f"caret {len('  Command: ') + caret + 1}"]


def test_the_whole_error_log_entry_is_read():
    got = logged_words(_entry("event_probe", "This event field is not found.",
                              "e:eprobes/e sched.sched_switch nofield", 30))
    assert got == ("event_probe", "This event field is not found.",
                   "e:eprobes/e sched.sched_switch nofield", 30)
    assert logged_words([]) is None
    assert logged_words(["  Command: p x"]) is None


def test_the_guests_caret_is_taken_back_to_the_line_as_written():
    spec = parse("p  do_sys_openat2   x=%ax", kernel=view("6.1"))
    cmd = guest_line(spec)              # p:kprobes/p_do_sys_openat2_0 do_sys_openat2 x=...
    assert written_column(spec, cmd, cmd.index("x=%")) == 17
    assert written_column(spec, cmd, cmd.index("%ax")) == 19
    assert written_column(spec, cmd, cmd.index(" do_sys") + 1) == 2
    assert written_column(spec, cmd, 0) == 0
    assert written_column(spec, cmd, len(cmd) + 1) == len("p do_sys_openat2 x=%ax") + 1
    assert written_column(spec, cmd, -1) == -1


def test_a_uprobe_lines_canonical_words_map_back():
    spec = parse("p /bin/sh:0x10 %ip", uprobe_symbols=False)
    cmd = guest_line(spec)              # p:uprobes/... /bin/sh:0x0000000000000010 arg1=%ip
    assert written_column(spec, cmd, cmd.index("/bin")) == 2
    assert written_column(spec, cmd, cmd.index("%ip")) == 15
    assert written_column(spec, cmd, len(cmd) + 1) == len("p /bin/sh:0x10 %ip") + 1


def test_a_guest_refusal_outcome():
    spec = parse("p:kprobes/x vfs_read x=@nosuch", kernel=view("6.1"))
    cmd = guest_line(spec)
    o = refusal_outcome("kprobes/x", spec, "@err sh: write error: No such file or directory",
                        _entry("trace_kprobe", "Invalid probed address or symbol", cmd,
                               cmd.index("vfs_read")), index=2)
    assert (o.errno, o.index) == (errno.ENOENT, 2)
    assert o.error_log() == ("trace_kprobe", "Invalid probed address or symbol", 12)
    # a filter's caret is in the filter
    e = parse("e:eprobes/e sched.sched_switch if prev_pid > 1", kernel=view("7.3"))
    o = refusal_outcome("eprobes/e", e, "@err sh: write error: Invalid argument",
                        _entry("event filter parse error", "Field not found", "prev_pid > 1",
                               0), index=0)
    assert o.error_log() == ("event filter parse error", "Field not found", 0)
    # nothing logged, or an enable that failed: strerror, no subsystem, no caret
    for detail in ([], ["enable: error: failed"]):
        o = refusal_outcome("kprobes/x", spec, "@err sh: write error: Invalid argument",
                            detail, index=0)
        assert o.error_log() == ("", "Invalid argument", -1) and o.errno == errno.EINVAL


def test_a_failed_open_is_its_errno_not_a_stale_text():
    """busybox's shell words for an ``echo ... > FILE`` that failed: its write's, or the
    open's (ENOENT said as "nonexistent directory", shell/ash.c: errmsg())."""
    assert write_error("sh: write error: File exists") == "File exists"
    assert write_error("/bin/sh: can't create events/a/b/enable: nonexistent directory") \
        == os.strerror(errno.ENOENT)
    assert write_error("sh: can't create kprobe_events: Permission denied") == \
        "Permission denied"
    assert write_error("") == ""
    spec = parse("p:kprobes/x vfs_read")
    o = refusal_outcome("kprobes/x", spec, "@err sh: can't create events/kprobes/x/enable: "
                        "nonexistent directory", ["enable: error: failed"], index=0)
    assert (o.errno, o.message, o.reason) == (errno.ENOENT, os.strerror(errno.ENOENT),
                                              "enabling it failed")


def test_the_readers_answer_reads_as_the_shells_text():
    """kph-reader's ``w`` answer (errnos) in the shell script's words, each ``@erro``
    naming the file whose open failed: the line's, or its enable file's."""
    files = [("kprobe_events", "events/k/a/enable"), ("kprobe_events", "events/k/b/enable"),
             ("kprobe_events", "events/k/c/enable"), ("uprobe_events", "")]
    text = ("@ok\n@errw 22\n[ 1.0] trace_kprobe: error: Invalid argument\n  Command: p x\n"
            "caret 13\n@erro 2\nenable: error: failed\n@erro 13\n@cpus\ncpu0\n")
    assert reader_script_text(text, files).split("\n") == [
        "@ok", "@err sh: write error: Invalid argument",
        "[ 1.0] trace_kprobe: error: Invalid argument", "  Command: p x", "caret 13",
        "@err sh: can't create events/k/c/enable: nonexistent directory",
        "enable: error: failed", "@err sh: can't create uprobe_events: Permission denied",
        "@cpus", "cpu0", ""]
    spec = parse("p:kprobes/x vfs_read")
    status, *detail = reader_script_text("@errw 17\n", files[:1]).split("\n")
    o = refusal_outcome("kprobes/x", spec, status, [d for d in detail if d], index=0)
    assert (o.errno, o.message) == (errno.EEXIST, os.strerror(errno.EEXIST))


def test_a_registration_that_fails_for_memory_or_an_existing_probe_logs_nothing_there():
    from harness.kernel.dynevent import registration_refusal

    spec = parse("p:kprobes/x vfs_read")
    for e in (errno.ENOMEM, errno.EEXIST):
        r = registration_refusal(spec, e, lambda m: True)
        assert r.errno == e and r.words(spec) == ("", os.strerror(e), -1)
    r = registration_refusal(spec, errno.EBUSY, lambda m: True)
    assert r.words(spec) == ("trace_kprobe", FAIL_REG_PROBE, 12)


#: events a batch defines, and the file each one's line goes to
_DEFINED = {"f/r": {"dynamic_events"}, "e/o": {"dynamic_events"}, "u/b": {"uprobe_events"},
            "k/o": {"kprobe_events"}, "m/u": {"uprobe_events"}, "m/k": {"kprobe_events"},
            # e:d/e then p:d/e (refused: the name is taken), as dynevent/test_duplicates.tc
            "d/e": {"dynamic_events", "kprobe_events"}}


@pytest.mark.parametrize("line, defined, file", [
    ("p:k/o do_sys_openat2", {}, "kprobe_events"),
    ("  r10 vfs_read", {}, "kprobe_events"),
    ("p:u/b /bin/busybox:0x10", {}, "uprobe_events"),
    ("f:f/r vfs_read%return", {}, "dynamic_events"),
    ("t:t/s sched_switch", {}, "dynamic_events"),
    ("e:e/o syscalls/sys_enter_openat", {}, "dynamic_events"),
    ("-:k/o", {}, "kprobe_events"),
    ("-:u/b /bin/busybox:0x10", {}, "uprobe_events"),
    ("-:f/r", _DEFINED, "dynamic_events"),
    ("-:r", _DEFINED, "dynamic_events"),
    ("-:f/", _DEFINED, "dynamic_events"),
    ("-:e/o", _DEFINED, "dynamic_events"),
    ("-:u/b", _DEFINED, "uprobe_events"),
    ("-:b", _DEFINED, "uprobe_events"),
    ("-:k/o", _DEFINED, "kprobe_events"),
    ("-:m/", _DEFINED, "dynamic_events"),          # a uprobe and a kprobe: every kind
    ("-:m/k", _DEFINED, "kprobe_events"),
    ("-:g/r", _DEFINED, "kprobe_events"),
    ("-:g/", _DEFINED, "kprobe_events"),
    ("-:g/b /bin/busybox:0x10", _DEFINED, "uprobe_events"),
    ("-:d/e", _DEFINED, "dynamic_events"),
])
def test_a_line_goes_to_the_file_of_its_kind_and_a_spec_to_the_same(line, defined, file):
    """kernel/trace/trace_kprobe.c: create_or_delete_trace_kprobe() (and trace_uprobe.c's)
    remove their own kind only, so a ``-:`` line goes where the events it names were
    defined, and to dynamic_events when they were defined in two; the parsed line goes
    where its text goes."""
    assert events_file_of(line, defined) == file
    spec = parse(line, kernel=KernelView(rules_for("6.12")), uprobe_symbols=False)
    assert events_file(spec, defined) == file


def test_line_files_names_each_defined_events_file():
    specs = [parse(ln, kernel=KernelView(rules_for("6.12")), uprobe_symbols=False) for ln in (
        "p:k/o do_sys_openat2", "p:u/b /bin/busybox:0x10", "f:f/r vfs_read%return",
        "e:e/o syscalls/sys_enter_openat", "-:k/o", "p:e/o vfs_read")]
    assert line_files(specs) == {"k/o": {"kprobe_events"}, "u/b": {"uprobe_events"},
                                 "f/r": {"dynamic_events"},
                                 "e/o": {"dynamic_events", "kprobe_events"}}
