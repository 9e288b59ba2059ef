"""tests/kph_watchdog.py: a test that pytest-timeout cannot end (SIGALRM blocked, so its
signal method never runs) ends its xdist worker after its timeout plus the margin, with
the stacks on stderr; xdist reports the test as crashed and a new worker runs the rest."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

HUNG = '''
import signal, time
import pytest

@pytest.mark.timeout(1)
def test_hangs_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(300)

# a timeout of its own: with none (no ini file here) the watchdog's deadline would be the
# 2 s margin alone, which a loaded machine's worker can pass on a test that does nothing
@pytest.mark.timeout(60)
def test_after_it():
    assert True
'''

#: the inner run's bound: past it, its processes' stacks are the failure's evidence
INNER = 150


def _run_inner(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    """The inner pytest in a session of its own, its output in a file. Past ``INNER``
    seconds every process of the session gets SIGABRT (PYTHONFAULTHANDLER: each writes
    its threads' stacks to the file), then SIGKILL: nothing outlives the test, and a hang
    says where each process was."""
    log = tmp_path / "inner.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                              "kph_watchdog", "-n", "1", "-p", "no:randomly", "--rootdir",
                              str(tmp_path), "-c", os.devnull, "test_hung.py"],
                             cwd=tmp_path, env={**env, "PYTHONFAULTHANDLER": "1"},
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=INNER)
        except subprocess.TimeoutExpired:
            ps = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-s", str(p.pid)],
                                capture_output=True, text=True).stdout
            for sig, grace in ((signal.SIGABRT, 3), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=grace)
            pytest.fail(f"the inner run did not end in {INNER} s; its processes:\n{ps}\n"
                        f"its output, then their stacks:\n{log.read_text()[-12000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)      # a worker left behind, if any
            p.wait()
    return rc, log.read_text()


# its bound is the inner run's INNER, not the suite's 60 s (CI's run of b18c37a: a loaded
# machine took longer than 60 s to start the inner run's two workers)
@pytest.mark.timeout(INNER + 30)
def test_a_hang_pytest_timeout_cannot_end_ends_its_worker_with_the_stacks(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    env = {**os.environ, "KPH_WATCHDOG_MARGIN": "2",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    rc, out = _run_inner(tmp_path, env)
    # ended in INNER s (_run_inner), not the test's 300 s sleep: two xdist workers'
    # start-ups and 3 s (6-21 s on a quiet machine)
    assert rc == 1, out[-3000:]
    assert "kph watchdog: test_hung.py::test_hangs_where_no_signal_reaches still running" \
        in out, out[-3000:]
    assert "time.sleep" in out or "test_hung.py\", line 8" in out, out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
