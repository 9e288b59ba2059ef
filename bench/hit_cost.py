#!/usr/bin/env python3
"""What one host-side breakpoint hit costs, measured three ways in one run.

Same guest workload (N short processes, each opening a file, so do_sys_openat2 runs a
few times per process) on one booted guest:
  none     no breakpoint: the baseline (measured before and after, averaged);
  raw      a raw RSP client (bench/rsp.py) stops at do_sys_openat2, reads rip and rdi,
           moves rip past the 5-byte entry nop, resumes;
  gdbstub  GdbStub (GDB/MI) does exactly the same.
"added/hit" is (wall - baseline) / hits; "handling/hit" is the time from the stop
reaching the harness to the resume being sent (the part the harness controls).
Repeated with the system QEMU when it is older than the chosen one, so the table shows
what QEMU >= 10.2 buys (no translation-cache flush per debug stop).

Then the plugin engine (issue 15) against the same two stub clients, on a hit-dense
workload (``dd bs=1``: one vfs_read per byte, no process per hit) on one guest booted
with the plugin loaded, interleaved rounds, each method at an iteration count that
makes its added time measurable (stops cost milliseconds, plugin hits microseconds) and
what a registration costs once negligible beside its hits (a probe's registration
retranslates the code around it: ~45 ms measured, 9 us a hit over 5,000 Python handler
hits, ~2 us over 20,000; the stub's 1,000 stops cost the same per hit as 300), each with
its own baseline at that count:
  raw / gdbstub    a breakpoint at vfs_read, read rdi, resume past the entry nop;
  plugin spec      ``p:rd vfs_read di=%di`` compiled, recorded in C into the ring;
  plugin handler   a Python pre_handler reading regs.di (one round trip per hit).
The last two lines are ``ratio gdbstub/plugin spec: N`` and ``... handler: N``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.gdbstub import attach  # noqa: E402
from harness.machine.image.store import default_image  # noqa: E402
from harness.machine.qemu import find_qemu, system_qemu  # noqa: E402
from harness.kernel.symbols import load_kallsyms_cached  # noqa: E402
from harness.vmctl import Machine  # noqa: E402
from rsp import RawStub  # noqa: E402

RIP, RDI = 16, 5


def workload(n: int) -> str:
    return f"i=0; while [ $i -lt {n} ]; do cat /proc/version >/dev/null; i=$((i+1)); done"


def timed_run(vm: Machine, n: int) -> float:
    t0 = time.monotonic()
    vm.run(workload(n), timeout=600, check=True)
    return time.monotonic() - t0


def in_thread(vm: Machine, n: int, out: dict) -> threading.Thread:
    def go() -> None:
        out["wall"] = timed_run(vm, n)
    t = threading.Thread(target=go)
    t.start()
    return t


def raw_loop(vm: Machine, addr: int, n: int) -> tuple[float, int, list[float]]:
    stub = RawStub(str(vm.gdb_socket))
    assert stub.cmd(f"Z0,{addr:x},1") == "OK"
    stub.cont()
    out: dict = {}
    th = in_thread(vm, n, out)
    hits, handling = 0, []
    while th.is_alive():
        try:
            reply = stub.wait_stop(0.2)
        except TimeoutError:
            continue
        t0 = time.perf_counter()
        if not reply.startswith("T05"):
            stub.cont()
            continue
        rip = stub.read_reg(RIP)
        stub.read_reg(RDI)
        stub.write_reg(RIP, rip + 5)
        stub.cont()
        handling.append(time.perf_counter() - t0)
        hits += 1
    th.join()
    # Remove the breakpoint and detach (QEMU resumes the guest).
    stub.interrupt()
    stub.cmd(f"z0,{addr:x},1")
    stub.close()
    return out["wall"], hits, handling


GDB_CPU: list[float] = []


def _cpu_seconds(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def gdbstub_loop(vm: Machine, addr: int, n: int) -> tuple[float, int, list[float]]:
    g = attach(vm, resume=False)
    cpu0 = _cpu_seconds(g.proc.pid)
    g.insert_breakpoint(addr)
    g.cont()
    out: dict = {}
    th = in_thread(vm, n, out)
    hits, handling = 0, []
    while th.is_alive():
        try:
            s = g.wait_stop(timeout=0.2)
        except TimeoutError:
            continue
        t0 = time.perf_counter()
        g.read_registers(("rdi",))  # rip is in the stop record
        g.resume(s.addr + 5)
        handling.append(time.perf_counter() - t0)
        hits += 1
        assert s.addr == addr
    th.join()
    GDB_CPU.append((_cpu_seconds(g.proc.pid) - cpu0) / max(1, hits))
    g.close()
    return out["wall"], hits, handling


def packets_per_hit(qemu, addr: int) -> None:
    """Print the RSP exchanges GDB makes for one hit (``set debug remote 1``), against
    the raw loop's: the part of the ratio no harness code can remove."""
    import logging
    import re

    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = re.search(r"\[remote\] Sending packet: \$([^#]*)#", record.getMessage())
            if m:
                lines.append(m[1])

    lg = logging.getLogger("harness.gdbstub")
    h, old = Grab(), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        with Machine.boot(qemu=qemu) as vm:
            g = attach(vm, resume=False)
            g.insert_breakpoint(addr)
            g.command("-gdb-set debug remote 1")
            g.cont()
            out: dict = {}
            th = in_thread(vm, 2, out)
            while th.is_alive():
                try:
                    s = g.wait_stop(timeout=0.2)
                except TimeoutError:
                    continue
                g.read_registers(("rdi",))
                g.resume(s.addr + 5)
            th.join()
            g.command("-gdb-set debug remote 0")
            g.close()
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    # One hit: from one vCont;c to the next.
    conts = [i for i, x in enumerate(lines) if x.startswith("vCont;c")]
    one = lines[conts[-3] + 1:conts[-2] + 1] if len(conts) >= 3 else lines
    short = [x if len(x) < 24 else x[:21] + "..." for x in one]
    print(f"GDB, one hit ({len(one)} packets after the stop reply): " + ", ".join(short))
    print("raw, one hit (4 packets after the stop reply): p10 (rip), p5 (rdi), P10=..., vCont;c")


