"""The kernel-side oracles' parser (harness.kernel.splat) on splats in the kernel's own
formats (__warn(), page_fault_oops(), __die(), kasan_report(), lockdep, RCU stall, panic),
and the watch's dmesg window (harness.machine.kwatch.dmesg_after)."""
from __future__ import annotations

from harness.diff.report import findings_json, findings_text
from harness.diff.verdict import compare
from harness.kernel.splat import (VERDICTS, GuestHangError, KernelPanicFinding, Splat,
                                  find_splats, headline, merge)
from harness.machine.kwatch import dmesg_after
from harness.records import SideResult

WARN = """\
[   12.345678] ------------[ cut here ]------------
[   12.345679] WARNING: CPU: 0 PID: 1 at kernel/trace/trace_probe.c:123 parse_btf_arg+0x1a2/0x3c0
[   12.345680] Modules linked in: kph_kprobes(OE) virtio_console pvpanic_pci
[   12.345681] CPU: 0 PID: 1 Comm: sh Tainted: G           OE      6.1.0-56-cloud-amd64 #1  Debian 6.1.153-1
[   12.345682] Hardware name: QEMU Standard PC (i440FX + PIIX, 1996), BIOS 1.16.3-debian-1.16.3-2 04/01/2014
[   12.345683] RIP: 0010:parse_btf_arg+0x1a2/0x3c0
[   12.345684] Call Trace:
[   12.345685]  <TASK>
[   12.345686]  traceprobe_parse_probe_arg+0x5f/0x8d0
[   12.345687]  </TASK>
[   12.345688] ---[ end trace 0000000000000000 ]---
[   12.400000] virtio_net virtio0: something unrelated
"""

NULL_DEREF = """\
BUG: kernel NULL pointer dereference, address: 0000000000000000
#PF: supervisor read access in kernel mode
#PF: error_code(0x0000) - not-present page
PGD 0 P4D 0
Oops: 0000 [#1] PREEMPT SMP NOPTI
CPU: 0 PID: 77 Comm: kph-efault Not tainted 6.1.0-56-cloud-amd64 #1  Debian 6.1.153-1
RIP: 0010:do_sys_openat2+0x5a/0x160
Call Trace:
 <TASK>
 __x64_sys_openat+0x6c/0xa0
 </TASK>
---[ end trace 0000000000000000 ]---
Kernel panic - not syncing: Fatal exception
Kernel Offset: disabled
---[ end Kernel panic - not syncing: Fatal exception ]---
"""

KASAN = """\
==================================================================
BUG: KASAN: slab-out-of-bounds in trace_probe_log_err+0x2a/0x60
Read of size 8 at addr ffff888003a1c7f8 by task sh/1
CPU: 0 PID: 1 Comm: sh Not tainted 6.1.0 #1
==================================================================
Disabling lock debugging due to kernel taint
"""

LOCKDEP = """\
======================================================
WARNING: possible circular locking dependency detected
6.1.0 #1 Not tainted
------------------------------------------------------
sh/1 is trying to acquire lock:
ffffffff82a4b0c8 (event_mutex){+.+.}-{3:3}, at: trace_kprobe_create+0x1c/0x40
"""

ATOMIC = """\
[    3.1] BUG: sleeping function called from invalid context at kernel/locking/mutex.c:580
[    3.2] in_atomic(): 1, irqs_disabled(): 0, non_block: 0, pid: 1, name: sh
[    3.3] preempt_count: 1, expected: 0
"""

RCU = """\
rcu: INFO: rcu_sched detected stalls on CPUs/tasks:
rcu:     0-...!: (1 GPs behind) idle=7f4/1/0x4000000000000000 softirq=1/1 fqs=0
        (detected by 1, t=5252 jiffies, g=1, q=1 ncpus=2)
"""

SYSRQ = """\
[   40.1] sysrq: Trigger a crash
[   40.2] Kernel panic - not syncing: sysrq triggered crash
[   40.3] CPU: 0 PID: 90 Comm: sh Not tainted 6.1.0-56-cloud-amd64 #1  Debian 6.1.153-1
[   40.4] Call Trace:
[   40.5]  <TASK>
[   40.6]  panic+0x118/0x2f0
[   40.7]  sysrq_handle_crash+0x16/0x20
[   40.8]  </TASK>
[   40.9] Kernel Offset: disabled
[   41.0] ---[ end Kernel panic - not syncing: sysrq triggered crash ]---
"""


