"""``kph doctor``: report QEMU, gdb, KVM, the image cache and what to fix."""
from __future__ import annotations

import argparse
from typing import Any

from .common import examples, sub
from .output import EXIT_OK, EXIT_USAGE, Output

NAME = "doctor"
EXAMPLES = ["kph doctor", "kph doctor --json"]


def add_parser(subparsers: Any) -> None:
    sub(subparsers, NAME, help="Report QEMU, gdb, KVM, the image cache and what to fix",
        description="Check what the harness would use. Exit 0 when nothing fails, 2 "
        "otherwise (each failure names its fix).", epilog=examples(EXAMPLES))


def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps.doctor import run_checks

    checks = run_checks()
    bad = 0
    for c in checks:
        out.text(f"[{c.mark:4s}] {c.name:12s} {c.detail}")
        if c.ok is False:
            bad += 1
            if c.fix:
                out.text(f"       {'':12s} fix: {c.fix}")
    out.result({"ok": not bad, "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                                          "fix": c.fix} for c in checks]})
    return EXIT_OK if not bad else EXIT_USAGE
