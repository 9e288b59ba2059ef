"""``pytest -p harness.apps.pytest_ktap --kph-ktap FILE``: a pytest run's results as KTAP v1
(docs/ci.md), for the selftest-derived cases (tests/vm/test_selftests*.py) as for any
other test: one test per test module, its cases as subtests; passed ``ok``, failed
``not ok``, skipped ``ok # SKIP REASON``, xfail ``ok # XFAIL REASON``, an error in setup
or teardown (a machine that did not boot) ``not ok # ERROR``. With pytest-xdist the
controller writes it (the workers' reports come to it)."""
from __future__ import annotations

from typing import Any

from ..diff import ktap


def pytest_addoption(parser: Any) -> None:
    parser.getgroup("kph-ktap", "KTAP results (docs/ci.md)").addoption(
        "--kph-ktap", metavar="FILE", default=None,
        help="write the run's results as KTAP v1 to FILE (one test per module, its cases "
        "as subtests)")


def pytest_configure(config: Any) -> None:
    path = config.getoption("kph_ktap", None)
    if path and not hasattr(config, "workerinput"):        # the controller, or no xdist
        config.pluginmanager.register(Recorder(path), "kph-ktap-recorder")


def _reason(report: Any) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:              # a skip: (file, line, reason)
        return str(lr[2]).removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or str(lr or "")
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()
    return lines[0].removeprefix("E ").strip() if lines else ""


class Recorder:
    """Each test's status from its reports (setup, call, teardown), written at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cases: dict[str, ktap.Case] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        xfail = getattr(report, "wasxfail", None)
        if report.when == "call":
            if xfail is not None and report.skipped:
                case = ktap.Case(report.nodeid, "xfail", str(xfail) or "expected to fail")
            elif report.failed:
                case = ktap.Case(report.nodeid, "fail", diagnostics=[_reason(report)])
            elif report.skipped:
                case = ktap.Case(report.nodeid, "skip", _reason(report))
            else:
                case = ktap.Case(report.nodeid, "pass")
        elif report.skipped and report.when == "setup":
            case = (ktap.Case(report.nodeid, "xfail", str(xfail)) if xfail is not None
                    else ktap.Case(report.nodeid, "skip", _reason(report)))
        elif report.failed:                                 # setup or teardown
            case = ktap.Case(report.nodeid, "error", f"{report.when}: {_reason(report)}")
        else:
            return
        old = self.cases.get(report.nodeid)
        if old is None or old.status != "error":            # an error in teardown wins
            self.cases[report.nodeid] = case

    def pytest_sessionfinish(self, session: Any) -> None:
        modules: dict[str, list[ktap.Case]] = {}
        for nodeid, case in self.cases.items():
            mod, _, name = nodeid.partition("::")
            case.name = name or mod
            modules.setdefault(mod, []).append(case)
        cases = [ktap.Case.parent(mod, subs) for mod, subs in modules.items()]
        with open(self.path, "w") as f:
            f.write(ktap.render(cases))
