#!/usr/bin/env python3
"""What a guest that does nothing costs the host: the CPU time of its QEMU process (all
threads, from /proc) over a window in which the guest only sits idle, for the machine
every guest is (``harness.constants.MACHINE``: no HPET) against the same machine with
QEMU's HPET (``-machine pc,hpet=on`` merged after it), both booted cold with the default
command line, measured in turn, N rounds, medians, as a ratio.

    python bench/idle_cost.py [-n 3] [--seconds 15] [--image 6.12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.constants import MACHINE  # noqa: E402
from harness.machine.image.store import default_image  # noqa: E402
from harness.vmctl import Machine  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (its /proc/PID/stat sums them)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def idle_share(image, extra: list[str], seconds: float) -> tuple[float, str]:
    """The share of one host CPU the guest's QEMU used over ``seconds`` of idling, and
    the guest's clocksource."""
    with Machine.boot(image, fresh=False, extra_args=extra) as vm:
        source = vm.run("cat /sys/devices/system/clocksource/clocksource0/current_clocksource",
                        timeout=60).stdout.strip()
        time.sleep(2)                   # the command's own teardown
        assert vm.proc is not None
        c0, t0 = cpu_seconds(vm.proc.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_seconds(vm.proc.pid) - c0) / (time.monotonic() - t0), source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=15.0, help="idle window (default 15)")
    ap.add_argument("--image", default=None, help="image name or series (default image)")
    args = ap.parse_args()
    image = default_image(args.image)
    extras = {f"-machine {MACHINE}": [], "with the HPET (hpet=on)": ["-machine", "pc,hpet=on"]}
    ways: dict[str, list[float]] = {k: [] for k in extras}
    sources: dict[str, set[str]] = {k: set() for k in ways}
    for r in range(args.n):
        for name in ways:
            share, source = idle_share(image, extras[name], args.seconds)
            ways[name].append(share)
            sources[name].add(source)
            print(f"round {r + 1}: {name:28s} {share * 100:5.2f}% of a CPU ({source})",
                  file=sys.stderr)
    print(f"{image.dir.name}: an idle guest's QEMU, {args.seconds:.0f} s windows, "
          f"median of {args.n}")
    med = {k: statistics.median(v) for k, v in ways.items()}
    for name, m in med.items():
        print(f"  {name:28s} {m * 100:5.2f}% of a CPU  "
              f"(clocksource {', '.join(sorted(sources[name]))})")
    base, hpet = med.values()
    print(f"  with the HPET / without: {hpet / base:.1f}x" if base else "  without: 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
