"""pytest plugin: fixtures for differential kprobe tests (entry point ``kprobe_harness``).

Thin, like xdist's plugin: options, markers and fixtures here; the work is in
``harness.diff.runner`` and ``harness.diff.verdict``, which plain code can call too
(``boot_machine``, ``probe_diff``). QEMU-related imports happen inside the fixtures, so
``pytest --help`` works on hosts without QEMU. Under ``pytest -n N`` every worker boots its
own machines (named after the worker) and nothing is shared between workers.

Fixtures:
  kph_kernel         the kernel of this test with ``--kph-kernels`` (a series or ABI), or
                     None; tests that use a machine are parametrized over the list, and
                     xdist spreads the copies
  kph_image          the image to boot (session; built first if the kernel has none)
  kph_machine        one booted Machine per worker (session); tests must leave it clean
  kph_fresh_machine  a Machine of its own for one test, restored from the image's ready
                     snapshot (``harness.machine.snapshot``; ~0.5 s instead of a ~3 s cold boot),
                     so no test can see what an earlier one did to the guest
  probe_diff         call with (specs, workload) -> DiffResult; ``.assert_equivalent()``;
                     runs on a fresh machine per test (``--kph-machine-per worker``: on
                     one machine per worker, kept while tests pass and leave no probes,
                     restored fresh from the snapshot after one that did not)

Across machines (pytest-xdist's SSH gateways, ``kph worker prepare``): with several
kernels, every machine test carries ``xdist_group("kph-<kernel>")`` so that
``--dist loadgroup`` keeps a kernel's cases on one worker (its machine and snapshot);
every report carries the host and worker it ran on (``user_properties``: ``kph_host``),
a ``probe_diff`` report its diff as a section, and a failed one its diff JSON and the
guest's console tail, which the controller writes under ``--kph-evidence DIR`` (one
directory per host and test), so nothing has to be copied back from a remote worker.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TYPE_CHECKING

import pytest

if TYPE_CHECKING:   # the CLI and the pytest plugin load the machine only when used
    from ..vmctl import Machine


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kprobe-harness", "kprobe-harness differential tests")
    group.addoption("--kph-image", metavar="VERSION|DIR", default=None,
                    help="Image to boot (default: the one `kph image build` made)")
    group.addoption("--kph-qemu", metavar="PATH", default=None,
                    help="QEMU binary (default: the one the harness chooses)")
    group.addoption("--kph-guest", choices=("events", "module"), default="events",
                    help="In-guest side of probe_diff (default: events)")
    group.addoption("--kph-machine-per", choices=("test", "worker"), default="test",
                    help="Machine of probe_diff: a fresh one per test (default), or one "
                    "per worker, kept while tests pass and leave no probes behind (about "
                    "twice as fast)")
    group.addoption("--kph-kernels", metavar="K,K,...", default=None,
                    help="Run every machine test once per kernel (series or ABI), e.g. "
                    "6.1,6.12,7.3; images are built on first use")
    group.addoption("--kph-evidence", metavar="DIR", default=None,
                    help="Write each failed test's evidence (diff report, diff JSON, "
                    "console tail) under DIR/<host>/<test>/, from local and remote workers")
    group.addoption("--kph-strict", action="store_true",
                    help="probe_diff results allow no normalization except --kph-allow's "
                    "(as kph diff --strict)")
    group.addoption("--kph-allow", metavar="RULE,...", default="",
                    help="With --kph-strict, the normalizations to accept (docs/diff.md)")
    group.addoption("--kph-cold", action="store_true",
                    help="Boot every machine cold instead of from the image's ready snapshot")
    group.addoption("--kph-host", choices=("gdbstub", "plugin", "both"), default="gdbstub",
                    help="Host-side engine of the machines (vm.host, probe_diff's host "
                    "side): gdbstub (default), the QEMU plugin, or both (probe_diff then "
                    "compares gdbstub, plugin and guest on one execution)")


def pytest_configure(config: pytest.Config) -> None:
    d = config.getoption("--kph-evidence", None)
    if d and not hasattr(config, "workerinput"):   # the controller writes, workers report
        config.pluginmanager.register(_Evidence(Path(d)), "kph-evidence")
    config.addinivalue_line("markers", "vm: boots a real kernel under QEMU")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "kvm: needs a working /dev/kvm")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    kernels = metafunc.config.getoption("--kph-kernels")
    own = any("kph_kernel" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize"))
    if kernels and "kph_kernel" in metafunc.fixturenames and not own:
        ks = [k.strip() for k in kernels.split(",") if k.strip()]
        metafunc.parametrize("kph_kernel", ks, indirect=True, scope="session",
                             ids=[f"k{k}" for k in ks])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kernels = config.getoption("--kph-kernels")
    if not kernels or "," not in kernels:
        return  # one kernel: a group would put every case on one worker
    for item in items:
        callspec = getattr(item, "callspec", None)
        kernel = callspec.params.get("kph_kernel") if callspec is not None else None
        if kernel:
            item.add_marker(pytest.mark.xdist_group(name=f"kph-{kernel}"))


def _where() -> str:
    """``host:worker`` of this process (``host:local`` without xdist)."""
    return f"{socket.gethostname()}:{os.environ.get('PYTEST_XDIST_WORKER', 'local')}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call":
        return
    item.kph_call_failed = rep.failed       # type: ignore[attr-defined]  # probe_diff reads it
    # The item's list feeds the teardown report, which --junitxml reads properties from;
    # the call report's own copy feeds --kph-evidence.
    for props in (rep.user_properties, item.user_properties):
        props.append(("kph_host", _where()))
    helper = getattr(item, "funcargs", {}).get("probe_diff")
    if isinstance(helper, DiffHelper) and helper.last is not None:
        from harness.diff import report

        rep.sections.append(("kph diff", report.text(helper.last)))
        if rep.failed:
            rep.user_properties.append(("kph_diff_json", report.to_json(
                helper.last, getattr(helper.last, "runs", None))))
            try:
                rep.user_properties.append(("kph_console", helper.vm.console_tail(60)))
            except Exception:  # noqa: BLE001 - evidence is best effort
                pass


def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """A worker that died (its host lost, its SSH session ended): name the host in the
    error, not only xdist's gateway id."""
    node = getattr(report, "node", None)
    spec = getattr(getattr(node, "gateway", None), "spec", None)
    if spec is None:
        return
    where = f"ssh host {spec.ssh}" if getattr(spec, "ssh", None) else "a local (popen) worker"
    report.longrepr = f"{report.longrepr} (on {where}); the QEMU it ran died with it " \
                      "(PR_SET_PDEATHSIG); the other workers go on"
    report.user_properties.append(("kph_host", f"{getattr(spec, 'ssh', None) or 'local'}:"
                                   f"{getattr(node.gateway, 'id', '?')}"))


