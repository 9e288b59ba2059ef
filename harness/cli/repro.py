"""``kph repro``: run a scenario file, decide whether its expectation is met and keep the
evidence; ``--record`` / ``--replay`` under QEMU record/replay."""
from __future__ import annotations

import argparse
import re
import signal
from pathlib import Path
from typing import Any

from ..errors import SetupError
from . import ci
from .common import ci_group, examples, sub
from .common import kernel_report
from .output import EXIT_DIVERGED, EXIT_OK, Output, check_output

NAME = "repro"
EXAMPLES = ["kph repro probes/scenarios/blacklisted.toml",
            "kph repro probes/scenarios/blacklisted.toml --out bundle --json",
            "kph repro probes/scenarios/upstream/btf-char-ptr.toml --kernels stock,source,patched"
            "  # not run: builds two kernels first (docs/upstream.md)",
            "kph repro probes/scenarios/upstream/btf-char-ptr.toml --kernels stock,source,patched"
            " --series 7.3  # not run: the same on 7.3, with 7.3's fix"]


def add_parser(subparsers: Any) -> None:
    rp = sub(subparsers, NAME, help="Reproduce a probe bug and keep the evidence",
             description="Run a scenario file (probes/scenarios/*.toml), decide "
             "whether its expectation is met and write an evidence bundle (--out DIR, "
             "default kph-runs/repro-NAME-TIME/). Exit 0 met, 1 not met, 2 for a bad "
             "scenario (the key at fault is named).", epilog=examples(EXAMPLES))
    rp.add_argument("scenario", metavar="SCENARIO.toml", nargs="?",
                    help="the scenario (optional with --replay: the bundle holds its own)")
    rp.add_argument("--out", metavar="DIR", help="bundle directory (default "
                    "kph-runs/repro-NAME-TIME)")
    rp.add_argument("--record", action="store_true",
                    help="run under QEMU record/replay (-icount rr=record, one vCPU, in-guest "
                    "probes only); the bundle then holds the replay log")
    rp.add_argument("--replay", metavar="DIR", help="replay a --record bundle to its end and "
                    "check the console and the final registers are identical")
    rp.add_argument("--gdb", action="store_true",
                    help="with --replay: stay stopped at the end with the gdbstub open for "
                    "reverse-stepi / reverse-continue; Ctrl-C ends QEMU")
    rp.add_argument("--kernels", metavar="K,K,...",
                    help="run the scenario on each of these kernels and show each verdict: "
                    "stock, source and patched (the scenario's [kernels]: Debian's binary "
                    "kernel, a build of Debian's source of it, that build with the fix), or "
                    "any image selector (6.12, tree:PATH+FIX.patch, an image directory), or "
                    "NAME=SELECTOR (patched=tree:6.12+OTHER.patch: another fix, expected "
                    "NOT MET). "
                    "Exit 0 when each is as expected: MET, and NOT MET for patched (the fix "
                    "works)")
    rp.add_argument("--series", metavar="SERIES",
                    help="with --kernels: stock, source and patched of this series instead of "
                    "the scenario's own (its [kernels.patches] names the fix for each other "
                    "series, e.g. 7.3)")
    rp.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")
    ci_group(rp)


@ci.reported(NAME)
def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import repro, scenario

    if args.record and args.replay:
        raise SetupError("--record and --replay together", "record first, then replay the bundle")
    if args.gdb and not args.replay:
        raise SetupError("--gdb goes with --replay DIR", "kph repro --replay DIR --gdb")
    if args.scenario is None and not args.replay:
        raise SetupError("kph repro needs a scenario file", "kph repro probes/scenarios/NAME.toml")
    check_output("-o", out.json_file)
    scn = scenario.load(args.scenario) if args.scenario else None
    if args.replay:
        return replay(scn, args, out)
    assert scn is not None
    if args.series is not None and not re.fullmatch(r"\d+\.\d+", args.series):
        raise SetupError(f"--series {args.series!r} is not a series", "e.g. --series 7.3")
    if args.series and args.kernels is None:
        raise SetupError(f"--series {args.series} without --kernels",
                         f"--kernels stock,source,patched --series {args.series}")
    if args.kernels is not None:
        if args.record:
            raise SetupError("--kernels and --record together", "record one kernel at a time")
        return run_kernels(scn, args, out)
    if args.record:
        from ..apps import repro_rr

        res = repro_rr.record_scenario(scn, out_dir=Path(args.out) if args.out else None,
                                       qemu=args.qemu, progress=out.progress)
    else:
        res = repro.run(scn, out_dir=Path(args.out) if args.out else None, qemu=args.qemu,
                        progress=out.progress)
    out.progress.clear()
    out.text(f"{'MET' if res.met else 'NOT MET'}: {scn.name}" + (" (recorded)" if args.record else ""))
    out.text(f"  cause: {res.cause}")
    for r in res.reasons:
        out.text(f"  - {r}")
    out.text(f"  evidence: {res.bundle}/summary.md")
    from ..diff.report import findings_json
    kernel_report(res.observed.splats, out,      # reported; the scenario decides the exit
                  full_text=f"{res.bundle}/kernel.txt")
    doc = {"met": res.met, "scenario": scn.name, "file": str(scn.path), "cause": res.cause,
           "reasons": list(res.reasons), "bundle": str(res.bundle),
           "summary": f"{res.bundle}/summary.md",
           "kernel": findings_json(res.observed.splats)}
    if args.record:
        out.text(f"  replay:   kph repro --replay {res.bundle}")
        doc["replay"] = f"kph repro --replay {res.bundle}"
    out.result(doc)
    from ..diff import ktap
    kernel = str(scn.machine.get("image") or scn.machine.get("kernel") or "default")
    ci.emit(args, ktap.repro_cases(scn, res, kernel=kernel), verb=NAME, kernel=kernel)
    return EXIT_OK if res.met else EXIT_DIVERGED


