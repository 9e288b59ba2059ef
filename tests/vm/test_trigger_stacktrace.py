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


def _after_entry_site(vm, func):
    """The offset of the first instruction after ``func``'s ENDBR and ftrace site: a
    probe there is at an offset, and the guest's optimizer may turn it into a jump."""
    from harness.kernel.symbols import instruction_at, is_ftrace_site

    addr = vm.symbols.lookup(func).addr
    code = vm.host.read(addr, 32)
    off = 4 if code.startswith(b"\xf3\x0f\x1e\xfa") else 0
    assert is_ftrace_site(code[off:off + 5]), code.hex()
    off += 5
    assert instruction_at(code[off:], addr + off) is not None
    return off


@pytest.mark.parametrize("series", NEWER)
def test_an_optimized_probes_stack_is_the_frame_pointer_guess(series):
    """A probe at an offset: the guest optimizes it after ``OPTIMIZE_DELAY`` (a jump into a
    detour buffer, arch/x86/kernel/kprobes/opt.c). Its handler's unwinder reaches the
    buffer, which has no ORC data, and goes on by the frame-pointer guess from the
    probe's rbp (``unwind_next_frame()``: ``orc_fp_entry``): the probed function and its
    callers are not in that trace. The host reads the jump at each hit and predicts the
    guest's trace, hit for hit, int3 hits (before the optimizer ran) too."""
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper
    from harness.machine.image.build import build_image

    with Machine.boot(build_image(kernel=series, progress=lambda s: None)) as vm:
        off = _after_entry_site(vm, "do_sys_openat2")
        res = DiffHelper(vm, "events")(
            [f"p:o do_sys_openat2+{off}"],
            "sleep 1; cat /proc/version > /dev/null; cat /proc/version > /dev/null",
            triggers=["o=stacktrace"])
        res.assert_equivalent()
        host, guest = ([h for h in side.hits if h.stack and h.comm != "qemu-ga"]
                       for side in res.runs)
        assert len(host) == len(guest) >= 2
        optimized = ["optimized_callback" in g.stack for g in guest]
        assert any(optimized), [g.stack for g in guest]      # the optimizer ran in the run
        for h, g, opt in zip(host, guest, optimized, strict=True):
            assert ("do_sys_openat2" in h.stack) != opt, (h.stack, g.stack)
            assert h.stack and g.stack[-len(h.stack):] == h.stack


@pytest.mark.parametrize("series", ("6.1",) + NEWER)
def test_a_function_graph_hook_below_the_probe_is_recovered(series):
    """The guest's function_graph tracer (in an instance of its own) hooks kernel_clone's
    return slot with ``return_to_handler``; a kprobe below it, in copy_process, takes a
    stack trace. The guest's unwinder recovers the slot through the task's return stack
    (``ftrace_graph_ret_addr()``: 6.12's and 7.3's frames of words, 6.1's array) and so
    does the host: kernel_clone's caller, not ``return_to_handler``."""
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper
    from harness.machine.image.build import build_image

    # 6.1 runs function_graph only in the top instance (its records then share the
    # buffer with the probe's, and the harness reads past them)
    t = "/sys/kernel/tracing"
    fg = t if series == "6.1" else f"{t}/instances/kphfg"
    with Machine.boot(build_image(kernel=series, progress=lambda s: None)) as vm:
        vm.run(f"mkdir -p {fg} && echo kernel_clone > {fg}/set_ftrace_filter && "
               f"echo function_graph > {fg}/current_tracer", check=True)
        try:
            res = DiffHelper(vm, "events")(["p:k copy_process"],
                                           "ls / > /dev/null; cat /proc/version > /dev/null",
                                           triggers=["k=stacktrace"])
        finally:
            vm.run(f"echo nop > {fg}/current_tracer; echo > {fg}/set_ftrace_filter" +
                   (f"; rmdir {fg}" if fg != t else ""), check=True)
        res.assert_equivalent()
        host = [h for h in res.runs[0].hits if h.stack and h.comm != "qemu-ga"]
        assert host and all(h.stack[:2] == ("copy_process", "kernel_clone") and
                            h.stack[2].startswith("__do_sys_clone") for h in host), \
            [h.stack for h in host]