def measure(qemu, addr: int, n: int, rounds: int) -> list[tuple[str, float, int, list[float]]]:
    """Interleave the three methods ``rounds`` times on one guest; medians of each."""
    walls: dict[str, list[float]] = {"none": [], "raw": [], "gdbstub": []}
    hits: dict[str, int] = {"none": 0, "raw": 0, "gdbstub": 0}
    handling: dict[str, list[float]] = {"none": [], "raw": [], "gdbstub": []}
    with Machine.boot(qemu=qemu) as vm:
        timed_run(vm, 5)  # warm up the guest's page cache and TBs
        for _ in range(rounds):
            walls["none"].append(timed_run(vm, n))
            for name, fn in (("raw", raw_loop), ("gdbstub", gdbstub_loop)):
                wall, h, hand = fn(vm, addr, n)
                walls[name].append(wall)
                hits[name] = h
                handling[name] += hand
        walls["none"].append(timed_run(vm, n))
    return [(k, statistics.median(walls[k]), hits[k], handling[k]) for k in walls]


def report(qemu, rows, n: int) -> dict:
    base = rows[0][1]
    print(f"\nQEMU {qemu.version_str} ({qemu.source}), {n} processes, median of the rounds")
    print(f"  {'method':8s} {'wall s':>8s} {'hits':>6s} {'added/hit ms':>13s} {'handling/hit ms':>16s}")
    per = {}
    for name, wall, hits, handling in rows:
        added = (wall - base) / hits * 1e3 if hits else 0.0
        hand = statistics.median(handling) * 1e3 if handling else 0.0
        per[name] = (added, hand)
        print(f"  {name:8s} {wall:8.2f} {hits:6d} {added:13.2f} {hand:16.3f}")
    ratio = per["gdbstub"][0] / per["raw"][0] if per["raw"][0] > 0 else float("nan")
    print(f"  ratio gdbstub/raw (added per hit): {ratio:.2f}")
    if GDB_CPU:
        print(f"  gdb's own CPU per hit (stop processing the harness cannot remove): "
              f"{statistics.median(GDB_CPU) * 1e3:.2f} ms")
        GDB_CPU.clear()
    return per


def dense(n: int) -> str:
    return f"dd if=/dev/zero of=/dev/null bs=1 count={n} 2>/dev/null"


def timed_dense(vm: Machine, n: int) -> float:
    t0 = time.monotonic()
    vm.run(dense(n), timeout=900, check=True)
    return time.monotonic() - t0


def _dense_thread(vm: Machine, n: int, out: dict) -> threading.Thread:
    def go() -> None:
        out["wall"] = timed_dense(vm, n)
    t = threading.Thread(target=go)
    t.start()
    return t


def dense_stub(vm: Machine, addr: int, n: int, raw: bool) -> tuple[float, int]:
    """The raw RSP client or GdbStub at ``addr`` during the dense workload."""
    global in_thread
    saved = in_thread
    in_thread = _dense_thread          # the loops above, on the dense workload
    try:
        wall, hits, _ = (raw_loop if raw else gdbstub_loop)(vm, addr, n)
    finally:
        in_thread = saved
    return wall, hits


def dense_plugin_spec(vm: Machine, n: int) -> tuple[float, int]:
    from harness.kernel.grammar import program as fetchprog
    from harness.kernel.grammar import parse

    eng = vm.host
    addr = vm.symbols.lookup("vfs_read").addr
    p = eng.add_spec_probe(addr, ret=False,
                           program=fetchprog.compile_spec(parse("p:rd vfs_read di=%di").args))
    eng.records()
    try:
        wall = timed_dense(vm, n)
    finally:
        eng.remove_probe(p)
    return wall, sum(1 for r in eng.records() if r.probe_id == p.id)


