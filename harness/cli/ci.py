"""``--ktap``, ``--ktap-file FILE``, ``--kcidb FILE``: a verb's result for kernel CI (KTAP v1,
KCIDB), written beside its text and JSON (docs/ci.md).

A verb declares itself with :func:`reported` (a harness error before its result is then
``not ok 1 kph-VERB # ERROR MESSAGE``) and hands its cases to :func:`emit`. The library is
imported inside the functions (``kph --help`` stays light, as in every verb module).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any, Callable

from ..errors import SetupError
from .output import Output, check_output


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "ktap", False) or getattr(args, "ktap_file", None)
                or getattr(args, "kcidb", None))


def check(args: argparse.Namespace) -> None:
    """Before anything boots: one stdout document at a time, the files writable."""
    if getattr(args, "ktap", False) and getattr(args, "json", False):
        raise SetupError("--ktap and --json both write to stdout",
                         "write one of them to a file: --ktap-file FILE or -o FILE")
    check_output("--ktap-file", getattr(args, "ktap_file", None))
    check_output("--kcidb", getattr(args, "kcidb", None))
    if getattr(args, "kcidb", None):
        import re
        if not re.fullmatch(r"[a-z0-9_]+", args.kcidb_origin):
            raise SetupError(f"--kcidb-origin {args.kcidb_origin!r}: KCIDB origins are "
                             "lower-case letters, digits and _", "e.g. --kcidb-origin my_ci")


def reported(verb: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a verb's ``run(args, out)``: the CI outputs are checked before it runs, and
    an error it raises before :func:`emit` is written as one ``# ERROR`` test."""
    def deco(run: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(run)
        def wrapper(args: argparse.Namespace, out: Output) -> int:
            if not wanted(args):
                return run(args, out)
            check(args)
            args.ci_start = time.time()
            args.ci_done = False
            try:
                return run(args, out)
            except Exception as exc:
                if not args.ci_done:
                    from ..diff import ktap
                    write(args, ktap.error(verb, str(exc) or type(exc).__name__), verb=verb)
                raise
        return wrapper
    return deco


def emit(args: argparse.Namespace, cases: list[Any], *, verb: str,
         diagnostics: list[str] | tuple[str, ...] = (), kernel: str = "") -> None:
    """Write the cases as each option asks (nothing when none is given)."""
    if wanted(args):
        write(args, cases, verb=verb, diagnostics=diagnostics, kernel=kernel)


def write(args: argparse.Namespace, cases: list[Any], *, verb: str,
          diagnostics: list[str] | tuple[str, ...] = (), kernel: str = "") -> None:
    from ..diff import kcidb, ktap

    args.ci_done = True
    if getattr(args, "ktap", False) or getattr(args, "ktap_file", None):
        text = ktap.render(cases, diagnostics=diagnostics)
        if args.ktap_file:
            with open(args.ktap_file, "w") as f:
                f.write(text)
        if args.ktap:
            sys.stdout.write(text)
            sys.stdout.flush()
    if getattr(args, "kcidb", None):
        doc = kcidb.report(cases, verb=verb, origin=args.kcidb_origin,
                           start=getattr(args, "ci_start", None), default_kernel=kernel or "default")
        with open(args.kcidb, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def kernel_of(vm: Any) -> str:
    """The release a machine booted (``6.1.0-...-cloud-amd64``), for KCIDB's build."""
    facts = getattr(vm, "facts", None)
    return getattr(facts, "release", "") or ""
