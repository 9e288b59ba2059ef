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
import re
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


def jit_blocks(vm: Machine) -> int:
    """The translation blocks QEMU holds now (HMP ``info jit``: "TB count")."""
    out = vm.qmp("human-monitor-command", {"command-line": "info jit"})
    m = re.search(r"TB count\s+(\d+)", out)
    if m is None:
        sys.exit(f"no TB count in QEMU's `info jit`: {out[:200]!r}")
    return int(m.group(1))


def ready_boot(qemu, fresh: bool, phases: dict[str, list[float]] | None = None) -> float:
    t0 = time.monotonic()
    with Machine.boot(qemu=qemu, fresh=fresh) as vm:
        t1 = time.monotonic()
        vm.run("true")
        took = time.monotonic() - t0
        if vm.start_mode != ("snapshot" if fresh else "cold"):
            sys.exit(f"expected a {'snapshot' if fresh else 'cold'} start: {vm.cold_reason}")
        if phases is not None:
            for k, v in vm.boot_phases.items():
                phases.setdefault(k, []).append(v)
            phases.setdefault("1 cmd", []).append(took - (t1 - t0))
        return took


def first_exec(qemu) -> tuple[list[int], list[float]]:
    """A snapshot start with the resync's exec held back (Machine._resync replaced for
    this machine alone), then the same command twice: each exec's seconds and the
    translation blocks QEMU made for it (``info jit``), after the restore and the agent's
    first answers."""
    blocks, secs = [], []

    def measured(vm: Machine) -> None:
        blocks.append(jit_blocks(vm))
        for _ in range(2):
            t = time.monotonic()
            vm.run("true")
            secs.append(time.monotonic() - t)
            blocks.append(jit_blocks(vm))
    real = Machine._resync
    Machine._resync = measured      # type: ignore[method-assign]
    try:
        with Machine.boot(qemu=qemu) as vm:
            if vm.start_mode != "snapshot":
                sys.exit(f"expected a snapshot start: {vm.cold_reason}")
    finally:
        Machine._resync = real      # type: ignore[method-assign]
    return [b - a for a, b in zip(blocks, blocks[1:])] + [blocks[0]], secs


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
        phases: dict[str, list[float]] = {}
        blocks: list[list[int]] = []
        execs: list[list[float]] = []
        for _ in range(args.n):  # interleaved so drift hits all alike
            bare.append(bare_boot(qemu, img.kernel, initrd))
            ready.append(ready_boot(qemu, False))
            snap.append(ready_boot(qemu, True, phases))
            b, e = first_exec(qemu)
            blocks.append(b)
            execs.append(e)
    b, r, s = (statistics.median(x) for x in (bare, ready, snap))
    print(f"kernel {img.version}, QEMU {qemu.version_str} ({qemu.source}), n={args.n}")
    print(f"{'bare boot (start -> poweroff)':44s} {b:6.2f} s")
    print(f"{'cold (start -> agent answers + 1 cmd)':44s} {r:6.2f} s")
    print(f"{'snapshot (start -> restored, resynced + 1 cmd)':44s} {s:6.2f} s"
          f"   (min {min(snap):.2f}, max {max(snap):.2f})")
    print(f"ratio cold/bare: {r / b:.2f}x   snapshot/cold: {s / r:.2f}x   snapshot/bare: {s / b:.2f}x")
    print("snapshot start by phase (Machine.boot_phases), medians: " + ", ".join(
        f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in phases.items()))
    first, second, before = (statistics.median(x) for x in zip(*blocks))
    e1, e2 = (statistics.median(x) for x in zip(*execs))
    print(f"the guest's first exec after a restore (no resync before it), medians: "
          f"{e1 * 1000:.0f} ms, {first:.0f} translation blocks made; the same command again "
          f"{e2 * 1000:.0f} ms, {second:.0f} blocks (QEMU `info jit`; {before:.0f} made by "
          "the restore and the agent's first answers)")
    print("target (issue 39): snapshot start + 1 cmd <= 0.15 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
