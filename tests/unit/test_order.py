"""tests/conftest.py's order for xdist's worksteal: a test tests/durations.json lists as
long takes the tests of its module that share a module fixture with it along, right
behind it, so that one worker sets the fixture up once (CI's run on 2026-12-02 made
test_remote.py's prepared worker, ~65 s, on both workers)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLICE = "tests/vm/test_remote.py::test_a_slice_through_two_ssh_gateways_and_popen_matches_a_local_run"


def test_a_long_test_s_module_fixture_siblings_follow_it_and_the_others_do_not():
    assert SLICE in json.loads((ROOT / "tests" / "durations.json").read_text())["seconds"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                        "--collect-only", "-q", "tests/vm/test_interrupt.py",
                        "tests/vm/test_hunt.py", "tests/vm/test_remote.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    order = [ln for ln in r.stdout.splitlines() if "::" in ln]
    at = order.index(SLICE)
    # the two tests that use the module's ``worker`` fixture, in collection order around it
    assert order[at - 1:at + 2] == [
        "tests/vm/test_remote.py::test_prepare_makes_an_identical_worker_and_prints_its_tx",
        SLICE,
        "tests/vm/test_remote.py::test_a_remote_worker_killed_mid_run_is_an_error_naming_its_host",
    ], order
    # a test of the module without the fixture stays with the rest, after the listed ones
    pinned = order.index("tests/vm/test_remote.py::test_the_loopback_sshd_host_key_is_pinned")
    assert pinned > order.index("tests/vm/test_hunt.py::"
                                "test_a_short_hunt_on_the_default_kernel_finds_nothing_new")
