#!/usr/bin/env python3
"""A kernel built from source, on this machine, in one run: the cold build of the minimal
config (``kph kernel build``: tinyconfig + images/kernel.config) from a fresh unpack of
Debian's linux-source, the incremental rebuild after a one-file change, and the cold boot
of that kernel to the guest agent beside the default image's cold boot, then the boot from
the ready snapshot of the tree's image (``kph image build --tree``) beside the one of
Debian's binary kernel of the same series (interleaved, N times each, medians; ratios
printed).

Run: ``python3 bench/kernel_build.py [--series 6.12] [-n 3] [--boots-only]``
(``--boots-only``: the snapshot boots alone, of ``tree:SERIES``'s image, built if missing).

``--variants A.patch,B.patch``: patched variants of the series' tree one after the other
(``kph image build --tree SERIES --patch ...``, the variant tree of issue 37): A, then B,
then A again, each timed from the command to the image with its ready snapshot; the first
may be cold (the variant tree's first build), the next two are what a corpus costs per
entry. Target: <= 1 min for a one-file patch. It needs the source in the
cache (``kph kernel fetch``; a fresh unpack of it is made in a scratch directory, as the
build writes nothing into the tree but the change this script makes) and about 3 GB free.

``--ccache``: the series' tree built cold in two places (hard-link copies at two paths,
each built in its own ``TREE/.kph-build``) with one empty ccache: the first fills it, the
second is what a second tree of the same sources costs (a bisect's first commit, a
variant tree, another checkout), with ccache's hit count.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.machine.image import kbuild, ksource  # noqa: E402
from harness.machine.image.build import image_for  # noqa: E402
from harness.vmctl import Machine  # noqa: E402


def cold_boot(**kw) -> float:
    t0 = time.monotonic()
    with Machine.boot(fresh=False, **kw) as vm:
        vm.run("true", check=True)
    return time.monotonic() - t0


def snapshot_boot(img) -> float:
    t0 = time.monotonic()
    with Machine.boot(img) as vm:
        assert vm.start_mode == "snapshot", vm.start_mode
        vm.run("true", check=True)
    return time.monotonic() - t0


def snapshot_boots(series: str, n: int) -> None:
    tree = image_for(f"tree:{series}", progress=print)
    debian = image_for(series, progress=print)
    own, deb = [], []
    for _ in range(n):
        own.append(snapshot_boot(tree))
        deb.append(snapshot_boot(debian))
    o, b = statistics.median(own), statistics.median(deb)
    print(f"snapshot boot to the agent, {tree.dir.name}: {o:6.2f} s  (median of {n})")
    print(f"snapshot boot to the agent, {debian.version}: {b:6.2f} s  (median of {n})")
    print(f"tree / Debian snapshot boot: {o / b:6.2f}")


def variants(series: str, patches: list[Path]) -> None:
    from harness.machine.image.build import build_tree_image

    steps = [*patches, patches[0]] if len(patches) > 1 else patches
    times = []
    for p in steps:
        t0 = time.monotonic()
        img = build_tree_image(series, patches=[p], progress=lambda s: None)
        times.append(time.monotonic() - t0)
        print(f"variant {p.name}: {times[-1]:7.1f} s to its image ({img.dir.name})", flush=True)
    if len(times) > 1:
        print(f"after the first: {statistics.median(times[1:]):.1f} s per variant "
              f"(median of {len(times) - 1}); first {times[0]:.1f} s")


def ccache_pair(series: str) -> None:
    import os

    src = ksource.fetch_source(series, progress=print)
    with tempfile.TemporaryDirectory(prefix="kph-ccache-bench-") as d:
        env = os.environ.copy()
        os.environ["CCACHE_DIR"] = str(Path(d) / "ccache")
        try:
            times = []
            for name in ("first", "second"):
                tree = Path(d) / name / "linux"
                tree.parent.mkdir()
                ksource.link_copy(src, tree)
                t0 = time.monotonic()
                kbuild.build(tree)
                times.append(time.monotonic() - t0)
                stats = subprocess.run(["ccache", "-s"], capture_output=True, text=True,
                                       env=os.environ).stdout
                hits = next((ln.strip() for ln in stats.splitlines()
                             if ln.strip().startswith("Hits:")), "?")
                print(f"{name} tree, cold build dir: {times[-1]:7.1f} s  (ccache {hits})",
                      flush=True)
                subprocess.run(["ccache", "-z"], capture_output=True, env=os.environ)
        finally:
            os.environ.clear()
            os.environ.update(env)
    print(f"second / first: {times[1] / times[0]:.2f} ({time.strftime('%Y-%m-%d')}, "
          f"{os.cpu_count()} CPUs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", default="6.12")
    ap.add_argument("-n", type=int, default=3, help="boots of each kind")
    ap.add_argument("--boots-only", action="store_true",
                    help="measure the snapshot boots only (no build)")
    ap.add_argument("--variants", metavar="A.patch,B.patch",
                    help="time patched variants A, B, A of the series' tree (no other step)")
    ap.add_argument("--ccache", action="store_true",
                    help="a cold build of the tree in two places with one ccache")
    args = ap.parse_args()
    if args.ccache:
        ccache_pair(args.series)
        return
    if args.variants:
        variants(args.series, [Path(p) for p in args.variants.split(",")])
        return
    if args.boots_only:
        snapshot_boots(args.series, args.n)
        return
    src = ksource.fetch_source(args.series, progress=print)
    with tempfile.TemporaryDirectory(prefix="kph-kbuild-bench-") as d:
        tree, out = Path(d) / "tree", Path(d) / "out"
        t0 = time.monotonic()
        tree.mkdir()
        subprocess.run(["cp", "-a", "--reflink=auto",
                        *[str(e) for e in src.iterdir() if e.name != ksource.BUILD_SUBDIR],
                        str(tree)], check=True)
        copy_s = time.monotonic() - t0
        t0 = time.monotonic()
        kb = kbuild.build(tree, out)
        cold_s = time.monotonic() - t0
        f = tree / "kernel/trace/trace_probe.c"
        f.write_text(f.read_text() + "\n/* kph bench: a one-file change */\n")
        t0 = time.monotonic()
        kbuild.build(tree, out)
        incr_s = time.monotonic() - t0
        own, debian = [], []
        for _ in range(args.n):
            own.append(cold_boot(kernel=kb.out))
            debian.append(cold_boot())
        shutil.rmtree(tree, ignore_errors=True)
    o, b = statistics.median(own), statistics.median(debian)
    print(f"kernel {kb.version}, {kbuild.os.cpu_count()} CPUs, date {time.strftime('%Y-%m-%d')}")
    print(f"copy of the unpacked tree:         {copy_s:7.1f} s")
    print(f"cold build (tinyconfig + fragment): {cold_s:7.1f} s")
    print(f"incremental, one file changed:      {incr_s:7.1f} s  ({incr_s / cold_s:.3f} of cold)")
    print(f"cold boot to the agent, own kernel: {o:7.2f} s  (median of {args.n})")
    print(f"cold boot to the agent, Debian's:   {b:7.2f} s  (median of {args.n})")
    print(f"own / Debian boot:                  {o / b:7.2f}")
    snapshot_boots(args.series, args.n)


if __name__ == "__main__":
    main()
