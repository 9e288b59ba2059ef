"""``--kph-machine-per worker``: probe_diff keeps one machine per worker while its tests
pass and leave no probe behind, and gives the next test a fresh one (restored from the
snapshot) after a test that failed or leaked a probe (harness.apps.pytest_plugin._Reused).
Run as a user's suite would: a pytest of its own, on the default image."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(180)]

INNER = '''
import json, os, pathlib

P = pathlib.Path(os.environ["KPH_PIDS"])


def _note(name, vm):
    d = json.loads(P.read_text()) if P.exists() else {}
    d[name] = vm.pid
    P.write_text(json.dumps(d))


def test_a(probe_diff):
    _note("a", probe_diff.vm)


def test_b(probe_diff):
    _note("b", probe_diff.vm)


def test_c_fails(probe_diff):
    _note("c", probe_diff.vm)
    assert False, "planned"


def test_d(probe_diff):
    _note("d", probe_diff.vm)


def test_e_leaves_a_probe(probe_diff):
    _note("e", probe_diff.vm)
    probe_diff.vm.run("echo 'p:kph_leak vfs_read' >> /sys/kernel/tracing/kprobe_events")


def test_f(probe_diff):
    _note("f", probe_diff.vm)
'''


def test_a_reused_machine_is_replaced_after_a_failure_or_a_leak(tmp_path, default_image):
    (tmp_path / "test_inner.py").write_text(INNER)
    pids = tmp_path / "pids.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o",
                        "addopts=", "-c", os.devnull, "--rootdir", str(tmp_path),
                        "--kph-machine-per", "worker", "test_inner.py"],
                       cwd=tmp_path, env={**os.environ, "KPH_PIDS": str(pids)},
                       capture_output=True, text=True, timeout=170)
    out = r.stdout + r.stderr
    assert "1 failed, 5 passed, 1 error" in out, out[-3000:]
    assert "in-guest probes left behind: p:kprobes/kph_leak vfs_read" in out, out[-3000:]
    p = json.loads(pids.read_text())
    assert p["a"] == p["b"] == p["c"], p        # kept while the tests pass
    assert p["d"] != p["c"], p                  # a fresh one after the failure
    assert p["e"] == p["d"], p
    assert p["f"] != p["e"], p                  # and after the leaked probe
