"""``kph``: the command line. The only package that prints or configures logging.

One module per verb (``boot``, ``image``, ``qemu``, ``doctor``, ``probe``, ``diff``,
``matrix``, ``fuzz``, ``worker``, ``repro``, ``demo``), each with its parser and its run;
``main`` registers them and handles signals; ``output`` holds the one output convention
every verb follows (stdout JSON, stderr talk, ``-q``, ``-o``, exit statuses, errors in one
line); ``common`` the option groups and steps several verbs share. The work itself is in
the library (runner, repro, trapflow, report). Verbs import the library inside ``run``:
``kph --help`` (0.04 s; 0.18 s with the layers loaded, measured 2026-11-26) and a Ctrl-C
during start-up do not wait for QEMU's, GDB's and the probe
grammar's modules.

A SIGINT or SIGTERM that comes while the program (``kph``, or ``python -m harness.cli``,
whose ``sys.argv[0]`` is ``-m`` while the package is found) imports the modules below,
before ``main`` installs its handlers, is recorded in ``early_signals``; ``main`` then ends
at once with 130 and its one line, as for any interruption. Once ``main`` has its exit
status the program ignores both signals: Python's shutdown puts back the default action
of a signal whose handler is a Python function (Modules/signalmodule.c:
``_PySignal_Fini``), so a Ctrl-C in the last milliseconds of a finished run would
otherwise kill it silently (-SIGINT) instead of letting it exit with its status.
Imported as a library, nothing is installed.
"""
import os as _os
import signal as _signal
import sys as _sys

early_signals: list[int] = []
#: run as the program (not imported as a library): ``main`` leaves SIGINT and SIGTERM
#: ignored once its outcome is decided, through the interpreter's own shutdown
as_program = _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "kph"


def _record(signum: int, frame: object) -> None:
    early_signals.append(signum)


if as_program:
    for _s in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(_s, _record)

from .main import COMMANDS, EXAMPLES, VERBS, main, make_parser
from .output import (EXIT_DIVERGED, EXIT_EMPTY, EXIT_INFRA, EXIT_OK, EXIT_USAGE, Output,
                     Progress)

__all__ = ["main", "make_parser", "COMMANDS", "EXAMPLES", "VERBS", "Output", "Progress",
           "EXIT_OK", "EXIT_DIVERGED", "EXIT_USAGE", "EXIT_INFRA", "EXIT_EMPTY"]
