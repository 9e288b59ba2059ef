"""Linux 6.1's own probe definitions, each placed host-side and in the guest, on the
default kernel or each of ``--kph-kernels`` (where a newer kernel answers otherwise, it is
compared with that kernel's guest, not with 6.1's). 6.12's and 7.3's own selftests are in
``test_selftests_newer.py``; the helpers and workloads in ``selftests.py``.

Sources (Debian's linux-source-6.1, 6.1.192): tools/testing/selftests/ftrace/test.d/kprobe/*.tc,
test.d/dynevent/*.tc and samples/kprobes/{kprobe,kretprobe}_example.c. Every definition
these files write to ``kprobe_events``, ``uprobe_events`` or ``dynamic_events`` is here once
(names as the selftest writes them, ``$FUNCTION_FORK`` = ``kernel_clone``), in one of:

- ``PARSE``: lines 6.1 refuses while parsing them. ``kph diff`` refuses them before booting,
  with the kernel's ``error_log`` text and caret column; the test writes every one to the
  guest as well and compares the two entries (and the errno where 6.1 logs nothing).
- ``CASES``: lines 6.1 accepts, or refuses at registration. Each case runs host-side and
  in-guest on one execution of a busybox workload that hits its probes, and must agree hit
  for hit, value for value, or refuse alike with the kernel's errno and ``error_log`` text.
- ``REGISTRATION``: ``multiple_kprobes.tc``'s 256 probes, compared line by line.
- ``SKIPPED``: what cannot run here, each with the reason.

The fidelity section of docs/diff.md gives the counts; ``test_inventory`` keeps them honest.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from selftests import (ACCEPT, EEXIST_ARG, EEXIST_EVENT, EEXIST_SAME, EEXIST_TYPE, EXEC,
                       FORK, FTRACE, MKEVENT, MKINST, OPEN, PROBEFUNC, PVPANIC, READ, STAND_IN,
                       SYMLINK, C, case_id, check_case, check_parse_refusals,
                       check_registration, ids)

pytestmark = pytest.mark.vm


def _syntax_good(arg, workload=READ, expect="hit", note=""):
    return C("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}", workload, expect, note=note)


CASES = [
    C("kprobe/add_and_remove.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/busy_check.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/profile.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/kprobe_args.tc", "p:testprobe kernel_clone $stack $stack0 +0($stack)", FORK),
    C("kprobe/kprobe_args_comm.tc", "p:testprobe kernel_clone comm=$comm", FORK),
    C("kprobe/kprobe_args_string.tc", "p:testprobe {dirfunc} arg1=+0(%di):string", MKEVENT),
    C("kprobe/kprobe_args_string.tc",
      "p:testprobe {dirfunc} arg1=+0(%di):string arg2=+0(%di):string", MKEVENT),
    C("kprobe/kprobe_args_symbol.tc", [
        "p:testprobe_u kernel_clone arg1=@linux_proc_banner:u64 arg2=@linux_proc_banner:u32 "
        "arg3=@linux_proc_banner:u16 arg4=@linux_proc_banner:u8",
        "p:testprobe_s kernel_clone arg1=@linux_proc_banner:s64 arg2=@linux_proc_banner:s32 "
        "arg3=@linux_proc_banner:s16 arg4=@linux_proc_banner:s8",
        "p:testprobe_x kernel_clone arg1=@linux_proc_banner:x64 arg2=@linux_proc_banner:x32 "
        "arg3=@linux_proc_banner:x16 arg4=@linux_proc_banner:x8",
        "p:testprobe_bf kernel_clone arg1=@linux_proc_banner:b8@4/32"], FORK),
    # the string holds a newline: the guest's trace text would cut it
    C("kprobe/kprobe_args_symbol.tc", "p:testprobe_str kernel_clone arg1=@linux_proc_banner:string",
      FORK),
    # kprobe_args_syntax.tc: every test_goodarg (with a workload that reads)
    _syntax_good("%ax"),
    _syntax_good("@_sdata"),
    _syntax_good("@{sym:_sdata}"),
    _syntax_good("@_sdata+10"),
    _syntax_good("@_sdata-10"),
    _syntax_good("$stack"),
    _syntax_good("$stack0"),
    _syntax_good("$stack1"),
    C("kprobe/kprobe_args_syntax.tc", f"r {PROBEFUNC} $retval", READ),
    _syntax_good("$comm"),
    _syntax_good("+0(%ax)"),
    _syntax_good("-0(%ax)"),
    _syntax_good("+10($stack)"),
    _syntax_good("+0($stack1)"),
    _syntax_good("+10(@_sdata-10)"),
    _syntax_good("+0(+10(+20($stack)))"),
    _syntax_good("varname=%ax"),
    _syntax_good("%ax:x16"),
    _syntax_good("$comm:string"),
    _syntax_good("+0($stack):string"),
    # test_badarg lists it, but 6.1 takes it (what follows ')' is ignored, strrchr() in
    # parse_probe_arg()); "! echo" never fails a selftest script. Seen in the guest.
    _syntax_good("+0(%ax)+10", note="the selftest calls it bad; 6.1 accepts it"),
    # kprobe_args_syntax.tc: the test_badarg lines refused at registration (@SYM)
    *[C("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}", "true",
        "ENOENT: Invalid probed address or symbol")
      for arg in ("@", "@deaqswdefr", "@_sdata*10", "@_sdata/10", "@_sdata%10", "@_sdata&10",
                  "@_sdata|10")],
    *[C("kprobe/kprobe_args_type.tc",
        f"p:testprobe kernel_clone $stack0:s{w} $stack0:u{w} $stack0:x{w} $stack0:b4@4/{w}", FORK)
      for w in (64, 32, 16, 8)],
    C("kprobe/kprobe_args_user.tc", [
        "p:myevent do_sys_open path=+0($arg2):ustring path2=+u0($arg2):string",
        "p:myevent2 do_sys_openat2 path=+0($arg2):ustring path2=+u0($arg2):string"], OPEN,
      "ok", "hit", note="do_sys_open is inlined into the openat path of this build and nothing "
      "in the image calls open(2): compared as accepted, never hit, on both sides"),
    C("kprobe/kprobe_args_user.tc",
      "p:myevent vfs_symlink path=+0($arg3):ustring path2=+u0($arg3):string", SYMLINK),
    C("kprobe/kprobe_eventname.tc", f"p {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", f"p:event1 {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", f"p:kprobes2/event2 {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", "p do_execveat_common.isra.0", EXEC),     # a dot function
    C("kprobe/kprobe_ftrace.tc", "p:testprobe kernel_clone", FTRACE),
    # kprobe_module.tc probes trace_printk.ko (CONFIG_SAMPLES is off in Debian's kernel): the
    # same definitions on pvpanic, a module every image loads; then the module absent.
    C("kprobe/kprobe_module.tc", f"p {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", f"p:event1 {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", f"p:kprobes1/event1 {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", "p:event2 trace_printk:trace_printk_irq_work", "true",
      "pending"),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit"], FORK),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "p:kprobes/testevent kernel_clone $stack"], FORK,
      "hit", "hit", EEXIST_ARG),
    # "-:EVENT" removes both probes; "-:EVENT SYM1" only kernel_clone's (dyn_event_release())
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "-:kprobes/testevent"], FORK, "ok", "ok", "ok"),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "-:kprobes/testevent kernel_clone"], FORK, "ok", "hit", "ok"),
    C("kprobe/kprobe_syntax_errors.tc", "p vfs_read+3", "true",
      "EILSEQ: Probe point is not an instruction boundary"),
    C("kprobe/kprobe_syntax_errors.tc", ["p:kprobes/testevent kernel_clone",
                                         "r:kprobes/testevent do_exit"], FORK, "hit", EEXIST_TYPE),
    C("kprobe/kprobe_syntax_errors.tc", [
        "p:kprobes/testevent kernel_clone abcd=\\1",
        "p:kprobes/testevent kernel_clone bcd=\\1",
        "p:kprobes/testevent kernel_clone abcd=\\1:u8",
        "p:kprobes/testevent kernel_clone abcd=\\\"foo\"",
        "p:kprobes/testevent kernel_clone abcd=\\1"], FORK,
      "hit", EEXIST_ARG, EEXIST_ARG, EEXIST_ARG, EEXIST_SAME),
    C("kprobe/kretprobe_args.tc", "r:testprobe2 kernel_clone $retval", FORK),
    C("kprobe/kretprobe_maxactive.tc", "r:myprobeaccept inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r10:myprobeaccept inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r10 inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_return_suffix.tc", "r:myprobeaccept vfs_read", READ),
    C("kprobe/kretprobe_return_suffix.tc", "p:myprobeaccept vfs_read%return", READ),
    C("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir", MKINST),
    C("kprobe/probepoint.tc", "p:testprobe {sym:tracefs_create_dir}", MKINST),
    C("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{next:tracefs_create_dir}",
      "true", "ok"),
    C("kprobe/uprobe_syntax_errors.tc", "p /non_exist_file:100", "true",
      "ENOENT: Failed to find the given file"),
    C("kprobe/uprobe_syntax_errors.tc", "p /sys:100", "true", "EINVAL: Not a regular file"),
    C("dynevent/add_remove_kprobe.tc", ["p:myevent1 kernel_clone", "r:myevent2 kernel_clone"],
      FORK),
    C("dynevent/add_remove_kprobe.tc", "p:mygroup/ kernel_clone", FORK),
    C("dynevent/test_duplicates.tc", ["p:kgroup/kevent vfs_open file=+0($arg2)",
                                      "p:kgroup/kevent vfs_open file=+0($arg2)",
                                      "p:syscalls/sys_enter_open vfs_open file=+0($arg2)"],
      OPEN, "hit", EEXIST_SAME, EEXIST_EVENT),
    # samples/kprobes: what kprobe_example.c's handlers print, and kretprobe_example.c
    C("samples/kprobes/kprobe_example.c", "p:kprobe_example kernel_clone ip=%ip flags=%flags",
      FORK),
    C("samples/kprobes/kretprobe_example.c", "r20:kretprobe_example kernel_clone ret=$retval",
      FORK),
    # the module backend: kph_kprobes.ko's register_kprobe() with the trace layer host-side
    C("samples/kprobes/kprobe_example.c", "p:kprobe_example kernel_clone ip=%ip flags=%flags",
      FORK, guest="module"),
    C("samples/kprobes/kretprobe_example.c", "r20:kretprobe_example kernel_clone ret=$retval",
      FORK, guest="module"),
    C("kprobe/kprobe_args.tc", "p:testprobe kernel_clone $stack $stack0 +0($stack)", FORK,
      guest="module"),
    C("kprobe/kprobe_args_symbol.tc", "p:testprobe_str kernel_clone arg1=@linux_proc_banner:string",
      FORK, guest="module"),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "p:kprobes/testevent kernel_clone $stack"], FORK,
      "hit", "hit", EEXIST_ARG, guest="module"),
    C("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} @_sdata*10", "true",
      "ENOENT: Invalid probed address or symbol", guest="module"),
]

# (source, line with ^ where error_log puts the caret; none: the kernel logs nothing, EINVAL)
PARSE = [
    *[("kprobe/kprobe_syntax_errors.tc", ln) for ln in (
        "p^100 vfs_read", "r^1a111 vfs_read", "r^100000 vfs_read", "p ^non_exist_func",
        "p ^hoge-fuga", "p ^hoge+1000-1000", "r ^vfs_read+10", "p:^/bar vfs_read",
        "p:^12345678901234567890123456789012345678901234567890123456789012345/bar vfs_read",
        "p:^foo.1/bar vfs_read", "p:^ vfs_read",
        "p:foo/^12345678901234567890123456789012345678901234567890123456789012345 vfs_read",
        "p:foo/^bar.1 vfs_read", "p vfs_read ^$retval", "p vfs_read ^$stack10000",
        "p vfs_read ^$arg10000", "p vfs_read ^$none_var", "p vfs_read ^%none_reg",
        "p vfs_read ^@12345678abcde", "p vfs_read ^@+10", "p vfs_read arg1=\\^x",
        "p vfs_read arg1=\\\"abcd^", "p vfs_read ^+0@0)", "p vfs_read ^+0ab1(@0)",
        "p vfs_read +0(+0(@0^)", "p vfs_read +0(^$comm)", "p vfs_read ^&1",
        "p vfs_read +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))",
        "p vfs_read +0(@11):u8[10^", "p vfs_read +0(@11):u8[10]^a",
        "p vfs_read +0(@11):u8[^10a]", "p vfs_read +0(@11):u8[^256]",
        "p vfs_read @11:^unknown_type", "p vfs_read $stack0:^string", "p vfs_read @11:^b10@a/16",
        "p vfs_read ^arg123456789012345678901234567890=@11", "p vfs_read ^=@11",
        "p vfs_read ^var.1=@11", "p vfs_read var1=@11 ^var1=@12",
        "p vfs_read ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))",
        "p vfs_read arg1=^", "p vfs_read^%hoge", "p ^vfs_read+10%return")],
    # kprobe_args_syntax.tc: test_badarg (no caret in the selftest: the guest's is compared)
    *[("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}") for arg in (
        "%ex", "$stackp", "$stack0+10", "$stack1-10", "$retval", "+(%ax)", "(%ax+10)",
        "-(%ax)", "(%ax)", "+10($comm)", "varname=varname2=%ax", "%ax::x16", "%ax:y16",
        "x16:%ax", "$comm:x64", "$stack:string", "%ax:string")],
    ("kprobe/kretprobe_maxactive.tc", "a:myprobeaccept inet_csk_accept"),
    ("kprobe/kretprobe_maxactive.tc", "r1000000:myprobeaccept inet_csk_accept"),
    ("kprobe/kretprobe_maxactive.tc", "r10fuzz:myprobeaccept inet_csk_accept"),
    ("kprobe/kprobe_non_uniq_symbol.tc", "p:test_non_unique name_show"),
    ("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{prev:tracefs_create_dir}"),
    ("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{overflow:tracefs_create_dir}"),
    *[("kprobe/uprobe_syntax_errors.tc", ln) for ln in (
        "p /bin/sh:^10a", "p /bin/sh:10(^1a)", "p /bin/sh:10(10^", "p /bin/sh:10(10)^a",
        "p /bin/sh:10 ^@+ab", "p /bin/sh:10 ^@symbol", "p /bin/sh:10^%hoge",
        "p /bin/sh:10(10)^%return")],
]

REGISTRATION = [("kprobe/multiple_kprobes.tc",
                 "p SYM+5 for the first 256 text symbols without a dot, as the selftest picks "
                 "them from /proc/kallsyms")]

SKIPPED = {
    "kprobe/kprobe_module.tc: rmmod trace-printk, then modprobe it and see event1 fire":
        "pvpanic (the stand-in) cannot be unloaded while its device is bound; "
        "trace_printk.ko is not built (CONFIG_SAMPLES is off in Debian's kernel)",
    "kprobe/busy_check.tc: 'echo > kprobe_events' refused while an event is enabled":
        "a property of clearing kprobe_events, not of a probe definition (its definition is "
        "in CASES)",
    "dynevent/clear_select_events.tc, dynevent/generic_clear_event.tc":
        "their kprobe definitions are add_remove_kprobe.tc's (in CASES); what they test is "
        "synthetic events ('s:') and '!' removal, which are not probe definitions",
    "dynevent/test_duplicates.tc: the 'e:' lines and 'p:egroup/eevent' after an eprobe":
        "6.1's kprobe_events, which the harness mirrors on 6.1, takes no event probes "
        "(6.12's and 7.3's event-probe selftests run on those kernels: docs/eprobes.md)",
    "dynevent/add_remove_eprobe.tc, dynevent/eprobes_syntax_errors.tc,"
    " dynevent/add_remove_synth.tc": "event probes (as above) and synthetic events, not "
                                      "kprobe/uprobe lines",
}


@pytest.mark.parametrize("case", CASES, ids=ids(CASES, case_id))
def test_selftest_case(probe_diff, case):
    check_case(probe_diff, case, probe_diff.vm.facts.series)


#: The cases with the harness's module as the in-guest side (uprobe lines and -: lines have none);
#: the ones written for the module above are already there.
MODULE_CASES = [dataclasses.replace(c, guest="module") for c in CASES
                if c.guest == "events" and not any(
                    s.startswith("-") or "/" in (s.split() + ["", ""])[1] for s in c.specs)]


@pytest.mark.parametrize("case", MODULE_CASES, ids=ids(MODULE_CASES, case_id))
def test_selftest_case_with_the_module(probe_diff, case):
    check_case(probe_diff, case, probe_diff.vm.facts.series)


def test_parse_refusals_match_the_guests_error_log(kph_fresh_machine):
    """6.1's refusals on the booted kernel, as that kernel parses them: on 6.1 every line is
    refused, two without an error_log entry (``a:...``, -ECANCELED made -EINVAL, and
    ``$comm:x64``); a newer kernel words some differently (compared with its own
    error_log), logs ``$comm:x64`` (NEED_STRING_TYPE), and 7.3 takes the 65-character
    argument (MAX_ARGSTR_LEN 255)."""
    vm = kph_fresh_machine
    series = vm.facts.series
    logged, silent, accepted = check_parse_refusals(vm, PARSE, carets=series == "6.1")
    if series == "6.1":
        assert (logged, silent, accepted) == (len(PARSE) - 2, 2, 0)
    else:
        assert silent == 1 and accepted == (1 if series == "7.3" else 0)


@pytest.mark.slow
@pytest.mark.timeout(240)   # with --kph-host plugin the reserved-text tables are read via QMP
def test_multiple_kprobes_registration(kph_fresh_machine):
    """multiple_kprobes.tc: ``p SYM+5`` on the first 256 text symbols. Registration only:
    the host side registers them disabled (no breakpoints on hot early text), the guest
    through kprobe_events; every line must be accepted or refused alike."""
    vm = kph_fresh_machine
    syms = [s for s in vm.symbols if s.type in "tT" and s.module is None and "." not in s.name]
    g_out = check_registration(vm, [f"p {s.name}+5" for s in syms[:256]])
    # On 6.12 and 7.3 most of the first text symbols are __pfx_ padding or their +5 is
    # no instruction boundary: both sides refuse alike (6.12's own selftest walks on until
    # 256 register: test_selftests_newer.py).
    assert sum(o.accepted for o in g_out) >= (100 if vm.facts.series == "6.1" else 1)


def test_inventory():
    """docs/diff.md states how many selftest-derived cases there are and what is skipped."""
    readme = (Path(__file__).parents[2] / "docs" / "diff.md").read_text()
    total = len(CASES) + len(PARSE) + len(REGISTRATION)
    assert f"**{total} selftest-derived cases**" in readme
    assert f"{len(CASES)} differential cases" in readme and f"{len(PARSE)} parse refusals" in readme
    for what in SKIPPED:
        assert what in readme, what
