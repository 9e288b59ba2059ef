"""``--host``: choosing the host-side engine on the command line (issue 15)."""
import subprocess
import sys

from harness.cli import make_parser


def test_probe_and_diff_take_host():
    p = make_parser()
    assert p.parse_args(["probe", "p do_sys_openat2", "--run", "true"]).host == "gdbstub"
    assert p.parse_args(["probe", "p do_sys_openat2", "--run", "true", "--host", "plugin"]).host == "plugin"
    assert p.parse_args(["diff", "p do_sys_openat2", "--run", "true", "--host", "both"]).host == "both"


def test_probe_has_no_both_and_bad_values_are_usage_errors():
    for argv in (["probe", "p do_sys_openat2", "--run", "true", "--host", "both"],
                 ["diff", "p do_sys_openat2", "--run", "true", "--host", "tcg"]):
        r = subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and "--host" in r.stderr and "Traceback" not in r.stderr


def test_help_names_the_engines():
    text = make_parser()._subparsers._group_actions[0].choices["diff"].format_help()
    assert "gdbstub" in text and "plugin" in text and "three" in text

