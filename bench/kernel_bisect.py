#!/usr/bin/env python3
"""``kph bisect`` on a planted history, timed: the history of tests/vm/test_bisect.py
(``harness.apps.bisect.plant_history``: Debian's tree, a finding's fix, comment changes and
the commit that undoes the fix, ``--after`` more changes after it), then ``kph bisect`` over
it. Prints every step (role, commit, verdict, build and run seconds), the number of steps,
the first build beside the median of the later (incremental) ones as a ratio, and whether
the planted commit was named.

Run: ``python3 bench/kernel_bisect.py [--series 6.12] [--after 3] [--no-check-ends]``. It needs a
git identity (``git config user.name/user.email``: the planted commits' author), Debian's
source of the series (fetched when missing) and about 3 GB free; it takes both CPUs for
the first build (minutes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.apps import bisect  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", default="6.12", choices=("6.12", "7.3"))
    ap.add_argument("--finding", default="non-unique-symbol-errno")
    ap.add_argument("--after", type=int, default=1, help="commits after the planted one")
    ap.add_argument("--no-check-ends", action="store_true")
    a = ap.parse_args()
    scenario = ROOT / "probes/scenarios/upstream" / f"{a.finding}.toml"
    with tempfile.TemporaryDirectory(prefix="kph-bench-bisect-") as d:
        t0 = time.monotonic()
        h = bisect.plant_history(Path(d) / "linux", finding=a.finding, series=a.series,
                                 after=a.after, progress=print)
        plant = time.monotonic() - t0
        argv = [sys.executable, "-m", "harness.cli", "bisect", str(scenario), "--tree",
                str(h.tree), "--good", h.good, "--bad", h.bad, "--out", str(Path(d) / "out"),
                "--json"] + (["--no-check-ends"] if a.no_check_ends else [])
        t1 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True)
        total = time.monotonic() - t1
        if r.returncode != 0:
            print(r.stderr[-3000:])
            return 1
        doc = json.loads(r.stdout)
    steps = doc["steps"]
    print(f"history: {len(h.commits)} commits on Debian's {a.series}, planted "
          f"{h.planted[:12]}; made in {plant:.0f} s")
    for s in steps:
        print(f"  {s['role']:9s} {s['commit'][:12]} {s['verdict']:5s} build {s['build_s']:6.0f} s"
              f"  run {s['run_s']:5.0f} s")
    first, later = steps[0]["build_s"], [s["build_s"] for s in steps[1:]]
    if later:
        print(f"first build {first:.0f} s, later builds median {statistics.median(later):.0f} s: "
              f"ratio {first / statistics.median(later):.1f}x")
    print(f"steps: {len(steps)} ({sum(1 for s in steps if s['role'].startswith('step'))} by "
          f"git bisect), whole bisect {total:.0f} s")
    ok = doc["first_bad"] == h.planted
    print(f"named: {doc['fixes']} ({'the planted commit' if ok else 'NOT the planted commit'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
