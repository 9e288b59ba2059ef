"""``kph bisect``: the first commit of a kernel tree's history on which a scenario is MET,
printed as a ``Fixes:`` line (``harness.apps.bisect``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import examples, sub
from .output import EXIT_OK, Output

NAME = "bisect"
EXAMPLES = ["kph bisect probes/scenarios/upstream/btf-char-ptr.toml --tree ~/linux "
            "--good v6.5 --bad v6.6  # not run: needs a kernel git checkout"]


def add_parser(subparsers: Any) -> None:
    b = sub(subparsers, NAME, help="Find the commit that made a scenario MET: git bisect "
            "run over a kernel tree, each step an incremental build and one boot",
            description="Search the history of a kernel git checkout between a good and a "
            "bad revision for the first commit on which a kph repro scenario is MET (the "
            "bug shows). Each step builds the checked-out commit into the tree's one build "
            "directory (incremental; the first build takes minutes), makes its image, boots "
            "it once and runs the scenario: MET is bad, NOT MET is good, a commit that does "
            "not build is skipped. The two ends are run first: --bad must be MET and --good "
            "NOT MET. The tree is left at the commit it had. Prints every step and the first "
            "bad commit as a Fixes: line. Exit 0 when a commit is named, 2 on bad input or "
            "an end that is not what it is said to be, 3 when a VM was lost.",
            epilog=examples(EXAMPLES))
    b.add_argument("scenario", metavar="SCENARIO", help="a kph repro scenario (.toml): MET "
                   "means the bug shows")
    b.add_argument("--tree", required=True, metavar="GIT",
                   help="a kernel git checkout, clean (Debian's linux-source has no history)")
    b.add_argument("--good", required=True, metavar="REV", help="a revision without the bug")
    b.add_argument("--bad", required=True, metavar="REV", help="a later revision with it")
    b.add_argument("--out", metavar="DIR", help="where the steps' log and repro bundles go "
                   "(default kph-runs/bisect-SCENARIO-TIME)")
    b.add_argument("--no-check-ends", action="store_true",
                   help="trust --good and --bad without running them (two builds fewer)")
    b.add_argument("--qemu", metavar="PATH", help="the QEMU binary (default: the private one)")


def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import bisect

    res = bisect.run(args.scenario, args.tree, args.good, args.bad,
                     out=Path(args.out) if args.out else None,
                     check_ends=not args.no_check_ends, qemu=args.qemu, progress=out.progress)
    out.progress.clear()
    for st in res.steps:
        out.text(st.line())
    out.text(f"first bad commit: {res.first_bad}")
    out.text(res.fixes_line)
    out.text(f"log: {res.out}/steps.jsonl, {res.out}/bisect.log")
    out.result({"first_bad": res.first_bad, "subject": res.subject, "fixes": res.fixes_line,
                "steps": [vars(s) for s in res.steps], "out": str(res.out)})
    return EXIT_OK