def test_a_warn_from_cut_here_to_end_trace():
    (s,) = find_splats(WARN, source="dmesg")
    assert s.verdict == "KERNEL-WARNING"
    assert s.title.startswith("WARNING: CPU: 0 PID: 1 at kernel/trace/trace_probe.c:123 parse_btf_arg")
    lines = s.text.splitlines()
    assert lines[0] == "------------[ cut here ]------------"
    assert lines[-1] == "---[ end trace 0000000000000000 ]---"     # not the next message
    assert "virtio_net" not in s.text and s.source == "dmesg" and not s.before


def test_a_null_dereference_is_an_oops_then_the_panic_it_led_to():
    oops, panic = find_splats(NULL_DEREF, source="console")
    assert oops.verdict == "KERNEL-OOPS"
    assert oops.title == "BUG: kernel NULL pointer dereference, address: 0000000000000000"
    assert "Oops: 0000 [#1] PREEMPT SMP NOPTI" in oops.text
    assert oops.text.endswith("---[ end trace 0000000000000000 ]---")
    assert panic.verdict == "KERNEL-PANIC" and panic.title == "Kernel panic - not syncing: Fatal exception"
    assert headline([oops, panic]) == "KERNEL-PANIC"


def test_kasan_lockdep_atomic_sleep_rcu_stall_and_sysrq_panic():
    (k,) = find_splats(KASAN, source="console")
    assert k.verdict == "KERNEL-KASAN" and k.text.startswith("=====") and k.text.endswith("=====")
    assert "Disabling lock debugging" not in k.text
    (ld,) = find_splats(LOCKDEP, source="console")
    assert ld.verdict == "KERNEL-LOCKDEP"
    assert ld.title == "WARNING: possible circular locking dependency detected"
    (a,) = find_splats(ATOMIC, source="console")
    assert a.verdict == "KERNEL-BUG" and "preempt_count: 1" in a.text
    (r,) = find_splats(RCU, source="console")
    assert r.verdict == "KERNEL-RCU-STALL"
    (p,) = find_splats(SYSRQ, source="console")
    assert p.verdict == "KERNEL-PANIC" and p.title == "Kernel panic - not syncing: sysrq triggered crash"
    assert "sysrq_handle_crash" in p.text and p.text.endswith("sysrq triggered crash ]---")


def test_gpf_kernel_bug_soft_lockup_and_hung_task():
    gpf = "general protection fault, probably for non-canonical address 0xdead000000000122: 0000 [#1] PREEMPT SMP NOPTI\nRIP: 0010:x+0x1/0x2\n"
    assert [s.verdict for s in find_splats(gpf, source="console")] == ["KERNEL-OOPS"]
    kb = "kernel BUG at mm/slub.c:435!\ninvalid opcode: 0000 [#1] PREEMPT SMP NOPTI\nRIP: 0010:x\n"
    (s,) = find_splats(kb, source="console")
    assert s.verdict == "KERNEL-OOPS" and "invalid opcode" in s.text
    sl = "watchdog: BUG: soft lockup - CPU#0 stuck for 22s! [sh:1]\n"
    assert find_splats(sl, source="console")[0].verdict == "KERNEL-BUG"
    ht = "INFO: task sh:12 blocked for more than 120 seconds.\n"
    assert find_splats(ht, source="dmesg")[0].verdict == "KERNEL-HUNG-TASK"


def test_a_long_splat_is_cut_and_quiet_text_has_none():
    long = "WARNING: CPU: 0 PID: 1 at a.c:1 f+0x0/0x1\n" + "".join(f" frame{i}+0x0/0x1\n" for i in range(500))
    (s,) = find_splats(long, source="dmesg", max_lines=20)
    assert len(s.text.splitlines()) == 20
    assert find_splats("Linux version 6.1.0\nrandom: crng init done\nkph: script start\n",
                       source="console") == []


def test_console_and_dmesg_merge_one_splat_and_before_is_not_the_runs():
    c = find_splats(NULL_DEREF, source="console")
    d = find_splats(NULL_DEREF, source="dmesg")
    m = merge(c, d)
    assert [s.source for s in m] == ["console+dmesg", "console+dmesg"]
    boot = find_splats(WARN, source="dmesg", before=True)
    assert headline(boot) is None            # printed before the run: no verdict for it
    assert "before the run" in boot[0].headline()
    assert headline(boot + c) == "KERNEL-PANIC"


