"""A refusal in the kernel's own words, on the booted 6.12 and 7.3 (issue 36, verdict
defect 9): for each kind of line (``p``/``r``, uprobe, ``f``, ``t``, ``e``, an ``e`` line's
filter) the host side predicts the ``error_log`` entry the kernel writes (subsystem,
message, caret column) and the errno, and the events side reads the same back from the
guest's ``error_log``. One boot per kernel, every line registered in one batch on each
side."""
from __future__ import annotations

import dataclasses
import errno

import pytest
from selftests import series_machine

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

#: (the line, the subsystem the kernel logs it under; "" nothing logged, None accepted),
#: the line written as it is. Lines the booted kernel refuses while parsing are written
#: as a line parsed before the kernel was known (kph matrix): the host's trace layer
#: parses them again as that kernel does.
LINES = [
    ("p:kph/k1 do_sys_openat2 x=%zz", "trace_kprobe"),          # a caret in an argument
    ("p:kph/k2   do_int3", "trace_kprobe"),                     # blacklisted, registration
    ("r:kph/k3 non_exist_func", "trace_kprobe"),
    ("p:kph/d do_sys_openat2 a=%di", None),
    ("p:kph/d do_sys_openat2 a=%si:u32", "trace_kprobe"),       # EEXIST at the argument
    ("p:kph/u1 /nonexist:0x10", "trace_uprobe"),
    ("p:kph/u2 /sys:0x10", "trace_uprobe"),
    ("f:kph/f1 non_exist_func", "trace_fprobe"),                # 6.12 and 7.3 differ
    ("f:kph/f2 vfs_read %ax", "trace_fprobe"),
    ("f:kph/f3 vfs_read @+10", "trace_fprobe"),
    ("t:kph/t1 sched-switch", "trace_fprobe"),
    ("e:kph/e1 sched.sched_switch nofield", "event_probe"),     # 6.12 and 7.3 differ
    ("e:kph/e2 sched.nosuch", "event_probe"),
    ("e:kph/e3 sched.sched_switch if prev_pid ===", "event filter parse error"),
    ("e:kph/e4 sched.sched_switch x=@nosuchsym", ""),
    # the name of an event available_events leaves out (ftrace's own): EVENT_EXIST
    ("p:ftrace/function do_sys_openat2", "trace_kprobe"),
]

#: a line of each kind that parses, for writing a refused line as already parsed
_BASE = {"p": "p:kph/base do_sys_openat2", "r": "r:kph/base vfs_read",
         "f": "f:kph/base vfs_read", "t": "t:kph/base sched_switch",
         "e": "e:kph/base sched.sched_switch"}


@pytest.fixture(params=["6.12", "7.3"])
def machine(request):
    with series_machine(request, request.param) as vm:
        yield vm


def _spec(line: str, view):
    from harness.errors import ProbeSpecError
    from harness.kernel.grammar import parse

    try:
        return parse(line, kernel=view, uprobe_symbols=False)
    except ProbeSpecError:
        head = line.split()[0]
        base = parse(_BASE[head[0]], kernel=view)
        return dataclasses.replace(base, event=head.split("/")[1], text=line)


def register_both(machine, specs):
    """The Outcomes of ``specs`` registered host-side (unarmed) and in the guest's
    tracefs, each backend closed after."""
    from harness.backends.events import EventsBackend
    from harness.backends.host import HostBackend

    host, guest = HostBackend(machine, armed=False), EventsBackend(machine)
    try:
        return host.register(specs), guest.register(specs)
    finally:
        host.close()
        guest.close()


def test_refusals_are_predicted_in_the_kernels_words(machine):
    from harness.kernel.grammar import KernelView

    view = KernelView(machine.facts.rules)
    specs = [_spec(line, view) for line, _ in LINES]
    h_out, g_out = register_both(machine, specs)

    def words(o):
        return "accepted" if o.accepted else (errno.errorcode.get(o.errno, o.errno),
                                              *o.error_log(), o.words)

    bad = []
    for (line, sub), h, g in zip(LINES, h_out, g_out):
        if words(h) != words(g):
            bad.append(f"{line!r}: host {words(h)} ({h.reason}), guest {words(g)}")
        elif (sub is None) != g.accepted or (sub is not None and g.subsystem != sub):
            bad.append(f"{line!r}: {words(g)} on both sides, expected {sub!r}")
    assert not bad, "\n".join(bad)
    # the kernels differ where the host says they do (docs/fprobes.md, docs/eprobes.md)
    f1, e1 = g_out[7], g_out[11]
    if machine.facts.series == "6.12":
        assert (f1.message, e1.message) == ("Failed to register probe event",
                                            "BTF is not available or not supported")
    else:
        assert (f1.message, e1.message) == ("Invalid probed address or symbol",
                                            "This event field is not found.")
    assert g_out[0].column == len("p:kph/k1 do_sys_openat2 x=")
    assert machine.run("cat /sys/kernel/tracing/dynamic_events").stdout == ""


def test_the_guest_s_event_names_are_its_event_directories(machine):
    """harness.backends.tracelayer.guest_event_names (issue 39: a file read, not an exec
    per run) gives what ``ls -d events/*/*/`` lists: available_events plus the events it
    leaves out, read once per machine; a dynamic event added later is in the next read."""
    from harness.backends.tracelayer import guest_event_names
    from harness.kernel.dynevent import other_event_names

    def listed():
        return other_event_names(machine.run("cd /sys/kernel/tracing/events && ls -d */*/",
                                             timeout=60, check=True).stdout)
    names = guest_event_names(machine)
    assert names == listed() and "ftrace/function" in names and "sched/sched_switch" in names
    # available_events is read again only when a dynamic event or a module came or went
    pulls: list[str] = []
    pull = machine.pull
    machine.pull = lambda path, **kw: (pulls.append(path), pull(path, **kw))[1]
    try:
        assert guest_event_names(machine) == names and pulls == []
        machine.run("echo 'p:kph/late vfs_write' >> /sys/kernel/tracing/kprobe_events",
                    check=True)
        try:
            assert "kph/late" in guest_event_names(machine)
            assert guest_event_names(machine) == listed()
            assert len(pulls) == 1
        finally:
            machine.run("echo '-:kph/late' >> /sys/kernel/tracing/kprobe_events", check=True)
        assert guest_event_names(machine) == names == listed() and len(pulls) == 2
        loaded = "kph_kprobes " in machine.run("cat /proc/modules", check=True).stdout
        machine.run("rmmod kph_kprobes" if loaded else "insmod /lib/modules/kph_kprobes.ko",
                    check=True, timeout=60)
        try:
            assert guest_event_names(machine) == listed() and len(pulls) == 3   # a module
        finally:
            machine.run("insmod /lib/modules/kph_kprobes.ko" if loaded else "rmmod kph_kprobes",
                        check=True, timeout=60)
    finally:
        del machine.pull
