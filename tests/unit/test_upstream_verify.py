"""``kph upstream verify`` (harness.apps.upstream_verify), its logic without a guest: each
committed series has its fix and its selftest, the selftest patch applies to the tree's own
ftrace selftest directory, ftracetest's KTAP is read by the tree's own
``tools/testing/kunit/kunit.py parse``, and the result's KTAP says xfail where the bug
shows as expected. The run in a guest: tests/vm/test_upstream_verify.py.

Needs Debian's unpacked linux-source-6.12 and 7.3 (fetched when missing, as
test_upstream_export.py does)."""
from __future__ import annotations

import io
import tarfile

import pytest

from harness.apps import upstream_verify as uv
from harness.apps.upstream import FINDINGS, find_source
from harness.diff import ktap
from harness.errors import SetupError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SERIES = [(f.name, s) for f in FINDINGS.values() for s in ("6.12", "7.3")]

PASSED = "TAP version 13\n1..1\nok 1 Kprobe event BTF string type check\n# Totals: pass:1\n"
FAILED = "TAP version 13\n1..1\nnot ok 1 Kprobe event BTF string type check\n"
SKIPPED = "TAP version 13\n1..1\nok 1 Kprobe event BTF string type check # SKIP\n"


@pytest.mark.parametrize("name,series", SERIES, ids=[f"{n}-{s}" for n, s in SERIES])
def test_each_series_has_its_fix_and_a_selftest_that_applies(name, series):
    fix, test = uv.series_patches(name, series)
    assert fix.name.startswith("0001-") and test.name.startswith("0002-")
    tc = uv.new_test(test)
    assert tc.startswith("test.d/kprobe/") and tc.endswith(".tc")
    src = find_source(series)
    with tarfile.open(fileobj=io.BytesIO(uv.selftests_tarball(src, test))) as t:
        names = set(t.getnames())
        assert {"ftrace/ftracetest", f"ftrace/{tc}"} <= names
        body = t.extractfile(f"ftrace/{tc}").read().decode()
    assert body.startswith("#!/bin/sh") and "# description:" in body
    assert not (src / uv.FTRACE_DIR / tc).exists()        # the patch adds it: a new test


def test_ftracetest_s_ktap_is_read_by_the_tree_s_own_parser():
    src = find_source("6.12")

    def parse_ktap(src, text):
        return uv.verdict(list(uv.read_ktap(src, text).values()))
    assert parse_ktap(src, PASSED) == "pass"
    assert parse_ktap(src, FAILED) == "fail"
    assert parse_ktap(src, SKIPPED) == "skip"      # unsupported: neither outcome
    assert parse_ktap(src, "sh: ./ftracetest: not found\n") == "error"


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(SetupError, match="no finding"):
        uv.series_patches("nonesuch", "6.12")
    with pytest.raises(SetupError, match="--tree 6.1"):
        uv.series_patches("1", "6.1")
    with pytest.raises(SetupError, match="--kernels"):
        uv.verify("1", "6.12", ["stock", "nope"])


def _run(kernel, expected, result, ktap_text="", why=""):
    return uv.SelftestRun(kernel, f"sel-{kernel}", expected, result, ktap_text, why)


def test_the_result_as_ktap_shows_the_bug_as_xfail_and_the_fix_as_pass():
    runs = [_run("stock", "fail", "fail", FAILED), _run("source", "fail", "fail", FAILED),
            _run("patched", "pass", "pass", PASSED)]
    [case] = ktap.upstream_verify_cases("btf-char-ptr", runs)
    assert case.status == "pass"
    assert [c.status for c in case.subtests] == ["xfail", "xfail", "pass"]
    # the fix that does not fix: the patched kernel's failure fails the series
    runs[2] = _run("patched", "pass", "fail", FAILED)
    [case] = ktap.upstream_verify_cases("btf-char-ptr", runs)
    assert case.status == "fail" and case.subtests[2].status == "fail"
    # a test skipped on a kernel is not the bug shown
    [case] = ktap.upstream_verify_cases("btf-char-ptr", [_run("stock", "fail", "skip", SKIPPED)])
    assert case.status == "fail"
    # a kernel that could not run it
    [case] = ktap.upstream_verify_cases("x", [_run("patched", "pass", "error", why="no boot")])
    assert case.subtests[0].status == "error"
    text = ktap.render([case])
    assert text.startswith("KTAP version 1") and "not ok 1 x" in text


ALL_BEFORE = ("TAP version 13\n1..3\nnot ok 1 Kprobe event BTF string type check\n"
              "ok 2 Kprobe dynamic event - adding and removing\n"
              "not ok 3 Kprobe dynamic event - probing module # UNRESOLVED\n")


def test_others_runs_every_case_on_the_two_kernels_it_compares_and_the_series_alone_else():
    assert uv.compared(uv.KERNELS) == ("source", "patched")
    assert uv.compared(["stock", "patched"]) == ("stock", "patched")
    assert uv.compared(["patched", "stock"]) == ("patched", "stock")
    assert uv.compared(["stock"]) == ("stock",) and uv.compared(["source"]) == ("source",)


def test_the_other_cases_are_compared_between_the_bug_and_the_fix():
    """--others: ftracetest's UNRESOLVED is a failure to the kernel's parser, the same on
    both kernels is no change; a case that moved is named with both statuses."""
    src = find_source("6.12")
    before = uv.read_ktap(src, ALL_BEFORE)
    assert before == {"Kprobe event BTF string type check": "FAIL",
                      "Kprobe dynamic event - adding and removing": "PASS",
                      "Kprobe dynamic event - probing module": "FAIL"}
    after = dict(before, **{"Kprobe event BTF string type check": "PASS"})
    test = "Kprobe event BTF string type check"
    runs = [_run("source", "fail", "fail"), _run("patched", "pass", "pass")]
    runs[0].cases, runs[1].cases = before, after
    runs[0].test = runs[1].test = test
    runs[0].others = runs[1].others = True
    assert uv.changed(runs) == {}
    # a kernel that ran the series' case alone is compared with nothing
    alone = _run("stock", "fail", "fail")
    alone.cases, alone.test = {test: "FAIL"}, test
    assert uv.changed([alone, *runs]) == {}
    assert uv.changed([alone, runs[1]]) == {}      # no kernel with the bug ran them all
    after["Kprobe dynamic event - adding and removing"] = "FAIL"
    assert uv.changed(runs) == {"Kprobe dynamic event - adding and removing": ("PASS", "FAIL")}
    [case] = ktap.upstream_verify_cases("btf-char-ptr", runs, uv.changed(runs))
    assert case.status == "fail" and case.subtests[-1].name == "other cases unchanged"
    assert uv.verdict([]) == "error" and uv.verdict(["PASS", "SKIP"]) == "skip"