def test_dmesg_after_the_mark():
    before = "[    1.0] a\n[    2.0] b\n"
    assert dmesg_after(before, before + "[    3.0] c\n") == "[    3.0] c"
    # the ring dropped b's line: time stamps decide
    assert dmesg_after(before, "[    2.5] x\n[    3.0] c\n") == "[    2.5] x\n[    3.0] c"
    assert dmesg_after(None, "[    1.0] a\n") == "[    1.0] a\n"


def test_findings_report_and_json_and_the_errors():
    s = find_splats(WARN, source="dmesg")
    text = findings_text(s)
    assert text.startswith("kernel: KERNEL-WARNING: 1 kernel report(s) during the run")
    assert "    | WARNING: CPU: 0 PID: 1 at kernel/trace/trace_probe.c:123" in text
    doc = findings_json(s)
    assert doc["verdict"] == "KERNEL-WARNING" and doc["splats"][0]["source"] == "dmesg"
    assert findings_text([]) == ""
    p = KernelPanicFinding("panicked", "tail", find_splats(SYSRQ, source="console"))
    assert p.verdict == "KERNEL-PANIC"
    h = GuestHangError("hang", "tail", [Splat("HANG", "the agent stopped", "tail", "agent")], "x")
    assert h.verdict == "HANG" and "HANG" in VERDICTS


def test_event_lists_compared_after_the_run():
    a = SideResult("host", events_left=("kprobes/a",))
    b = SideResult("events", events_left=("kprobes/a", "kprobes/stale"))
    res = compare(a, b)
    (d,) = res.divergences
    assert (d.probe, d.field) == ("dynamic_events", "event-list")
    assert d.b_value == "only here: kprobes/stale" and d.a_value == "only here: (nothing)"
    assert compare(a, SideResult("events", events_left=("kprobes/a",))).divergences == []
    assert compare(a, SideResult("module")).divergences == []      # no list: not compared


class _FakeVM:
    """What KernelWatch reads of a Machine: the console, kernel_log(), run(), qmp(), the
    process."""

    def __init__(self, *, status="running", answers=True, alive=True, dmesg="[    1.0] boot\n",
                 busy=False):
        import types
        self.console = "boot line\n"
        self.busy, self.host_stops = busy, 12345 if busy else 0
        self.status, self.answers, self.dmesg = status, answers, dmesg
        self.aborting = False
        self.name = "fake"
        self.state = types.SimpleNamespace(value="running")
        self.proc = types.SimpleNamespace(poll=lambda: None if alive else 1)

    def console_mark(self):
        return len(self.console)

    def console_since(self, mark, end=None):
        return self.console[mark:end]

    def console_tail(self, lines=40):
        return self.console[-200:]

    def run(self, cmd, timeout=0):
        import types
        from harness.errors import VMLostError
        if not self.answers:
            raise VMLostError("guest agent did not answer in time")
        return types.SimpleNamespace(status=0, stdout=self.dmesg if cmd == "dmesg" else "")

    def kernel_log(self, timeout=0):
        return self.run("dmesg", timeout).stdout

    def qmp(self, cmd, timeout=0):
        return {"status": self.status}

    def host_busy(self, at=None):
        return self.busy


