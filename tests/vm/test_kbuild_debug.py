"""``kph image build --tree 6.12 --debug`` (issue 37): Debian's 6.12 source built with the
debug options of images/kernel-debug.config (lockdep with PROVE_RCU, DEBUG_ATOMIC_SLEEP,
KASAN) in a build directory of its own, made an image of its own, booted with lockdep and
KASAN running, and diffed: a kprobe and an fprobe on the hunt's workload agree and the
kernel watch sees no report. A cold build (both CPUs, minutes: bench/debug_cost.py); ``kbuild``
schedules it with the other builds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.machine.image import kbuild
from harness.machine.image.store import load_image
from harness.vmctl import Machine

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.kbuild, pytest.mark.timeout(2400)]


def kph(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


def test_a_debug_build_boots_with_lockdep_and_kasan_and_a_diff_agrees_without_a_report():
    r = kph("image", "build", "--tree", "6.12", "--debug", "--json", timeout=2300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    tree = doc["tree"]
    assert tree["debug"] is True and Path(tree["build"]).name == ".kph-build-debug", tree
    config = (Path(tree["build"]) / ".config").read_text()
    assert kbuild.missing_options(config, kbuild.required_options(kbuild.fragment_for(True))) == []
    img = load_image(Path(doc["dir"]))
    with Machine.boot(img) as vm:
        dmesg = vm.run("dmesg", timeout=60).stdout
    assert "KernelAddressSanitizer initialized" in dmesg and "Lock dependency validator" in dmesg
    d = kph("diff", "--image", Path(img.dir).name, "--run", "cat /proc/version; ls / >/dev/null",
            "--", "p:kph/o do_sys_openat2 dfd=%di:s32", "f:kph/r vfs_read%return ret=$retval",
            timeout=900)
    assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-2000:]