class _Evidence:
    """On the controller (or a plain run): each failed test's evidence on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed or report.when not in ("call", "???"):   # "???": a crash
            return
        props = dict(report.user_properties)
        where = str(props.get("kph_host", "unknown")).replace(":", "-")
        d = self.root / where / re.sub(r"[^\w.\[\]-]+", "_", report.nodeid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "report.txt").write_text(str(report.longrepr) + "".join(
            f"\n--- {name} ---\n{text}" for name, text in report.sections))
        for key, fname in (("kph_diff_json", "diff.json"), ("kph_console", "console.log")):
            if key in props:
                (d / fname).write_text(str(props[key]))


def boot_machine(image: Any = None, qemu: str | None = None, **kw: Any) -> Any:
    """A booted Machine (the plain function behind ``kph_machine`` and ``kph_fresh_machine``);
    ``fresh=True`` by default: restored from the image's ready snapshot when there is one."""
    from harness.vmctl import Machine

    return Machine.boot(image, qemu=qemu, **kw)


def _boot_opts(config: pytest.Config) -> dict[str, Any]:
    host = config.getoption("--kph-host")
    return {"qemu": config.getoption("--kph-qemu"), "fresh": not config.getoption("--kph-cold"),
            "host": "plugin" if host == "both" else host}


