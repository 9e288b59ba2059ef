"""The kernels' own ftrace selftests as data: the probe definitions of Linux 6.1's
tools/testing/selftests/ftrace/test.d (kprobe/*.tc, the dynevent/*.tc that write kprobe or
uprobe lines) and samples/kprobes, the workloads that hit them, and what each kernel
answers. 6.12's and 7.3's own are in :mod:`harness.apps.selftests_newer`.

The suite checks every case (``tests/vm/test_selftests.py``, ``test_selftests_newer.py``,
their checks in ``tests/vm/selftests.py``); ``kph hunt`` (:mod:`harness.apps.hunt`) runs
the booted kernel's cases differentially.

Names as the selftest writes them (``$FUNCTION_FORK`` = ``kernel_clone``), in one of:

- ``CASES``: lines 6.1 accepts, or refuses at registration, each with a busybox workload
  that hits its probes;
- ``PARSE``: lines 6.1 refuses while parsing them (``^`` where ``error_log`` puts the caret);
- ``REGISTRATION``: ``multiple_kprobes.tc``'s 256 probes;
- ``SKIPPED``: what cannot run here, each with the reason.

A spec may hold placeholders :func:`fill` replaces from the booted guest, as the selftest
computes them there: ``{sym:F}``, ``{next:F}``, ``{prev:F}``, ``{overflow:F}``
(probepoint.tc: F's address and the distances to its neighbours, ``__pfx_`` padding
symbols left out as 6.12's probepoint.tc does), ``{dirfunc}`` (kprobe_args_string.tc: the
function creating an event's directory, ``eventfs_create_dir`` where tracefs has one),
``{dotfunc}`` (kprobe_eventname.tc's ``find_dot_func``), ``{entry:PATH}``
(add_remove_uprobe.tc: the file offset of PATH's ELF entry point).
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..backends.events import try_lines

FORK = "ls / >/dev/null; ls / >/dev/null"              # ( echo "forked" ) in ash forks nothing
READ = "head -c 20 /proc/version >/dev/null"           # busybox head read()s: vfs_read
OPEN = "echo > /dev/null"                              # kprobe_args_user.tc's workload
SYMLINK = "ln -s foo /tmp/bar; rm /tmp/bar"            # vfs_symlink with a kernel pointer
# kprobe_args_string.tc: creating an event makes its tracefs (6.12+: eventfs) directory
MKEVENT = ("echo 'p:test kernel_clone' >> /sys/kernel/tracing/kprobe_events; "
           "echo '-:test' >> /sys/kernel/tracing/kprobe_events")
# probepoint.tc's tracefs_create_dir: a trace instance's directory (6.12+ makes event
# directories in eventfs, so only instances still come through it)
MKINST = ("mkdir /sys/kernel/tracing/instances/kph && "
          "rmdir /sys/kernel/tracing/instances/kph")
ACCEPT = ("ip link set lo up; httpd -f -p 127.0.0.1:8080 -h /proc & p=$!; sleep 0.3; "
          "wget -q -O /dev/null http://127.0.0.1:8080/version; kill $p; wait")
# kprobe_module.tc's module function: pvpanic's sysfs "capability" (a module on all three
# kernels; trace_printk.ko is not built, CONFIG_SAMPLES is off in Debian's kernels)
PVPANIC = "cat /sys/bus/pci/drivers/pvpanic-pci/*/capability >/dev/null"
STAND_IN = "pvpanic:capability_show"
# kprobe_ftrace.tc: the function tracer on kernel_clone too, sharing its fentry site with
# the kprobe. In a trace instance: switching the top-level current_tracer would empty the
# buffer the kprobe events are in (the selftest greps between switches).
FTRACE = ("cd /sys/kernel/tracing/instances && mkdir ft && cd ft && "
          "echo kernel_clone > set_ftrace_filter && echo function > current_tracer && "
          "ls / >/dev/null; ls / > /dev/null; grep -c kernel_clone trace; "
          "echo nop > current_tracer; cd ..; rmdir ft")
EXEC = "/usr/bin/kph-loop 1 >/dev/null; /usr/bin/kph-loop 1 >/dev/null"   # ash runs ls unexec'd
SH = "echo ls | /bin/sh >/dev/null"                    # add_remove_uprobe.tc
ANY = "ls / >/dev/null"

PROBEFUNC = "vfs_read"
EEXIST_TYPE = "EEXIST: Probe type is different from existing probe"
EEXIST_ARG = "EEXIST: Argument type or name is different from existing probe"
EEXIST_SAME = "EEXIST: There is already the exact same probe event"
EEXIST_EVENT = "EEXIST: Given group/event name is already used by another event"


@dataclass(frozen=True)
class Case:
    """``expect`` per line: ``hit`` (accepted, its event matched at least once), ``ok``
    (accepted, registered or not), ``pending`` (accepted, nothing registered), or ``ERRNO: error_log text``
    (``ERRNO`` alone: refused without an ``error_log`` entry). ``expect_by`` overrides it
    for a kernel series where that kernel answers otherwise (the reason in ``note``)."""

    source: str
    specs: tuple[str, ...]
    workload: str
    expect: tuple[str, ...]
    guest: str = "events"
    note: str = ""
    expect_by: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def expected(self, series: str) -> tuple[str, ...]:
        return self.expect_by.get(series, self.expect)


def C(source, specs, workload, *expect, guest="events", note="", expect_by=None):  # noqa: N802
    specs = (specs,) if isinstance(specs, str) else tuple(specs)
    expect = expect or ("hit",) * len(specs)
    return Case(source, specs, workload, tuple(expect), guest, note, dict(expect_by or {}))


def ids(items, key):
    seen: dict[str, int] = {}
    out = []
    for it in items:
        base = re.sub(r"\s+", " ", key(it))[:70]
        n = seen[base] = seen.get(base, 0) + 1
        out.append(base if n == 1 else f"{base} #{n}")
    return out


def case_id(c: Case) -> str:
    return f"{c.source.split('/')[-1]}: {' + '.join(c.specs)}" + (
        " [module]" if c.guest == "module" else "")


#: per symbol table (by identity, while it lives): its symbols in address order without
#: absolute ones and __pfx_ labels, for {next:}/{prev:}/{overflow:}; built once, not per
#: line (160,000 Symbols a build: 0.7 s a fill() before)
_ORDER: "weakref.WeakKeyDictionary[Any, tuple[int, list[Any]]]" = weakref.WeakKeyDictionary()


def _order(symbols: Any) -> list[Any]:
    got = _ORDER.get(symbols)
    if got is None or got[0] != len(symbols):      # a module's symbols added since
        got = _ORDER[symbols] = (len(symbols), [s for s in symbols if s.type not in "aA"
                                                and not s.name.startswith("__pfx_")])
    return got[1]


def dot_func(vm) -> str:
    """kprobe_eventname.tc's ``find_dot_func``: the first line of /proc/kallsyms that
    ``grep ' [tT] .*\\.isra\\..*'`` finds whose name, a grep pattern (``.`` is any
    character), is on exactly one line of ``available_filter_functions``. Done here on
    the guest's symbols (vmlinux's, in /proc/kallsyms's order: by address) and one read of
    that file, where the selftest's loop greps the file once a candidate (a minute under
    TCG on 7.3)."""
    funcs = vm.pull("/sys/kernel/tracing/available_filter_functions",
                    timeout=120).decode("utf-8", "replace").splitlines()
    for sym in vm.symbols:
        if sym.type not in "tT" or sym.module is not None or ".isra." not in sym.name:
            continue
        stem = sym.name.split(".", 1)[0]
        pattern = re.compile(re.escape(sym.name).replace(r"\.", "."))
        if sum(1 for f in funcs if stem in f and pattern.search(f)) == 1:
            return sym.name
    raise LookupError("no .isra. function of this kernel is one line of "
                      "available_filter_functions (kprobe_eventname.tc's find_dot_func)")


def fill(text: str, vm) -> str:
    """The placeholders of the module docstring, from the booted guest ``vm``."""
    if "{" not in text:
        return text
    symbols = vm.symbols

    def one(m: re.Match) -> str:
        kind, name = m[1], m[2]
        if kind == "dirfunc":
            r = vm.run("grep -qw eventfs_create_dir /sys/kernel/tracing/"
                       "available_filter_functions && echo eventfs_create_dir || "
                       "echo tracefs_create_dir", timeout=60)
            return r.stdout.strip()
        if kind == "dotfunc":
            return dot_func(vm)
        if kind == "entry":       # REALBIN=`readlink -f PATH`, then its entry's file offset
            from harness.kernel.elf import ElfImage
            name = vm.run(f"readlink -f {name}", check=True).stdout.strip()
            img = ElfImage(vm.pull(name))
            return f"{name}:0x{img.file_offset(img._elf['e_entry']):x}"
        sym = symbols.lookup(name)
        order = _order(symbols)
        i = next(j for j, s in enumerate(order) if s.name == name and s.addr == sym.addr)
        if kind == "sym":
            return f"0x{sym.addr:x}"
        if kind == "next":
            nxt = next(s for s in order[i + 1:] if s.addr > sym.addr)
            return f"+{nxt.addr - sym.addr}"
        prev = next(s for s in reversed(order[:i]) if s.addr < sym.addr)
        if kind == "prev":
            return f"{prev.addr - sym.addr}"
        return f"+0x{(prev.addr - sym.addr) & ((1 << 64) - 1):x}"
    return re.sub(r"\{(sym|next|prev|overflow|dirfunc|dotfunc|entry)(?::([\w./]+))?\}",
                  one, text)


def guest_errors(vm, lines: list[str]) -> list[tuple[int, str | None, int | None] | None]:
    """Each line written alone to the guest's kprobe_events, uprobe_events or
    dynamic_events (``harness.backends.events.try_lines``, all in one request): (errno,
    error_log message or None, caret column or None), or None when the guest accepts it
    (then removed)."""
    return [None if ok else (code, msg, col) for ok, code, msg, col in try_lines(vm, lines)]


def guest_error(vm, line: str) -> tuple[int, str | None, int | None] | None:
    """:func:`guest_errors` of one line."""
    return guest_errors(vm, [line])[0]


# ---------------------------------------------------------------- Linux 6.1's own

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
