"""The kernel matrix's images (issue 16): each Debian kernel builds from the archives,
boots from its own snapshot, carries its own facts and a module built for it, and the
host places probes where that kernel's kprobes do."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.kernel.kprobes import Kprobe
from harness.vmctl import Machine

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

SERIES = ["6.1", "6.12", "7.3"]


@pytest.fixture(scope="session")
def kernel_image():
    """Build (or find current) the image of a series; one build per image across workers."""
    from harness.machine.image.build import build_image

    made = {}

    def get(series):
        if series not in made:
            made[series] = build_image(kernel=series, progress=lambda s: None)
        return made[series]
    return get


@pytest.mark.parametrize("series", SERIES)
def test_each_kernel_boots_from_its_own_snapshot_with_its_own_facts(kernel_image, series):
    img = kernel_image(series)
    assert img.series == series and img.facts.missing() == []
    with Machine.boot(img) as vm:
        assert vm.start_mode == "snapshot", vm.cold_reason
        assert vm.snapshot.dir.parent.parent == img.dir
        assert vm.run("uname -r", check=True).stdout.strip() == img.version
        # The harness's module was built for this kernel and loads into it.
        r = vm.run("insmod /lib/modules/kph_kprobes.ko && lsmod | grep -c kph_kprobes && "
                   "rmmod kph_kprobes", timeout=60)
        assert r.status == 0 and r.stdout.strip() == "1", r.stderr


@pytest.mark.parametrize("series", SERIES)
def test_a_function_entry_probe_goes_where_that_kernels_kprobes_put_it(kernel_image, series):
    """arch_adjust_kprobe_addr() (arch/x86/kernel/kprobes/core.c): with IBT (6.12, 7.3)
    kernel_clone starts with a sealed ENDBR and sym+0 is placed at +4; 6.1 has no IBT."""
    img = kernel_image(series)
    with Machine.boot(img) as vm:
        kp = vm.host.register_kprobe(Kprobe(symbol_name="kernel_clone"))
        base = vm.symbols.lookup("kernel_clone").addr
        vm.run("echo 'p:kph_entry kernel_clone' > /sys/kernel/tracing/kprobe_events", check=True)
        listing = vm.run("cat /sys/kernel/debug/kprobes/list", check=True).stdout
        vm.run("echo '-:kph_entry' >> /sys/kernel/tracing/kprobe_events", check=True)
        guest = [ln for ln in listing.splitlines() if "kernel_clone" in ln]
        assert guest, listing
        assert int(guest[0].split()[0], 16) == kp.addr, (guest, hex(kp.addr))
        ibt = img.facts.config.get("CONFIG_X86_KERNEL_IBT") == "y"
        assert kp.addr - base == (4 if ibt else 0)
        vm.host.unregister_kprobe(kp)


@pytest.mark.slow
@pytest.mark.parametrize("series", ["6.12", "7.3"])
def test_each_kernels_module_builds_in_an_empty_cache_of_its_own(series, tmp_path, monkeypatch):
    """Not only after another kernel filled the shared toolchain tree: 7.3's headers bring
    no ``as`` that gcc can call, 6.12's do, and the suite once passed only because it
    built 6.12 first (a newcomer's ``kph image build --kernel 7.3`` failed with "Compiler
    does not support fentry?")."""
    from harness.machine.image import kernels, toolchain
    from harness.machine.image.store import kmod_sources

    monkeypatch.setenv("KPH_CACHE", str(tmp_path))    # $KPH_DOWNLOADS, if set, is shared
    rel = kernels.resolve(series)
    tc = toolchain.for_kernel(rel)
    toolchain.build_module(tc, kmod_sources(), "kph_kprobes", tmp_path / "kph_kprobes.ko")
    assert (tmp_path / "kph_kprobes.ko").read_bytes()[:4] == b"\x7fELF"
    assert "gcc-14 14." in tc.describe()       # the compiler kbuild calls, found and named


def test_an_unknown_kernel_is_one_line_listing_the_available_ones():
    r = subprocess.run([sys.executable, "-m", "harness.cli", "image", "build", "--kernel", "5.4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "available: 6.1, 6.12" in lines[0] and "7.3" in lines[0], r.stderr
    r = subprocess.run([sys.executable, "-m", "harness.cli", "boot", "--image", "9.9",
                        "--run", "true"], capture_output=True, text=True, timeout=60)
    # --image SERIES builds a Debian image not built yet; one the archives lack is one line
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "'9.9'" in lines[0] and "available: 6.1, 6.12" in lines[0] and "7.3" in lines[0], r.stderr
