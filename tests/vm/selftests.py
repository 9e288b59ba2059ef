"""The kernels' own ftrace selftests as data: probe definitions, workloads that hit them,
what each kernel answers. Shared by ``test_selftests.py`` (6.1's, on any kernel) and
``test_selftests_newer.py`` (6.12's and 7.3's, each on its own kernel); not collected.

A spec may hold placeholders :func:`fill` replaces from the booted guest, as the selftest
computes them there: ``{sym:F}``, ``{next:F}``, ``{prev:F}``, ``{overflow:F}``
(probepoint.tc: F's address and the distances to its neighbours, ``__pfx_`` padding
symbols left out as 6.12's probepoint.tc does), ``{dirfunc}`` (kprobe_args_string.tc: the
function creating an event's directory, ``eventfs_create_dir`` where tracefs has one),
``{dotfunc}`` (kprobe_eventname.tc's ``find_dot_func``), ``{entry:PATH}``
(add_remove_uprobe.tc: the file offset of PATH's ELF entry point).
"""
from __future__ import annotations

import errno
import os
import re
import shlex
from dataclasses import dataclass, field

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


def C(source, specs, workload, *expect, guest="events", note="", expect_by=None):
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


def fill(text: str, vm) -> str:
    """The placeholders of the module docstring, from the booted guest ``vm``."""
    symbols = vm.symbols
    order = [s for s in symbols if s.type not in "aA" and not s.name.startswith("__pfx_")]

    def one(m: re.Match) -> str:
        kind, name = m[1], m[2]
        if kind == "dirfunc":
            r = vm.run("grep -qw eventfs_create_dir /sys/kernel/tracing/"
                       "available_filter_functions && echo eventfs_create_dir || "
                       "echo tracefs_create_dir", timeout=60)
            return r.stdout.strip()
        if kind == "dotfunc":
            r = vm.run("cd /sys/kernel/tracing; grep ' [tT] .*\\.isra\\..*' /proc/kallsyms | "
                       "cut -f 3 -d ' ' | while read f; do "
                       "[ $(grep -s $f available_filter_functions | wc -l) -eq 1 ] && "
                       "echo $f && break; done", timeout=120)
            return r.stdout.split()[0]
        if kind == "entry":       # REALBIN=`readlink -f PATH`, then its entry's file offset
            from harness.kernel.elf import ElfImage
            name = vm.run(f"readlink -f {name}", check=True).stdout.strip()
            img = ElfImage(vm.pull(name))
            return f"{name}:0x{img.file_offset(img._elf['e_entry']):x}"
        sym = symbols.lookup(name)
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


def guest_error(vm, line: str) -> tuple[int, str | None, int | None] | None:
    """Write ``line`` to the guest's kprobe_events/uprobe_events: (errno, error_log message
    or None, caret column or None), or None when the guest accepts it (then removed)."""
    target = line.split()[1] if len(line.split()) > 1 else ""
    f = "dynamic_events" if line[:1] in "fte" else \
        "uprobe_events" if "/" in target else "kprobe_events"
    r = vm.run(f"cd /sys/kernel/tracing; : > error_log; echo {shlex.quote(line)} >> {f}; "
               "echo \"@rc=$?\"; cat error_log")
    if "@rc=0" in r.stdout:
        vm.run(f"echo > /sys/kernel/tracing/{f}")
        return None
    err = r.stderr.rsplit("write error: ", 1)[-1].strip()
    code = {os.strerror(n): n for n in range(1, 134)}[err]
    log = r.stdout.split("@rc=1\n", 1)[1].splitlines()
    if not log:
        return code, None, None
    # the last entry: a write can log twice (6.12's fprobe %REG: BAD_VAR, BAD_FETCH_ARG)
    # "[ts] event_probe: error: MSG", or "[ts] event filter parse error: error: MSG"
    msg = [ln for ln in log if " error: " in ln][-1].split(": error: ", 1)[1]
    caret = log[-1].index("^") - len("  Command: ")
    return code, msg, caret


def check_case(probe_diff, case: Case, series: str):
    """Run ``case`` host-side and in the guest on one execution; both sides must agree,
    and each line must get what ``case.expected(series)`` says."""
    vm = probe_diff.vm
    specs = [fill(s, vm) for s in case.specs]
    workload = fill(case.workload, vm)
    res = probe_diff(specs, workload, guest=case.guest)
    expected = case.expected(series)
    # a case with no line expected to hit may arm nothing (refused, pending; "ok" is
    # either): each line's outcome is checked below
    res.assert_equivalent(min_events=0, refusals_ok="hit" not in expected)
    host, guest = res.runs
    assert [o.index for o in host.outcomes] == list(range(len(specs)))
    assert [o.index for o in guest.outcomes] == list(range(len(specs)))
    for i, want in enumerate(expected):
        h, g = host.outcomes[i], guest.outcomes[i]
        where = f"line {i + 1} {specs[i]!r}: host {h}, {case.guest} {g}"
        if want in ("hit", "ok", "pending"):
            assert h.accepted and g.accepted, where
            if want != "ok":    # ok: accepted, registered or kept unregistered
                assert bool(h.pending) == (want == "pending"), where
            if want == "hit":
                from harness.diff import report
                assert res.matched.get(h.probe, 0) >= 1, \
                    f"{where}: no hit\n{report.text(res.result)}"
        else:
            name, _, msg = want.partition(": ")
            assert not h.accepted and not g.accepted, where
            assert h.errno == g.errno == getattr(errno, name), where
            if msg:
                assert h.message == msg and g.message == msg, where
    return res


