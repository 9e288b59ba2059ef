"""``regs.stack_trace()`` in host-side handlers against the guest kernel's own
``stack_trace_save()``, on 6.1, 6.12 and 7.3, on both host engines.

lib/test_kprobes.c's ``test_stacktrace_on_kretprobe`` and
``test_stacktrace_on_nested_kretprobe`` run twice on one call path
(``probes/kunit/kph_test_kprobes.ko``, built for each image with its toolchain):

- in the guest: the module's own kretprobes, the innermost handler saving
  ``stack_trace_save()`` (``echo gstack > run``, ``echo gstack2 > run``);
- host-side: the same kretprobes through the Python API, the handler taking
  ``regs.stack_trace()`` (``stack_trace_save_regs()``).

The guest's trace starts in its handler (the handler, ``rethook_trampoline_handler()``,
the trampoline...) and reaches the real return address, where the host's starts
(``rethook_trampoline_handler()`` set ``regs->ip`` to it): from there on both must be the
same frames, through the module (frame pointers) and vmlinux (ORC: ``run_write()``'s
callers, ``vfs_write()``, ``ksys_write()``, the syscall entry) alike. In the nested case
the outer return slot holds a trampoline (the guest's, or the host's) and both unwinders
must show the real return address instead.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.kernel.kprobes import Kretprobe

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

SRC = Path(__file__).parents[2] / "probes" / "kunit"
DIR = "/sys/kernel/debug/kph_test_kprobes"
SERIES = ("6.1", "6.12", "7.3")


@pytest.fixture(scope="module")
def kunit_images(tmp_path_factory):
    """(image, kph_test_kprobes.ko) per series, built on first use."""
    from harness.errors import HarnessError
    from harness.machine.image import toolchain
    from harness.machine.image.build import build_image
    from harness.machine.image.kernels import KernelRelease
    from harness.machine.image.store import default_image

    made: dict[str, tuple] = {}

    def get(series):
        if series not in made:
            try:
                img = default_image(series if series != "6.1" else None)
            except HarnessError:
                img = build_image(kernel=series, progress=lambda s: None)
            tc = toolchain.for_kernel(KernelRelease(img.version,
                                                    img.manifest.get("kernel_origin", "host")))
            ko = tmp_path_factory.mktemp(f"kunit-{series}") / "kph_test_kprobes.ko"
            toolchain.build_module(tc, [SRC / "Makefile", SRC / "kph_test_kprobes.c"],
                                   "kph_test_kprobes", ko)
            made[series] = (img, ko)
        return made[series]
    return get


@pytest.fixture(params=[(s, h) for s in SERIES for h in ("gdbstub", "plugin")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def kvm(request, kunit_images):
    from harness.vmctl import Machine

    series, host = request.param
    img, ko = kunit_images(series)
    with Machine.boot(img, host=host) as vm:
        assert vm.facts.series == series
        vm.push(ko, "/tmp/kph_test_kprobes.ko")
        vm.run("insmod /tmp/kph_test_kprobes.ko", check=True)
        vm.refresh_module_symbols()         # the plugin engine takes them from here
        yield vm


def _ints(text: str) -> list[int]:
    return [int(x, 16) for x in text.split()]


def _guest_trace(vm, cmd: str) -> list[int]:
    vm.run(f"echo {cmd} > {DIR}/run", check=True)
    return _ints(vm.run(f"cat {DIR}/gtrace", check=True).stdout)


def _return_addresses(vm) -> tuple[int, int]:
    vm.run(f"echo stacktrace > {DIR}/run", check=True)
    _, ra0, ra1 = vm.run(f"cat {DIR}/result", check=True).stdout.split()
    return int(ra0, 16), int(ra1, 16)


def _same_from(guest: list[int], host: list[int], start: int, vm) -> int:
    """Both traces from ``start`` on: the guest's from where it reaches it. Returns how
    many frames agree (all the host found, or all the guest's rest)."""
    names = [vm.symbols.format(a) for a in guest]
    assert start in guest, f"the guest's trace misses {start:#x}: {names}"
    rest = guest[guest.index(start):]
    n = min(len(rest), len(host))
    assert host[:n] == rest[:n], (
        f"host {[vm.symbols.format(a) for a in host]}\nguest {names}")
    return n


def test_stacktrace_on_kretprobe(kvm):
    ra0, ra1 = _return_addresses(kvm)
    guest = _guest_trace(kvm, "gstack")
    traces = []

    def handler(ri, regs):
        traces.append(regs.stack_trace(32))
        return 0

    rp = Kretprobe(symbol_name="kprobe_stacktrace_target", handler=handler)
    kvm.host.register_kretprobe(rp)
    kvm.run(f"echo stacktrace > {DIR}/run", check=True)
    kvm.host.unregister_kretprobe(rp)
    assert len(traces) == 1
    host = traces[0]
    assert host[0] == ra1 and kvm.host.trampoline not in host
    n = _same_from(guest, host, ra1, kvm)
    # through the module's frames into vmlinux: run_write()'s callers, down to the syscall
    assert n >= 6, (f"host {[kvm.symbols.format(a) for a in host]}\n"
                    f"guest {[kvm.symbols.format(a) for a in guest]}")
    assert any(kvm.symbols.format(a).startswith(("vfs_write", "ksys_write")) for a in host[:n])


def test_stacktrace_on_nested_kretprobe(kvm):
    ra0, ra1 = _return_addresses(kvm)
    guest = _guest_trace(kvm, "gstack2")
    traces = []

    def outer(ri, regs):
        return 0

    def inner(ri, regs):
        traces.append(regs.stack_trace(32))
        return 0

    rps = [Kretprobe(symbol_name="kprobe_stacktrace_target", handler=outer),
           Kretprobe(symbol_name="kprobe_stacktrace_internal_target", handler=inner)]
    for rp in rps:
        kvm.host.register_kretprobe(rp)
    kvm.run(f"echo stacktrace > {DIR}/run", check=True)
    for rp in rps:
        kvm.host.unregister_kretprobe(rp)
    assert len(traces) == 1
    host = traces[0]
    # the outer call's return slot holds the trampoline: both show the real address
    assert host[:2] == [ra0, ra1], [hex(a) for a in host[:3]]
    n = _same_from(guest, host, ra0, kvm)
    assert n >= 6, (f"host {[kvm.symbols.format(a) for a in host]}\n"
                    f"guest {[kvm.symbols.format(a) for a in guest]}")
