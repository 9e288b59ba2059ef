"""``kph qemu``: provision or show the QEMU the harness uses."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import SetupError
from .common import examples, sub
from .output import EXIT_OK, Output

NAME = "qemu"
EXAMPLES = ["kph qemu which", "kph qemu which --json"]


def add_parser(subparsers: Any) -> None:
    q = sub(subparsers, NAME, help="Provision or show the QEMU the harness uses",
            epilog=examples(EXAMPLES))
    qsub = q.add_subparsers(dest="qemu_cmd", metavar="ACTION")
    pv = sub(qsub, "provision", help="Unpack QEMU >= 10.2 from Debian 13 backports "
             "into the cache (skipped when the system QEMU is new enough)")
    pv.add_argument("--force", action="store_true", help="provision even if one exists")
    sub(qsub, "which", help="Show the QEMU that would be used and why", epilog=examples(EXAMPLES))


def run(args: argparse.Namespace, out: Output) -> int:
    from ..machine.qemu import find_qemu, provision_private_qemu, system_qemu, why_chosen

    if args.qemu_cmd == "provision":
        s = system_qemu()
        if s and s.fast_gdbstub and not args.force:
            out.text(f"qemu: system QEMU {s.version_str} is >= 10.2; nothing to provision")
            q = s
        else:
            q = provision_private_qemu(progress=out.progress, force=args.force)
            out.progress.clear()
        out.result({"version": q.version_str, "path": q.argv[-1], "why": why_chosen(q)})
        return EXIT_OK
    if args.qemu_cmd == "which":
        q = find_qemu()
        why = why_chosen(q)
        out.result({"version": q.version_str, "path": q.argv[-1], "why": why,
                    "fast_gdbstub": q.fast_gdbstub})
        out.text(f"QEMU {q.version_str}: {q.argv[-1]} ({why})")
        return EXIT_OK
    raise SetupError("kph qemu needs an action", "try `kph qemu provision` or `kph qemu which`")
