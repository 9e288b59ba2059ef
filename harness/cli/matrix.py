"""``kph matrix``: run a probe set on several kernels; show where they differ."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import NotMirroredError, ProbeSpecError, SetupError
from . import ci
from .common import ci_group, examples, spec_args, spec_file_lines, sub, workload_ran
from .common import kernel_report, kernel_verdict
from .output import EXIT_DIVERGED, EXIT_HANG, EXIT_KERNEL, EXIT_OK, Output, check_writable

NAME = "matrix"
EXAMPLES = ["kph matrix -f probes/examples/matrix.spec --run 'sh -c \"true & wait\"' "
            "--kernels 6.1,6.12,7.3"]


def add_parser(subparsers: Any) -> None:
    mx = sub(subparsers, NAME, help="Run a probe set on several kernels; show where they differ",
             description="For each kernel (--kernels), boot its image (built first "
             "if missing), place the specs host-side and in the guest on one "
             "execution of --run and compare them (as kph diff); then compare the "
             "kernels' guests with each other: registration, probe mode, event "
             "counts and the printed fields. Exit 0 when host and guest agree on "
             "every kernel, 1 otherwise, 2 on usage or setup errors (a workload that "
             "did not run: exit 126 or 127 from its shell), 5 a kernel splat during a "
             "kernel's run (a panic too), 6 a kernel's guest hung.",
             epilog=examples(EXAMPLES))
    spec_args(mx)
    mx.add_argument("--kernels", default="6.1,6.12,7.3", metavar="K,K,...",
                    help="kernel series or ABIs, image directories, or kernel trees "
                    "(tree:TREE[+PATCH...], built first: kph image build --tree), "
                    "comma-separated (default 6.1,6.12,7.3)")
    mx.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    mx.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    mx.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")
    ci_group(mx)


@ci.reported(NAME)
def run(args: argparse.Namespace, out: Output) -> int:
    from ..diff import ktap, report
    from ..diff.runner import run_matrix

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels:
        raise SetupError("--kernels names no kernel", "e.g. --kernels 6.1,6.12,7.3")
    for path in (out.json_file, args.html):
        check_writable(path)
    lines = list(args.specs)
    if args.spec_file:
        lines += spec_file_lines(args.spec_file)
    if not lines:
        raise SetupError("no probe spec given", "pass SPEC arguments or -f FILE")
    check_kernels(kernels)
    specs = matrix_specs(kernels, lines)
    findings: dict[str, tuple[Any, ...]] = {}
    res = run_matrix(kernels, specs, args.run, guest=args.guest, timeout=args.timeout,
                     qemu=args.qemu, progress=out.progress,
                     check_run=lambda r: workload_ran(r, args.run), findings=findings)
    out.progress.clear()
    out.text(report.matrix_text(res))
    for name, splats in findings.items():
        if splats:
            out.text(f"{name}:")
            kernel_report(splats, out)
    out.result(lambda: dict(json.loads(report.matrix_json(res)),
                            kernel={n: report.findings_json(s) for n, s in findings.items()}))
    cases, between = ktap.matrix_cases(res)
    ci.emit(args, cases, verb=NAME, diagnostics=between)
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.matrix_html(res))
        out.text(f"wrote {args.html}")
    worst = kernel_verdict([s for ss in findings.values() for s in ss])
    if worst is not None:
        return EXIT_HANG if worst == "HANG" else EXIT_KERNEL
    return EXIT_OK if res.all_equivalent else EXIT_DIVERGED


def check_kernels(kernels: list[str]) -> None:
    """Every kernel named has an image or exists in the archives, before any machine boots
    (``kph matrix --kernels 6.1,9.9`` once ran 6.1 first and only then said 9.9 does not
    exist). :raise SetupError: the first one that does not, listing what is available."""
    from ..machine.image.store import default_image
    from ..machine.image.kernels import resolve

    for k in kernels:
        if k.startswith("tree:"):
            from ..machine.image.build import parse_tree_selector
            from ..machine.image.ksource import check_patches
            check_patches(parse_tree_selector(k)[1])      # type: ignore[index]
            continue
        try:
            default_image(k)
        except SetupError:
            resolve(k)


def matrix_specs(kernels: list[str], lines: list[str]) -> list[Any]:
    """Each line parsed with the grammar of every kernel named (its series' rules, no BTF
    yet): a line no kernel parses is a usage error, one some kernel parses goes on (each
    kernel's own parse at registration refuses it where it must, a per-kernel result)."""
    from ..kernel.rules import rules_for
    from ..kernel.grammar import KernelView, parse

    sels = [k.removeprefix("tree:").split("+")[0] for k in kernels]
    views = [KernelView(rules_for(k if k[:1].isdigit() else None)) for k in sels]
    out = []
    for ln in lines:
        first: ProbeSpecError | None = None
        for v in views:
            try:
                out.append(parse(ln, kernel=v))
                break
            except NotMirroredError:
                raise
            except ProbeSpecError as exc:
                first = first or exc
        else:
            assert first is not None
            raise first
    return out
