#!/usr/bin/env python3
"""A probe on a hot path: ``p:rd vfs_read count=%dx:u64`` over >= 100,000 hits.

One guest booted with the plugin loaded, one workload (``dd bs=1``: one vfs_read per
byte), interleaved rounds, medians; every figure is the workload's wall time as the
harness sees it (``vm.run``), the host's decoding of the records afterwards is reported
apart:
  unprobed   nothing armed;
  plugin     the spec in the plugin engine (compiled, recorded in C, no round trip);
  events     the same line in the guest's tracefs kprobe_events;
  gdbstub    the gdbstub engine's HostBackend, measured on a shorter run (every hit is a
             stop of the whole VM) and extrapolated per hit to the long one.
Target (issue 15): plugin <= 2x the unprobed run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.backends.events import EventsBackend  # noqa: E402
from harness.backends.host import HostBackend  # noqa: E402
from harness.backends.plugin import PluginBackend  # noqa: E402
from harness.engines.gdbstub_engine import HostEngine  # noqa: E402
from harness.kernel.grammar import parse  # noqa: E402
from harness.vmctl import Machine  # noqa: E402

SPEC = "p:rd vfs_read count=%dx:u64"


def workload(n: int) -> str:
    return f"dd if=/dev/zero of=/dev/null bs=1 count={n} 2>/dev/null"


def timed(vm: Machine, n: int) -> float:
    t0 = time.monotonic()
    vm.run(workload(n), timeout=1800, check=True)
    return time.monotonic() - t0


def with_backend(vm: Machine, be, n: int) -> tuple[float, int, float]:
    """(workload wall, hits recorded, host seconds to collect them)."""
    out = be.register([parse(SPEC)])
    assert out[0].accepted, out[0]
    try:
        be.enable()
        wall = timed(vm, n)
        t0 = time.monotonic()
        be.disable()
        hits = sum(1 for h in be.collect() if h.comm == "dd")
        return wall, hits, time.monotonic() - t0
    finally:
        be.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100_000, help="vfs_read calls (default 100000)")
    ap.add_argument("--n-gdbstub", type=int, default=400, help="the gdbstub's shorter run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    walls: dict[str, list[float]] = {"unprobed": [], "plugin": [], "events": []}
    hits: dict[str, int] = {}
    host_s: dict[str, list[float]] = {"plugin": [], "events": []}
    stub_per_hit: list[float] = []
    with Machine.boot(host="plugin") as vm:
        timed(vm, 1000)
        for _ in range(args.rounds):
            walls["unprobed"].append(timed(vm, args.n))
            for name, be in (("plugin", PluginBackend(vm)), ("events", EventsBackend(vm))):
                w, h, c = with_backend(vm, be, args.n)
                walls[name].append(w)
                hits[name] = h
                host_s[name].append(c)
            short_base = timed(vm, args.n_gdbstub)
            stub = HostEngine(vm)
            try:
                hb = HostBackend(vm)
                hb.engine = stub
                w, h, _ = with_backend(vm, hb, args.n_gdbstub)
            finally:
                stub.close()
            stub_per_hit.append((w - short_base) / max(1, h))
        walls["unprobed"].append(timed(vm, args.n))
    base = statistics.median(walls["unprobed"])
    print(f"{SPEC!r} during {workload(args.n)!r}, median of {args.rounds} rounds")
    print(f"  {'side':10s} {'wall s':>9s} {'x unprobed':>11s} {'hits':>8s} {'host decode s':>14s}")
    print(f"  {'unprobed':10s} {base:9.3f} {1.0:11.2f} {'':>8s}")
    for name in ("plugin", "events"):
        w = statistics.median(walls[name])
        print(f"  {name:10s} {w:9.3f} {w / base:11.2f} {hits[name]:8d} "
              f"{statistics.median(host_s[name]):14.2f}")
    per = statistics.median(stub_per_hit)
    est = base + per * hits["plugin"]
    print(f"  {'gdbstub':10s} {est:9.1f} {est / base:11.0f} {hits['plugin']:8d} "
          f"  (extrapolated: {per * 1e3:.2f} ms per hit over {args.n_gdbstub} calls)")
    print(f"plugin overhead: {statistics.median(walls['plugin']) / base:.2f}x the unprobed run "
          f"(target <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
