"""lib/test_kprobes.c (Linux 6.1's KUnit suite ``kprobes_test``), through the Python API.

The same six cases, the same targets (``probes/kunit/kph_test_kprobes.ko``: the suite's
functions in a module, built here against the image's headers and loaded in the guest),
the same handlers and expectations; the kprobes are host-side (``vm.host``). What
``KUNIT_EXPECT_FALSE(preemptible())`` asks becomes: handlers run with the guest halted
(the dispatcher owns the stopped vCPUs; nothing else can run). ``stack_trace_save()`` /
``stack_trace_save_regs()`` are ``harness.kernel.unwind.stack_trace`` (frame pointers; the module
is built with them). The targets are module functions named without their module
(``kprobe_target``), as the suite names them: ``kallsyms_lookup_name()`` finds them in the
module, and the harness takes module symbols from the running guest.
"""
from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from harness.kernel.kprobes import Kprobe, Kretprobe
from harness.kernel.unwind import stack_trace

pytestmark = [pytest.mark.vm]

SRC = Path(__file__).parents[2] / "probes" / "kunit"
DIR = "/sys/kernel/debug/kph_test_kprobes"
DIV = 3                                           # div_factor


@pytest.fixture(scope="module")
def kunit_vm(default_image):
    """A guest with kph_test_kprobes.ko loaded."""
    from harness.vmctl import Machine

    headers = Path(f"/usr/src/linux-headers-{default_image.version}")
    if not (headers / "Makefile").exists():
        pytest.fail(f"kernel headers {headers} are missing: ./setup.sh installs them")
    with tempfile.TemporaryDirectory(prefix="kph-kunit-") as tmp:
        for f in ("Makefile", "kph_test_kprobes.c"):
            shutil.copy(SRC / f, tmp)
        r = subprocess.run(["make", "-C", str(headers), f"M={tmp}", "modules"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        with Machine.boot(default_image) as vm:
            vm.push(Path(tmp) / "kph_test_kprobes.ko", "/tmp/kph_test_kprobes.ko")
            vm.run("insmod /tmp/kph_test_kprobes.ko", check=True)
            yield vm


@pytest.fixture
def kt(kunit_vm):
    """One KUnit case: ``rand1`` as kprobes_test_init() draws it, the guest's calls, and
    the checks (KUNIT_EXPECT_*) handlers make, reported after the case."""
    vm = kunit_vm

    class Case:
        rand1 = random.randrange(DIV + 1, 1 << 32)
        failures: list[str] = []

        def expect(self, ok, what):
            if not ok:
                self.failures.append(what)

        def call(self, what):
            vm.run(f"echo {what} > {DIR}/run", check=True)
            return [int(x, 16 if i else 10) for i, x in
                    enumerate(vm.run(f"cat {DIR}/result", check=True).stdout.split())]

        def halted(self):
            """preemptible() is false: the guest is stopped while a handler runs."""
            return not vm.host.stub.running

    case = Case()
    case.failures = []
    yield case
    host = vm.host
    left = host.list()
    assert not left, f"probes left registered: {left}"
    assert not host.handler_errors, f"a handler raised: {host.handler_errors[0]!r}"
    assert not case.failures, "; ".join(case.failures)


def test_kprobe(kunit_vm, kt):
    host = kunit_vm.host
    seen = {"preh": 0, "posth": 0}

    def kp_pre_handler(p, regs):
        kt.expect(kt.halted(), "pre_handler ran preemptible")
        kt.expect(regs.di & 0xFFFFFFFF == kt.rand1, f"pre: the argument is {regs.di:#x}")
        kt.expect(regs.ip == p.addr + 1, f"pre: regs.ip {regs.ip:#x}, probe at {p.addr:#x}")
        seen["preh"] = kt.rand1 // DIV
        return 0

    def kp_post_handler(p, regs, flags):
        kt.expect(kt.halted(), "post_handler ran preemptible")
        kt.expect(seen["preh"] == kt.rand1 // DIV, "post: preh_val")
        seen["posth"] = seen["preh"] + DIV

    kp = Kprobe(symbol_name="kprobe_target", pre_handler=kp_pre_handler,
                post_handler=kp_post_handler)
    host.register_kprobe(kp)                     # KUNIT_EXPECT_EQ(test, 0, register_kprobe(&kp))
    assert kt.call(f"target {kt.rand1}")[0] == kt.rand1 // DIV
    host.unregister_kprobe(kp)
    assert seen["preh"] != 0 and seen["posth"] != 0
    assert kp.addr == kunit_vm.symbols.lookup("kph_test_kprobes:kprobe_target").addr


def test_kprobes(kunit_vm, kt):
    host = kunit_vm.host
    val = {"preh": 0, "posth": 0}

    def pre(p, regs):
        val["preh"] = kt.rand1 // DIV
        return 0

    def post(p, regs, flags):
        kt.expect(val["preh"] == kt.rand1 // DIV, "kp post: preh_val")
        val["posth"] = val["preh"] + DIV

    def pre2(p, regs):
        val["preh"] = kt.rand1 // DIV + 1
        return 0

    def post2(p, regs, flags):
        kt.expect(val["preh"] == kt.rand1 // DIV + 1, "kp2 post: preh_val")
        val["posth"] = val["preh"] + DIV

    kps = [Kprobe(symbol_name="kprobe_target", pre_handler=pre, post_handler=post),
           Kprobe(symbol_name="kprobe_target2", pre_handler=pre2, post_handler=post2)]
    host.register_kprobes(kps)
    val.update(preh=0, posth=0)
    assert kt.call(f"target {kt.rand1}")[0] == kt.rand1 // DIV
    assert val["preh"] != 0 and val["posth"] != 0
    val.update(preh=0, posth=0)
    assert kt.call(f"target2 {kt.rand1}")[0] == kt.rand1 // DIV + 1
    assert val["preh"] != 0 and val["posth"] != 0
    host.unregister_kprobes(kps)


def _kretprobes(kt):
    krph = {"val": 0}

    def entry_handler(ri, regs):
        kt.expect(kt.halted(), "entry_handler ran preemptible")
        krph["val"] = kt.rand1 // DIV
        return 0

    def return_handler(ri, regs):
        ret = regs.ax                              # regs_return_value(regs)
        kt.expect(kt.halted(), "return handler ran preemptible")
        kt.expect(ret & 0xFFFFFFFF == kt.rand1 // DIV, f"ret {ret} != rand1 / 3")
        kt.expect(krph["val"] != 0, "krph_val was 0 at the return")
        krph["val"] = kt.rand1
        return 0

    def return_handler2(ri, regs):
        ret = regs.ax
        kt.expect(ret & 0xFFFFFFFF == kt.rand1 // DIV + 1, f"ret {ret} != rand1 / 3 + 1")
        kt.expect(krph["val"] != 0, "krph_val was 0 at the return")
        krph["val"] = kt.rand1
        return 0

    rp = Kretprobe(symbol_name="kprobe_target", handler=return_handler,
                   entry_handler=entry_handler)
    rp2 = Kretprobe(symbol_name="kprobe_target2", handler=return_handler2,
                    entry_handler=entry_handler)
    return krph, rp, rp2


def test_kretprobe(kunit_vm, kt):
    host = kunit_vm.host
    krph, rp, _ = _kretprobes(kt)
    host.register_kretprobe(rp)
    kt.call(f"target {kt.rand1}")
    host.unregister_kretprobe(rp)
    assert krph["val"] == kt.rand1


def test_kretprobes(kunit_vm, kt):
    host = kunit_vm.host
    krph, rp, rp2 = _kretprobes(kt)
    host.register_kretprobes([rp, rp2])
    krph["val"] = 0
    kt.call(f"target {kt.rand1}")
    assert krph["val"] == kt.rand1
    krph["val"] = 0
    kt.call(f"target2 {kt.rand1}")
    assert krph["val"] == kt.rand1
    host.unregister_kretprobes([rp, rp2])


def _return_addresses(kt):
    """stacktrace_driver() once without probes: target_return_address[0] and [1] are then
    the real return addresses (a hijacked call would record the trampoline)."""
    ret, ra0, ra1 = kt.call("stacktrace")
    assert ra0 and ra1 and ret not in (ra0, ra1)   # KUNIT_ASSERT_NE(myretaddr, driver())
    return ra0, ra1


def test_stacktrace_on_kretprobe(kunit_vm, kt):
    host = kunit_vm.host
    ra0, ra1 = _return_addresses(kt)
    calls = []

    def stacktrace_return_handler(ri, regs):
        kt.expect(kt.halted(), "return handler ran preemptible")
        kt.expect(regs.ax == ra1, f"retval {regs.ax:#x} != target_return_address[1] {ra1:#x}")
        trace = stack_trace(host, regs)            # stack_trace_save_regs(regs, ...)
        kt.expect(trace and trace[0] == ra1, f"the trace starts at {trace[:1]}, not {ra1:#x}")
        kt.expect(host.trampoline not in trace, "the trampoline shows in the trace")
        calls.append(trace)
        return 0

    rp3 = Kretprobe(symbol_name="kprobe_stacktrace_target", handler=stacktrace_return_handler)
    host.register_kretprobe(rp3)
    kt.call("stacktrace")
    host.unregister_kretprobe(rp3)
    assert len(calls) == 1


def test_stacktrace_on_nested_kretprobe(kunit_vm, kt):
    host = kunit_vm.host
    ra0, ra1 = _return_addresses(kt)
    inner = []

    def stacktrace_return_handler(ri, regs):
        kt.expect(regs.ax == ra1, "outer retval")
        return 0

    def stacktrace_internal_return_handler(ri, regs):
        kt.expect(kt.halted(), "return handler ran preemptible")
        kt.expect(regs.ax == ra0, f"retval {regs.ax:#x} != target_return_address[0] {ra0:#x}")
        trace = stack_trace(host, regs)
        # the outer function's return slot still holds the trampoline: it must unwind to
        # the real address (kretprobe_find_ret_addr()), right after ours
        kt.expect(trace[:2] == [ra0, ra1],
                  f"trace {[hex(a) for a in trace[:3]]}, want {ra0:#x} {ra1:#x}")
        inner.append(trace)
        return 0

    rp3 = Kretprobe(symbol_name="kprobe_stacktrace_target", handler=stacktrace_return_handler)
    rp4 = Kretprobe(symbol_name="kprobe_stacktrace_internal_target",
                    handler=stacktrace_internal_return_handler)
    host.register_kretprobes([rp3, rp4])
    kt.call("stacktrace")
    host.unregister_kretprobes([rp3, rp4])
    assert len(inner) == 1
