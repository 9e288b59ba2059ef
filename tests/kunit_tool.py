"""The kernel's own KTAP parser (tools/testing/kunit/kunit_parser.py of Debian's
linux-source-6.12, unpacked by ``kph kernel fetch 6.12``), for the tests of kph's KTAP
(tests/unit/test_ktap.py, tests/vm/test_ci_output.py).

The tree is fetched when the cache lacks it (as ``kph kernel fetch 6.12``); a fetch that
fails fails the test, naming the tree: never a silent skip.
"""
from __future__ import annotations

import importlib
import inspect
import io
import sys
from pathlib import Path
from typing import Any

import pytest

SERIES = "6.12"


def kunit_dir() -> Path:
    from harness.machine.image.ksource import fetch_source, sources_dir

    have = sorted(sources_dir().glob(f"linux-source-{SERIES}.*/tools/testing/kunit/kunit_parser.py"))
    if have:
        return have[-1].parent
    try:
        tree = fetch_source(SERIES)
    except Exception as exc:   # noqa: BLE001 - the test fails, naming what is missing
        pytest.fail(f"the kernel's KTAP parser is missing ({sources_dir()}/linux-source-"
                    f"{SERIES}*/tools/testing/kunit/kunit_parser.py) and `kph kernel fetch "
                    f"{SERIES}` failed: {exc}")
    return tree / "tools/testing/kunit"


def parser() -> Any:
    """kunit_parser, imported from the tree (its directory first on sys.path: it imports
    kunit_printer beside it)."""
    d = str(kunit_dir())
    if d not in sys.path:
        sys.path.insert(0, d)
    return importlib.import_module("kunit_parser")


def parse(text: str) -> Any:
    """The parser's main Test for a KTAP document (nothing printed)."""
    kp = parser()
    import kunit_printer
    if "printer" in inspect.signature(kp.parse_run_tests).parameters:   # 7.3's
        return kp.parse_run_tests(text.splitlines(), kunit_printer.null_printer)
    # 6.12's prints to kunit_printer.stdout, a Printer bound to the sys.stdout of the
    # moment it was imported: under pytest, maybe a test's capture closed since (seen:
    # "I/O operation on closed file" in a later test of the same worker)
    printer = kunit_printer.stdout
    saved, printer._output = printer._output, io.StringIO()
    try:
        return kp.parse_run_tests(text.splitlines())
    finally:
        printer._output = saved


def leaves(test: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """Each leaf test of the parser's tree: (its path of names, its status name)."""
    if not test.subtests:
        return [(path, test.status.name)]
    out = []
    for t in test.subtests:
        out += leaves(t, (*path, t.name))
    return out


def check_counts(text: str, cases: list[Any]) -> Any:
    """Parse ``text`` and check the parser's counts are what kph decided (``ktap.counts``:
    passed = pass + xfail, failed = fail + error, skipped, no crash, no parse error) and
    that the leaves are kph's, by name and status. Returns the parser's main Test."""
    from harness.diff import ktap

    main = parse(text)
    want = ktap.counts(cases)
    c = main.counts
    got = {"passed": c.passed, "failed": c.failed, "skipped": c.skipped,
           "crashed": c.crashed, "errors": c.errors}
    assert got == {"passed": want["passed"], "failed": want["failed"],
                   "skipped": want["skipped"], "crashed": 0, "errors": 0}, (got, want, text)
    status = {"pass": "SUCCESS", "xfail": "SUCCESS", "fail": "FAILURE", "error": "FAILURE",
              "skip": "SKIPPED"}

    def ours(cs: list[Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
        out = []
        for cs_ in cs:
            p = (*path, ktap._clean(cs_.name))
            out += ours(cs_.subtests, p) if cs_.subtests else [(p, status[cs_.status])]
        return out
    assert leaves(main) == ours(cases), text
    return main
