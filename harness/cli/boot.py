"""``kph boot``: boot the default image (or --kernel/--initrd), run commands, power off."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from .common import examples, kernel_group, qemu_group, rules_note, started, sub, warn_slow_qemu
from .output import EXIT_OK, Output

NAME = "boot"
EXAMPLES = ["kph boot --run 'uname -r' --run 'cat /proc/cmdline'",
            "kph boot --cold --run true",
            "kph boot --json --run 'cat /proc/version'"]


def add_parser(subparsers: Any) -> None:
    bt = sub(subparsers, NAME, help="Boot the default image (or --kernel/--initrd) and run commands",
             description="Boot, run each --run command in the guest, power off. The "
             "commands' output is passed through (their stdout on stdout); with --json "
             "it is in the JSON document instead. Exit status: that of the last command.",
             epilog=examples(EXAMPLES))
    bt.add_argument("--run", action="append", default=[], metavar="CMD",
                    help="a shell command to run in the guest (repeatable)")
    bt.add_argument("--timeout", type=float, default=60.0, metavar="S",
                    help="limit for each command (default 60)")
    bt.add_argument("--console", action="store_true", help="show the guest console at the end")
    kernel_group(bt)
    qemu_group(bt)


def run(args: argparse.Namespace, out: Output) -> int:
    from ..vmctl import Machine

    opts: dict[str, Any] = dict(kernel=args.kernel, initrd=args.initrd, vmlinux=args.vmlinux,
                                smp=args.smp,
                                accel=args.accel, memory=args.memory, append=args.append,
                                qemu=args.qemu)
    if args.dry_run:  # the cold command line; a restore adds -incoming and the RAM file
        line = Machine.prepare(args.image, **opts).dry_run()
        out.result({"command": line, "argv": shlex.split(line)})
        if not out.json:
            print(line)     # the command line is data: stdout, as --dry-run promises
        return EXIT_OK
    status = EXIT_OK
    vm = Machine.boot(args.image, fresh=not args.cold, **opts)
    doc: dict[str, Any] = {"commands": []}
    with vm:
        how = started(vm, args)
        doc["start"] = {"mode": vm.start_mode, "seconds": round(vm.boot_seconds, 3),
                        "phases": {k: round(v, 3) for k, v in vm.boot_phases.items()},
                        "reason": how}
        out.text(f"boot: {how}")
        rules_note(vm, out)
        warn_slow_qemu(vm.qemu, out)
        for cmd in args.run:
            r = vm.run(cmd, timeout=args.timeout)
            doc["commands"].append({"command": cmd, "status": r.status, "stdout": r.stdout,
                                    "stderr": r.stderr})
            out.data(r.stdout)
            if not out.json:
                sys.stderr.write(r.stderr)
                sys.stderr.flush()
            status = r.status
        if args.console:
            doc["console"] = vm.console_text()
            out.text(doc["console"])
    doc["status"] = status
    out.result(doc)
    return status
