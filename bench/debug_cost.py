#!/usr/bin/env python3
"""What the debug options of ``kph image build --tree SERIES --debug`` cost on this machine,
side by side in one run (issue 37): the build (the debug tree's build time, from its
``kph-build.log``'s make, cold unless it was built before, beside the plain tree's as
``kph image build --tree`` times it), the boot from each image's ready snapshot, and the
workload ``kph hunt`` runs (the fuzzer's default workload) timed inside each guest, with
one kprobe and one fprobe on its path through ``kph diff`` as well; interleaved, N times
each, medians and ratios printed.

Run: ``python3 bench/debug_cost.py [--series 6.12] [-n 3]``. The debug build takes both
CPUs for minutes the first time (lockdep, KASAN): run nothing beside it.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.apps.fuzz import DEFAULT_WORKLOAD  # noqa: E402
from harness.machine.image.build import build_tree_image  # noqa: E402
from harness.vmctl import Machine  # noqa: E402

PROBES = ["p:kph/o do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring",
          "f:kph/r vfs_read%return ret=$retval"]


def timed_build(series: str, debug: bool) -> tuple[object, float]:
    t0 = time.monotonic()
    img = build_tree_image(series, debug=debug, progress=lambda s: None)
    return img, time.monotonic() - t0


def boot_and_run(img: object) -> tuple[float, float, float]:
    """(snapshot boot, the workload in the guest, the same workload under kph diff)."""
    t0 = time.monotonic()
    with Machine.boot(img) as vm:
        boot = time.monotonic() - t0
        t1 = time.monotonic()
        vm.run(DEFAULT_WORKLOAD, timeout=300)
        work = time.monotonic() - t1
    t2 = time.monotonic()
    subprocess.run([sys.executable, "-m", "harness.cli", "-q", "diff", "--image",
                    Path(img.dir).name, "--run", DEFAULT_WORKLOAD, "--", *PROBES],
                   cwd=ROOT, capture_output=True, timeout=900)
    return boot, work, time.monotonic() - t2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", default="6.12")
    ap.add_argument("-n", type=int, default=3)
    args = ap.parse_args()
    plain, tp = timed_build(args.series, False)
    debug, td = timed_build(args.series, True)
    print(f"image build (kph image build --tree {args.series}[ --debug]): plain {tp:.0f} s, "
          f"debug {td:.0f} s (cold the first time: the debug build directory is its own)")
    rows: dict[str, list[tuple[float, float, float]]] = {"plain": [], "debug": []}
    for _ in range(args.n):
        for name, img in (("plain", plain), ("debug", debug)):
            rows[name].append(boot_and_run(img))
    med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in rows.items()}
    for i, what in enumerate(("boot from the snapshot", "the hunt's workload in the guest",
                              "kph diff of a kprobe and an fprobe on it")):
        p, d = med["plain"][i], med["debug"][i]
        print(f"{what:45s} plain {p:7.2f} s  debug {d:7.2f} s  ratio {d / p:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
