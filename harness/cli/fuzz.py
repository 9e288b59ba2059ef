"""``kph fuzz``: draw probe definitions from the grammar, run each host against guest,
shrink every divergence to one line (harness.apps.fuzz; workers through pytest-xdist)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import SetupError
from . import ci
from .common import ci_group, examples, sub
from .output import EXIT_DIVERGED, EXIT_HANG, EXIT_KERNEL, EXIT_OK, Output

NAME = "fuzz"
EXAMPLES = ["kph fuzz --list --examples 5 --seed 7",
            "kph fuzz --examples 10 --seed 7 --out fuzz-run"]


def add_parser(subparsers: Any) -> None:
    fz = sub(subparsers, NAME, help="Generate probe definitions from the grammar; host against "
             "guest; shrink every divergence to one line",
             description="Draw kprobe_events lines (Hypothesis, seeded) from the "
             "grammar the harness mirrors and from the functions the workload calls, "
             "run each on both sides of one execution (or compare the guest's "
             "error_log with the host's parse error), and shrink each divergence to "
             "a minimal definition. Findings are written as kph diff one-liners "
             "and as regression cases (tests/data/fuzz/) the suite replays. Exit 0 "
             "with no finding, 1 with findings, 2 on bad input, 5 when a run made the "
             "kernel report a splat (a finding of kind kernel), 6 when the guest hung "
             "(kind hang) and no run made a splat.",
             epilog=examples(EXAMPLES))
    fz.add_argument("--image", metavar="SERIES|ABI|DIR", help="the kernel (default: the default image)")
    fz.add_argument("--host", choices=("gdbstub", "plugin"), default="gdbstub",
                    help="host-side engine (default gdbstub)")
    fz.add_argument("--guest", choices=("events", "module"), default="events",
                    help="in-guest side (default events)")
    fz.add_argument("--examples", type=int, default=100, metavar="N", help="examples (default 100)")
    fz.add_argument("--seed", type=int, default=0, metavar="S", help="seed (default 0)")
    fz.add_argument("--time-budget", type=float, metavar="SEC", help="stop after SEC seconds")
    fz.add_argument("-n", dest="workers", type=int, default=1, metavar="W",
                    help="workers (pytest-xdist), each with its own machine (default 1)")
    fz.add_argument("--workload", metavar="CMD", help="the guest workload (default: opens, "
                    "reads, a fork and a sleep)")
    fz.add_argument("--mix", choices=("all", "defects"), default="all",
                    help="what is drawn: all (well-formed lines run on both sides, lines "
                    "with one defect, duplicates, deletions; default) or defects only "
                    "(the parser's refusals, each judged by one write to the guest: about "
                    "ten times as many a minute)")
    fz.add_argument("--list", action="store_true", help="show the examples the seed draws; run nothing")
    fz.add_argument("--out", metavar="DIR", help="where findings go (default kph-runs/fuzz-TIME)")
    ci_group(fz)


@ci.reported(NAME)
def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps import fuzz, fuzzdraw

    if args.examples < 1:
        raise SetupError(f"--examples {args.examples}: nothing to run", "give 1 or more")
    if args.workers < 1:
        raise SetupError(f"-n {args.workers} is not a worker count", "use -n 1 or more")
    if args.time_budget is not None and args.time_budget <= 0:
        raise SetupError("--time-budget must be positive", "give seconds, e.g. --time-budget 600")
    from ..machine.image.store import default_image
    img = default_image(args.image)                        # an unknown image: one line, exit 2
    workload = args.workload or fuzz.DEFAULT_WORKLOAD
    say = out.progress
    if args.list and ci.wanted(args):
        raise SetupError("--list runs nothing: no result for --ktap or --kcidb",
                         "drop --list to run the examples")
    if args.list:
        from ..vmctl import Machine
        say(f"fuzz: booting {img.version} to list the functions the workload calls")
        with Machine.boot(img) as vm:
            pool = fuzz.drawing_pool(vm, workload, args.host)
        listed = [list(ex) for ex in fuzzdraw.list_examples(pool, examples=args.examples,
                                                         seed=args.seed * 1000,
                                                         rules=img.facts.rules,
                                                         guest=args.guest, mix=args.mix)]
        out.progress.clear()
        for ex in listed:
            out.text("  |  ".join(ex))
        out.result({"seed": args.seed, "examples": listed})
        return EXIT_OK
    runs = Path(args.out or f"kph-runs/fuzz-{time.strftime('%Y%m%d-%H%M%S')}")
    runs.mkdir(parents=True, exist_ok=True)
    cfg = {"image": str(img.dir), "host": args.host, "guest": args.guest, "seed": args.seed,
           "examples": args.examples, "workers": args.workers, "workload": workload,
           "time_budget": args.time_budget, "out": str(runs.resolve()), "mix": args.mix}
    t0 = time.monotonic()
    say(f"fuzz: {args.examples} examples on {img.version}, seed {args.seed}, "
        f"{args.workers} worker(s), host {args.host}, guest {args.guest}; findings in {runs}")
    if args.workers == 1:
        from ..vmctl import Machine
        vm = Machine.boot(img, host=args.host)
        try:
            st = fuzz.run(vm, examples=args.examples, seed=args.seed * 1000, guest=args.guest,
                          workload=workload, time_budget=args.time_budget, progress=say,
                          reboot=lambda: Machine.boot(img, host=args.host), mix=args.mix)
            vm = st.vm
        finally:
            vm.close()
        shards = [{"examples": st.examples, "seconds": st.seconds, "agreed_runs": st.agreed_runs,
                   "agreed_refusals": st.agreed_refusals, "not_mirrored": st.not_mirrored,
                   "not_mirrored_why": st.not_mirrored_why, "slowed": st.slowed,
                   "events": st.events, "findings": [f.as_dict() for f in st.findings]}]
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(cfg, tmp)
        env = dict(os.environ, KPH_FUZZ_CONFIG=tmp.name)
        for old in runs.glob("shard-*.*"):
            old.unlink()
        log = runs / "pytest.log"
        # the shards' pytest temp directories in one of our own, removed after: pytest's
        # own (/tmp/pytest-of-USER) would keep one per run, and pytest deletes there, as
        # it ends, whatever numbered directory of the user's no live run holds
        basetemp = tempfile.mkdtemp(prefix="kph-fuzz-pytest-")
        with open(log, "w") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p",
                                     "no:cacheprovider", "-p", "no:randomly", "--pyargs",
                                     "harness.apps.fuzzshard", "-n", str(args.workers), "-o",
                                     "timeout=0", f"--basetemp={basetemp}"], env=env,
                                    stdout=logf, stderr=subprocess.STDOUT, text=True)
            try:
                while proc.poll() is None:
                    time.sleep(2)
                    shard_progress(runs, args.examples, time.monotonic() - t0,
                                   out.progress.transient)
            finally:
                if proc.poll() is None:             # an interrupt: the shards go with it
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                os.unlink(tmp.name)
                shutil.rmtree(basetemp, ignore_errors=True)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")
        shards = [json.loads(p.read_text()) for p in sorted(runs.glob("shard-*.json"))]
        for p in runs.glob("shard-*.progress"):
            p.unlink()
        if len(shards) != args.workers:
            why = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("E ")][:1]
            raise SetupError(f"{args.workers - len(shards)} fuzz worker(s) failed"
                             + (f": {why[0][2:].strip()[:300]}" if why else ""),
                             f"the workers' output is in {runs / 'pytest.log'}")
    wall = time.monotonic() - t0
    examples = sum(s["examples"] for s in shards)
    seen: dict[str, fuzz.Finding] = {}
    for s in shards:
        for d in s["findings"]:
            f = fuzz.Finding(**{**d, "lines": tuple(d["lines"])})
            seen.setdefault(f.signature, f)
    findings = list(seen.values())
    report_lines = []
    for f in findings:
        repro = fuzz.repro_line(f, image=args.image, guest=args.guest, workload=workload)
        # In a checkout, straight into the suite's regression cases; else beside the run.
        # One that did not repeat on replay is no case a suite can rely on: beside the run.
        in_checkout = (fuzz.REGRESSIONS.parent.parent / "vm").is_dir()
        kernel = img.series if args.image else None
        case = fuzz.write_regression(f, kernel=kernel) if in_checkout and not f.flaky \
            else fuzz.write_regression(f, runs / "regressions", kernel=kernel)
        report_lines.append(f"- {f.kind}: {f.detail.splitlines()[0]}\n  {repro}\n  case: {case}")
    doc = {"config": cfg, "examples": examples, "wall_seconds": wall,
           "findings": [f.as_dict() for f in findings]}
    (runs / "findings.json").write_text(json.dumps(doc, indent=1))
    (runs / "findings.md").write_text("\n".join(report_lines) + "\n")
    rate = 60 * examples / wall if wall else 0.0
    out.progress.clear()
    out.text(f"kph fuzz: {examples} examples in {wall:.0f} s ({rate:.0f}/min, {args.workers} "
             f"worker(s)); {sum(s['agreed_runs'] for s in shards)} agreed on events, "
             f"{sum(s['agreed_refusals'] for s in shards)} on refusals; "
             + (f"{unmirrored} not mirrored by this host engine or guest side "
                f"({not_mirrored_why(shards)}); "
                if (unmirrored := sum(s.get('not_mirrored', 0) for s in shards)) else "")
             + (f"{slowed} not compared (the host's probes slowed the guest past the "
                "timeout); " if (slowed := sum(s.get('slowed', 0) for s in shards)) else "")
             + f"{len(findings)} finding(s); in {runs}")
    for ln in report_lines:
        out.text(ln)
    out.result({**doc, "dir": str(runs)})
    from ..diff import ktap
    ci.emit(args, ktap.fuzz_cases(doc, shards, kernel=img.version), verb=NAME,
            kernel=img.version)
    kinds = {f.kind for f in findings}
    return EXIT_KERNEL if "kernel" in kinds else EXIT_HANG if "hang" in kinds else \
        EXIT_OK if not findings else EXIT_DIVERGED


def shard_progress(runs: Any, total: int, elapsed: float, say: Any) -> None:
    """One progress line from the shards' ``shard-*.progress`` files."""
    done = found = 0
    for p in runs.glob("shard-*.progress"):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        done += d.get("examples", 0)
        found += d.get("findings", 0)
    if not done:
        say(f"fuzz: booting the workers' machines ({elapsed:.0f} s)")
        return
    rate = 60 * done / elapsed
    left = (total - done) / (done / elapsed) if done < total else 0
    say(f"fuzz: {done}/{total} examples, {found} finding(s), {rate:.0f}/min, "
        f"about {left / 60:.0f} min left")


def not_mirrored_why(shards: list[dict[str, Any]]) -> str:
    """The reasons of the shards' not-mirrored examples, most frequent first:
    ``"not mirrored host-side: synthetic events on 6.12": 3; ...``."""
    total: dict[str, int] = {}
    for s in shards:
        for why, n in s.get("not_mirrored_why", {}).items():
            total[why] = total.get(why, 0) + n
    return "; ".join(f"{why}: {n}" for why, n in sorted(total.items(), key=lambda kv: -kv[1]))
