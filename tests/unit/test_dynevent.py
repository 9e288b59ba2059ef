"""harness.kernel.dynevent: the trace-event layer's decisions, with the messages and carets the
6.1 guest gave for the same lines (tests/vm/test_fidelity.py checks them in the guest)."""
import errno

import pytest

from harness.kernel.dynevent import (BAD_PROBE_ADDR, DIFF_ARG_TYPE, DIFF_PROBE_TYPE, EVENT_EXIST,
                              FAIL_REG_PROBE, NON_UNIQ_SYMBOL, SAME_PROBE, EventTable, Refusal,
                              arg_column, module_pending, registration_refusal,
                              resolve_fetch_symbols, target_refusal)
from harness.kernel.grammar.fetch import MemSymbol
from harness.kernel.grammar import parse

FORK = "kernel_clone"


def table(*lines, other=()):
    t = EventTable(other=set(other))
    for ln in lines:
        assert t.check(parse(ln)) is None
        t.add(parse(ln))
    return t


# kprobe_syntax_errors.tc, "multiprobe errors" (the caret is where check_error puts ^)
@pytest.mark.parametrize("existing,line,msg", [
    (f"p:kprobes/testevent {FORK}", "^r:kprobes/testevent do_exit", DIFF_PROBE_TYPE),
    (f"p:kprobes/testevent {FORK} abcd=\\1", f"p:kprobes/testevent {FORK} ^bcd=\\1", DIFF_ARG_TYPE),
    (f"p:kprobes/testevent {FORK} abcd=\\1", f"p:kprobes/testevent {FORK} ^abcd=\\1:u8",
     DIFF_ARG_TYPE),
    (f"p:kprobes/testevent {FORK} abcd=\\1", f"p:kprobes/testevent {FORK} ^abcd=\\\"foo\"",
     DIFF_ARG_TYPE),
    (f"p:kprobes/testevent {FORK} abcd=\\1", f"^p:kprobes/testevent {FORK} abcd=\\1", SAME_PROBE),
    # kprobe_multiprobe.tc: "Appending different type must fail"
    (f"p:kprobes/testevent {FORK}", f"p:kprobes/testevent {FORK} ^$stack", DIFF_ARG_TYPE),
    # the case: another function, an extra argument
    (f"p:kprobes/testevent {FORK}", "p:kprobes/testevent do_exit ^$stack", DIFF_ARG_TYPE),
    # test_duplicates.tc
    ("p:kgroup/kevent vfs_open file=+0($arg2)", "^p:kgroup/kevent vfs_open file=+0($arg2)",
     SAME_PROBE),
    # fewer arguments than the event: the caret goes one past the end of the line
    (f"p:kprobes/e {FORK} a=%di", f"p:kprobes/e {FORK} ^", DIFF_ARG_TYPE),
])
def test_existing_event_names_refuse_with_eexist(existing, line, msg):
    text = line.replace("^", "")
    got = table(existing).check(parse(text.strip()))
    assert got == Refusal(errno.EEXIST, msg, line.index("^")), got


def test_appending_and_what_counts_as_the_same_probe():
    t = table(f"p:kprobes/testevent {FORK}")
    assert t.check(parse("p:kprobes/testevent do_exit")) is None        # appended
    assert t.check(parse(f"p:kprobes/testevent {FORK}+0")).message == SAME_PROBE
    # a bitfield's type is its container's: u32 and b4@0/32 are one type
    t = table("p:kprobes/b f x=%di:u32")
    assert t.check(parse("p:kprobes/b g x=%di:b4@0/32")) is None
    # two raw-address probes are "the same" whatever the address (trace_kprobe_symbol()
    # is "unknown" for both): seen in the guest
    t = table("p:b1 0xffffffff8134cc50")
    assert t.check(parse("p:b1 0xffffffff8134a350")).message == SAME_PROBE


def test_names_of_other_events_and_of_other_probe_kinds():
    t = table(other={"syscalls/sys_enter_open"})
    assert t.check(parse("p:syscalls/sys_enter_open vfs_open")) == \
        Refusal(errno.EEXIST, EVENT_EXIST, 0)
    t = table("p:uprobes/u /bin/sh:0x10")
    assert t.check(parse("p:uprobes/u vfs_read")).message == EVENT_EXIST


def test_uprobe_events_compare_inode_and_offset():
    t = EventTable(identity=lambda s: "inode-of-" + s.path.replace("/bin/ash", "/bin/sh"))
    t.add(parse("p:uprobes/u /bin/sh:0x10 a=%ax"))
    assert t.check(parse("p:uprobes/u /bin/ash:0x10 a=%ax")).message == SAME_PROBE
    assert t.check(parse("p:uprobes/u /bin/sh:0x20 a=%ax")) is None
    assert t.check(parse("r:uprobes/u /bin/sh:0x20 a=%ax")).message == DIFF_PROBE_TYPE


def test_symbol_counts():
    counts = {"vfs_read": 1, "name_show": 6}.get
    assert target_refusal(parse("p vfs_read"), lambda n: counts(n, 0)) is None
    assert target_refusal(parse("p:t name_show"), lambda n: counts(n, 0)) == \
        Refusal(errno.EADDRNOTAVAIL, NON_UNIQ_SYMBOL, 4)
    assert target_refusal(parse("p non_exist_func"), lambda n: 0) == \
        Refusal(errno.ENOENT, BAD_PROBE_ADDR, 2)
    assert target_refusal(parse("p mod:f"), lambda n: 0) is None         # counted later
    assert target_refusal(parse("p 0xffffffff81000000"), lambda n: 0) is None


