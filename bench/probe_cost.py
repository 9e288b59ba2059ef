#!/usr/bin/env python3
"""Per-hit cost of a host-side kprobe: emulating the probed instruction vs single-stepping it.

One guest, one workload (N short processes), interleaved rounds, medians. Each row is a
kprobe with a pre_handler that reads one register, so every hit pays the same handler
cost and differs only in how the probed instruction is executed:
  entry nop  do_sys_openat2+0 (the 5-byte ftrace nop): emulated = pc += 5
  push       do_sys_openat2+5 (push %r12): emulated = one register and one memory write
  kretprobe  do_sys_openat2 return probe (entry nop emulated, return via the trampoline)
"added/hit" is (wall - baseline) / hits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.kernel.kprobes import Kprobe, Kretprobe  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def workload(n: int) -> str:
    return f"i=0; while [ $i -lt {n} ]; do cat /proc/version >/dev/null; i=$((i+1)); done"


def timed(vm: Machine, n: int) -> float:
    t0 = time.monotonic()
    vm.run(workload(n), timeout=900, check=True)
    return time.monotonic() - t0


def one(vm: Machine, n: int, kind: str, emulate: bool) -> tuple[float, int]:
    host = vm.host
    host.emulate = emulate
    if kind == "kretprobe":
        p = host.register_kretprobe(Kretprobe(symbol_name="do_sys_openat2",
                                              handler=lambda ri, r: r.ax))
    else:
        p = host.register_kprobe(Kprobe(symbol_name="do_sys_openat2",
                                        offset=0 if kind == "entry nop" else 5,
                                        pre_handler=lambda kp, r: r.di and 0))
    wall = timed(vm, n)
    hits = host.stats["hits"]
    host.close()
    return wall, hits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200, help="processes per run (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args()
    rows = [("entry nop", True), ("entry nop", False), ("push", True), ("push", False),
            ("kretprobe", True)]
    walls: dict[tuple[str, bool], list[float]] = {r: [] for r in rows}
    hits: dict[tuple[str, bool], int] = {}
    base: list[float] = []
    with Machine.boot() as vm:
        timed(vm, 5)
        for _ in range(args.rounds):
            base.append(timed(vm, args.n))
            for r in rows:
                w, h = one(vm, args.n, *r)
                walls[r].append(w)
                hits[r] = h
        base.append(timed(vm, args.n))
        qemu = vm.qemu.version_str
    b = statistics.median(base)
    print(f"QEMU {qemu}, {args.n} processes, baseline {b:.2f} s, median of {args.rounds} rounds")
    print(f"  {'probe':10s} {'execution':10s} {'hits':>6s} {'added/hit ms':>13s}")
    per = {}
    for (kind, emu), ws in walls.items():
        per[(kind, emu)] = (statistics.median(ws) - b) / max(1, hits[(kind, emu)]) * 1e3
        print(f"  {kind:10s} {'emulated' if emu else 'stepped':10s} {hits[(kind, emu)]:6d} "
              f"{per[(kind, emu)]:13.2f}")
    for kind in ("entry nop", "push"):
        print(f"  {kind}: single-step costs {per[(kind, False)] / per[(kind, True)]:.1f}x "
              "the emulated hit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
