#!/usr/bin/env python3
"""What record/replay costs: one scripted guest run four ways, interleaved rounds, medians.

The run: boot the default image with a script (an in-guest kprobe through tracefs,
``cat /proc/version``, the trace), script end, poweroff. Timed from QEMU's start:

- plain:  the same machine and initramfs, no icount (QEMU start to QEMU exit)
- icount: plain with ``-icount shift=auto,sleep=off`` and no record/replay
- record: ``harness.machine.replay.record`` (QEMU start to the end marker and poweroff)
- replay: ``harness.machine.replay.replay`` of that recording (QEMU start to the recorded end)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import constants as C  # noqa: E402
from harness.machine import replay as rr  # noqa: E402
from harness.machine.image.store import default_image  # noqa: E402
from harness.machine.qemu import find_qemu  # noqa: E402

SCRIPT = """echo 'p:kprobes/o do_sys_openat2 dfd=%di:s32' > /sys/kernel/tracing/kprobe_events
echo 1 > /sys/kernel/tracing/events/kprobes/enable
cat /proc/version
cat /sys/kernel/tracing/trace
"""


def plain(qemu, work: Path, icount: bool) -> float:
    args = rr._guest_args(C.DEFAULT_APPEND, "record", False, "", "plain-console.log")
    i = args.index("-icount")
    del args[i:i + 2]
    args[args.index("panic=pause,shutdown=pause")] = "panic=shutdown"
    if icount:
        args += ["-icount", "shift=auto,sleep=off"]
    t0 = time.monotonic()
    subprocess.run(qemu.command(args), cwd=work, env=dict(os.environ, **qemu.env),
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300, check=True)
    took = time.monotonic() - t0
    assert "kph: script exit 0" in (work / "plain-console.log").read_text()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="rounds (default 5)")
    args = ap.parse_args()
    qemu = find_qemu()
    img = default_image()
    times: dict[str, list[float]] = {k: [] for k in ("plain", "icount", "record", "replay")}
    sizes = []
    with tempfile.TemporaryDirectory(prefix="kph-bench-rr-") as tmp:
        work = Path(tmp) / "plain"
        work.mkdir()
        rr.script_initrd(img.initrd, SCRIPT, work / rr.INITRD)
        os.symlink(img.kernel, work / rr.KERNEL)
        for i in range(args.n):
            times["plain"].append(plain(qemu, work, icount=False))
            times["icount"].append(plain(qemu, work, icount=True))
            rec = rr.record(SCRIPT, Path(tmp) / f"rec{i}", image=img, qemu=qemu)
            assert rec.end is rr.End.EXIT and rec.exit_code == 0
            times["record"].append(rec.seconds)
            rep = rr.replay(rec.out_dir, qemu=qemu)
            assert rep.matches, "replay diverged"
            times["replay"].append(rep.seconds)
            sizes.append((rec.out_dir / rr.LOG).stat().st_size)
            print(f"round {i + 1}: " + "  ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"QEMU {qemu.version_str}, {args.n} rounds, medians:")
    for k, v in med.items():
        print(f"  {k:7s} {v:6.2f} s   {v / med['plain']:.2f}x plain")
    print(f"  log     {statistics.median(sizes) / 1024:.0f} KiB (replay.bin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