def dense_plugin_handler(vm: Machine, n: int) -> tuple[float, int]:
    from harness.kernel.kprobes import Kprobe

    eng = vm.host
    kp = eng.register_kprobe(Kprobe(symbol_name="vfs_read", pre_handler=lambda p, r: r.di and 0))
    try:
        wall = timed_dense(vm, n)
    finally:
        eng.unregister_kprobe(kp)
    return wall, kp.nhit


def measure_plugin(qemu, rounds: int, n_stop: int, n_spec: int, n_handler: int) -> dict:
    """Interleaved rounds of every method on one plugin-loaded guest; medians."""
    counts = {"raw": n_stop, "gdbstub": n_stop, "plugin spec": n_spec, "plugin handler": n_handler}
    walls: dict[str, list[float]] = {k: [] for k in counts}
    bases: dict[int, list[float]] = {n: [] for n in set(counts.values())}
    hits: dict[str, int] = {}
    GDB_CPU.clear()
    with Machine.boot(qemu=qemu, host="plugin") as vm:
        addr = vm.symbols.lookup("vfs_read").addr
        assert vm.host.read(addr, 5) == bytes.fromhex("0f1f440000"), "vfs_read has no entry nop"
        timed_dense(vm, 1000)
        for _ in range(rounds):
            for n in bases:
                bases[n].append(timed_dense(vm, n))
            for name, fn in (("raw", lambda: dense_stub(vm, addr, n_stop, True)),
                             ("gdbstub", lambda: dense_stub(vm, addr, n_stop, False)),
                             ("plugin spec", lambda: dense_plugin_spec(vm, n_spec)),
                             ("plugin handler", lambda: dense_plugin_handler(vm, n_handler))):
                wall, h = fn()
                walls[name].append(wall)
                hits[name] = h
        for n in bases:
            bases[n].append(timed_dense(vm, n))
    print(f"\nQEMU {qemu.version_str}, plugin engine vs gdbstub: dense workload (dd bs=1, one "
          f"vfs_read per byte), median of {rounds} rounds")
    print(f"  {'method':15s} {'count':>7s} {'wall s':>8s} {'base s':>8s} {'hits':>7s} {'added/hit us':>13s}")
    per = {}
    for name, n in counts.items():
        w, b = statistics.median(walls[name]), statistics.median(bases[n])
        per[name] = (w - b) / hits[name] * 1e6 if hits.get(name) else float("nan")
        print(f"  {name:15s} {n:7d} {w:8.3f} {b:8.3f} {hits[name]:7d} {per[name]:13.1f}")
    if GDB_CPU:
        print(f"  gdb's own CPU per hit: {statistics.median(GDB_CPU) * 1e3:.2f} ms")
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200, help="processes in the workload (default 200)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--no-system", action="store_true", help="skip the system QEMU comparison")
    ap.add_argument("--packets", action="store_true",
                    help="only show the packets GDB exchanges per hit, against the raw loop's")
    ap.add_argument("--plugin-only", action="store_true",
                    help="only the plugin engine against the stub clients (dense workload)")
    ap.add_argument("--n-stop", type=int, default=1000,
                    help="dd bytes for raw/gdbstub (default 1000)")
    ap.add_argument("--n-spec", type=int, default=200000,
                    help="dd bytes for the plugin spec probe (default 200000)")
    ap.add_argument("--n-handler", type=int, default=20000,
                    help="dd bytes for the plugin handler probe (default 20000)")
    args = ap.parse_args()
    img = default_image()
    addr = load_kallsyms_cached(img.kallsyms).lookup("do_sys_openat2").addr
    chosen = find_qemu()
    if args.packets:
        packets_per_hit(chosen, addr)
        return 0
    results = {}
    if not args.plugin_only:
        results["chosen"] = report(chosen, measure(chosen, addr, args.n, args.rounds), args.n)
    sysq = None if args.no_system or args.plugin_only else system_qemu()
    if sysq and sysq.version < chosen.version:
        n = max(20, args.n // 4)  # ~70 ms per hit: keep the run short
        results["system"] = report(sysq, measure(sysq, addr, n, 1), n)
        a, b = results["system"]["gdbstub"][0], results["chosen"]["gdbstub"][0]
        print(f"\nQEMU {chosen.version_str} vs {sysq.version_str}: added time per GdbStub hit "
              f"{b:.2f} ms vs {a:.2f} ms ({a / b:.0f}x less)")
    per = measure_plugin(chosen, args.rounds, args.n_stop, args.n_spec, args.n_handler)
    for kind in ("spec", "handler"):
        print(f"ratio gdbstub/plugin {kind}: {per['gdbstub'] / per['plugin ' + kind]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
