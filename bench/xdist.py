#!/usr/bin/env python3
"""The differential suite's wall time, in one run, as ratios, in five configurations:

  -n 2, fresh machine per test      (the default since snapshots: kph_fresh_machine,
                                     each restored from the image's ready snapshot)
  -n 2, fresh machine per test, cold (what a fresh machine per test costs without them)
  -n 2, one machine per worker      (restored from the snapshot)
  -n 2, one machine per worker, cold (how the suite ran before snapshots)
  -n 1, fresh machine per test      (for the -n 1 -> -n 2 speed-up)

Runs each ``--repeat`` times, interleaved, and prints the medians.
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
CONFIGS = {
    "-n 2, fresh machine per test (snapshot)": (2, []),
    "-n 2, fresh machine per test (cold)": (2, ["--kph-cold"]),
    "-n 2, machine per worker (snapshot)": (2, ["--kph-machine-per", "worker"]),
    "-n 2, machine per worker (cold; before)": (2, ["--kph-machine-per", "worker", "--kph-cold"]),
    "-n 1, fresh machine per test (snapshot)": (1, []),
}


def run(workers: int, extra: list[str]) -> float:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-n", str(workers), SUITE, *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"the suite failed under -n {workers} {' '.join(extra)}:\n{r.stdout[-2000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="runs of each (default 2)")
    args = ap.parse_args()
    walls: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeat):
        for name, (n, extra) in CONFIGS.items():
            walls[name].append(run(n, extra))
    med = {name: statistics.median(w) for name, w in walls.items()}
    print(f"differential suite ({SUITE}), median of {args.repeat}:")
    for name, m in med.items():
        print(f"  {name:42s} {m:6.1f} s   ({', '.join(f'{w:.1f}' for w in walls[name])})")
    before = med["-n 2, machine per worker (cold; before)"]
    for name in ("-n 2, fresh machine per test (snapshot)", "-n 2, machine per worker (snapshot)"):
        print(f"  before / {name}: {before / med[name]:.2f}x")
    cold = med["-n 2, fresh machine per test (cold)"]
    print(f"  fresh per test, cold / snapshot: {cold / med['-n 2, fresh machine per test (snapshot)']:.2f}x")
    n1, n2 = med["-n 1, fresh machine per test (snapshot)"], med["-n 2, fresh machine per test (snapshot)"]
    print(f"  speed-up -n 1 -> -n 2 (fresh per test): {n1 / n2:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
