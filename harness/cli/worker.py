"""``kph worker``: prepare a host over SSH as a pytest-xdist worker, or show this
checkout's identity (what prepare compares)."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import SetupError
from .common import examples, sub
from .output import EXIT_OK, Output

NAME = "worker"
EXAMPLES = ["kph worker identity --kernels default --json",
            "kph worker prepare root@build2 --dir /srv/kph --kernels 6.12,7.3  "
            "# not run: needs a second machine reachable over SSH"]


def add_parser(subparsers: Any) -> None:
    wk = sub(subparsers, NAME, help="Prepare a host over SSH as a pytest-xdist worker",
             description="Scale the differential suite out to other machines "
             "with pytest-xdist's SSH gateways (docs/remote.md).",
             epilog=examples(EXAMPLES))
    wsub = wk.add_subparsers(dest="worker_cmd", metavar="ACTION")
    wp = sub(wsub, "prepare", help="Send this commit to HOST, run setup.sh there, build "
             "the images, check it is identical, show the --tx spec",
             epilog=examples(EXAMPLES, "then: pytest -d --tx <the --tx spec> --tx popen "
                                       "--dist loadgroup"))
    wp.add_argument("target", metavar="[USER@]HOST", help="an ssh target (or a Host of --ssh-config)")
    wp.add_argument("--dir", required=True, metavar="PATH", help="the worker's checkout on HOST")
    wp.add_argument("--commit", default="HEAD", metavar="REV", help="what to check out (default HEAD)")
    wp.add_argument("--kernels", default="", metavar="K,K,...",
                    help="images to build there besides the default (e.g. 6.12,7.3)")
    wp.add_argument("--cache", metavar="DIR", help="KPH_CACHE on HOST (default: its own default)")
    wp.add_argument("--ssh-config", metavar="FILE", help="an ssh_config for the connection")
    wi = sub(wsub, "identity", help="Show this checkout's identity (commit, QEMU, images, "
             "cores): what prepare compares", epilog=examples(EXAMPLES))
    wi.add_argument("--kernels", default="", metavar="K,K,...", help="only these images")


def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import remote

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if args.worker_cmd == "identity":
        ident = remote.local_identity(kernels or None)
        out.result(ident)
        out.text(f"{ident['host']}: commit {ident['commit'][:12]}"
                 f"{' (dirty)' if ident['dirty'] else ''}, QEMU {ident['qemu']}, "
                 f"{ident['cores']} cores")
        for series, i in ident["images"].items():
            out.text(f"  {series:6s} {i['abi']} ({'current' if i['current'] else 'stale'})")
        return EXIT_OK
    if args.worker_cmd == "prepare":
        info = remote.prepare(args.target, directory=args.dir, commit=args.commit,
                              kernels=kernels, cache=args.cache, ssh_config=args.ssh_config,
                              progress=out.progress)
        out.progress.clear()
        out.result(info)
        out.text(f"--tx {info['tx']}")
        return EXIT_OK
    raise SetupError("kph worker needs an action", "try `kph worker prepare HOST --dir PATH`")
