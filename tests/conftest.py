"""Shared fixtures. VM tests boot the real default image; when none can boot they fail
with the reason (never skip)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

# tests/vm/selftests.py (the kernels' selftests as data) is imported by two test modules;
# --import-mode=importlib puts no test directory on sys.path.
sys.path.insert(0, str(Path(__file__).parent / "vm"))
sys.path.insert(0, str(Path(__file__).parent))
import kph_watchdog  # noqa: E402

ALONE_WAIT = 1800.0


def _our_qemu_children() -> list[str]:
    me = str(os.getpid())
    out = []
    for st in Path("/proc").glob("[0-9]*/status"):
        try:
            text = st.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == me and fields.get("Name", "").strip() in (
                "qemu-system-x86", "gdb", "ld-linux-x86-64"):
            out.append(f"{st.parent.name} {fields['Name'].strip()}")
    return out


@contextlib.contextmanager
def run_lock(exclusive: bool = False, item: pytest.Item | None = None):
    """The lock that makes ``alone`` tests run while no other xdist worker runs anything:
    every test (and every heavy module fixture, via this context manager) holds it shared,
    an ``alone`` test exclusively. Why: QEMU's reverse-continue stalls for good when the
    host's CPUs are saturated (docs/repro.md, "Record and replay"), and under ``-n 2`` the other
    worker saturates them.

    Fair to the ``alone`` test: it first takes a gate exclusively, which every shared taker
    passes through (shared, for an instant) before it takes the run lock, so the other
    worker starts no new test while the ``alone`` one waits for its current test to end
    (a bare flock() lets back-to-back shared holders starve an exclusive waiter: a CI run
    once waited 600 s). A wait past ALONE_WAIT fails the test (through ``item``, in its
    setup: never an internal error of the session)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid or _HELD:            # no xdist, or this process holds it already (a module
        yield                       # fixture set up inside a test's protocol)
        return
    base = (_LOCK_DIR or Path(tempfile.gettempdir())) / f"kph-tests-{uid}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as f:
        deadline = time.monotonic() + ALONE_WAIT
        got = True
        if exclusive:
            got = _flock(gate, fcntl.LOCK_EX, deadline) and _flock(f, fcntl.LOCK_EX, deadline)
        else:
            # waits while an alone test holds the gate (bounded too: never a silent hang)
            got = _flock(gate, fcntl.LOCK_SH, deadline) and _flock(f, fcntl.LOCK_SH, deadline)
        fcntl.flock(gate, fcntl.LOCK_UN)
        if not got:
            msg = f"waited {ALONE_WAIT:.0f} s for the other workers' tests to end"
            if item is None:
                pytest.fail(msg)
            item.kph_lock_error = msg               # failed by _lock_error() in setup
        _HELD.append(exclusive)
        try:
            yield
        finally:
            _HELD.pop()
            fcntl.flock(f, fcntl.LOCK_UN)


#: the run lock holds of this process (at most one: nested takers pass through)
_HELD: list[bool] = []

#: where a run's lock files go: the run's own pytest temp directory, shared by its xdist
#: workers (each worker's basetemp is ``<run>/popen-gwN``) and removed by pytest with the
#: run's other old temp directories, so no run leaves files in /tmp
_LOCK_DIR: Path | None = None


@pytest.hookimpl(trylast=True)            # after the tmp_path plugin's own configure
def pytest_configure(config: pytest.Config) -> None:
    global _LOCK_DIR
    if not config.pluginmanager.is_registered(kph_watchdog):
        config.pluginmanager.register(kph_watchdog, "kph_watchdog")
    if hasattr(config, "workerinput") and hasattr(config, "_tmp_path_factory"):
        _LOCK_DIR = config._tmp_path_factory.getbasetemp().parent


