#!/usr/bin/env python3
"""kph fuzz throughput: examples per minute with 1 and 2 workers, with each host engine,
measured side by side in one run (the same seed and budget for each), as ratios.

Each configuration runs ``kph fuzz --json --examples N --seed S`` and reads its result
(``examples``, ``wall_seconds``): wall time from the first boot to the last verdict,
machines and the symbol pool included.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("gdbstub", 1), ("gdbstub", 2), ("plugin", 1), ("plugin", 2)]


def run(host: str, workers: int, examples: int, seed: int) -> tuple[int, float]:
    with tempfile.TemporaryDirectory(prefix="kph-fuzz-rate-") as out:
        r = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", "--json",
                            "--examples", str(examples), "--seed", str(seed), "-n",
                            str(workers), "--host", host, "--out", out], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        sys.exit(f"kph fuzz --host {host} -n {workers} failed (exit {r.returncode}): "
                 f"{(r.stderr or r.stdout)[-800:]}")
    return int(doc["examples"]), float(doc["wall_seconds"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=120)
    ap.add_argument("--seed", type=int, default=31)
    args = ap.parse_args()
    rates = {}
    for host, n in CONFIGS:
        ex, secs = run(host, n, args.examples, args.seed)
        rates[(host, n)] = 60 * ex / secs
        print(f"  host {host:8s} -n {n}: {ex} examples in {secs:.0f} s = {rates[(host, n)]:.0f}/min")
    for host in ("gdbstub", "plugin"):
        print(f"  {host}: -n 2 / -n 1 = {rates[(host, 2)] / rates[(host, 1)]:.2f}x")
    print(f"  plugin / gdbstub at -n 2 = {rates[('plugin', 2)] / rates[('gdbstub', 2)]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
