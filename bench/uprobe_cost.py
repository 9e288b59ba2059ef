#!/usr/bin/env python3
"""Per-call cost of host-side Python uprobes on ``kph-loop N`` (N calls of kph_add, one
process), the gdbstub engine and the plugin engine side by side on one machine.

Rows, each the median of --rounds runs, the engines' runs interleaved round by round,
"added" = (wall - baseline) / N, each timed run after an untimed one (adding a uprobe
to the plugin flushes all translations, paid once: docs/plugin.md):
  entry     a Uprobe at kph_add with a handler reading rdi (pid=None: exe-inode filter)
  entry+ret the same with a ret_handler: two stops (round trips) per call
  filtered  a Uprobe for *another* pid: the gdbstub engine stops at every call and finds
            it is not ours; the plugin's C filter drops it without a round trip
The last column is the ratio gdbstub / plugin of the added cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.engines.gdbstub_engine import HostEngine  # noqa: E402
from harness.engines.uprobes import Uprobe  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cmd = f"/usr/bin/kph-loop {args.calls} > /dev/null"

    with Machine.boot(host="plugin") as vm:
        def wall() -> float:
            t = time.perf_counter()
            vm.run(cmd, check=True)
            return time.perf_counter() - t

        r = vm.run("(/usr/bin/kph-loop 1 x /tmp/never > /tmp/o 2>&1 < /dev/null &); "
                   "sleep 0.3; head -n1 /tmp/o", check=True)
        other = int(r.stdout.split()[0])
        kinds = {
            "entry": lambda: Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                    handler=lambda u, r: r.di),
            "entry+ret": lambda: Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                        handler=lambda u, r: r.di,
                                        ret_handler=lambda ri, r: r.ax),
            "filtered": lambda: Uprobe("/usr/bin/kph-loop", symbol="kph_add", pid=other,
                                       handler=lambda u, r: r.di),
        }
        stub = HostEngine(vm)
        engines = {"gdbstub": stub, "plugin": vm.host}
        walls: dict[tuple[str, str], list[float]] = {}
        base: list[float] = []
        try:
            for _ in range(args.rounds):
                base.append(wall())
                for row, make in kinds.items():
                    for name, eng in engines.items():
                        up = eng.register_uprobe(make())
                        wall()          # not timed: the plugin flushed every translation
                        walls.setdefault((row, name), []).append(wall())
                        eng.unregister_uprobe(up)
        finally:
            stub.close()
        stats = {name: dict(eng.stats) for name, eng in engines.items()}
    b = statistics.median(base)
    print(f"{'baseline':10} {b:.3f} s for {args.calls} calls")
    for row in kinds:
        added = {n: (statistics.median(walls[(row, n)]) - b) / args.calls for n in engines}
        ratio = added["gdbstub"] / added["plugin"] if added["plugin"] > 0 else float("inf")
        print(f"{row:10} gdbstub {added['gdbstub'] * 1e6:8.0f} us/call   "
              f"plugin {added['plugin'] * 1e6:6.0f} us/call   ratio {ratio:6.1f}")
    print(f"stats: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
