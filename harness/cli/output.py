"""The one output convention of every ``kph`` verb, in one place.

- ``--json``: the verb's result as one JSON document on stdout, and nothing else there;
- ``-o FILE`` / ``--json-file FILE``: the same document written to FILE;
- human text (reports, verdicts, tables, progress, warnings, errors) goes to stderr, and
  ``-q`` silences it (errors excepted). The one thing on stdout without ``--json`` is the
  guest's own output of ``kph boot --run CMD``;
- progress of long work is one live line on a terminal, plain lines otherwise;
- exit status 0 success, 1 divergence / not met / failed command, 2 usage or setup error,
  3 the VM was lost (QEMU died, QMP silent), 4 nothing measured (``kph diff``: no armed
  probe fired), 5 a kernel splat during the run (a panic too), 6 the guest hung, 130
  interrupted; a harness error is one line (:func:`report_error`), never a traceback, and
  so is any other exception (:func:`report_crash`: exit 2, the traceback at DEBUG).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import (EngineReadError, GuestLossError, HandlerError, HarnessError,
                      HostSlowedError, NotMirroredError, PluginRecordError, ProbeSpecError,
                      ScenarioError, SetupError, VMError)

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_INFRA, EXIT_EMPTY = 0, 1, 2, 3, 4
#: A kernel finding: a splat during the run (WARNING, BUG, Oops, panic, KASAN, lockdep, an
#: RCU stall, a hung task: ``harness.kernel.splat``), and a guest that hung (``HANG``)
EXIT_KERNEL, EXIT_HANG = 5, 6
EXIT_INTERRUPTED = 130


class Progress:
    """Progress for people, on stderr: on a terminal one live line rewritten in place
    (phases and live counters), otherwise a plain line per phase (live counters at most
    every ``plain_every`` seconds). Silent with ``-q``. A ``harness.progress`` sink."""

    def __init__(self, stream: Any = None, *, quiet: bool = False, live: bool | None = None,
                 plain_every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        if live is None:
            live = self.stream.isatty() and os.environ.get("TERM", "") != "dumb"
        self.live = live
        self.plain_every = plain_every
        self._shown = False
        self._last_plain = 0.0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        """A phase."""
        if self.quiet:
            return
        with self._lock:
            if self.live:
                self._draw(text)
            else:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def transient(self, text: str) -> None:
        """A live update (hit counts while the workload runs)."""
        if self.quiet:
            return
        with self._lock:
            if self.live:
                self._draw(text)
            elif time.monotonic() - self._last_plain >= self.plain_every:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def _draw(self, text: str) -> None:
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        self.stream.write("\r\x1b[K" + text[:width])
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the live line (before other text is written)."""
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False


class Output:
    """Where a verb's result and text go (the convention in the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        self.json_file: str | None = getattr(args, "json_file", None)
        self.quiet = bool(getattr(args, "quiet", False))
        self.progress = Progress(quiet=self.quiet)
        current.append(self)

    def text(self, s: str = "") -> None:
        """Human text: stderr, unless -q."""
        if self.quiet:
            return
        self.progress.clear()
        sys.stderr.write(s if s.endswith("\n") else s + "\n")
        sys.stderr.flush()

    def warn(self, s: str) -> None:
        self.text(f"warning: {s}")

    def data(self, s: str) -> None:
        """Data that is stdout's without --json (kph boot's guest output)."""
        if not self.json:
            self.progress.clear()
            sys.stdout.write(s)
            sys.stdout.flush()

    @property
    def wants_result(self) -> bool:
        """Whether :meth:`result` writes anything (--json or -o)."""
        return self.json or bool(self.json_file)

    def result(self, doc: Any) -> None:
        """The machine-readable result: stdout with --json, the file with -o. ``doc`` may
        be a function that builds it, called only then (a run's every hit as JSON costs
        seconds for 100,000 hits that only the text report was asked for)."""
        if not self.wants_result:
            return
        if callable(doc):
            doc = doc()
        text = json.dumps(doc, indent=2, default=str) + "\n"
        if self.json_file:
            with open(self.json_file, "w") as f:
                f.write(text)
        if self.json:
            self.progress.clear()
            sys.stdout.write(text)
            sys.stdout.flush()


#: The Outputs of this process, the latest last (log records and errors clear its line).
current: list[Output] = []


def clear_progress() -> None:
    if current:
        current[-1].progress.clear()


class LogHandler(logging.StreamHandler):
    """Log records on stderr, on a line of their own (the live progress line is erased
    first, and redrawn by the next update)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        clear_progress()
        super().emit(record)


