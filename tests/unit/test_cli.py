import subprocess
import sys

from harness.cli import make_parser


def _kph(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_teaches_the_first_steps():
    text = make_parser().format_help()
    for word in ("kph image build", "kph boot", "exit status", "default image"):
        assert word in text


def test_missing_kernel_is_one_line_exit_2():
    r = _kph("boot", "--kernel", "/nonexistent", "--run", "true")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent" in lines[0], r.stderr


def test_bad_accel_is_a_usage_error():
    r = _kph("boot", "--accel", "hvf")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_a_bad_output_path_is_one_line_exit_2_before_any_boot(tmp_path):
    for opt, path in (("--json", "/nonexistent/dir/x.json"), ("--html", str(tmp_path))):
        r = _kph("diff", "p:x do_sys_openat2", "--run", "true", opt, path,
                 "--kernel", "/nonexistent")   # would fail to boot: the path is checked first
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and opt in lines[0] and path in lines[0], r.stderr


def test_a_workload_that_did_not_run_is_a_usage_error(monkeypatch, capsys):
    from harness import cli
    from harness.errors import SetupError
    from harness.records import RunResult

    for status in (126, 127):
        r = RunResult("host", workload_status=status,
                      workload_stderr="/bin/sh: no_such_cmd: not found\n")
        try:
            cli._workload_ran(r, "no_such_cmd")
        except SetupError as exc:
            assert "did not run" in str(exc) and "no_such_cmd: not found" in str(exc)
        else:
            raise AssertionError(f"exit {status} passed")
    cli._workload_ran(RunResult("host", workload_status=1, workload_stderr="x"), "false")


def test_verdicts_name_refusals_and_stderr():
    from harness import report
    from harness.diff import compare
    from harness.records import Hit, Outcome, RunResult

    def run(side, outcomes, hits=()):
        return RunResult(side, outcomes, list(hits), {})
    a = run("host", [Outcome.rejected("kprobes/x", 22, "Failed to register probe event",
                                      index=0, reason="blacklisted: do_int3")])
    b = run("events", [Outcome.rejected("kprobes/x", 22, "Failed to register probe event",
                                        index=0)])
    res = compare(a, b)
    assert res.equivalent and res.both_refused == ["kprobes/x"]
    text = report.text(res, workload="true", status=0)
    assert "result: both refused: EINVAL (blacklisted: do_int3; events: Failed to register " \
           "probe event)" in text and "equivalent" not in text
    # two lines of one event, the second refused on both sides; hits on the first
    h = [Hit(side=s, probe="kprobes/e", kind="p", seq=0, cpu=0, pid=5, comm="ls", ip="f+0x0/0x10")
         for s in ("host", "events")]
    ok = Outcome("kprobes/e", True, index=0)
    bad = Outcome.rejected("kprobes/e", 17, "There is already the exact same probe event", index=1)
    res = compare(run("host", [ok, bad], [h[0]]), run("events", [ok, bad], [h[1]]))
    v = report.verdict(res)
    assert v == ("equivalent: 1 events matched on each side (1); both refused: kprobes/e#2 "
                 "EEXIST (There is already the exact same probe event)"), v
    assert "exit 1: cat: can't open '/nope'" in report.text(
        res, status=1, stderr="cat: can't open '/nope': No such file or directory\n")
    # refused with different errnos: a divergence
    res = compare(run("host", [Outcome.rejected("kprobes/x", 2, index=0)]),
                  run("events", [Outcome.rejected("kprobes/x", 22, index=0)]))
    assert not res.equivalent and res.first.field == "registration"


def test_deletion_lines_are_a_usage_error(tmp_path):
    f = tmp_path / "specs"
    f.write_text("p:kprobes/testevent kernel_clone\n-:kprobes/testevent\n")
    r = _kph("diff", "-f", str(f), "--run", "true", "--kernel", "/nonexistent")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "deletes probes" in r.stderr and len(r.stderr.strip().splitlines()) == 1
