#!/usr/bin/env python3
"""Boot-to-agent-ready against the bare kernel-to-userspace time of the same kernel.

Bare: the image's kernel with a one-file initramfs whose init powers off at once (QEMU
start to QEMU exit). Ready: ``Machine.boot()`` of the default image (QEMU start to the
guest agent answering). Both in this run, on this machine, N times each, medians.
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

from harness.images import HOST_BUSYBOX, _pack_cpio, default_image  # noqa: E402
from harness.qemu import find_qemu  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def bare_initrd(dst: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "bin").mkdir()
        (root / "bin/busybox").write_bytes(Path(HOST_BUSYBOX).read_bytes())
        os.chmod(root / "bin/busybox", 0o755)
        (root / "init").write_text("#!/bin/busybox sh\n/bin/busybox poweroff -f\n")
        os.chmod(root / "init", 0o755)
        _pack_cpio(root, dst)


def bare_boot(qemu, kernel: Path, initrd: Path) -> float:
    m = Machine(kernel=kernel, initrd=initrd, append="console=ttyS0 nokaslr quiet panic=-1",
                qemu=qemu)
    argv = qemu.command(["-nodefaults", "-no-user-config", "-display", "none", "-machine", "pc",
                         "-m", "512M", "-accel", "tcg", "-no-reboot", "-kernel", str(kernel),
                         "-initrd", str(initrd), "-append", m.append])
    t0 = time.monotonic()
    subprocess.run(argv, env=dict(os.environ, **qemu.env), stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
    return time.monotonic() - t0


def ready_boot(qemu) -> float:
    t0 = time.monotonic()
    with Machine.boot(qemu=qemu) as vm:
        vm.run("true")
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
        bare, ready = [], []
        for _ in range(args.n):  # interleaved so drift hits both alike
            bare.append(bare_boot(qemu, img.kernel, initrd))
            ready.append(ready_boot(qemu))
    b, r = statistics.median(bare), statistics.median(ready)
    print(f"kernel {img.version}, QEMU {qemu.version_str} ({qemu.source}), n={args.n}")
    print(f"{'bare boot (start -> poweroff)':40s} {b:6.2f} s")
    print(f"{'ready (start -> agent answers + 1 cmd)':40s} {r:6.2f} s")
    print(f"ratio ready/bare: {r / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