def test_the_watch_turns_a_panic_and_a_hang_into_findings_and_leaves_harness_failures():
    import pytest
    from harness.errors import GuestPanicError, VMError, VMLostError
    from harness.machine.kwatch import KernelWatch

    vm = _FakeVM()
    w = KernelWatch(vm)
    with pytest.raises(KernelPanicFinding) as ei:
        with w.watching():
            vm.console += SYSRQ
            raise GuestPanicError("fake: guest kernel panicked: sysrq triggered crash")
    assert ei.value.verdict == "KERNEL-PANIC" and ei.value.splats[0].title.endswith("crash")

    vm = _FakeVM()
    w = KernelWatch(vm)
    with pytest.raises(GuestHangError) as ei:      # the workload timed out, the agent answers
        with w.watching():
            vm.dmesg += "[    9.0] INFO: task sh:5 blocked for more than 2 seconds.\n"
            raise VMLostError("guest command ['/bin/sh'] did not finish within 3 s")
    assert ei.value.verdict == "HANG" and "still answers" in ei.value.why
    assert [s.verdict for s in ei.value.splats] == ["KERNEL-HUNG-TASK", "HANG"]

    vm = _FakeVM()
    w = KernelWatch(vm)
    with pytest.raises(GuestHangError) as ei:      # a request before the workload ran out
        with w.watching():
            raise VMLostError("guest agent did not answer guest-file-open of /e/enable in "
                              "time (20 s)")
    assert "workload" not in ei.value.why and "guest-file-open of /e/enable" in ei.value.why

    vm = _FakeVM()
    w = KernelWatch(vm)
    with pytest.raises(GuestHangError) as ei:      # nothing answers, QEMU runs the guest
        with w.watching():
            vm.answers = False
            raise VMLostError("guest agent did not answer in time")
    assert "stopped answering" in ei.value.why

    for kw in ({"alive": False}, {"status": "paused"}):    # QEMU died; a guest held stopped
        vm = _FakeVM(**kw)
        w = KernelWatch(vm)
        with pytest.raises(VMLostError) as ei:
            with w.watching():
                raise VMLostError("lost")
        assert not isinstance(ei.value, GuestHangError)
    vm = _FakeVM()
    with pytest.raises(VMError) as ei:
        with KernelWatch(vm).watching():
            raise VMError("QEMU exited with status 1")
    assert type(ei.value) is VMError

    vm = _FakeVM(dmesg="[    1.0] boot\n" + WARN)      # printed at boot: listed, no verdict
    w = KernelWatch(vm)
    w.start()
    vm.dmesg += "[   20.0] " + ATOMIC.splitlines()[0].split("] ", 1)[1] + "\n"
    found = w.finish()
    assert [(s.verdict, s.before) for s in found] == [("KERNEL-WARNING", True), ("KERNEL-BUG", False)]
    assert headline(found) == "KERNEL-BUG"


def test_a_guest_still_taking_host_probe_stops_is_slowed_not_hung():
    """The wait ran out while the host engine was still handling the guest's probe stops
    (16 post_handler kprobes inside release_pages' loop: 20,702 hits a workload, ~3.6 ms
    each through GDB): HostSlowedError, a run not compared, never a HANG finding; the
    agent need not answer (it is starved by the same stops)."""
    import pytest
    from harness.errors import HostSlowedError, VMLostError
    from harness.machine.kwatch import KernelWatch
    from harness.kernel.splat import KernelFinding

    for answers in (True, False):
        vm = _FakeVM(busy=True, answers=answers)
        with pytest.raises(HostSlowedError) as ei:
            with KernelWatch(vm).watching():
                raise VMLostError("guest command ['/bin/sh'] did not finish within 30 s")
        assert not isinstance(ei.value, KernelFinding)
        assert "not compared" in str(ei.value) and ei.value.stops == 12345
    vm = _FakeVM(busy=False)            # no stop lately: the guest hung
    with pytest.raises(GuestHangError):
        with KernelWatch(vm).watching():
            raise VMLostError("guest command ['/bin/sh'] did not finish within 30 s")


def test_host_busy_is_a_share_of_the_window_held_not_a_stop_now_and_then():
    """Machine.host_busy: stops a few ms apart that held the guest most of the window
    before the wait ran out are a slowed guest; the opens of a ``sleep`` 2.5 s before it,
    or one stop a second (a timer's probe), are not."""
    import collections

    from harness import constants as C
    from harness.vmctl import Machine

    m = Machine.__new__(Machine)
    m.host_stops, m._host_held = 0, collections.deque()
    at = 1000.0
    m._host_held.extend((at - 2.0 + k * 0.004, 0.003) for k in range(500))   # 3 ms in 4
    assert m.host_busy(at)
    assert not m.host_busy(at + 2 * C.HOST_BUSY_WINDOW)     # long after: nothing held then
    m._host_held.clear()
    m._host_held.extend((at - 2.9 + k * 0.01, 0.003) for k in range(30))    # then quiet
    assert not m.host_busy(at)
    m._host_held.clear()
    m._host_held.extend((at - k, 0.004) for k in range(10))                 # one a second
    assert not m.host_busy(at)
