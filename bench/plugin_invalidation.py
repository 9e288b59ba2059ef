#!/usr/bin/env python3
"""How a probe added at run time reaches code QEMU translated before it was added.

The plugin instruments an instruction when QEMU translates it; code translated earlier
runs on without the callback until its translation goes. Candidates, tried on one
plugin-loaded guest whose do_sys_openat2 is translated (a workload ran first), a spec
probe added *without* invalidation, then the candidate, then one ``cat`` (did the probe
fire?):
  none        nothing (the control: no hit expected);
  gdbstub     a Z0/z0 pair at the address through a raw gdbstub client (QEMU >= 9.1
              looks translations up with a "breakpoint on this page" flag, CF_BP_PAGE,
              rather than flushing);
  byte        the plugin rewrites the instruction's first byte with itself through
              qemu_plugin_write_memory_vaddr(), from a vCPU (the default);
  reset       qemu_plugin_reset() from a vCPU: every callback dropped, the whole
              translation cache flushed, callbacks registered again.
Then the costs: how long until the invalidation is done (idle guest, busy guest) and
what the guest pays afterwards (the next workload's wall time, which includes
retranslating what was invalidated).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.kernel.grammar import program as fetchprog  # noqa: E402
from harness.kernel.grammar import parse  # noqa: E402
from harness.vmctl import Machine  # noqa: E402
from rsp import RawStub  # noqa: E402

WARM = "i=0; while [ $i -lt 20 ]; do cat /proc/version >/dev/null; i=$((i+1)); done"


def fires_after(vm: Machine, how: str) -> bool:
    eng = vm.host
    addr = vm.symbols.lookup("do_sys_openat2").addr
    vm.run(WARM, check=True)
    p = eng.add_spec_probe(addr, ret=False, invalidate=False,
                           program=fetchprog.compile_spec(parse("p:o do_sys_openat2").args))
    try:
        if how == "gdbstub":
            stub = RawStub(str(vm.gdb_socket))      # connecting stops the VM
            assert stub.cmd(f"Z0,{addr:x},1") == "OK" and stub.cmd(f"z0,{addr:x},1") == "OK"
            stub.close()                           # detaching leaves it paused (11.1.3)
            vm.qmp("cont")
        elif how == "byte":
            eng.invalidate(addr)
        elif how == "reset":
            eng.invalidate(addr, flush_all=True)
        eng.records()
        vm.run("cat /proc/version >/dev/null", check=True)
        return any(r.comm == b"cat" for r in eng.records())
    finally:
        eng.remove_probe(p)


def latency(vm: Machine, flush_all: bool, busy: bool, n: int) -> list[float]:
    eng = vm.host
    addr = vm.symbols.lookup("do_sys_openat2").addr
    th = None
    if busy:
        th = threading.Thread(target=vm.run, args=(
            "i=0; while [ $i -lt 60000 ]; do i=$((i+1)); done",), kwargs={"timeout": 120})
        th.start()
        time.sleep(0.3)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            st = eng.invalidate(addr, flush_all=flush_all)
            out.append((time.perf_counter() - t0) * 1e3)
            assert st in ("done", "all vCPUs idle"), st
            time.sleep(0.02)
    finally:
        if th is not None:
            th.join(120)
    return out


def after_cost(vm: Machine, flush_all: bool, rounds: int) -> float:
    """Median wall time of the warm workload right after an invalidation."""
    eng = vm.host
    addr = vm.symbols.lookup("do_sys_openat2").addr
    walls = []
    for _ in range(rounds):
        vm.run(WARM, check=True)
        eng.invalidate(addr, flush_all=flush_all)
        t0 = time.monotonic()
        vm.run(WARM, check=True)
        walls.append(time.monotonic() - t0)
    return statistics.median(walls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with Machine.boot(host="plugin") as vm:
        print("does a probe added after translation fire? (one cat, do_sys_openat2 warm)")
        for how in ("none", "gdbstub", "byte", "reset"):
            print(f"  {how:8s} {'yes' if fires_after(vm, how) else 'no'}")
        print("time until invalidated, ms (median / max of 10)")
        for flush_all in (False, True):
            for busy in (False, True):
                lat = latency(vm, flush_all, busy, 10)
                print(f"  {'reset' if flush_all else 'byte':6s} {'busy' if busy else 'idle':5s} "
                      f"{statistics.median(lat):7.2f} / {max(lat):7.2f}")
        walls = {}
        for flush_all in (False, True):
            walls[flush_all] = after_cost(vm, flush_all, args.rounds)
        print(f"the guest afterwards: 20 x cat right after the invalidation, median of "
              f"{args.rounds}")
        print(f"  byte   {walls[False]:.3f} s")
        print(f"  reset  {walls[True]:.3f} s  (+{(walls[True] - walls[False]) * 1e3:.0f} ms: "
              f"everything retranslated)")
        print(f"  stats  {vm.host.global_stats()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