def check_parse_refusals(vm, items, *, carets: bool = True) -> tuple[int, int, int]:
    """Every ``(source, line with ^ at the selftest's caret)`` of ``items``: the harness
    refuses it as the booted kernel parses it (its rules and BTF), and the guest's
    ``error_log`` says the same at the same column (or, where the kernel logs nothing,
    the errno agrees); or both accept it (a line another kernel's selftest lists).
    ``carets``: the selftest's caret must be the kernel's too (its own kernel's list).
    Returns (logged, silent, accepted) counts."""
    from harness.errors import ProbeSpecError
    from harness.kernel.grammar import parse

    from harness.backends.tracelayer import TraceLayer

    view = TraceLayer(vm).view()        # the booted kernel: rules, BTF, symbols, events
    bad, logged, silent, accepted = [], 0, 0, 0
    for source, raw in items:
        raw = fill(raw, vm)
        line, caret = raw.replace("^", "", 1), (raw.index("^") if "^" in raw else None)
        try:
            parse(line, kernel=view)
        except ProbeSpecError as exc:
            ours = (str(exc), exc.column, exc.errno, exc.logged)
        else:
            ours = None
        got = guest_error(vm, line)
        if got is None or ours is None:
            if got is not None or ours is not None:
                bad.append(f"{source}: {line!r}: the " + (
                    f"harness accepts it, the guest refuses it: {got}" if ours is None else
                    f"guest accepts it, the harness refuses it: {ours[0]!r}"))
            else:
                accepted += 1
            continue
        code, msg, col = got
        if msg is None:             # the kernel refuses without a log entry
            silent += 1
            if ours[3] or code != ours[2]:
                bad.append(f"{source}: {line!r}: guest {errno.errorcode[code]}, no "
                           f"error_log; harness {errno.errorcode[ours[2]]} {ours[0]!r}"
                           + (" (logged)" if ours[3] else ""))
            continue
        logged += 1
        if (msg, col) != ours[:2] or not ours[3] or code != ours[2] or \
                (carets and caret is not None and caret != col):
            bad.append(f"{source}: {line!r}: guest {msg!r} at {col} "
                       f"({errno.errorcode[code]}), harness {ours[0]!r} at {ours[1]} "
                       f"({errno.errorcode[ours[2]]})"
                       + (f", selftest caret {caret}" if caret is not None else ""))
    assert not bad, "\n".join(bad)
    assert vm.run("cat /sys/kernel/tracing/dynamic_events").stdout == ""
    return logged, silent, accepted


def check_registration(vm, lines: list[str]) -> list:
    """Register ``lines`` on both sides without arming anything; every line must be
    accepted or refused alike (errno and message). Returns the guest's outcomes."""
    from harness.backends.events import EventsBackend
    from harness.backends.host import HostBackend
    from harness.kernel.grammar import KernelView, parse

    view = KernelView(vm.facts.rules)
    specs = [parse(ln, kernel=view) for ln in lines]
    host, guest = HostBackend(vm, armed=False), EventsBackend(vm)
    try:
        h_out, g_out = host.register(specs), guest.register(specs)
    finally:
        host.close()
        guest.close()
    # a side that returned fewer outcomes than lines (nothing, at worst) must not pass
    assert len(h_out) == len(g_out) == len(specs), (len(specs), h_out, g_out)
    differ = [f"{specs[i].text}: host {h.errno} {h.message!r}, guest {g.errno} {g.message!r}"
              for i, (h, g) in enumerate(zip(h_out, g_out, strict=True))
              if (h.accepted, h.errno, h.message) != (g.accepted, g.errno, g.message)]
    assert not differ, "\n".join(differ)
    return g_out


def check_lines(vm, lines: list[str]) -> list[str]:
    """Each line parsed as the booted kernel parses it (its rules, BTF, symbols) and
    written to its ``kprobe_events``/``uprobe_events``: both accept it, or both refuse it
    with the same ``error_log`` text, caret and errno. Returns what differs."""
    from harness.errors import ProbeSpecError
    from harness.machine.image.facts import kernel_view
    from harness.kernel.grammar import parse

    view = kernel_view(vm.facts, vm.symbols, read=lambda a, n: vm.host.read(a, n))
    bad = []
    for raw in lines:
        line = fill(raw, vm)
        try:
            parse(line, kernel=view)
            ours = None
        except ProbeSpecError as exc:
            ours = (errno.errorcode[exc.errno], str(exc) if exc.logged else None,
                    exc.column if exc.logged else None)
        got = guest_error(vm, line)
        theirs = None if got is None else (errno.errorcode[got[0]], got[1], got[2])
        if ours is None and theirs is not None:
            # refused at registration, not while parsing: the host side's trace layer and
            # register_kprobe() rules say it (no caret: the outcome has none)
            from harness.backends.host import HostBackend
            from harness.kernel.grammar import KernelView
            host = HostBackend(vm, armed=False)
            try:
                (o,) = host.register([parse(line, kernel=KernelView(vm.facts.rules))])
            finally:
                host.close()
            if not o.accepted:
                ours = (errno.errorcode[o.errno], o.message, theirs[2])
        if ours != theirs:
            bad.append(f"{line!r}: harness {ours or 'accepts'}, guest {theirs or 'accepts'}")
    return bad