SYMS = {"_sdata": 0xFFFFFFFF82A00000, "linux_proc_banner": 0xFFFFFFFF82000280}


# kprobe_args_syntax.tc, "Symbol access"
@pytest.mark.parametrize("arg", ["@", "@deaqswdefr", "@_sdata*10", "@_sdata/10", "@_sdata%10",
                                 "@_sdata&10", "@_sdata|10"])
def test_bad_fetch_symbols_parse_and_are_enoent_at_registration(arg):
    spec = parse(f"p:e vfs_read {arg}")                 # the kernel's parser takes them
    got = resolve_fetch_symbols(spec, SYMS.get)
    assert got == Refusal(errno.ENOENT, BAD_PROBE_ADDR, 4)   # the caret on the target


def test_a_bad_fetch_symbol_offset_is_einval():
    spec = parse("p:e vfs_read x=@_sdata+zz")
    assert spec.args[0].fetch == MemSymbol("_sdata+zz")
    assert resolve_fetch_symbols(spec, SYMS.get) == Refusal(errno.EINVAL, FAIL_REG_PROBE, 4)


@pytest.mark.parametrize("arg,addr", [("@_sdata", 0xFFFFFFFF82A00000),
                                      ("@_sdata+10", 0xFFFFFFFF82A0000A),
                                      ("@_sdata-10", 0xFFFFFFFF829FFFF6),
                                      ("+10(@_sdata-10)", 0xFFFFFFFF829FFFF6)])
def test_good_fetch_symbols_become_immediates(arg, addr):
    spec = resolve_fetch_symbols(parse(f"p:e vfs_read x={arg}"), SYMS.get)
    assert spec.args[0].code[0] == ("imm", addr)
    assert all(op[0] != "nop_symbol" for op in spec.args[0].code)


def test_the_enoent_the_kernel_forgives():
    loaded = {"virtio_console"}.__contains__
    # a raw address, or a module not loaded: the event is kept, unregistered
    assert registration_refusal(parse("p:a 0x1234"), errno.ENOENT, loaded) is None
    assert registration_refusal(parse("p:a nosuchmod:foo"), errno.ENOENT, loaded) is None
    assert module_pending(parse("p:a 0xffffffff8134cc50 x=@bogus"), loaded)
    # a loaded module, or a plain symbol: refused
    assert registration_refusal(parse("p:a virtio_console:nosuch"), errno.ENOENT, loaded) == \
        Refusal(errno.ENOENT, BAD_PROBE_ADDR, 4)
    assert registration_refusal(parse("p:x do_int3"), errno.EINVAL, loaded) == \
        Refusal(errno.EINVAL, FAIL_REG_PROBE, 4)
    assert registration_refusal(parse("p:a11 vfs_read+1"), errno.EILSEQ, loaded).message == \
        "Probe point is not an instruction boundary"


def test_arg_column_counts_tokens_of_the_line_as_written():
    spec = parse("p:kprobes/testevent   do_exit  $stack")
    # __trace_probe_log_err() places the caret in argv joined by single spaces, the
    # command error_log shows: each word's start there, and one past the end of it
    # past the last argument
    assert [arg_column(spec, i) for i in range(4)] == [0, 20, 28, 35]


def test_a_removal_frees_the_kinds_of_its_file_and_matches_a_uprobe_by_its_padded_offset():
    """dyn_event_release() with the file's ops (kprobe_events: kprobes, uprobe_events:
    uprobes, dynamic_events: every kind), and trace_uprobe_match_command_head()'s
    ``PATH:0x%016lx[(0x%lx)]`` (kernel/trace/trace_uprobe.c, Debian's 6.12.117)."""
    def p(line):
        return parse(line, uprobe_symbols=False)

    t = EventTable()
    for line in ("p:m/u /bin/sh:0x10 x=%di", "p:m/k vfs_read", "p:m/r /bin/sh:0x20(0x8)"):
        t.add(p(line))
    for line, file in (("-:m/u /bin/sh:0x10", "uprobe_events"),
                       ("-:m/u /bin/sh:0x0000000000000010", "kprobe_events"),
                       ("-:m/u /bin/sh:0x0000000000000010 x=%si", "uprobe_events"),
                       ("-:m/u /bin/sh:0x0000000000000011", "uprobe_events"),
                       ("-:m/r /bin/sh:0x0000000000000020", "uprobe_events"),
                       ("-:m/k", "uprobe_events")):
        assert t.release(p(line), file) == [], line
    assert [s.event for s in t.release(p("-:m/u /bin/sh:0x0000000000000010 x=%di"),
                                       "uprobe_events")] == ["u"]
    assert [s.event for s in t.release(p("-:m/r /bin/sh:0x0000000000000020(0x8)"),
                                       "uprobe_events")] == ["r"]
    t.add(p("p:m/u /bin/sh:0x10"))
    assert [s.event for s in t.release(p("-:m/"), "kprobe_events")] == ["k"]
    t.add(p("p:m/k vfs_read"))
    assert sorted(s.event for s in t.release(p("-:m/"), "dynamic_events")) == ["k", "u"]
    assert t.specs() == []
