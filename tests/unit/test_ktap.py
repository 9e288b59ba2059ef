"""KTAP and KCIDB out of every verb (harness.diff.ktap, harness.diff.kcidb), on recorded
results: the KTAP is read by the kernel's own parser (tools/testing/kunit/kunit_parser.py
of linux-source-6.12) and its counts must be what kph decided; the KCIDB document must
validate against kcidb-io's schema."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.diff import kcidb, ktap
from harness.diff.matrix import KernelDifference, KernelRun, MatrixResult
from harness.diff.verdict import compare
from harness.records import Hit, Outcome, SideResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kunit_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def hit(side, seq, probe="kprobes/open", **args):
    return Hit(side=side, probe=probe, kind="p", seq=seq, cpu=0, pid=7, comm="cat",
               ip="do_sys_openat2+0x0/0x170", args=tuple((k, str(v)) for k, v in args.items()))


def outcomes():
    return [Outcome("kprobes/open", True, index=0), Outcome("kprobes/never", True, index=1),
            Outcome.rejected("kprobes/bl", 22, index=2)]


def diverged():
    """open diverges at its second hit; never has no hit; bl is refused on both sides."""
    a = SideResult("host", outcomes(), [hit("host", 0, dfd=1), hit("host", 1, dfd=2)])
    b = SideResult("events", outcomes(), [hit("events", 0, dfd=1), hit("events", 1, dfd=3)])
    return compare(a, b)


def equivalent():
    a = SideResult("host", outcomes(), [hit("host", 0, dfd=1)])
    b = SideResult("events", outcomes(), [hit("events", 0, dfd=1)])
    return compare(a, b)


def empty():
    o = [Outcome("kprobes/open", True)]
    return compare(SideResult("host", o, []), SideResult("events", o, []))


def test_diff_one_test_per_probe_line_counted_by_the_kernel_s_parser():
    res = diverged()
    cases = ktap.diff_cases(res, kernel="6.1.0-test")
    assert [(c.name, c.status) for c in cases] == [
        ("kprobes/open", "fail"), ("kprobes/never", "skip"), ("kprobes/bl", "pass")]
    text = ktap.render(cases)
    assert text.startswith("KTAP version 1\n1..3\n")
    assert "not ok 1 kprobes/open\n" in text
    assert "ok 2 kprobes/never # SKIP no hit on either side\n" in text
    assert "# kprobes/open: DIVERGED at kprobes/open: hit no.2, field arg:dfd" in text
    main = kunit_tool.check_counts(text, cases)
    assert (main.counts.passed, main.counts.failed, main.counts.skipped) == (1, 1, 1)
    assert main.status.name == "FAILURE"            # kph diff: exit 1

    ok = ktap.diff_cases(equivalent())
    main = kunit_tool.check_counts(ktap.render(ok), ok)
    assert main.status.name == "SUCCESS"            # exit 0
    assert "1 events matched" in ok[0].reason

    nothing = ktap.diff_cases(empty())              # exit 4: nothing measured, all skipped
    main = kunit_tool.check_counts(ktap.render(nothing), nothing)
    assert main.status.name == "SKIPPED"
    # kph matrix counts an empty kernel as not agreeing: a failing "measured" test
    assert ktap.diff_cases(empty(), empty_fails=True)[-1].status == "fail"
    # a splat the kernel reported during the run fails the run, whatever the comparison
    k = ktap.diff_cases(equivalent(), findings=["KERNEL-WARNING: at kernel/x.c:1 f+0x1/0x2"])
    assert (k[-1].name, k[-1].status) == ("kernel", "fail")
    assert kunit_tool.check_counts(ktap.render(k), k).status.name == "FAILURE"


def test_not_strict_is_a_failing_test_of_its_own():
    a = SideResult("host", [Outcome("kprobes/open", True)],
                   [hit("host", 0, dfd=1), Hit("host", "kprobes/open", "p", 1, 0, 8, "qemu-ga",
                                               "do_sys_openat2+0x0/0x170", None, (("dfd", "2"),))])
    b = SideResult("events", [Outcome("kprobes/open", True)], [hit("events", 0, dfd=1)])
    res = compare(a, b, strict=True)
    assert res.verdict_word == "not-strict"
    cases = ktap.diff_cases(res)
    assert [(c.name, c.status) for c in cases] == [("kprobes/open", "pass"), ("strict", "fail")]
    kunit_tool.check_counts(ktap.render(cases), cases)


def test_three_worlds_one_test_per_pair():
    cases = ktap.three_cases([equivalent(), diverged()])
    assert [(c.name, c.status) for c in cases] == [("host-vs-events", "pass"),
                                                   ("host-vs-events", "fail")]
    main = kunit_tool.check_counts(ktap.render(cases), cases)
    assert [t.name for t in main.subtests] == ["host-vs-events", "host-vs-events"]


def matrix():
    return MatrixResult("cat /proc/version", [
        KernelRun("6.1", "6.1.0-41-cloud-amd64", diff=equivalent()),
        KernelRun("6.12", "6.12.117+deb13-cloud-amd64", diff=diverged()),
        KernelRun("7.3", "7.3.4+bpo-cloud-amd64", error="no image and no build possible: x"),
        KernelRun("6.6", "6.6-abi", diff=empty())],
        [KernelDifference("kprobes/open", "ip", (("6.1", "f+0x0"), ("6.12", "f+0x4")), 0)])


def test_matrix_subtests_per_kernel_and_a_kernel_not_run_is_an_error():
    cases, between = ktap.matrix_cases(matrix())
    assert [(c.name, c.status) for c in cases] == [
        ("6.1", "pass"), ("6.12", "fail"), ("7.3", "error"), ("6.6", "fail")]
    text = ktap.render(cases, diagnostics=between)
    assert "not ok 3 7.3 # ERROR no image and no build possible: x\n" in text
    assert "  KTAP version 1\n  # Subtest: 6.1\n  1..3\n" in text
    assert "# between kernels: kprobes/open ip (event 1): f+0x0 (6.1) | f+0x4 (6.12)" in text
    main = kunit_tool.check_counts(text, cases)
    # 6.1: 2 passed 1 skipped; 6.12: 1 failed 1 skipped 1 passed; 7.3: 1 failed (error);
    # 6.6: 1 skipped + the "measured" failure
    assert (main.counts.passed, main.counts.failed, main.counts.skipped) == (3, 3, 3)
    assert main.status.name == "FAILURE"            # kph matrix: exit 1


def scenario(name, known):
    return SimpleNamespace(path=Path(f"probes/scenarios/{name}.toml"), name=f"the {name} bug",
                           kernels={"series": "6.12"} if known else {})


def test_repro_a_known_bug_met_on_a_stock_kernel_is_xfail():
    met = SimpleNamespace(met=True, cause="the line was accepted", reasons=[])
    notmet = SimpleNamespace(met=False, cause="refused", reasons=["expected ok, saw refused"])
    known = ktap.repro_cases(scenario("btf-char-ptr", True), met, kernel="6.12")
    assert known[0].status == "xfail"
    text = ktap.render(known)
    assert "ok 1 btf-char-ptr # XFAIL known bug: the btf-char-ptr bug\n" in text
    kunit_tool.check_counts(text, known)
    plain = ktap.repro_cases(scenario("blacklisted", False), met)
    assert plain[0].status == "pass"
    failed = ktap.repro_cases(scenario("blacklisted", False), notmet)
    assert failed[0].status == "fail"
    kunit_tool.check_counts(ktap.render(failed), failed)

    image = SimpleNamespace(version="6.12.117")
    runs = [SimpleNamespace(name="stock", image=image, result=met, expect_met=True, as_expected=True),
            SimpleNamespace(name="patched", image=image, result=notmet, expect_met=False,
                            as_expected=True),
            SimpleNamespace(name="source", image=image, result=notmet, expect_met=True,
                            as_expected=False)]
    cases = ktap.repro_kernels_cases(scenario("btf-char-ptr", True), runs)
    assert [(c.name, c.status) for c in cases[0].subtests] == [
        ("stock", "xfail"), ("patched", "pass"), ("source", "fail")]
    main = kunit_tool.check_counts(ktap.render(cases), cases)
    assert (main.counts.passed, main.counts.failed) == (2, 1)


def test_the_upstream_scenarios_are_the_known_bugs():
    from harness.apps import scenario as sc

    for p in sorted((ROOT / "probes/scenarios/upstream").glob("*.toml")):
        assert ktap._known_bug(sc.load(p)), p
    assert not ktap._known_bug(sc.load(ROOT / "probes/scenarios/blacklisted.toml"))


def test_fuzz_findings_and_not_mirrored():
    shards = [{"agreed_runs": 5, "agreed_refusals": 3, "not_mirrored": 2,
               "not_mirrored_why": {"synthetic events": 2}}]
    doc = {"examples": 10, "findings": [{"kind": "events", "detail": "arg x differs\nmore",
                                         "lines": ["p:a f x=%di"], "flaky": True}]}
    cases = ktap.fuzz_cases(doc, shards, kernel="6.1")
    assert [(c.name, c.status) for c in cases] == [
        ("agreed", "pass"), ("not-mirrored", "skip"), ("finding-1-events", "fail")]
    kunit_tool.check_counts(ktap.render(cases), cases)


def test_an_error_before_a_result_is_one_error_test():
    cases = ktap.error("diff", "the VM was lost: a panic\nsecond line")
    text = ktap.render(cases)
    assert text == "KTAP version 1\n1..1\nnot ok 1 kph-diff # ERROR the VM was lost: a panic\n"
    kunit_tool.check_counts(text, cases)


def test_a_name_with_a_hash_stays_one_test():
    cases = [ktap.Case("p:x f #1", "skip", "why # not\nsecond")]
    text = ktap.render(cases)
    assert text.count("#") == 1 and "\n" not in text.split("1..1\n")[1].rstrip("\n")
    kunit_tool.check_counts(text, cases)


def validate(doc):
    from kcidb_io import schema

    schema.LATEST.validate(json.loads(json.dumps(doc)))


def test_kcidb_validates_and_links_known_bugs_as_issues():
    cases, _ = ktap.matrix_cases(matrix())
    doc = kcidb.report(cases, verb="matrix", run_id="r1", start=0)
    validate(doc)
    assert {b["id"] for b in doc["builds"]} == {
        "kph:6.1.0-41-cloud-amd64", "kph:6.12.117+deb13-cloud-amd64", "kph:7.3.4+bpo-cloud-amd64",
        "kph:6.6-abi"}
    by_path = {t["path"]: t for t in doc["tests"]}
    assert by_path["kph.matrix.7_3"]["status"] == "ERROR"
    assert by_path["kph.matrix.6_12.kprobes_open"]["status"] == "FAIL"
    assert by_path["kph.matrix.6_1.kprobes_never"]["status"] == "SKIP"
    assert len(doc["tests"]) == len({t["id"] for t in doc["tests"]})

    met = SimpleNamespace(met=True, cause="accepted", reasons=[])
    xf = ktap.repro_cases(scenario("btf-char-ptr", True), met, kernel="6.12.117")
    doc = kcidb.report(xf, verb="repro", origin="my_ci")
    validate(doc)
    (test,) = doc["tests"]
    assert test["status"] == "FAIL" and test["misc"]["kph_status"] == "xfail"
    (issue,) = doc["issues"]
    (inc,) = doc["incidents"]
    assert issue["id"] == "my_ci:btf-char-ptr" and inc["test_id"] == test["id"]
    assert inc["issue_id"] == issue["id"] and inc["present"] is True
    with pytest.raises(ValueError):
        kcidb.report(xf, verb="repro", origin="My-CI")


def test_cli_options_and_an_error_written_as_ktap(tmp_path, capsys):
    from harness.cli.main import main

    # a bad spec is refused before anything boots: the KTAP says so, as an ERROR
    k, c = tmp_path / "r.ktap", tmp_path / "r.json"
    rc = main(["diff", "p:bad do_sys_openat2 x=%zz", "--run", "true", "--ktap",
               "--ktap-file", str(k), "--kcidb", str(c)])
    assert rc == 2
    out = capsys.readouterr().out
    assert out == k.read_text() and out.startswith("KTAP version 1\n1..1\nnot ok 1 kph-diff # ERROR")
    kunit_tool.check_counts(out, ktap.error("diff", "x"))
    doc = json.loads(c.read_text())
    validate(doc)
    assert [t["status"] for t in doc["tests"]] == ["ERROR"]
    assert main(["diff", "p:x do_sys_openat2", "--run", "true", "--ktap", "--json"]) == 2
    assert main(["diff", "p:x do_sys_openat2", "--run", "true", "--kcidb",
                 str(tmp_path / "no/such/dir.json")]) == 2
    from harness.cli.main import make_parser
    p = make_parser()
    for argv in (["diff", "--run", "true"], ["matrix", "--run", "true"], ["repro", "x.toml"],
                 ["fuzz"]):
        a = p.parse_args([*argv, "--ktap-file", "f", "--kcidb", "g", "--kcidb-origin", "ci"])
        assert (a.ktap, a.ktap_file, a.kcidb, a.kcidb_origin) == (False, "f", "g", "ci")


PYTEST_CASES = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_skips():
    pytest.skip("no such kernel here")

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    assert False

@pytest.fixture
def machine():
    raise RuntimeError("the machine did not boot")

def test_needs_a_machine(machine):
    pass
'''


def test_pytest_results_as_ktap(tmp_path):
    import subprocess

    (tmp_path / "test_cases.py").write_text(PYTEST_CASES)
    out = tmp_path / "run.ktap"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "harness.apps.pytest_ktap", "--kph-ktap", str(out),
                        "test_cases.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    text = out.read_text()
    sub = [ktap.Case(n, s) for n, s in (("test_passes", "pass"), ("test_fails", "fail"),
                                         ("test_skips", "skip"), ("test_known_bug", "xfail"),
                                         ("test_needs_a_machine", "error"))]
    main = kunit_tool.check_counts(text, [ktap.Case.parent("test_cases.py", sub)])
    assert (main.counts.passed, main.counts.failed, main.counts.skipped) == (2, 2, 1)
    assert "ok 3 test_skips # SKIP no such kernel here\n" in text
    assert "ok 4 test_known_bug # XFAIL a known bug\n" in text
    assert "not ok 5 test_needs_a_machine # ERROR setup: RuntimeError: the machine did not boot" in text