def output_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """-q, --log-level, --json, -o: on the top parser (with defaults) and on every
    command (defaults suppressed, so that a value given before the command stays)."""
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    g = p.add_argument_group("Output")
    g.add_argument("--json", action="store_true",
                   help="write the result as JSON to stdout, and nothing else", **kw)
    g.add_argument("-o", "--json-file", metavar="FILE",
                   help="write the result as JSON to FILE", **kw)
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no text on stderr but errors (no progress, no report)", **kw)
    g.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the library's log level, on stderr (default WARNING)",
                   **({"default": "WARNING"} if top else kw))


def check_output(option: str, path: str | None) -> None:
    """An output file must be writable before any VM boots (a one-line usage error)."""
    if not path:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    why = ("it is a directory" if p.is_dir() else
           f"the directory {parent} does not exist" if not parent.is_dir() else
           f"the directory {parent} is not writable" if not os.access(parent, os.W_OK) else
           "the file is not writable" if p.exists() and not os.access(p, os.W_OK) else None)
    if why:
        raise SetupError(f"cannot write {option} {path}: {why}",
                         f"give {option} a file in an existing, writable directory")


def check_writable(path: str | None) -> None:
    """A report path that cannot be written is a usage error before anything boots."""
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise SetupError(f"cannot write {path}: no writable directory {d}",
                         "give a path in an existing, writable directory")


def report_error(exc: BaseException) -> int | None:
    """Print the one line for a harness error and return the exit status (None: not ours)."""
    clear_progress()
    if isinstance(exc, (SetupError, ScenarioError)):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, NotMirroredError):   # one line: not the kernel's error_log shape
        print(f"error: {exc}; {exc.hint or 'probe the function with a p: or r: line instead'}",
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, ProbeSpecError):
        from ..kernel.grammar import format_error    # only for this error: kph --help stays light
        # under the name the kernel logs it (trace_kprobe, trace_uprobe, trace_fprobe,
        # event_probe, event filter parse error, dynevent: grammar.error_subsystem())
        print(format_error(exc).rstrip("\n"), file=sys.stderr)
        return EXIT_USAGE
    from ..kernel.splat import KernelFinding     # only here: kph --help stays light
    if isinstance(exc, KernelFinding):      # a panic or a hang in the run: the kernel's doing
        from ..diff.report import findings_text
        print(findings_text(exc.splats).rstrip("\n"), file=sys.stderr)
        where = f" (console kept in {exc.console_log})" if getattr(exc, "console_log", None) else ""
        print(f"result: {exc.verdict}{where}", file=sys.stderr)
        return EXIT_HANG if exc.verdict == "HANG" else EXIT_KERNEL
    if isinstance(exc, HostSlowedError):
        # the guest ran, slowed by the host's own probes past --timeout: nothing measured,
        # no verdict (not HANG); the fix is the user's choice of probes or engine
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, VMError):
        first = str(exc.args[0]) if exc.args else str(exc)
        where = f"; console kept in {exc.console_log}" if exc.console_log else ""
        print(f"error: {first}{where}", file=sys.stderr)
        return EXIT_INFRA
    if isinstance(exc, HandlerError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INFRA
    if isinstance(exc, (EngineReadError, PluginRecordError, GuestLossError)):
        # never a value: the run is not compared; 3 when the VM was lost under it
        print(f"error: {exc}", file=sys.stderr)
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, VMError):
            cause = cause.__cause__
        return EXIT_INFRA if cause is not None else EXIT_USAGE
    if isinstance(exc, HarnessError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, OSError):    # the host refused something (disk full, permissions)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INFRA
    return None


def report_crash(exc: BaseException) -> int:
    """An exception no rule above knows (a bug in ``kph``): one line and exit 2, never 1
    (the status of a divergence) and never a traceback; the traceback is logged at DEBUG
    (``--log-level DEBUG``)."""
    clear_progress()
    logging.getLogger("harness.cli").debug("the traceback of the internal error:",
                                           exc_info=exc)
    what = str(exc).strip().splitlines()
    print(f"error: internal error: {type(exc).__name__}" + (f": {what[0]}" if what else "")
          + " (a bug in kph; --log-level DEBUG shows the traceback)", file=sys.stderr)
    return EXIT_USAGE
