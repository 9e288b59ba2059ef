"""The stacktrace event trigger (``echo stacktrace > events/GROUP/EVENT/trigger``) compared
host vs guest, frame for frame from the probed function down, on 6.12 and 7.3: on a
kprobe, a kretprobe, an fprobe, an event probe and a counted kprobe on a function the
harness's own setup calls (its count read from guest memory at the window's start), all
on one execution (harness.backends.triggers, docs/diff.md)."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

NEWER = ("6.12", "7.3")
LINES = ["p:k kernel_clone", "r:r kernel_clone", "f:f kernel_clone",
         "e:e sched.sched_process_fork c=$child_pid", "p:o do_sys_openat2"]
TRIGGERS = ["k=stacktrace", "kprobes/r=stacktrace", "f=stacktrace", "e=stacktrace",
            "o=stacktrace:2"]
WORKLOAD = "ls / > /dev/null; cat /proc/version > /dev/null; ls /"


@pytest.mark.parametrize("series", NEWER)
def test_stacktrace_trigger_agrees_frame_for_frame(series):
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper
    from harness.machine.image.build import build_image

    with Machine.boot(build_image(kernel=series, progress=lambda s: None)) as vm:
        diff = DiffHelper(vm, "events")
        res = diff(LINES, WORKLOAD, triggers=TRIGGERS)
        res.assert_equivalent()
        host, guest = res.runs
        for side in (host, guest):
            with_stack = [h for h in side.hits if h.stack is not None and h.comm != "qemu-ga"]
            by = {p: [h for h in with_stack if h.probe == p] for p in
                  ("kprobes/k", "kprobes/r", "fprobes/f", "eprobes/e", "kprobes/o")}
            assert all(by.values()), (side.side, {p: len(v) for p, v in by.items()})
            assert len(by["kprobes/o"]) <= 2        # stacktrace:2
        # the counted trigger: exactly the hits the guest's count had left
        assert [h.stack is not None for h in host.hits if h.probe == "kprobes/o"] == \
            [h.stack is not None for h in guest.hits if h.probe == "kprobes/o"]
        # the syscall path, below the guest's own probe machinery, on both sides
        full = [h for h in host.hits if h.probe == "kprobes/o" and h.stack]
        assert full and full[0].stack[0] == "do_sys_openat2" and \
            "entry_SYSCALL_64_after_hwframe" in full[0].stack
        g = next(h for h in guest.hits if h.probe == "kprobes/o" and h.stack)
        assert g.stack[0] == "kprobe_trace_func" and g.stack[-len(full[0].stack):] == full[0].stack
        assert res.result.applied.get("stack-machinery", 0) >= 5


def test_a_different_stack_diverges():
    """A host stack that is not the guest's below its machinery is a divergence: the
    verdict checked on a real run by changing one host frame."""
    import dataclasses

    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper
    from harness.diff.verdict import compare
    from harness.machine.image.build import build_image

    with Machine.boot(build_image(kernel="6.12", progress=lambda s: None)) as vm:
        res = DiffHelper(vm, "events")(["p:o do_sys_openat2"], "cat /proc/version",
                                       triggers=["o=stacktrace"])
        host, guest = res.runs
        hits = [dataclasses.replace(h, stack=("vfs_read",) + h.stack[1:])
                if h.stack and h.comm != "qemu-ga" else h for h in host.hits]
        bad = compare(dataclasses.replace(host, hits=hits), guest)
        assert not bad.agrees and bad.first.field == "stack"


def test_a_count_on_a_return_probes_trigger_is_refused():
    """Calls entered before the window return into the guest's return probe inside it and
    run its count down there only: refused in one line, before anything is placed."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "harness.cli", "diff", "--image", "6.12",
                        "r:r kernel_clone", "--trigger", "r=stacktrace:1", "--run", "true"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "a count on a return probe's trigger" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
