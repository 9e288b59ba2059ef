#!/usr/bin/env python3
"""The differential suite's wall time, in one run, as ratios, in five configurations:

  -n 2, fresh machine per test      (the default since snapshots: kph_fresh_machine,
                                     each restored from the image's ready snapshot)
  -n 2, fresh machine per test, cold (what a fresh machine per test costs without them)
  -n 2, one machine per worker      (restored from the snapshot)
  -n 2, one machine per worker, cold (how the suite ran before snapshots)
  -n 1, fresh machine per test      (for the -n 1 -> -n 2 speed-up)

Runs each ``--repeat`` times, interleaved, and prints the medians.

``--remote``: instead, the suite locally with -n 1, -n 2, and through two SSH gateways to
a worker prepared by ``kph worker prepare`` (on a private sshd on 127.0.0.1) plus one local
(popen) worker. All share this machine's cores, so only the ratios mean anything: what
the SSH path costs against local workers, not what another machine would add.
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
#: the suite's cases on the default kernel with the events backend (as measured before the
#: suite ran on every kernel of the matrix with both in-guest sides)
SLICE = "test_differential and 6.1-events"
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
                        "-n", str(workers), SUITE, "-k", SLICE, *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"the suite failed under -n {workers} {' '.join(extra)}:\n{r.stdout[-2000:]}")
    return wall


def remote(repeat: int) -> int:
    import tempfile

    sys.path.insert(0, str(ROOT))
    from harness.apps.loopback_sshd import HOST_ALIAS, LoopbackSshd

    base = Path(tempfile.mkdtemp(prefix="kph-bench-remote-"))
    sshd = LoopbackSshd(Path(tempfile.mkdtemp(prefix="kbs", dir="/tmp")))
    sshd.start()
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "harness.cli", "-q", "worker", "prepare",
                            HOST_ALIAS, "--dir", str(base / "w"), "--cache", str(base / "cache"),
                            "--ssh-config", str(sshd.ssh_config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(f"kph worker prepare failed: {r.stderr[-1000:]}")
        prep = time.monotonic() - t0
        tx = r.stdout.split("--tx ", 1)[1].strip()
        two = "2" + tx[tx.index("*"):]
        sel = ["-k", SLICE]   # ssh gateways take -k, not paths
        configs = {"-n 1": ["-n", "1", *sel], "-n 2": ["-n", "2", *sel],
                   "2 ssh gateways + 1 popen": ["--dist", "load", "--tx", two, "--tx", "popen",
                                                *sel]}
        walls: dict[str, list[float]] = {n: [] for n in configs}
        for _ in range(repeat):
            for name, extra in configs.items():
                t0 = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *extra], cwd=ROOT, capture_output=True, text=True, timeout=1800)
                if r.returncode != 0:
                    sys.exit(f"the suite failed with {name}:\n{r.stdout[-2000:]}")
                walls[name].append(time.monotonic() - t0)
        med = {n: statistics.median(w) for n, w in walls.items()}
        print(f"differential suite (-k {SLICE!r}), median of {repeat}; "
              f"worker prepared in {prep:.0f} s:")
        for name, m in med.items():
            print(f"  {name:28s} {m:6.1f} s   ({', '.join(f'{w:.1f}' for w in walls[name])})")
        print(f"  -n 1 / -n 2: {med['-n 1'] / med['-n 2']:.2f}x")
        print(f"  -n 2 / (2 ssh + 1 popen): {med['-n 2'] / med['2 ssh gateways + 1 popen']:.2f}x")
        return 0
    finally:
        sshd.stop()
        import shutil
        shutil.rmtree(sshd.dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="runs of each (default 2)")
    ap.add_argument("--remote", action="store_true",
                    help="-n 1, -n 2 and 2 SSH gateways + 1 popen (a loopback sshd)")
    args = ap.parse_args()
    if args.remote:
        return remote(args.repeat)
    walls: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeat):
        for name, (n, extra) in CONFIGS.items():
            walls[name].append(run(n, extra))
    med = {name: statistics.median(w) for name, w in walls.items()}
    print(f"differential suite ({SUITE} -k {SLICE!r}), median of {args.repeat}:")
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
