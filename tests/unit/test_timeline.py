"""The suite's timeline (``KPH_TEST_TIMELINE``, tests/conftest.py) and its summary
(``bench/test_durations.py --timeline``): where a run's minutes went, per worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "test_durations.py"


def _summary(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), "--timeline", str(path), *extra],
                          capture_output=True, text=True, timeout=60)


def test_each_test_is_one_line_with_its_worker_wait_and_span(tmp_path, monkeypatch):
    out = tmp_path / "tl.jsonl"
    monkeypatch.setattr(conftest, "TIMELINE", str(out))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    conftest._timeline(SimpleNamespace(nodeid="tests/vm/test_a.py::test_x"), 10.0, 12.5, 20.0)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    conftest._timeline(SimpleNamespace(nodeid="test_inner.py::test_y"), 11.0, 11.0, 12.0)
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    assert rows == [{"run": run, "worker": "gw1", "nodeid": "tests/vm/test_a.py::test_x",
                     "asked": 10.0, "start": 12.5, "end": 20.0},
                    {"run": run, "worker": "main", "nodeid": "test_inner.py::test_y",
                     "asked": 11.0, "start": 11.0, "end": 12.0}]


def test_the_summary_gives_each_worker_its_busy_idle_and_waits(tmp_path):
    tl = tmp_path / "tl.jsonl"
    rows = [("o", "gw0", "tests/vm/test_a.py::test_1", 0, 0, 100),
            ("o", "gw0", "tests/vm/test_a.py::test_2", 100, 130, 150),   # waited 30 s
            ("o", "gw1", "tests/vm/test_b.py::test_3", 0, 0, 40),
            ("i", "gw2", "test_inner.py::test_5", 20, 20, 30),        # an inner xdist run
            ("", "main", "test_inner.py::test_4", 5, 5, 500)]         # an inner plain run
    tl.write_text("".join(json.dumps({"run": u, "worker": w, "nodeid": n, "asked": a,
                                      "start": s, "end": e}) + "\n"
                          for u, w, n, a, s, e in rows))
    r = _summary(tl, "--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines.pop(0) == "(the longest of 2 xdist runs in the file; the others ran inside it)"
    assert lines[0] == "3 tests over 150 s (first asked to last ended)"
    assert lines[1].split() == "gw0: 2 tests, busy 120 s, waited for the run lock 30 s, " \
        "idle 0 s, done at 150 s (0 s before the end)".split()
    assert "gw1: 1 tests, busy 40 s" in lines[2] and "(110 s before the end)" in lines[2]
    assert "test_inner" not in r.stdout
    longest = lines[lines.index("the 2 longest tests (seconds, worker, started at):") + 1]
    assert longest.split() == ["100.0", "gw0", "0", "tests/vm/test_a.py::test_1"]
    assert r.stdout.rstrip().splitlines()[-2:][0].split() == ["120.0", "2",
                                                               "tests/vm/test_a.py"]


def test_a_file_without_a_worker_s_test_is_one_line_and_exit_2(tmp_path):
    tl = tmp_path / "tl.jsonl"
    tl.write_text(json.dumps({"worker": "main", "nodeid": "x::y", "asked": 0, "start": 0,
                              "end": 1}) + "\n")
    r = _summary(tl)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "run with -n" in r.stderr
    r = _summary(tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "KPH_TEST_TIMELINE" in r.stderr and "Traceback" not in r.stderr


def test_a_worker_s_idle_seconds_are_its_gaps_before_its_last_test_ended(tmp_path):
    tl = tmp_path / "tl.jsonl"
    rows = [("o", "gw0", "tests/vm/test_a.py::test_1", 0, 0, 100),
            ("o", "gw1", "tests/vm/test_b.py::test_2", 0, 0, 40),
            ("o", "gw1", "tests/vm/test_b.py::test_3", 60, 65, 70)]   # 20 s of nothing
    tl.write_text("".join(json.dumps({"run": u, "worker": w, "nodeid": n, "asked": a,
                                      "start": s, "end": e}) + "\n"
                          for u, w, n, a, s, e in rows))
    r = _summary(tl)
    assert r.returncode == 0, r.stderr
    gw1 = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("gw1:"))
    assert "busy 45 s, waited for the run lock 5 s, idle 20 s, done at 70 s" in gw1, gw1


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    tl = tmp_path / "tl.jsonl"
    tl.write_text("".join(json.dumps({"run": "o", "worker": "gw0", "nodeid": f"t.py::test_{i}",
                                      "asked": i, "start": i, "end": i + 1}) + "\n"
                          for i in range(50)))
    p = subprocess.Popen([sys.executable, str(BENCH), "--timeline", str(tl), "--top", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                    # as `| head -1` does once it has its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and "Traceback" not in err and "Exception" not in err, err
