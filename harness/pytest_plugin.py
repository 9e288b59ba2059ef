"""pytest plugin: fixtures for differential kprobe tests (entry point ``kprobe_harness``).

Thin, like xdist's plugin: options, markers and fixtures here; the work is in
``harness.runner`` and ``harness.diff``, which plain code can call too
(``boot_machine``, ``probe_diff``). QEMU-related imports happen inside the fixtures, so
``pytest --help`` works on hosts without QEMU. Under ``pytest -n N`` every worker boots its
own machines (named after the worker) and nothing is shared between workers.

Fixtures:
  kph_image          the image to boot (session)
  kph_machine        one booted Machine per worker (session); tests must leave it clean
  kph_fresh_machine  a Machine of its own for one test, restored from the image's ready
                     snapshot (``harness.snapshot``; ~0.5 s instead of a ~3 s cold boot),
                     so no test can see what an earlier one did to the guest
  probe_diff         call with (specs, workload) -> DiffResult; ``.assert_equivalent()``;
                     runs on a fresh machine per test (``--kph-machine-per worker``: on
                     the worker's kph_machine, as before snapshots existed)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kprobe-harness", "kprobe-harness differential tests")
    group.addoption("--kph-image", metavar="VERSION|DIR", default=None,
                    help="Image to boot (default: the one `kph image build` made)")
    group.addoption("--kph-qemu", metavar="PATH", default=None,
                    help="QEMU binary (default: the one the harness chooses)")
    group.addoption("--kph-guest", choices=("events", "module"), default="events",
                    help="In-guest side of probe_diff (default: events)")
    group.addoption("--kph-machine-per", choices=("test", "worker"), default="test",
                    help="Machine of probe_diff: a fresh one per test (default), or the "
                    "worker's shared kph_machine")
    group.addoption("--kph-cold", action="store_true",
                    help="Boot every machine cold instead of from the image's ready snapshot")
    group.addoption("--kph-host", choices=("gdbstub", "plugin", "both"), default="gdbstub",
                    help="Host-side engine of the machines (vm.host, probe_diff's host "
                    "side): gdbstub (default), the QEMU plugin, or both (probe_diff then "
                    "compares gdbstub, plugin and guest on one execution)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vm: boots a real kernel under QEMU")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "kvm: needs a working /dev/kvm")


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

    def __init__(self, vm: Any, guest: str, host: str = "gdbstub") -> None:
        self.vm, self.guest, self.host = vm, guest, host
        self.last: Any = None

    def __call__(self, specs: Sequence[str], workload: str, *, guest: str | None = None,
                 hook: Callable[..., None] | None = None, timeout: float = 120.0) -> Any:
        from harness.diff import compare
        from harness.probespec import parse
        from harness.runner import run_differential, trampoline_text

        parsed = [parse(s) for s in specs]
        if self.host == "both" and hook is None:
            from harness.worlds import run_three

            three = run_three(self.vm, parsed, workload, guest=guest or self.guest,
                              timeout=timeout)
            self.last = three
            return _CheckedThree(three)
        runs = run_differential(self.vm, parsed, workload, guest=guest or self.guest,
                                hook=hook, timeout=timeout)
        res = compare(*runs, trampoline=trampoline_text(self.vm))
        res.runs = runs  # type: ignore[attr-defined]
        self.last = res
        return _Checked(res)


class _Checked:
    def __init__(self, res: Any) -> None:
        self.result = res

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)

    def assert_equivalent(self, *, min_events: int = 1) -> Any:
        from harness import report

        text = report.text(self.result)
        assert self.result.equivalent, text
        assert self.result.total_matched >= min_events, f"too few events matched\n{text}"
        return self.result


class _CheckedThree:
    """probe_diff's answer under ``--kph-host both``: ``runs`` are (gdbstub, guest) as
    with one host engine; every pair of the three worlds must agree."""

    def __init__(self, three: Any) -> None:
        self.three = three
        self.runs = (three.runs[0], three.runs[2])
        self.plugin_run = three.runs[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.three.pairs[0], name)

    def assert_equivalent(self, *, min_events: int = 1) -> Any:
        from harness import report

        for res in self.three.pairs:
            text = report.text(res)
            assert res.equivalent, text
            assert res.total_matched >= min_events, f"too few events matched\n{text}"
        return self.three


@pytest.fixture(scope="session")
def kph_image(request: pytest.FixtureRequest) -> Any:
    from harness.errors import HarnessError
    from harness.images import default_image

    try:
        return default_image(request.config.getoption("--kph-image"))
    except HarnessError as exc:
        pytest.fail(f"no kprobe-harness image: {exc}")


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


@pytest.fixture
def probe_diff(request: pytest.FixtureRequest) -> DiffHelper:
    per_test = request.config.getoption("--kph-machine-per") == "test"
    vm = request.getfixturevalue("kph_fresh_machine" if per_test else "kph_machine")
    helper = DiffHelper(vm, request.config.getoption("--kph-guest"),
                        request.config.getoption("--kph-host"))
    yield helper
    # No state may leak out of a test: no probes left on either side (on a fresh machine
    # this still catches a runner that does not clean up after itself).
    left = vm.run("cat /sys/kernel/tracing/kprobe_events").stdout
    assert left == "", f"in-guest probes left behind: {left}"
