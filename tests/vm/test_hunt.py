"""``kph hunt`` on the default image (Linux 6.1, Debian's): a half-minute hunt runs every
phase, finds nothing new, and exits 0 (the bad-input cases need no guest:
tests/unit/test_hunt.py)."""
import json
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(120)]


def test_a_short_hunt_on_the_default_kernel_finds_nothing_new(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "harness.cli", "hunt", "--minutes", "0.5",
                        "--max-cases", "4", "--out", str(tmp_path / "runs"), "--json"],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["new"] == 0 and doc["status"] == 0, doc["findings"]
    # every phase ran something: the selftests, a scenario, raw kprobes' registrations, a
    # function's instructions with post_handlers, refused lines from writers at once on a
    # second machine (two CPUs), the fuzzer
    assert all(doc["counts"][p]["run"] >= 1 for p in ("selftests", "scenarios", "kprobes",
                                                       "insns", "writers", "fuzz")), doc
    assert "hunt: selftests:" in r.stderr and "0 new finding(s)" in r.stderr
    assert took < 60, took
