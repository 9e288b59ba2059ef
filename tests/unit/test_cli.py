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
