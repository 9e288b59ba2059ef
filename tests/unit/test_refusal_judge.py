"""The fuzzer's oracle on a refusal (``fuzz.Oracle._parse_refusal``, what ``kph diff
--refusals``, the fuzzer and the hunt's selftests phase judge refusals with): the errno,
whether error_log has an entry, its message and caret must all agree; a guest that refuses
with nothing in error_log where the host logs a message is a divergence (7.3's
probe-too-many-args-not-logged: E2BIG and no entry), not an agreement."""
from __future__ import annotations

import errno
from types import SimpleNamespace

from harness.apps import fuzz
from harness.errors import ProbeSpecError

LINE = "p:kph/m vfs_read a=%di"


class FakeVM:
    """A machine without kph-reader: the guest script's text (``try_lines``), the write's
    error as the shell said it and ``kph_log``'s lines of ``log`` (its entry's first
    line, command and caret line's length)."""

    def __init__(self, stderr: str, log: str) -> None:
        x, c, caret = (log.splitlines() + ["", "", ""])[:3] if log else ("", "", "")
        entry = f"{x}\n{c}\ncaret {len(caret)}\n" if x else ""
        self.out = SimpleNamespace(stdout=f"@err {stderr}\n{entry}", stderr="", status=1)

    def reader_writes(self, ops, **kw):
        return None

    def run(self, cmd, **kw):
        return self.out


def judge(stderr: str, log: str, exc: ProbeSpecError):
    o = fuzz.Oracle.__new__(fuzz.Oracle)
    o._vm, o.stats = FakeVM(stderr, log), fuzz.FuzzStats()
    return o._parse_refusal(LINE, exc), o.stats.agreed_refusals


LOGGED = ("[  1.0] trace_kprobe: error: Too many arguments are specified\n"
          f"  Command: {LINE}\n" + " " * (len("  Command: ") + 18) + "^\n")
E2BIG = "sh: write error: Argument list too long"
EINVAL = "sh: write error: Invalid argument"
TOO_MANY = ProbeSpecError("Too many arguments are specified", LINE, 18, errno=errno.E2BIG)


def test_the_same_refusal_agrees():
    assert judge(E2BIG, LOGGED, TOO_MANY) == (None, 1)


def test_nothing_in_error_log_where_the_host_logs_is_a_divergence():
    got, agreed = judge(E2BIG, "", TOO_MANY)
    assert agreed == 0 and got.kind == "parse" and "nothing in error_log" in got.detail


def test_an_entry_where_the_host_logs_nothing_is_a_divergence():
    quiet = ProbeSpecError("refused without an error_log entry", LINE, 0, errno=errno.E2BIG,
                           logged=False)
    assert judge(E2BIG, "", quiet) == (None, 1)
    got, agreed = judge(E2BIG, LOGGED, quiet)
    assert agreed == 0 and "host refuses" in got.detail


def test_another_errno_is_a_divergence():
    got, agreed = judge(EINVAL, LOGGED, TOO_MANY)
    assert agreed == 0 and got.signature == "parse:errno:EINVAL|E2BIG", got
