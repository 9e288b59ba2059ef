#!/usr/bin/env python3
"""``r1:`` (maxactive=1) under real concurrency: two vCPUs, two processes, one kretprobe.

``-smp 2``; the same ``r1:`` line placed by the plugin engine and by the guest's own
tracefs (one execution, ``harness.diff.runner.run_differential``), and, on a second run of
the same workload, by the gdbstub engine. ``nmissed`` is what pre_handler_kretprobe()
(kernel/kprobes.c, 6.1) counts when the instance pool is empty; the guest's number is
its ``kprobe_profile`` column. Two workloads:
  sleep   two pinned ``sleep 1`` overlapping in do_nanosleep: exactly one miss;
  read    two pinned ``dd bs=1`` loops hammering vfs_read at once: calls overlap on the
          two vCPUs for real, nmissed is large and timing-dependent.
With the gdbstub engine every hit stops both vCPUs, so what overlaps is what the guest
scheduler interleaves between stops, not two CPUs inside the function together. Where
the plugin and the guest probe one function together their instances do not cover the
same instructions (the plugin takes its instance before the guest's ftrace handler and
frees it after the guest's rethook trampoline), so in the read case the plugin's window
contains the guest's and its nmissed is at least as large; in the sleep case the
overlap is the whole sleep and both count exactly one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.kernel.grammar import parse  # noqa: E402
from harness.diff.runner import run_differential  # noqa: E402
from harness.vmctl import Machine  # noqa: E402

CASES = {
    "sleep": ("r1:ns do_nanosleep ret=$retval:s32",
              "taskset 1 sleep 1 & taskset 2 sleep 1 & wait"),
    "read": ("r1:rd vfs_read ret=$retval:s64",
             "taskset 1 dd if=/dev/zero of=/dev/null bs=1 count={n} 2>/dev/null & "
             "taskset 2 dd if=/dev/zero of=/dev/null bs=1 count={n} 2>/dev/null & wait"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000, help="bytes per dd in the read case")
    ap.add_argument("--n-gdbstub", type=int, default=200, help="bytes per dd for the gdbstub run")
    args = ap.parse_args()
    print(f"{'case':6s} {'side':8s} {'hits':>7s} {'nmissed':>8s}  (maxactive=1, -smp 2)")
    for case, (line, wl) in CASES.items():
        spec = parse(line)
        name = f"{spec.group}/{spec.event}"
        with Machine.boot(host="plugin", smp=2) as vm:
            plug, guest = run_differential(vm, [spec], wl.format(n=args.n), timeout=600)
        for run in (plug, guest):
            c = run.counters[name]
            print(f"{case:6s} {run.side:8s} {c.nhit:7d} {c.nmissed:8d}"
                  + ("   (kprobe_profile)" if run.side == "events" else ""))
        with Machine.boot(smp=2) as vm:
            n = args.n_gdbstub if case == "read" else args.n
            stub, guest2 = run_differential(vm, [spec], wl.format(n=n), timeout=600)
        c, g = stub.counters[name], guest2.counters[name]
        what = f"dd count {n}" if case == "read" else "same workload"
        print(f"{case:6s} {'gdbstub':8s} {c.nhit:7d} {c.nmissed:8d}   "
              f"(its own run, {what}; the guest counted {g.nhit} hits, {g.nmissed} missed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