class DiffHelper:
    """``probe_diff(specs, workload)``: run both sides on one execution and compare."""

    def __init__(self, vm: Machine, guest: str, host: str = "gdbstub", *, strict: bool = False,
                 allow: Sequence[str] = ()) -> None:
        self.vm, self.guest, self.host = vm, guest, host
        self.strict, self.allow = strict, tuple(allow)
        self.last: Any = None

    def __call__(self, specs: Sequence[str], workload: str, *, guest: str | None = None,
                 hook: Callable[..., None] | None = None, timeout: float = 120.0,
                 strict: bool | None = None, allow: Sequence[str] | None = None,
                 triggers: Sequence[str] = ()) -> Any:
        """Run ``specs`` on both sides of one execution of ``workload``; ``strict`` and
        ``allow`` as ``harness.diff.verdict.compare`` (default: the --kph-strict options);
        ``triggers``: ``EVENT=stacktrace[:N]`` items (``kph diff --trigger``)."""
        from harness.diff.verdict import compare
        from harness.kernel.grammar import parse
        from harness.diff.runner import run_differential, trampoline_text

        # The grammar of the machine's kernel; its BTF and symbols decide at registration,
        # where a refusal is a result on both sides (harness.backends.tracelayer).
        from harness.kernel.grammar import KernelView
        facts = getattr(self.vm, "facts", None)
        view = KernelView(facts.rules) if facts is not None else None
        parsed = [parse(s, kernel=view) for s in specs]
        verdict = {"strict": self.strict if strict is None else strict,
                   "allow": tuple(self.allow if allow is None else allow)}
        if self.host == "both" and hook is None:
            from harness.diff.worlds import run_three

            three = run_three(self.vm, parsed, workload, guest=guest or self.guest,
                              timeout=timeout, **verdict)
            self.last = three
            return _CheckedThree(three)
        from harness.backends.triggers import parse_triggers

        runs = run_differential(self.vm, parsed, workload, guest=guest or self.guest,
                                hook=hook, timeout=timeout, triggers=parse_triggers(triggers))
        res = compare(*runs, trampoline=trampoline_text(self.vm), **verdict)
        res.runs = runs  # type: ignore[attr-defined]
        self.last = res
        return _Checked(res)


class _Checked:
    def __init__(self, res: Any) -> None:
        self.result = res

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)

    def assert_equivalent(self, *, min_events: int = 1, refusals_ok: bool = False) -> Any:
        """No divergence, no normalization ``strict`` forbids, at least one line both
        sides armed (``refusals_ok=True``: none may be, every line refused or accepted
        without arming anything, as a test of refusals expects), and at least
        ``min_events`` matched hits *for each probe* both sides armed (0: an empty result
        is fine)."""
        check_equivalent(self.result, min_events, refusals_ok=refusals_ok)
        return self.result


def check_equivalent(res: Any, min_events: int, *, refusals_ok: bool = False) -> None:
    """``assert_equivalent``'s rule, for one ``DiffResult``: a result in which no line was
    armed on both sides (both refused every line, or nothing was registered) measured
    nothing, and passes only when the caller says so (``refusals_ok``)."""
    from harness.diff import report

    text = report.text(res)
    assert res.agrees, text
    assert not res.strict_violations, text
    # a kernel report during the run is a finding, whatever the comparison said (issue 37)
    runs = getattr(res, "runs", ())        # both sides carry the run's one list
    splats = [sp for sp in (getattr(runs[0], "splats", ()) if runs else ()) if not sp.before]
    assert not splats, report.findings_text(splats) + text
    if not refusals_ok:
        assert res.armed, ("no line was armed on both sides (every line refused, or "
                           "accepted without registering): nothing was compared; pass "
                           f"refusals_ok=True where that is the expected result\n{text}")
    if min_events > 0:
        assert not res.empty, text
        for probe in dict.fromkeys(res.outcomes[k][0].probe for k in res.armed):
            n = res.matched.get(probe, 0)
            assert n >= min_events, (f"{probe}: {n} matched hit(s), fewer than "
                                     f"min_events={min_events}\n{text}")


class _CheckedThree:
    """probe_diff's answer under ``--kph-host both``: ``runs`` are (gdbstub, guest) as
    with one host engine; every pair of the three worlds must agree."""

    def __init__(self, three: Any) -> None:
        self.three = three
        self.runs = (three.runs[0], three.runs[2])
        self.plugin_run = three.runs[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.three.pairs[0], name)

    def assert_equivalent(self, *, min_events: int = 1, refusals_ok: bool = False) -> Any:
        for res in self.three.pairs:
            check_equivalent(res, min_events, refusals_ok=refusals_ok)
        return self.three


@pytest.fixture(scope="session")
def kph_kernel(request: pytest.FixtureRequest) -> str | None:
    return getattr(request, "param", None)


@pytest.fixture(scope="session")
def kph_image(request: pytest.FixtureRequest, kph_kernel: str | None) -> Any:
    from harness.errors import HarnessError
    from harness.machine.image.store import default_image

    try:
        if kph_kernel is not None:
            try:
                return default_image(kph_kernel)
            except HarnessError:
                from harness.machine.image.build import build_image
                with _untimed(request):
                    return build_image(kernel=kph_kernel,
                                       qemu=request.config.getoption("--kph-qemu"),
                                       progress=lambda s: None)
        return default_image(request.config.getoption("--kph-image"))
    except HarnessError as exc:
        pytest.fail(f"no kprobe-harness image: {exc}")


