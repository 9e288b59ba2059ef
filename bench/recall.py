#!/usr/bin/env python3
"""Recall of ``kph hunt`` on the corpus of undone upstream fixes (``probes/bugs/``, issue 37):
how many real historical probe bugs the harness finds without being told where.

For each entry: build Debian's source of a series it applies to with the entry's patch
(``kph image build --tree SERIES --patch ENTRY``: the tree's variant tree, so every entry
after the first of a series is an incremental build), run ``kph hunt`` on that image with
a fixed budget, and call the entry *found* when the hunt reports a new finding (not one
of docs/upstream.md's known ones) that the same hunt on the stock build of that series
does not report and whose reproducer (the ``kph diff`` line the hunt prints) fails on the
planted build and passes on the stock one. A finding whose reproducer fails on the stock
build too is a false alarm, as are the stock builds' own new findings.

Nothing here tells the hunt which entry is planted: the hunt gets only the image.

    python bench/recall.py [--minutes 15] [--series 6.12,7.3] [--entries NAME,...]
                           [--seed 0] [--stop-at-first] [--jobs N] [-o recall.json]

One line per entry (found or not, by which phase and oracle, after how many seconds of
the hunt, the reproducer's verdicts), then ``recall: K/N`` and the false alarms.
docs/recall.md keeps the table. A full run is 15 min per entry plus the builds: hours.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.machine.image.build import build_tree_image  # noqa: E402

BUGS = ROOT / "probes" / "bugs"
PY = sys.executable


def entries(names: list[str], series: tuple[str, ...]) -> list[tuple[dict, str]]:
    """(entry, the series it is built on): the first of ``series`` the entry lists; in
    the order ``names`` gives them (all, by name, when it is empty)."""
    out = []
    for f in sorted(BUGS.glob("*.toml")):
        e = tomllib.loads(f.read_text())
        if names and e["name"] not in names:
            continue
        s = next((s for s in series if s in e["series"]), None)
        if s is not None:
            out.append((e, s))
    return sorted(out, key=lambda t: names.index(t[0]["name"])) if names else out


def unmet(e: dict, img: object) -> str:
    """What of the entry's ``requires`` the built image cannot give a hunt ("" when
    nothing): ``config:OPT`` an option of the build's config (=y); ``cpus:N`` the
    kernel bringing up N CPUs when booted with N; ``cmdline:WORD`` a word of the kernel
    command line, which a hunt never adds."""
    from harness.vmctl import Machine

    cfg = (Path(img.dir) / "config").read_text(errors="replace") \
        if (Path(img.dir) / "config").is_file() else ""
    for req in e.get("requires", []):
        what, _, arg = req.partition(":")
        if what == "config" and f"{arg}=y" not in cfg.splitlines():
            return f"the build has no {arg}=y"
        if what == "cmdline":
            return f"a hunt boots without {arg} on the kernel command line"
        if what == "cpus":
            with Machine.boot(img, smp=int(arg)) as vm:
                got = vm.run("nproc", timeout=30).stdout.strip()
            if got != arg:
                return f"the build brings up {got} CPU(s) of {arg}"
    return ""


def selector(series: str, patch: Path | None) -> str:
    return f"tree:{series}" + (f"+{patch}" if patch else "")


def hunt(sel: str, minutes: float, seed: int, stop_at_first: bool = False) -> dict:
    """``kph hunt`` on ``sel`` in a process of its own: its JSON, and when (seconds into
    the hunt) each new finding was first printed."""
    argv = [PY, "-m", "harness.cli", "hunt", "--image", sel, "--minutes", str(minutes),
            "--seed", str(seed), "--json"] + (["--stop-at-first"] if stop_at_first else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    first: dict[str, float] = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.match(r"hunt: \w+: finding \((.*?)\) \[NEW\]", line)
        if m:
            first.setdefault(m[1], round(time.monotonic() - t0))
        if line.startswith("error:"):
            print(f"  {sel}: {line.strip()}", flush=True)
    out = proc.stdout.read() if proc.stdout else ""
    code = proc.wait(timeout=60)
    try:
        doc = json.loads(out)
    except ValueError:
        return {"error": f"kph hunt exited {code} with no JSON", "findings": [], "exit": code}
    doc["exit"], doc["first_seen"] = code, first
    return doc


def key(f: dict) -> tuple[str, str, str]:
    return (f["kind"], f["probe_kind"], f["what"])


#: kph's exit statuses that are a verdict (diverged, a kernel report, a hang), not an error
VERDICTS = (1, 5, 6)


def replay(reproduce: str, sel: str) -> tuple[int, str]:
    """The hunt's reproducer (a ``kph ...`` line) run against ``sel``: its exit status,
    and its last line on stderr (an error's reason)."""
    argv = shlex.split(reproduce)
    if argv[:1] != ["kph"]:
        return -1, "not a kph line"
    argv = argv[1:]
    # the kernel is --image's (kph diff), or --kernels' (a scenario's kph repro line)
    opt = "--kernels" if argv[:1] == ["repro"] else "--image"
    if opt in argv:
        argv[argv.index(opt) + 1] = sel
    else:
        argv[1:1] = [opt, sel]
    r = subprocess.run([PY, "-m", "harness.cli", "-q", *argv], capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    return r.returncode, (r.stderr.strip().splitlines() or [""])[-1][:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="each hunt's budget")
    ap.add_argument("--series", default="6.12,7.3", help="the series to build on, in order "
                    "of preference (an entry is built on the first it lists)")
    ap.add_argument("--entries", default="", help="only these entries (names), in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stock", action="store_true",
                    help="skip the stock builds' hunts (no false-alarm count, and an entry "
                         "is found on any new finding)")
    ap.add_argument("--no-stock-hunt", action="store_true",
                    help="skip the stock builds' hunts but still replay each candidate's "
                         "reproducer on the stock build (a finding that shows there too is "
                         "a false alarm); the stock hunts' own false alarms are not counted")
    ap.add_argument("--stop-at-first", action="store_true",
                    help="end each planted build's hunt at its first new finding (the "
                         "stock builds' hunts always run their whole budget); a found "
                         "entry then costs its time to the finding, not the budget")
    ap.add_argument("--jobs", type=int, default=1,
                    help="hunts run at once (builds stay one at a time); each hunt gets "
                         "its budget in wall time, so on a machine of 2 cores 2 jobs give "
                         "each hunt less of the CPU: fewer cases in the same minutes")
    ap.add_argument("-o", "--output", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    series = tuple(s for s in args.series.split(",") if s)
    todo = entries([n for n in args.entries.split(",") if n], series)
    if not todo:
        print("error: no corpus entry matches", file=sys.stderr)
        return 2
    say = (lambda s: print(f"  {s}", flush=True)) if os.environ.get("KPH_VERBOSE") else \
        (lambda s: None)
    t_all = time.monotonic()
    stock: dict[str, dict] = {}
    hidden = [e for e, _ in todo if not e.get("visible", True)]
    for e in hidden:        # no probe line shows it: not a miss, not counted (docs/recall.md)
        print(f"{e['name']:42s} not counted: no probe line can show it "
              f"({e['invisible_why'][:100]}...)", flush=True)
    todo = [(e, s) for e, s in todo if e.get("visible", True)]
    # One build at a time: a series' variants share one variant tree (kernel.md).
    build_lock = threading.Lock()

    def built(s: str, patches: list[Path]) -> tuple[object, float]:
        with build_lock:
            t0 = time.monotonic()
            return build_tree_image(s, patches=patches, progress=say), time.monotonic() - t0

    def stock_job(s: str) -> None:
        _, took = built(s, [])
        stock[s] = hunt(selector(s, None), args.minutes, args.seed)
        new = [f for f in stock[s].get("findings", []) if f.get("new")]
        text = (f"stock tree:{s}: built in {took:.0f} s; hunt exit {stock[s]['exit']}, "
                f"{len(new)} new finding(s) (false alarms)")
        print("\n".join([text] + [f"  false alarm: {key(f)} {f['lines'][:2]}" for f in new]),
              flush=True)

    def entry_job(e: dict, s: str) -> dict:
        """Build, hunt, and replay each new finding's reproducer on both builds; which
        finding makes the entry found is decided once the stock hunts are in (judge)."""
        patch = BUGS / e["patch"]
        row: dict = {"entry": e["name"], "series": s, "kind": e["kind"], "effect": e["effect"]}
        try:
            img, took = built(s, [patch])
        except Exception as exc:                # a build error is the entry's result
            row.update(found=False, error=f"build: {exc}", false_alarms=[])
            return row
        row["build_s"] = round(took)
        why = unmet(e, img)
        if why:     # the hunt cannot show it on this build: not found, and said why
            row.update(found=False, not_run=why, false_alarms=[])
            return row
        doc = hunt(selector(s, patch), args.minutes, args.seed, args.stop_at_first)
        row.update(found=False, hunt_exit=doc["exit"], error=doc.get("error", ""),
                   false_alarms=[], cands=[])
        if not args.no_stock and any(f.get("new") for f in doc.get("findings", [])):
            built(s, [])        # the stock image the reproducers replay on
        for f in doc.get("findings", []):
            if not f.get("new"):
                continue
            planted = stock_rc = None
            says = ""
            if not args.no_stock:
                planted, says = replay(f["reproduce"], selector(s, patch))
                stock_rc, _ = replay(f["reproduce"], selector(s, None))
            row["cands"].append({**f, "repro_planted": planted, "repro_stock": stock_rc,
                                 "repro_planted_says": says,
                                 "after_s": doc["first_seen"].get(
                                     f"{f['kind']}, {f['probe_kind']}, {f['what']}")})
        print(f"  done: {e['name']} ({len(row['cands'])} new finding(s), "
              f"{time.monotonic() - t_all:.0f} s into the run)", flush=True)
        return row

    def judge(row: dict) -> dict:
        seen = {key(f) for f in stock.get(row["series"], {}).get("findings", [])
                if f.get("new")}
        cands = [f for f in row.pop("cands", []) if key(f) not in seen]
        row["findings"] = len(cands)
        for f in cands:
            if not args.no_stock:
                if f["repro_stock"] != 0:       # the stock build shows it too: not this bug
                    row["false_alarms"].append({"lines": f["lines"], "oracle":
                                                f"{f['kind']}/{f['what']}"})
                    continue
                if f["repro_planted"] == 0:     # not shown again on its own build
                    continue
            row.update(found=True, phase=f["phase"], oracle=f"{f['kind']}/{f['what']}",
                       source=f["source"], lines=f["lines"], reproduce=f["reproduce"],
                       after_s=f["after_s"], repro_planted=f["repro_planted"],
                       repro_stock=f["repro_stock"],
                       repro_planted_says=f.get("repro_planted_says", ""))
            break
        return row

    jobs: list = []
    if not args.no_stock and not args.no_stock_hunt:
        jobs += [(stock_job, (s,)) for s in sorted({s for _, s in todo})]
    jobs += [(entry_job, (e, s)) for e, s in todo]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(fn, *a) for fn, a in jobs]
        results = [f.result() for f in futures]
    rows = [judge(r) for r in results if isinstance(r, dict)]
    for row in rows:
        s = row["series"]
        if "build_s" not in row:
            what = f"BUILD FAILED: {row['error'][:120]}"
        elif row.get("not_run"):
            what = f"not run: {row['not_run']}"
        else:
            what = (f"FOUND by {row['phase']} ({row['oracle']}) after {row.get('after_s')} s; "
                    f"reproducer exit {row.get('repro_planted')} planted / "
                    f"{row.get('repro_stock')} stock" +
                    (f" (planted: an error, not a verdict: {row.get('repro_planted_says')})"
                     if row.get("repro_planted") not in (None, *VERDICTS) else "")
                    if row["found"] else
                    f"missed{': ' + row['error'] if row['error'] else ''}")
        for fa in row["false_alarms"]:
            what += f"; false alarm (fails on the stock build too): {fa['oracle']} {fa['lines']}"
        print(f"{row['entry']:42s} {s:5s} build {row.get('build_s', 0):4d} s  {what}",
              flush=True)
    found = sum(r["found"] for r in rows)
    alarms = sum(len([f for f in d.get("findings", []) if f.get("new")]) for d in stock.values()) \
        + sum(len(r.get("false_alarms", [])) for r in rows)
    print(f"recall: {found}/{len(rows)}" + ("" if args.no_stock else
                                            f"; false alarms on the stock builds: {alarms}")
          + f"; {time.monotonic() - t_all:.0f} s in all ({args.minutes:g} min hunts)")
    if args.output:
        args.output.write_text(json.dumps({"minutes": args.minutes, "seed": args.seed,
                                           "rows": rows, "stock": stock}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
