"""``kph probe``: place SPEC on one side (--backend), run a workload, show the events."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .common import (booted, examples, kernel_group, load_specs, machine, qemu_group,
                     refusals, spec_args, sub, workload_ran)
from .common import kernel_report, kernel_verdict
from .output import EXIT_KERNEL, EXIT_OK, EXIT_USAGE, Output, check_output

NAME = "probe"
EXAMPLES = ["kph probe 'p:open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring' "
            "--run 'cat /proc/version'",
            "kph probe 'r:openret do_sys_openat2 ret=$retval:s64' --backend events "
            "--run 'cat /proc/version' --json"]


def add_parser(subparsers: Any) -> None:
    pr = sub(subparsers, NAME, help="Place SPEC on one side (--backend), run a workload, "
             "show the events", description="Place kprobe_events specs host-side "
             "(through the gdbstub) or in the guest (tracefs or the kph module), "
             "run --run, show the events as the trace file would. Exit 0, or 2 when a "
             "spec is refused, 5 when the kernel reported a splat during the run (a "
             "WARNING:, BUG:, an oops, a panic), 6 when the guest hung.", epilog=examples(EXAMPLES))
    spec_args(pr)
    pr.add_argument("--backend", choices=("host", "events", "module"), default="host",
                    help="where the probes go (default host)")
    pr.add_argument("--host", choices=("gdbstub", "plugin"), default="gdbstub",
                    help="the host-side engine: gdbstub (default, the reference) or the QEMU "
                    "plugin (microseconds per hit, vCPUs not stopped)")
    kernel_group(pr)
    qemu_group(pr)


def run(args: argparse.Namespace, out: Output) -> int:
    from ..diff import report
    from ..diff.runner import run_single

    check_output("-o", out.json_file)
    specs = load_specs(args)
    backend = "plugin" if args.backend == "host" and args.host == "plugin" else args.backend
    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with machine(args, gdb=backend == "host") as vm:
        booted(vm, args, out)
        res = run_single(vm, backend, specs, args.run, timeout=args.timeout,
                         progress=out.progress)
    out.progress.clear()
    workload_ran(res, args.run)
    refused = refusals(res.outcomes, out)
    doc = {"side": res.side, "workload": {"command": args.run, "status": res.workload_status,
                                          "stderr": res.workload_stderr},
           "outcomes": [dataclasses.asdict(o) for o in res.outcomes],
           "hits": [report.hit_doc(h) for h in res.hits],
           "counters": {p: dataclasses.asdict(c) for p, c in res.counters.items()}}
    doc["kernel"] = report.findings_json(res.splats)
    out.result(doc)
    if refused:
        kernel_report(res.splats, out)
        return EXIT_USAGE
    for h in res.hits:
        out.text(h.line())
    counts = ", ".join(f"{p} {c.nhit} hits/{c.nmissed} missed" for p, c in res.counters.items())
    # an fprobe's or event probe's event has no kprobe_profile line (no counters)
    out.text(f"{backend}: {len(res.hits)} events; {counts + '; ' if counts else ''}workload "
             f"{report.workload_status(res.workload_status, res.workload_stderr)}")
    kernel_report(res.splats, out)
    return EXIT_KERNEL if kernel_verdict(res.splats) else EXIT_OK
