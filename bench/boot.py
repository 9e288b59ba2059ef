#!/usr/bin/env python3
"""Boot-to-agent-ready against the bare kernel-to-userspace time of the same kernel, and
the start from the image's ready snapshot against both.

Bare: the image's kernel with a one-file initramfs whose init powers off at once (QEMU
start to QEMU exit). Cold: ``Machine.boot(fresh=False)`` of the default image (QEMU start
to the guest agent answering, plus one command). Snapshot: ``Machine.boot()`` restoring
the image's ready snapshot (QEMU start, restore, resync of clock and random seed, plus
one command). All three in this run, on this machine, interleaved, N times each, medians.
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

from harness.constants import MACHINE  # noqa: E402
from harness.machine.image.store import HOST_BUSYBOX, pack_cpio, default_image  # noqa: E402
from harness.machine.qemu import find_qemu  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def bare_initrd(dst: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "bin").mkdir()
        (root / "bin/busybox").write_bytes(Path(HOST_BUSYBOX).read_bytes())
        os.chmod(root / "bin/busybox", 0o755)
        (root / "init").write_text("#!/bin/busybox sh\n/bin/busybox poweroff -f\n")
        os.chmod(root / "init", 0o755)
        pack_cpio(root, dst)


def bare_boot(qemu, kernel: Path, initrd: Path) -> float:
    m = Machine(kernel=kernel, initrd=initrd, append="console=ttyS0 nokaslr quiet panic=-1",
                qemu=qemu)
    argv = qemu.command(["-nodefaults", "-no-user-config", "-display", "none",
                         "-machine", MACHINE, "-m", "512M", "-accel", "tcg", "-no-reboot", "-kernel", str(kernel),
                         "-initrd", str(initrd), "-append", m.append])
    t0 = time.monotonic()
    subprocess.run(argv, env=dict(os.environ, **qemu.env), stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
    return time.monotonic() - t0


def ready_boot(qemu, fresh: bool) -> float:
    t0 = time.monotonic()
    with Machine.boot(qemu=qemu, fresh=fresh) as vm:
        vm.run("true")
        if vm.start_mode != ("snapshot" if fresh else "cold"):
            sys.exit(f"expected a {'snapshot' if fresh else 'cold'} start: {vm.cold_reason}")
        return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="boots of each kind (default 5)")
    ap.add_argument("--qemu", help="QEMU binary (default: the one the harness chooses)")
    args = ap.parse_args()
    qemu = find_qemu(args.qemu)
    img = default_image()
    with tempfile.TemporaryDirectory() as d:
        initrd = Path(d) / "bare.img"
        bare_initrd(initrd)
        ready_boot(qemu, True)  # builds the snapshot if there is none yet; not counted
        bare, ready, snap = [], [], []
        for _ in range(args.n):  # interleaved so drift hits all alike
            bare.append(bare_boot(qemu, img.kernel, initrd))
            ready.append(ready_boot(qemu, False))
            snap.append(ready_boot(qemu, True))
    b, r, s = (statistics.median(x) for x in (bare, ready, snap))
    print(f"kernel {img.version}, QEMU {qemu.version_str} ({qemu.source}), n={args.n}")
    print(f"{'bare boot (start -> poweroff)':44s} {b:6.2f} s")
    print(f"{'cold (start -> agent answers + 1 cmd)':44s} {r:6.2f} s")
    print(f"{'snapshot (start -> restored, resynced + 1 cmd)':44s} {s:6.2f} s"
          f"   (min {min(snap):.2f}, max {max(snap):.2f})")
    print(f"ratio cold/bare: {r / b:.2f}x   snapshot/cold: {s / r:.2f}x   snapshot/bare: {s / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
