#!/usr/bin/env python3
"""Per-call cost of host-side uprobes on ``kph-loop N`` (N calls of kph_add, one process).

Rows, each the median of --rounds runs, "added" = (wall - baseline) / N:
  entry     a Uprobe at kph_add with a handler reading rdi (pid=None: exe-inode filter)
  entry+ret the same with a ret_handler: two stops per call (entry, trampoline)
  filtered  a Uprobe for *another* pid: every call stops, is found not ours, and resumes
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.engines.uprobes import Uprobe  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cmd = f"/usr/bin/kph-loop {args.calls} > /dev/null"

    def timed(vm: Machine) -> float:
        runs = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            vm.run(cmd, check=True)
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    with Machine.boot() as vm:
        host = vm.host
        rows = {"baseline": timed(vm)}
        up = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                         handler=lambda u, r: r.di))
        rows["entry"] = timed(vm)
        host.unregister_uprobe(up)
        up = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                         handler=lambda u, r: r.di, ret_handler=lambda ri, r: r.ax))
        rows["entry+ret"] = timed(vm)
        host.unregister_uprobe(up)
        r = vm.run("(/usr/bin/kph-loop 1 x /tmp/never > /tmp/o 2>&1 < /dev/null &); "
                   "sleep 0.3; head -n1 /tmp/o", check=True)
        host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                    pid=int(r.stdout.split()[0]), handler=lambda u, r: r.di))
        rows["filtered"] = timed(vm)
        stats = dict(host.stats)
    base = rows["baseline"]
    for name, wall in rows.items():
        added = "" if name == "baseline" else f"  added {(wall - base) / args.calls * 1e3:.2f} ms/call"
        print(f"{name:10} {wall:.3f} s{added}")
    print(f"stats: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
