"""``kph hunt``: on one image, the kernel's own selftest cases, the generic scenarios,
kprobes with post_handlers on the instructions the workload runs, and the fuzzer, told
nothing about where a bug is; each finding once (harness.apps.hunt)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import SetupError
from . import ci
from .common import ci_group, examples, sub
from .output import Output

NAME = "hunt"
EXAMPLES = ["kph hunt --minutes 0.2 --max-cases 1"]


def add_parser(subparsers: Any) -> None:
    hp = sub(subparsers, NAME, help="Hunt for bugs on one kernel, told nothing about where: its "
             "own selftests, the scenarios, raw kprobes, its instructions, writers at once and "
             "the fuzzer, host against guest",
             description="Run what kph has against one image within a time budget: the "
             "kernel's own ftrace selftest cases (differentially), the generic scenarios "
             "(probes/scenarios/*.toml), kprobes registered as a module registers them at "
             "the entry of text symbols drawn from all of vmlinux's (register_kprobe()'s "
             "refusals and errnos), kprobes with post_handlers on the instructions of "
             "the functions the workload calls (where the kernel's emulation or single-step "
             "sent each, against where it goes), refused lines from four writers at once on "
             "two CPUs (error_log), then the fuzzer over every probe kind the "
             "series has, until the budget ends; the kernel-side oracles (splats, hangs, stale "
             "events) in every run. A comparison that does not repeat when run again is "
             "listed, not counted. Each finding is printed once (by kind, probe kind and "
             "field or verdict), at its fewest lines, with the command that shows it "
             "again. Findings docs/upstream.md reports for Debian's kernels are listed as "
             "known and not counted. Exit 0 with nothing new, 1 a divergence, 5 a kernel "
             "splat, 6 a hang, 2 on bad input. Progress on stderr.",
             epilog=examples(EXAMPLES))
    hp.add_argument("--image", metavar="SERIES|ABI|DIR|tree:...",
                    help="the kernel (default: the default image)")
    hp.add_argument("--minutes", type=float, default=10.0, metavar="N",
                    help="the budget, split across the phases (default 10)")
    hp.add_argument("--seed", type=int, default=0, metavar="S", help="the fuzzer's seed (default 0)")
    hp.add_argument("--max-cases", type=int, metavar="N",
                    help="at most N cases per phase (selftest cases, scenarios, runs of raw "
                    "kprobes, functions, runs of writers, fuzz examples)")
    hp.add_argument("--stop-at-first", action="store_true",
                    help="end the hunt at its first new finding (one docs/upstream.md does "
                    "not list), e.g. to ask a built kernel 'is anything wrong?' quickly; the "
                    "phases after it are not run")
    hp.add_argument("--out", metavar="DIR", help="where the scenarios' bundles go "
                    "(default kph-runs/hunt-TIME)")
    ci_group(hp)


@ci.reported(NAME)
def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import hunt
    from ..machine.image.store import default_image

    if not args.minutes > 0:
        raise SetupError(f"--minutes {args.minutes:g}: a budget of 0 or less runs nothing",
                         "give --minutes more than 0, e.g. --minutes 10")
    if args.max_cases is not None and args.max_cases < 1:
        raise SetupError(f"--max-cases {args.max_cases}: nothing to run", "give 1 or more")
    img = default_image(args.image)              # an unknown image: one line, exit 2
    hunt.check_image(img)
    h = hunt.Hunt(img, minutes=args.minutes, seed=args.seed, image_arg=args.image,
                  max_cases=args.max_cases, progress=out.progress,
                  out_dir=Path(args.out) if args.out else None,
                  stop_at_first=args.stop_at_first)
    res = h.run()
    out.progress.clear()
    for ln in hunt.report_lines(res):
        out.text(ln)
    out.result(res.as_dict())
    ci.emit(args, hunt.ktap_cases(res), verb=NAME, kernel=res.kernel)
    return res.findings.status