def run_kernels(scn: Any, args: argparse.Namespace, out: Output) -> int:
    """``kph repro SCENARIO --kernels stock,source,patched``: one verdict per kernel."""
    from ..apps import repro

    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not names:
        raise SetupError("--kernels names no kernel", "e.g. --kernels stock,patched")
    if args.series and not scn.kernels:
        raise SetupError(f"--series {args.series}: {scn.path.name} has no [kernels] table",
                         "name the kernels themselves (--kernels 7.3,tree:7.3+FIX.patch)")
    runs = repro.run_kernels(scn, names, out_dir=Path(args.out) if args.out else None,
                             qemu=args.qemu, series=args.series, progress=out.progress)
    out.progress.clear()
    out.text(scn.name)
    for r in runs:
        img = r.image
        tree = img.manifest.get("tree")
        what = img.version + (f", rules {img.manifest.get('rules')}" if tree else " (Debian)")
        if tree and tree.get("patches"):
            what += ", + " + " + ".join(p["name"] for p in tree["patches"])
        verdict = "MET" if r.result.met else "NOT MET"
        want = "MET" if r.expect_met else "NOT MET"
        out.text(f"  {r.name:8s} {verdict:8s} {'as expected' if r.as_expected else 'EXPECTED ' + want:12s}"
                 f"  {what}")
        out.text(f"           {r.result.cause}; evidence {r.result.bundle}/summary.md")
    ok = all(r.as_expected for r in runs)
    fixed = any(r.name == "patched" for r in runs) and ok
    out.text("verdict: " + ("the fix is verified: the scenario is met without the patch and "
                            "not met with it" if fixed else
                            "every kernel as expected" if ok else "NOT as expected"))
    out.result({"scenario": scn.name, "file": str(scn.path), "as_expected": ok,
                "fix_verified": fixed,
                "kernels": [{"name": r.name, "selector": r.selector, "image": str(r.image.dir),
                             "kernel": r.image.version, "rules": r.image.manifest.get("rules"),
                             "patches": [p["name"] for p in
                                         (r.image.manifest.get("tree") or {}).get("patches", [])],
                             "met": r.result.met, "expected_met": r.expect_met,
                             "cause": r.result.cause, "reasons": list(r.result.reasons),
                             "bundle": str(r.result.bundle)} for r in runs]})
    from ..diff import ktap
    ci.emit(args, ktap.repro_kernels_cases(scn, runs), verb=NAME)
    return EXIT_OK if ok else EXIT_DIVERGED


def replay(scn: Any, args: argparse.Namespace, out: Output) -> int:
    """``kph repro --replay DIR [--gdb]``: 0 when the replay is identical to the recording."""
    from ..apps.repro_rr import replay_scenario

    bundle = Path(args.replay)
    if scn is not None and (bundle / "scenario.toml").is_file() and \
            (bundle / "scenario.toml").read_text() != scn.text:
        raise SetupError(f"{bundle} recorded another scenario than {scn.path}",
                         f"run `kph repro --replay {bundle}` without the scenario")
    rep = replay_scenario(bundle, qemu=args.qemu, keep=args.gdb, progress=out.progress)
    from ..diff import ktap
    res = rep.result
    same = rep.same_console and rep.same_registers is not False
    regs = {True: "identical", False: "DIFFERENT", None: "not compared (the run did not end in a panic)"}
    end = res.end.value if res.end else "?"
    console_same = res.console == res.recorded.console
    out.progress.clear()
    out.text(f"{'REPLAYED' if same else 'DIVERGED'}: end {end} (recorded {res.recorded.end.value}) at "
             f"instruction {res.icount} (recorded {res.recorded.icount}), console "
             f"{'identical' if console_same else 'DIFFERENT'} "
             f"({len(res.console)} of {len(res.recorded.console)} chars), registers at the end "
             f"{regs[rep.same_registers]}")
    for r in rep.reasons:
        out.text(f"  - {r}")
    out.text(f"  stack at the end: {bundle}/replay-stack.txt")
    doc = {"replayed": same, "met": rep.met, "end": end, "recorded_end": res.recorded.end.value,
           "icount": res.icount, "recorded_icount": res.recorded.icount,
           "console_identical": console_same, "registers_identical": rep.same_registers,
           "reasons": list(rep.reasons), "stack": f"{bundle}/replay-stack.txt"}
    if args.gdb:
        with res:
            doc["gdb_socket"] = str(res.gdb_socket)
            out.result(doc)
            out.text(f"gdb is welcome: gdb -ex 'target remote {res.gdb_socket}' "
                     "(reverse-stepi, reverse-continue; `monitor quit` or Ctrl-C here ends QEMU)")
            old = signal.signal(signal.SIGTERM, signal.default_int_handler)
            try:
                res.wait()
            except KeyboardInterrupt:
                pass
            finally:
                signal.signal(signal.SIGTERM, old)
    else:
        out.result(doc)
    ci.emit(args, ktap.replay_cases(str(bundle), same, rep.met, list(rep.reasons)), verb=NAME)
    return EXIT_OK if same and rep.met else EXIT_DIVERGED
