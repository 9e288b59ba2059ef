"""The suite's last line against a hang: a test still running ``MARGIN`` seconds past its
own timeout (pytest-timeout's, taken from the test's marker or the ini file) ends its
worker, after writing every thread's stack to stderr.

Why: pytest-timeout's signal method cannot end a test whose main thread never returns to
Python (a C call that retries on EINTR, a timer cancelled for an image build that then
waits forever), and a hung xdist worker hangs the whole run: a CI run once printed
nothing for its last 36 minutes and was cut off at its 90. Ended, the worker is reported
by xdist as crashed while running that test (a failure naming it), the stacks say where
it was, a new worker takes the rest of the run, and the kernel ends the worker's QEMU and
gdb children (``harness.procs.pdeathsig``).

``KPH_WATCHDOG_MARGIN`` (seconds) changes the margin (the unit test sets it small).
"""
from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

#: Seconds past a test's timeout (long enough for a session image build, which suspends
#: the test's timer: harness.apps.pytest_plugin._untimed).
MARGIN = float(os.environ.get("KPH_WATCHDOG_MARGIN", "600"))
#: The exit status of a worker the watchdog ended.
EXIT_STATUS = 70


def timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout timeout in seconds (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            try:
                value = item.config.getini("timeout")
            except ValueError:          # no pytest-timeout: no timeout of its own
                value = None
    try:
        return max(float(value or 0), 0.0)
    except (TypeError, ValueError):
        return 0.0


class _Watch:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: pytest.Item | None = None
        self._start = 0.0
        self._deadline = 0.0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, item: pytest.Item) -> Iterator[None]:
        with self._cond:
            self._item, self._start = item, time.monotonic()
            self._deadline = self._start + timeout_of(item) + MARGIN
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kph-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._item = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._item is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fire(self._item)

    def _fire(self, item: pytest.Item) -> None:
        took = time.monotonic() - self._start
        head = (f"kph watchdog: {item.nodeid} still running {took:.0f} s after it began (its "
                f"timeout {timeout_of(item):.0f} s + {MARGIN:.0f} s); pytest-timeout could "
                f"not end it, so its worker (pid {os.getpid()}) ended. Its threads:\n")
        # for the controller's report of the crash (pytest_handlecrashitem below) ...
        with contextlib.suppress(OSError), open(_stacks_file(item.config, item.nodeid),
                                                "w") as f:
            f.write(head)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        # ... and on the worker's own stderr, past pytest's capture of the test's output
        with contextlib.suppress(Exception):
            capman = item.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                capman.suspend_global_capture(in_=False)
        sys.stderr.write("\n" + head)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_STATUS)


def _stacks_file(config: pytest.Config, nodeid: str) -> Path:
    """Where a worker leaves a hung test's stacks: the run's temp directory, which a
    worker's basetemp (``<run>/popen-gwN``) and the controller's basetemp share."""
    factory = config._tmp_path_factory           # type: ignore[attr-defined]
    run = factory.getbasetemp()
    if hasattr(config, "workerinput"):
        run = run.parent
    return run / f"kph-watchdog-{hashlib.sha256(nodeid.encode()).hexdigest()[:16]}.txt"


_WATCH = _Watch()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _WATCH.watching(item):
        yield


def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """On the controller: a worker the watchdog ended left the stacks; they join the
    crash's report."""
    config = getattr(getattr(sched, "config", None), "pluginmanager", None) and sched.config
    if config is None:
        return
    path = _stacks_file(config, crashitem)
    if path.exists():
        report.longrepr = f"{report.longrepr}\n{path.read_text()}"
