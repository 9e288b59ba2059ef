"""``kph kernel``: kernels built from source (``harness.machine.image.kbuild``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import SetupError
from .common import examples, sub
from .output import EXIT_OK, Output

NAME = "kernel"
EXAMPLES = ["kph kernel fetch 6.12",
            "kph kernel build 6.12 --out kbuild-6.12  # not run: both CPUs for minutes; "
            "tests/vm/test_kbuild.py builds it",
            "kph boot --kernel kbuild-6.12 --run 'uname -r'  # not run: boots that build"]


def add_parser(subparsers: Any) -> None:
    k = sub(subparsers, NAME, help="Fetch and build kernels from source (your own tree, a "
            "stable tree, Debian's linux-source)", epilog=examples(EXAMPLES))
    ksub = k.add_subparsers(dest="kernel_cmd", metavar="ACTION")
    f = sub(ksub, "fetch", help="Unpack Debian's linux-source-SERIES into the cache "
            "(the source of Debian's own kernels of that series)", epilog=examples(EXAMPLES[:1]))
    f.add_argument("series", metavar="SERIES", help="a kernel series Debian has sources of: "
                   "6.12, 7.3, ...")
    b = sub(ksub, "build", help="Configure a tree small (tinyconfig + images/kernel.config) and "
            "build it out of tree: bzImage, vmlinux (symbols, BTF) and modules",
            epilog=examples(EXAMPLES[1:]))
    b.add_argument("src", metavar="SRC", help="the top of a kernel source tree (a git "
                   "checkout, a stable tree), or a series (6.12): Debian's source of it, "
                   "fetched first when it is not in the cache")
    b.add_argument("--out", "-O", metavar="DIR", help="the build directory (default: "
                   "$KPH_CACHE/kbuild/<tree>-<hash>); an existing one is built incrementally")
    b.add_argument("-j", "--jobs", type=int, metavar="N", help="parallel jobs (default: the "
                   "host's CPUs)")
    b.add_argument("--debug", action="store_true", help="add the debug options that make a "
                   "probe bug loud (images/kernel-debug.config: lockdep with PROVE_RCU, "
                   "DEBUG_ATOMIC_SLEEP, KASAN), in a build directory of its own "
                   "(SRC/.kph-build-debug); their reports are the kernel watch's findings "
                   "(docs/kernel.md)")


def run(args: argparse.Namespace, out: Output) -> int:
    from ..machine.image import kbuild, ksource

    if args.kernel_cmd == "fetch":
        tree = ksource.fetch_source(args.series, progress=out.progress)
        out.progress.clear()
        out.result({"series": args.series, "tree": str(tree),
                    "version": kbuild.tree_version(tree)})
        out.text(f"{tree}\nnext: kph kernel build {tree}")
        return EXIT_OK
    if args.kernel_cmd == "build":
        if args.jobs is not None and args.jobs < 1:
            raise SetupError(f"-j {args.jobs}: the jobs must be 1 or more", "pass -j 2")
        src = args.src
        if ksource.is_series(src):
            src = ksource.fetch_source(src, progress=out.progress)
        kb = kbuild.build(Path(src), args.out if args.out is not None else
                          kbuild.default_out(kbuild.check_tree(Path(src)), args.debug),
                          jobs=args.jobs, progress=out.progress,
                          fragment=kbuild.fragment_for(args.debug))
        out.progress.clear()
        out.result({"version": kb.version, "src": str(kb.src), "out": str(kb.out),
                    "bzImage": str(kb.bzimage), "vmlinux": str(kb.vmlinux),
                    "config_sha256": kb.config_sha256})
        out.text(f"{kb.out}\nnext: kph boot --kernel {kb.out} --run 'uname -r'")
        return EXIT_OK
    raise SetupError("kph kernel needs an action",
                     "try `kph kernel fetch 6.12` or `kph kernel build SRC`")
