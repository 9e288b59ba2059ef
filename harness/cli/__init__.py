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
"""
from .main import COMMANDS, EXAMPLES, VERBS, main, make_parser
from .output import (EXIT_DIVERGED, EXIT_EMPTY, EXIT_INFRA, EXIT_OK, EXIT_USAGE, Output,
                     Progress)

__all__ = ["main", "make_parser", "COMMANDS", "EXAMPLES", "VERBS", "Output", "Progress",
           "EXIT_OK", "EXIT_DIVERGED", "EXIT_USAGE", "EXIT_INFRA", "EXIT_EMPTY"]
