#!/usr/bin/env python3
"""The differential suite's wall time under pytest -n 1 and -n 2, in one run, as a ratio.

Each worker boots its own machine (the plugin's kph_machine fixture), so -n 2 pays two
boots in parallel and then splits the cases. Runs each configuration ``--repeat`` times,
alternating, and prints the medians.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = "tests/vm/test_differential_suite.py"


def run(workers: int) -> float:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-n", str(workers), SUITE], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"the suite failed under -n {workers}:\n{r.stdout[-2000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="runs of each (default 2)")
    args = ap.parse_args()
    walls: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeat):
        for n in (1, 2):
            walls[n].append(run(n))
    m1, m2 = statistics.median(walls[1]), statistics.median(walls[2])
    print(f"differential suite ({SUITE}), median of {args.repeat}:")
    print(f"  -n 1  {m1:6.1f} s")
    print(f"  -n 2  {m2:6.1f} s")
    print(f"  speed-up -n 1 -> -n 2: {m1 / m2:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