@contextlib.contextmanager
def _untimed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Suspend pytest-timeout's timer of the test whose setup builds a session's image
    (minutes on a fresh cache, whichever test asks first, and then the image of every
    later test on that worker: a build cut off by one test's timeout would fail them
    all); the timer starts again, in full, once it is built. The build's own steps have
    their own timeouts. Without pytest-timeout, or its hooks, nothing to do."""
    item = getattr(request, "_pyfuncitem", None)
    cancel = getattr(item, "cancel_timeout", None)
    try:
        import pytest_timeout
        settings = pytest_timeout._get_item_settings(item) if item is not None else None
    except (ImportError, AttributeError):
        settings = None
    if cancel is None or settings is None:
        yield
        return
    cancel()
    try:
        yield
    finally:
        request.config.pluginmanager.hook.pytest_timeout_set_timer(item=item, settings=settings)


@pytest.fixture(scope="session")
def kph_machine(request: pytest.FixtureRequest, kph_image: Any) -> Any:
    vm = boot_machine(kph_image, **_boot_opts(request.config))
    with vm:
        yield vm


@pytest.fixture
def kph_fresh_machine(request: pytest.FixtureRequest, kph_image: Any) -> Any:
    vm = boot_machine(kph_image, **_boot_opts(request.config))
    with vm:
        yield vm


class _Reused:
    """The worker's machines ``probe_diff`` runs on with ``--kph-machine-per worker``, one
    per image: booted (restored from the image's ready snapshot) on first use and kept
    while tests leave it clean; after a test that failed, left probes behind or lost its
    guest, the next test gets a fresh one. Kept warm, a guest runs its commands about
    twice as fast as a just-restored one (TCG has translated the exec path already)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.vms: dict[str, Machine] = {}

    def get(self, image: Any) -> Machine:
        key = str(getattr(image, "dir", image))
        vm = self.vms.get(key)
        if vm is not None and not vm.alive():
            self.discard(vm)
            vm = None
        if vm is None:
            vm = self.vms[key] = boot_machine(image, **self.opts)
        return vm

    def discard(self, vm: Machine) -> None:
        for key in [k for k, v in self.vms.items() if v is vm]:
            del self.vms[key]
        with contextlib.suppress(Exception):
            vm.close()

    def after(self, request: pytest.FixtureRequest, vm: Machine, events: str) -> None:
        """A test's end: the guest's ``events`` file (kprobe_events, dynamic_events) must be
        empty; the machine is given up when it is not, when the test failed, or when the
        guest cannot answer.

        :raise AssertionError: probes were left behind."""
        try:
            left = vm.pull(f"/sys/kernel/tracing/{events}").decode("utf-8", "replace")
        except BaseException:
            self.discard(vm)
            raise
        if left or getattr(request.node, "kph_call_failed", True):
            self.discard(vm)
        assert left == "", f"in-guest probes left behind: {left}"

    def close(self) -> None:
        for vm in list(self.vms.values()):
            self.discard(vm)


@pytest.fixture(scope="session")
def kph_reused(request: pytest.FixtureRequest) -> Iterator[_Reused | None]:
    """With ``--kph-machine-per worker``: the worker's reused machines
    (``.get(image)``, ``.after(request, vm, events_file)``); else None."""
    if request.config.getoption("--kph-machine-per") == "test":
        yield None
        return
    reused = _Reused(_boot_opts(request.config))
    try:
        yield reused
    finally:
        reused.close()


@pytest.fixture
def probe_diff(request: pytest.FixtureRequest, kph_kernel: str | None) -> DiffHelper:
    # kph_kernel is named so that --kph-kernels parametrizes every probe_diff test; the
    # machine itself is looked up below (per test or per worker).
    reused = request.getfixturevalue("kph_reused")
    vm = request.getfixturevalue("kph_fresh_machine") if reused is None else \
        reused.get(request.getfixturevalue("kph_image"))
    allow = [r.strip() for r in request.config.getoption("--kph-allow").split(",") if r.strip()]
    helper = DiffHelper(vm, request.config.getoption("--kph-guest"),
                        request.config.getoption("--kph-host"),
                        strict=request.config.getoption("--kph-strict"), allow=allow)
    yield helper
    # No state may leak out of a test: no probes left on either side (on a fresh machine
    # this still catches a runner that does not clean up after itself). A reused machine
    # is given up after a failure or a leak, so the next test starts clean.
    if reused is not None:
        reused.after(request, vm, "kprobe_events")
        return
    left = vm.pull("/sys/kernel/tracing/kprobe_events").decode("utf-8", "replace")
    assert left == "", f"in-guest probes left behind: {left}"
