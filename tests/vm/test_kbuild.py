"""A kernel built from source (issue 27): Debian's linux-source of 6.12 fetched, a fix from
probes/patches/ applied to a copy, configured small (tinyconfig + images/kernel.config),
built, and made an image by ``kph image build --tree 6.12 --patch FIX`` (its own
kph_kprobes.ko, its kernel facts, a ready snapshot); then booted, diffed on both in-guest
sides, put beside Debian's binary 6.12 in ``kph matrix``, and used to verify the fix: the
upstream reproducer is MET on Debian's kernel and NOT MET on the patched build.

The build takes both CPUs for ~4 min (measured 2026-11-26 on this machine) when cold; a
second run in the same cache is incremental. Not ``alone`` (see tests/vm/test_bisect.py);
``kbuild`` schedules it first, with the bisect test whose ccache makes it warm."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.machine.image import kbuild, ksource
from harness.machine.image.store import load_image
from harness.vmctl import Machine

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.kbuild, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "probes/patches/btf-char-ptr-needs-a-pointer.patch"
REPRO = ROOT / "probes/scenarios/upstream/btf-char-ptr.toml"


def kph(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image():
    """``kph image build --tree 6.12 --patch FIX`` as a user runs it (its JSON result)."""
    r = kph("image", "build", "--tree", "6.12", "--patch", str(FIX), "--json", timeout=1700)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernel: building" in r.stderr or "kernel: built" in r.stderr   # progress on stderr
    doc = json.loads(r.stdout)
    assert doc["kernel_origin"] == "tree" and doc["snapshots"], doc
    return doc


def test_the_tree_is_patched_and_built_with_every_option_the_harness_needs(image):
    tree = image["tree"]
    assert [p["name"] for p in tree["patches"]] == [FIX.name]
    assert image["kernel_version"].startswith("6.12.") and image["rules"] == "6.12"
    out = Path(tree["build"])
    assert kbuild.missing_options((out / ".config").read_text(), kbuild.required_options()) == []
    src = Path((out / "source").resolve())
    assert "btf_type_is_ptr(type)" in (src / "kernel/trace/trace_probe.c").read_text()
    # the patch went into a copy: Debian's tree is as Debian ships it
    pristine = ksource.fetch_source("6.12")
    assert src != pristine
    assert "btf_type_is_ptr(type)" not in (pristine / "kernel/trace/trace_probe.c").read_text()
    from elftools.elf.elffile import ELFFile

    with open(Path(image["dir"]) / "vmlinux", "rb") as f:       # symbols and BTF, no DWARF
        elf = ELFFile(f)
        assert elf.get_section_by_name(".BTF") is not None
        assert elf.get_section_by_name(".debug_info") is None


def test_the_build_directory_boots_with_the_default_initramfs(image):
    with Machine.boot(kernel=image["tree"]["build"]) as vm:
        assert vm.run("uname -r", check=True).stdout.strip() == image["kernel_version"]
        assert vm.facts.rules.series == "6.12"          # the nearest series at or below it
        assert vm.symbols.lookup("vfs_read").addr
        assert vm.btf.offset("task_struct", "pid") > 0


def test_two_cpus_come_up_without_acpi(image):
    """The tree's config has no ACPI: its kernel finds CPUs in the BIOS's MP table, which
    lists one CPU a package (Machine's -smp puts each in its own socket)."""
    img = load_image(Path(image["dir"]))
    assert "CONFIG_ACPI=y" not in (Path(image["dir"]) / "config").read_text().splitlines()
    with Machine.boot(img, smp=2) as vm:
        assert vm.run("nproc", check=True).stdout.strip() == "2"


def test_the_image_boots_from_its_snapshot_and_loads_its_own_modules(image):
    img = load_image(Path(image["dir"]))
    with Machine.boot(img) as vm:
        assert vm.start_mode == "snapshot"                      # the ready snapshot
        # the tree's own modules: pvpanic-pci (a module in images/kernel.config) loaded at boot
        assert "pvpanic_pci" in vm.run("cat /proc/modules", check=True).stdout
        r = vm.run("insmod /lib/modules/kph_kprobes.ko && grep -c kph_kprobes /proc/modules",
                   check=True)
        assert r.stdout.strip() == "1"


@pytest.mark.parametrize("guest", ["events", "module"])
def test_kph_diff_agrees_on_it_on_both_in_guest_sides(image, guest):
    """The host engine against the guest's own kprobe_events, and against kph_kprobes.ko
    built against this tree, BTF arguments included."""
    r = kph("diff", "--image", image["dir"], "--guest", guest, "p:rd vfs_read count=%dx:u64",
            "r:rr vfs_read $retval", "p:op do_sys_openat2 dfd=$arg1 name=+0($arg2):ustring",
            "--run", "head -c 20 /proc/cpuinfo > /dev/null", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["result"] == "equivalent", doc
    assert all(n > 0 for n in doc["matched"].values()), doc["matched"]


def test_the_reproducer_is_met_on_debian_s_kernel_and_not_on_the_patched_build(image):
    """kph repro --kernels stock,patched: the fix is verified."""
    r = kph("repro", str(REPRO), "--kernels", "stock,patched", "--json", timeout=1700)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["fix_verified"] is True
    got = {k["name"]: (k["met"], k["image"]) for k in doc["kernels"]}
    assert got["stock"][0] is True and got["patched"][0] is False, doc
    assert got["patched"][1] == image["dir"]            # the very image built above
    stock, = (k for k in doc["kernels"] if k["name"] == "stock")
    assert stock["kernel"].endswith("-cloud-amd64")     # Debian's binary kernel
    patched, = (k for k in doc["kernels"] if k["name"] == "patched")
    assert "EINVAL" in patched["cause"] and "does not fit for string" in patched["cause"]


def test_kph_matrix_shows_debian_s_kernel_and_the_tree_side_by_side(image):
    r = kph("matrix", "--kernels", f"6.12,{image['dir']}", "p:rd vfs_read count=%dx:u64",
            "--run", "head -c 20 /proc/cpuinfo > /dev/null", "--json", timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    rows = {k["series"]: k for k in doc["kernels"]}
    assert set(rows) == {"6.12", "6.12 src+btf-char-ptr-needs-a-pointer"}, rows.keys()
    assert all(k["rules"] == "6.12" and k["equivalent"] for k in doc["kernels"]), doc
