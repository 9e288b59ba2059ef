"""One entry of the bug corpus end to end (issue 37): Debian's 6.12 source built with an
undone upstream fix (``kph image build --tree 6.12 --patch ENTRY``, in the tree's variant
tree: incremental once tests/vm/test_kbuild.py has built another variant), ``kph hunt``
on that image told nothing about the entry, and the reproducer the hunt prints: failing
on the planted build and passing on Debian's own 6.12. bench/recall.py runs the whole
corpus (docs/recall.md).

The hunt's budget gives its selftest phase (40% of it) the 80 s in which a 15-minute
hunt found this entry on a quiet machine (2026-11-27), with room; so the test runs
``alone``. ``--stop-at-first`` ends the hunt at its first new finding: the test asks
whether the hunt finds the entry, and the phases after it would only spend the budget
(the whole corpus's false alarms are bench/recall.py's to count)."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "probes/bugs/tprobe-btf-arg-off-by-one.patch"
MINUTES = "5"


def kph(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_a_hunt_finds_an_undone_fix_it_was_not_told_about(tmp_path):
    r = kph("image", "build", "--tree", "6.12", "--patch", str(ENTRY), "--json", timeout=1700)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "variants" in json.loads(r.stdout)["tree"]["build"]      # the shared build
    planted = f"tree:6.12+{ENTRY}"
    r = kph("hunt", "--image", planted, "--minutes", MINUTES, "--stop-at-first", "--out", str(tmp_path / "runs"),
            "--json", timeout=900)
    doc = json.loads(r.stdout)
    new = [f for f in doc["findings"] if f["new"]]
    assert r.returncode == 1 and new, (r.returncode, doc["findings"], r.stderr[-2000:])
    assert doc["stopped_early"] and len(new) == 1, doc
    f = new[0]
    assert f["reproduce"].startswith("kph diff --image ") and f["lines"], f
    argv = shlex.split(f["reproduce"])[1:]
    on = argv.index("--image") + 1
    # the reproducer shows the bug on the planted build, and not on Debian's 6.12
    assert kph("-q", *argv).returncode == 1, f["reproduce"]
    argv[on] = "6.12"
    stock = kph("-q", *argv)
    assert stock.returncode == 0, (f["reproduce"], stock.stdout[-2000:], stock.stderr[-2000:])
