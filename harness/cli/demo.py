"""``kph demo trap-flow``: a real in-guest kprobe fires while the host watches every step."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from ..errors import SetupError
from .common import examples, sub
from .output import EXIT_OK, Output, check_output

NAME = "demo"
EXAMPLES = ["kph demo trap-flow --variants int3",
            "kph demo trap-flow --variants int3,kretprobe --html flow.html"]


def add_parser(subparsers: Any) -> None:
    dm = sub(subparsers, NAME, help="Walk through a real kprobe trap, step by step",
             epilog=examples(EXAMPLES))
    dsub = dm.add_subparsers(dest="demo_cmd", metavar="DEMO")
    tf = sub(dsub, "trap-flow", help="A real in-guest kprobe fires; the host watches every step",
             description="Load an int3-based kprobe with pre and post handlers in the "
             "guest (the harness's module) and watch, with silent host breakpoints, "
             "the int3, the exception entry, kprobes core, the handlers, the "
             "out-of-line slot and the return; then the same probe ftrace-based, "
             "jump-optimized, and a kretprobe. The guest is left as it was.",
             epilog=examples(EXAMPLES))
    tf.add_argument("--symbol", default="do_sys_openat2+5", metavar="SYM[+OFF]",
                    help="where the int3 probe goes, not a function entry (default "
                         "do_sys_openat2+5); the ftrace and kretprobe variants use SYM")
    tf.add_argument("--run", default="cat /proc/version", metavar="CMD",
                    help="the guest command that makes it fire (default: cat /proc/version)")
    tf.add_argument("--variants", default="int3,ftrace,optimized,kretprobe",
                    help="comma-separated subset of int3,ftrace,optimized,kretprobe,uprobe,"
                         "uretprobe (the last two: a uprobe_events probe on kph_add in "
                         "/usr/bin/kph-loop, the XOL slot, the uretprobe trampoline)")
    tf.add_argument("--html", metavar="FILE", help="write a self-contained page with a "
                    "sequence diagram and the step table")
    tf.add_argument("--image", metavar="SERIES|ABI|DIR|tree:TREE",
                    help="the kernel to show it on (default: the default image): a series, an "
                    "image directory, or tree:TREE[+PATCH...] (a kernel tree's image)")
    tf.add_argument("--step", action="store_true", help="wait for Enter after each step "
                    "(on a terminal; with stdin not a terminal, the steps are not paused)")


def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import trapflow
    from ..vmctl import Machine

    if args.demo_cmd != "trap-flow":
        raise SetupError("kph demo needs a demo name", "try `kph demo trap-flow`")
    check_output("--html", args.html)
    check_output("-o", out.json_file)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for v in variants:
        if v not in ("int3", "ftrace", "optimized", "kretprobe", "uprobe", "uretprobe"):
            raise SetupError(f"unknown variant {v!r}",
                             "use int3, ftrace, optimized, kretprobe, uprobe, uretprobe")
    if "+" not in args.symbol or args.symbol.endswith("+0"):
        raise SetupError(f"--symbol {args.symbol} is a function entry (ftrace-based there)",
                         "give an offset into the function, e.g. do_sys_openat2+5")
    out.progress(f"demo: booting {'the default image' if args.image is None else args.image}")
    with Machine.boot(args.image) as vm:
        flows = []
        for v in variants:
            out.progress(f"demo: {v}: placing the in-guest probe and the host observers")
            flows += trapflow.demo(vm, target=args.symbol, workload=args.run, variants=(v,))
        left = vm.run("cat /sys/kernel/debug/kprobes/list; lsmod | grep -c kph_kprobes || true").stdout
    out.progress.clear()
    pause = args.step and not out.quiet
    for f in flows:
        blocks = trapflow.trapflow_blocks(f)
        for i, block in enumerate(blocks):
            out.text(block)
            if pause and 1 <= i <= len(f.steps):     # after each step, not header or facts
                pause = wait_enter()
    if left.strip() not in ("", "0"):
        out.warn(f"the guest still lists probes: {left.strip()}")
    out.result({"flows": [dataclasses.asdict(f) for f in flows],
                "guest_left_clean": left.strip() in ("", "0")})
    if args.html:
        with open(args.html, "w") as f:
            f.write(trapflow.trapflow_html(flows))
        out.text(f"demo: wrote {args.html}")
    return EXIT_OK


def wait_enter() -> bool:
    """Wait for Enter after a step; False (stop pausing) when stdin is not a terminal or
    has ended, so ``--step`` in a script or a pipe never blocks nor crashes."""
    if not sys.stdin or not sys.stdin.isatty():
        print("  (--step: stdin is not a terminal; not pausing)", file=sys.stderr)
        return False
    sys.stderr.write("  [Enter] ")
    sys.stderr.flush()
    return bool(sys.stdin.readline())     # "" at the end of input: stop pausing
