import os
import subprocess
import sys
from pathlib import Path

from harness.cli import make_parser

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_guest_buffer_that_is_not_a_size_is_one_line_exit_2():
    for bad in ("0", "lots", "1025"):
        r = _kph("diff", "p:x do_sys_openat2", "--run", "true", "--guest-buffer", bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"'{bad}' is not a size in MiB from 1 to 1024" in r.stderr, r.stderr


def test_a_host_buffer_that_is_not_a_power_of_two_of_mib_is_one_line_exit_2():
    for bad in ("0", "3", "lots", "2048"):
        r = _kph("diff", "--host", "plugin", "p:x do_sys_openat2", "--run", "true",
                 "--host-buffer", bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"'{bad}' is not a power of two of MiB from 1 to 1024" in r.stderr, r.stderr


def test_a_host_buffer_without_the_plugin_engine_is_refused_before_any_boot():
    r = _kph("diff", "p:x do_sys_openat2", "--run", "true", "--host-buffer", "64",
             "--kernel", "/nonexistent")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--host-buffer 64: the ring is the plugin engine's" in lines[0], r.stderr
    assert "add --host plugin" in lines[0], r.stderr


def test_a_bad_output_path_is_one_line_exit_2_before_any_boot(tmp_path):
    for opt, path in (("-o", "/nonexistent/dir/x.json"), ("--html", str(tmp_path))):
        r = _kph("diff", "p:x do_sys_openat2", "--run", "true", opt, path,
                 "--kernel", "/nonexistent")   # would fail to boot: the path is checked first
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and opt in lines[0] and path in lines[0], r.stderr


def test_a_workload_that_did_not_run_is_a_usage_error(monkeypatch, capsys):
    from harness.cli.common import workload_ran
    from harness.errors import SetupError
    from harness.records import SideResult

    for status in (126, 127):
        r = SideResult("host", workload_status=status,
                      workload_stderr="/bin/sh: no_such_cmd: not found\n")
        try:
            workload_ran(r, "no_such_cmd")
        except SetupError as exc:
            assert "did not run" in str(exc) and "no_such_cmd: not found" in str(exc)
        else:
            raise AssertionError(f"exit {status} passed")
    workload_ran(SideResult("host", workload_status=1, workload_stderr="x"), "false")


def test_verdicts_name_refusals_and_stderr():
    from harness.diff import report
    from harness.diff.verdict import compare
    from harness.records import Hit, Outcome, SideResult

    def run(side, outcomes, hits=()):
        return SideResult(side, outcomes, list(hits), {})
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


def test_deletion_lines_alone_are_a_usage_error(tmp_path):
    """-: lines are mirrored (dyn_event_release()), after the definitions they delete; a
    run of nothing but deletions is a usage error."""
    f = tmp_path / "specs"
    f.write_text("-:kprobes/testevent\n")
    r = _kph("diff", "-f", str(f), "--run", "true", "--kernel", "/nonexistent")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "deletes probes" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    f.write_text("p:kprobes/testevent kernel_clone\n-:kprobes/testevent\n")
    r = _kph("diff", "-f", str(f), "--run", "true", "--kernel", "/nonexistent")
    assert r.returncode == 2 and "deletes probes" not in r.stderr      # the kernel path


# -- the output convention (docs/cli.md) ---------------------------------------------------

def test_version():
    r = _kph("--version")
    assert r.returncode == 0 and r.stdout.startswith("kph (kprobe-harness) "), r.stdout


def test_global_options_go_before_or_after_the_command():
    p = make_parser()
    for argv in (["-q", "--log-level", "DEBUG", "--json", "doctor"],
                 ["doctor", "-q", "--log-level", "DEBUG", "--json"],
                 ["image", "list", "-q", "--log-level", "DEBUG", "--json"],
                 ["-q", "image", "--json", "list", "--log-level", "DEBUG"]):
        a = p.parse_args(argv)
        assert (a.quiet, a.log_level, a.json) == (True, "DEBUG", True), argv
    a = p.parse_args(["doctor"])
    assert (a.quiet, a.log_level, a.json, a.json_file) == (False, "WARNING", False, None)


def test_json_is_alone_on_stdout_and_q_silences_the_text(tmp_path):
    import json

    for argv in (["doctor"], ["qemu", "which"], ["image", "list"], ["image", "info"],
                 ["worker", "identity", "--kernels", "default"]):
        r = _kph(*argv, "--json")
        assert r.returncode in (0, 2), r.stderr      # doctor: 2 when a check fails
        json.loads(r.stdout)                          # stdout is one JSON document
        assert r.stderr.strip(), f"{argv}: the text goes to stderr"
        q = _kph("-q", *argv)
        assert q.stdout == "" and q.stderr == "", (argv, q.stdout, q.stderr)
        f = tmp_path / "out.json"
        # the same document as --json gave: asked again when it differs, up to 3 times,
        # as the other xdist worker may add an image to the cache between the two runs
        # (CI's run of 5978309: a tree image built between them, in `image list`)
        for _ in range(3):
            o = _kph(*argv, "-o", str(f), "-q")
            assert o.stdout == "", (argv, o.stdout)
            if argv == ["doctor"] or json.loads(f.read_text()) == json.loads(r.stdout):
                break                             # doctor's details may change between runs
            r = _kph(*argv, "--json")
        else:
            assert json.loads(f.read_text()) == json.loads(r.stdout), argv


def test_the_old_json_file_form_is_one_line_naming_o():
    r = _kph("diff", "p:x do_sys_openat2", "--run", "true", "--json", "out.json")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "-o out.json" in lines[0], r.stderr


def test_no_command_is_usage_on_stderr():
    r = _kph()
    assert r.returncode == 2 and r.stdout == "" and "usage: kph" in r.stderr


def test_every_verb_has_examples_and_no_escaped_percent_in_help():
    from harness.cli import EXAMPLES

    p = make_parser()
    sub = next(a for a in p._actions if a.dest == "cmd")
    assert set(sub.choices) == set(EXAMPLES)
    for verb, parser in sub.choices.items():
        text = parser.format_help()
        assert "examples:" in text and "%%" not in text, verb
        for ex in EXAMPLES[verb]:
            assert ex in text, (verb, ex)
    assert "%%" not in p.format_help()


def test_progress_plain_lines_off_a_terminal_and_a_live_line_on_one():
    import io

    from harness.cli import Progress

    plain = io.StringIO()
    p = Progress(plain, live=False, plain_every=3600)
    p("registering")
    p.transient("workload running 1 s: host 3 hits")     # live updates: at most every
    p.transient("workload running 2 s: host 9 hits")     # plain_every after a line
    p("collecting")
    assert plain.getvalue().splitlines() == ["registering", "collecting"]
    live = io.StringIO()
    p = Progress(live, live=True)
    p("registering")
    p.transient("workload running 1 s: host 3 hits")
    p.clear()
    assert live.getvalue() == ("\r\x1b[Kregistering\r\x1b[Kworkload running 1 s: host 3 hits"
                               "\r\x1b[K")
    quiet = io.StringIO()
    p = Progress(quiet, quiet=True, live=True)
    p("x")
    p.transient("y")
    assert quiet.getvalue() == ""


def test_step_does_not_block_or_crash_without_a_terminal(monkeypatch):
    import io

    from harness.cli.demo import wait_enter

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert wait_enter() is False


_UNRAISABLE = r'''
import os, signal, sys, time
import harness.cli as cli

def at_fork():                      # like logging's _releaseLock: Python cannot raise here
    if not getattr(at_fork, "done", False):
        at_fork.done = True
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):       # the handler runs here, between these bytecodes
            pass

def cmd(args, out):
    os.register_at_fork(after_in_parent=at_fork)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(20)                  # what the swallowed interrupt would have cut short
    return 0

cli.COMMANDS["boot"] = cmd
t = time.monotonic()
rc = cli.main(["boot"])
print(rc, round(time.monotonic() - t), file=sys.stderr)
'''


def test_an_interrupt_that_lands_where_python_cannot_raise_still_exits_130_in_one_line():
    """CI, SIGINT to kph diff's group: the KeyboardInterrupt landed in logging's at-fork
    ``_releaseLock``; Python printed "Exception ignored in" with a traceback and went on.
    Now it is silent there and delivered again, and main exits 130 at once."""
    r = subprocess.run([sys.executable, "-c", _UNRAISABLE], capture_output=True, text=True,
                       timeout=60)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "interrupted (SIGINT)", r.stderr
    rc, secs = lines[-1].split()
    assert rc == "130" and int(secs) < 5, r.stderr


_HALF_MADE = '''
import os, signal, sys, time
sys.argv = ["kph", "boot"]                  # run as the program
import harness.cli as cli

class Loop:                     # as asyncio's loop: __del__ reads what __init__ sets last
    def __init__(self):
        os.kill(os.getpid(), signal.SIGTERM)    # cut here, as new_event_loop() was
        time.sleep(20)
        self._debug = False

    def __del__(self):
        self._debug

def cmd(args, out):
    Loop()
    return 0

cli.COMMANDS["boot"] = cmd
sys.exit(cli.main())
'''


def test_an_object_the_interrupt_left_half_made_fails_its_del_in_silence():
    """CI, 2026-12-04, SIGTERM during ``kph diff``: "interrupted (SIGTERM)", then "Exception
    ignored in: BaseEventLoop.__del__" and a traceback: the signal cut an asyncio loop's
    ``__init__`` before it set ``_debug``, and the loop's ``__del__`` failed when it was
    collected. What fails in a ``__del__`` after an interruption comes of it: silent."""
    r = subprocess.run([sys.executable, "-c", _HALF_MADE], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted (SIGTERM)"), r


_STRING_EXEC = '''
import os, signal, sys
import harness.cli as cli

def cmd(args, out):                 # as a dataclass being made while an import is interrupted
    exec("import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(20)", {})
    return 0

cli.COMMANDS["boot"] = cmd
sys.exit(cli.main(["boot"]))
'''


def test_an_interrupt_inside_a_string_exec_under_python_m_exits_130_not_sigint(tmp_path):
    """CI, SIGTERM to ``python -m harness.cli diff`` at 0.29 s: "interrupted (SIGTERM)", then
    the process died of SIGINT (-2). CPython marks a KeyboardInterrupt leaving a string exec
    unhandled even once caught, and under ``-m`` ends the process with SIGINT at exit."""
    pkg = tmp_path / "kphstr"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(_STRING_EXEC)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    r = subprocess.run([sys.executable, "-m", "kphstr"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted (SIGTERM)"), r


_DURING_IMPORT = """
import importlib.abc, os, runpy, signal, sys

class Finder(importlib.abc.MetaPathFinder):    # SIGTERM as harness.cli.main is imported
    def find_spec(self, name, path, target=None):
        if name == "harness.cli.main":
            os.kill(os.getpid(), signal.SIGTERM)
        return None

sys.meta_path.insert(0, Finder())
sys.argv = ["kph", "doctor"]
runpy.run_module("harness.cli", run_name="__main__", alter_sys=True)
"""


def test_a_signal_while_the_cli_is_imported_exits_130_in_one_line():
    """A SIGTERM before ``main`` installs its handlers (the imports take ~0.15 s) ended the
    process by the signal (-15): ``python -m harness.cli`` records it and main ends at once."""
    r = subprocess.run([sys.executable, "-c", _DURING_IMPORT], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted (SIGTERM)"), r


_AFTER_THE_RESULT = """
import atexit, os, signal, sys, time
sys.argv = ["kph", "boot"]                  # run as the program
import harness.cli as cli

def late():                                 # Ctrl-C and SIGTERM as the process leaves
    for s in (signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), s)
    time.sleep(0.05)

atexit.register(late)
cli.COMMANDS["boot"] = lambda args, out: 1  # a finished run and its status
sys.exit(cli.main())
"""


def test_a_signal_after_the_outcome_is_decided_leaves_the_exit_status_alone():
    """CI, SIGINT to kph diff's group at 5.92 s, as the run ended: the process died of
    SIGINT (-2) with nothing on stderr. main had put back the default handlers, and
    Python's shutdown puts back the default action. As the program, main leaves both
    signals ignored once it has its status: the run exits with it, silently."""
    r = subprocess.run([sys.executable, "-c", _AFTER_THE_RESULT], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert (r.returncode, r.stderr) == (1, ""), r


def test_imported_as_a_library_main_puts_the_default_handlers_back(monkeypatch):
    import signal

    from harness import cli

    assert not cli.as_program
    monkeypatch.setitem(cli.COMMANDS, "boot", lambda args, out: 0)
    assert cli.main(["boot"]) == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


_FROZEN_AT_EXIT = """
import atexit, gc, sys
sys.argv[:] = ["kph", "boot"]
from harness import cli
atexit.register(lambda: print("frozen", gc.get_freeze_count()))
cli.COMMANDS["boot"] = lambda args, out: 3
sys.exit(cli.main())
"""


def test_as_the_program_main_leaves_the_objects_out_of_the_shutdown_collections(monkeypatch):
    """The interpreter's shutdown collections walked every object a run made (0.1-0.25 s
    of a kph diff): as the program, main freezes them once it has its status (the
    status and atexit hooks as before); imported as a library, it freezes nothing."""
    import gc

    r = subprocess.run([sys.executable, "-c", _FROZEN_AT_EXIT], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 3, r
    n = int(r.stdout.split()[-1])
    assert n > 1000, r.stdout
    from harness import cli

    monkeypatch.setitem(cli.COMMANDS, "boot", lambda args, out: 0)
    before = gc.get_freeze_count()
    assert cli.main(["boot"]) == 0
    assert gc.get_freeze_count() == before


def test_a_result_is_built_only_when_json_or_a_file_asks_for_it(tmp_path, capsys, monkeypatch):
    """Output.result(fn): fn is called only for --json or -o (a run's every hit as JSON
    cost seconds that a text report did not need); a plain document works as before."""
    import argparse
    import json

    from harness.cli import output
    from harness.cli.output import Output

    # each Output registers itself in output.current (log records clear its line): these
    # must not outlive the test's captured streams
    monkeypatch.setattr(output, "current", [])

    calls = []

    def doc():
        calls.append(1)
        return {"hits": [1, 2]}
    Output(argparse.Namespace(quiet=True)).result(doc)
    assert calls == []
    f = tmp_path / "r.json"
    Output(argparse.Namespace(quiet=True, json_file=str(f))).result(doc)
    assert calls == [1] and json.loads(f.read_text()) == {"hits": [1, 2]}
    Output(argparse.Namespace(quiet=True, json=True)).result({"a": (1, 2)})
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}
