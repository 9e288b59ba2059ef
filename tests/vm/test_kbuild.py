"""A kernel built from source (issue 27): Debian's linux-source of 6.12 fetched, configured
small (tinyconfig + images/kernel.config) and built by ``kph kernel build``, then booted with
the default image's initramfs and probed from both sides.

The build takes both CPUs for ~4 min (measured 2026-11-26 on this machine), so it runs
``alone``; a second run in the same cache is incremental."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.machine.image import kbuild
from harness.vmctl import Machine

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def built():
    """``kph kernel build 6.12`` as a user runs it (its JSON result)."""
    r = subprocess.run([sys.executable, "-m", "harness.cli", "kernel", "build", "6.12",
                        "--json"], capture_output=True, text=True, timeout=1700)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernel: building" in r.stderr       # progress reaches stderr
    return json.loads(r.stdout)


def test_the_tree_builds_with_every_option_the_harness_needs(built):
    out = Path(built["out"])
    assert built["version"].startswith("6.12.")
    config = (out / ".config").read_text()
    assert kbuild.missing_options(config, kbuild.required_options()) == []
    assert Path(built["bzImage"]).is_file()
    from elftools.elf.elffile import ELFFile

    with open(built["vmlinux"], "rb") as f:
        assert ELFFile(f).get_section_by_name(".BTF") is not None     # BTF args need it


def test_it_boots_with_the_default_initramfs_and_its_own_facts(built):
    with Machine.boot(kernel=built["out"]) as vm:
        assert vm.run("uname -r", check=True).stdout.strip() == built["version"]
        assert vm.facts.rules.series == "6.12"          # the nearest series at or below it
        assert vm.symbols.lookup("vfs_read").addr
        assert vm.btf.offset("task_struct", "pid") > 0


def test_kph_diff_agrees_on_it(built):
    """The host engine against the guest's own kprobe_events, BTF arguments included."""
    r = subprocess.run([sys.executable, "-m", "harness.cli", "diff", "--kernel", built["out"],
                        "--guest", "events", "p:rd vfs_read count=%dx:u64",
                        "r:rr vfs_read $retval",
                        "p:op do_sys_openat2 dfd=$arg1 name=+0($arg2):ustring",
                        "--run", "head -c 20 /proc/cpuinfo > /dev/null", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["result"] == "equivalent", doc
    assert all(n > 0 for n in doc["matched"].values()), doc["matched"]