def _flock(f, mode: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


DURATIONS = Path(__file__).parent / "durations.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order for xdist's ``worksteal`` scheduling (pyproject.toml's addopts): ``alone``
    and ``kbuild`` tests first (each module kept whole: a module fixture is set up once),
    then the tests tests/durations.json measured longest (longest first), then the rest as
    collected (a stable sort: each group keeps its modules together). The first worker
    starts on the first half, in this order: the kernel builds one after the other (the
    later ones warm from the first's ccache), then the long tests; the other worker starts
    on the second half, and a worker whose queue runs dry takes the back half of the
    other's, so neither idles at the end (the long tests, behind the builds, end the
    first worker's run while the other takes what is left). An ``alone`` test waits for
    the other worker's current test to end: at the start that is a short one, where later
    it can be a 7-minute docs example. ``python bench/test_durations.py run.xml`` rewrites
    the file.

    Under ``load`` (before 2026-12-01) the first worker's fixed first chunk, an eighth of
    the tests, held all of this; the other worker ran the rest and then idled for the
    last 321 s of a 33-minute CI run (measured with a per-test timeline)."""
    try:
        secs = json.loads(DURATIONS.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        secs = {}

    def key(item: pytest.Item) -> tuple[int, float]:
        if item.get_closest_marker("alone") is not None or \
                item.get_closest_marker("kbuild") is not None:
            return (0, 0.0)
        s = secs.get(item.nodeid)
        return (1, -s) if s else (2, 0.0)

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test runs holding the run lock (an ``alone`` test exclusively). Taken here,
    outside pytest-timeout's own wrapper, so that waiting for an ``alone`` test on the
    other worker is not counted against a test's timeout; module fixtures, set up inside
    the first test's protocol, hold it too."""
    t0 = time.time()
    with run_lock(exclusive=item.get_closest_marker("alone") is not None, item=item):
        t1 = time.time()
        yield
    if TIMELINE:
        _timeline(item, t0, t1, time.time())


#: ``KPH_TEST_TIMELINE=FILE``: each test's run, worker, lock wait, start and end appended to
#: FILE as a JSON line, the inner runs' tests too (``python bench/test_durations.py
#: --timeline FILE`` prints where the outer run's minutes went: per worker, busy and idle,
#: the longest tests and modules)
TIMELINE = os.environ.get("KPH_TEST_TIMELINE", "")


def _timeline(item: pytest.Item, asked: float, start: float, end: float) -> None:
    line = json.dumps({"run": os.environ.get("PYTEST_XDIST_TESTRUNUID", ""),
                       "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                       "nodeid": item.nodeid, "asked": round(asked, 3),
                       "start": round(start, 3), "end": round(end, 3)})
    with open(TIMELINE, "a") as f:       # one short write a line: whole under O_APPEND
        f.write(line + "\n")


@pytest.fixture(autouse=True)
def _lock_error(request):
    msg = getattr(request.node, "kph_lock_error", None)
    if msg:
        pytest.fail(msg)


@pytest.fixture(scope="session", autouse=True)
def _nested_pytest_temproot(tmp_path_factory):
    """A pytest this session starts (a test's inner run, a docs example, ``kph fuzz``) keeps
    its numbered temporary directories under this worker's own, not beside them in
    ``/tmp/pytest-of-USER``: at its end, pytest deletes the numbered directories there that
    no live session holds (``cleanup_numbered_dir()``), and on a machine with an earlier
    run's directories left (the bisect test's kernel tree is gigabytes) the watchdog test's
    inner run spent its whole 150 s deleting one (CI of cd8eca6)."""
    root = tmp_path_factory.getbasetemp() / "nested"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_DEBUG_TEMPROOT", str(root))
        yield root


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes():
    """After the whole session, nothing this worker started may still run."""
    yield
    from harness.vmctl import _live

    for m in list(_live):
        m.close()
    left = _our_qemu_children()
    assert not left, f"processes left running after the tests: {left}"


@pytest.fixture(scope="session")
def default_image():
    from harness.errors import HarnessError
    from harness.machine.image.store import default_image as _default

    try:
        return _default()
    except HarnessError as exc:
        pytest.fail(f"no default image: {exc}")


@pytest.fixture(scope="module")
def vm(default_image):
    """One booted default image shared by the tests of a module."""
    from harness.vmctl import Machine

    with Machine.boot(default_image) as m:
        yield m


@pytest.fixture
def host_vm(vm):
    """The machine ``host`` comes from: the module's ``vm`` (a module running its host
    tests on another machine, or on one per engine, overrides this)."""
    return vm


@pytest.fixture
def host(host_vm):
    """``vm.host`` for one test; closed after it, the guest still answering, no handler
    having raised."""
    h = host_vm.host
    yield h
    errors = h.take_handler_errors()
    h.close()
    assert host_vm.run("echo alive").stdout == "alive\n"
    assert not errors, f"handler raised: {errors[0]!r}"


@pytest.fixture
def page_layout(tmp_path):
    """``check(html, width, name) -> dict``: render ``html`` in headless Chromium at a
    window ``width`` px wide, write its screenshot to the test's output directory
    (``tmp_path/<name>-<width>.png``, the whole page) and return what
    ``tests/data/layout_check.js`` measured there: ``problems`` (cut-off or clipped
    elements, overlapping cells, SVG texts/circles/lines overlapping: empty when the page
    is clean), ``counts`` (what was measured), ``width``, ``height`` and ``screenshot``."""
    import json
    import re
    import shutil
    import subprocess

    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (./setup.sh installs it)"
    script = (Path(__file__).parent / "data" / "layout_check.js").read_text()

    def run(args, timeout=120):
        common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  f"--user-data-dir={tmp_path / 'chromium-profile'}"]
        return subprocess.run(common + args, capture_output=True, text=True, timeout=timeout)

    def check(html: str, width: int, name: str) -> dict:
        page = tmp_path / f"{name}-{width}.html"
        page.write_text(html.replace("</body>", f"<script>{script}</script></body>", 1))
        dom = run([f"--window-size={width},1000", "--dump-dom", page.as_uri()]).stdout
        m = re.search(r'<pre id="kph-layout"[^>]*>(.*?)</pre>', dom, re.S)
        assert m, f"the layout check did not run in Chromium: {dom[-500:]}"
        res = json.loads(m.group(1).replace("&lt;", "<").replace("&gt;", ">")
                         .replace("&quot;", '"').replace("&amp;", "&"))
        shot = tmp_path / f"{name}-{width}.png"
        run([f"--window-size={width},{min(max(res['height'], 600), 12000)}",
             f"--screenshot={shot}", page.as_uri()])
        assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no screenshot"
        res["screenshot"] = str(shot)
        return res
    return check
