"""Write ``tests/durations.json`` from a run's JUnit XML (``pytest --junitxml=FILE``): the
tests that took at least ``--min`` seconds (call plus setup), which tests/conftest.py
schedules first so that no worker ends the run alone on a long test.

    python bench/test_durations.py run.xml --machine "2 cores, Debian 12" [--min 30]

Or print where a run's minutes went, from the timeline tests/conftest.py writes with
``KPH_TEST_TIMELINE=FILE``: each xdist worker's busy seconds, its waits for the run lock,
the seconds it ran no test before its last one ended (idle), and when it was done; the
longest tests and test modules. Of the xdist runs in the file, the one
that spans the longest (the suite; an inner pytest's tests are their outer test's time).

    python bench/test_durations.py --timeline FILE [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def nodeid(classname: str, name: str) -> str:
    return classname.replace(".", "/") + ".py::" + name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path, nargs="?")
    ap.add_argument("--machine", help="where the run was measured")
    ap.add_argument("--timeline", type=Path, help="a KPH_TEST_TIMELINE file: print it")
    ap.add_argument("--top", type=int, default=25, help="tests and modules printed")
    ap.add_argument("--min", type=float, default=30.0, help="seconds (default 30)")
    a = ap.parse_args(argv)
    if a.timeline is not None:
        return timeline(a.timeline, a.top)
    if a.junit is None or not a.machine:
        ap.error("give the JUnit XML file and --machine (or --timeline FILE)")
    try:
        root = ET.parse(a.junit).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"error: {a.junit}: {e}; pass the file pytest --junitxml wrote", file=sys.stderr)
        return 2
    secs: collections.Counter[str] = collections.Counter()
    for tc in root.iter("testcase"):
        secs[nodeid(tc.get("classname", ""), tc.get("name", ""))] += float(tc.get("time") or 0)
    long = {k: round(v, 1) for k, v in secs.most_common() if v >= a.min}
    OUT.write_text(json.dumps({"measured": f"{datetime.date.today()}, {a.machine}",
                               "min_seconds": a.min, "seconds": long}, indent=1) + "\n")
    print(f"{len(long)} of {len(secs)} tests took {a.min:g} s or more; wrote {OUT}")
    return 0


def timeline(path: Path, top: int) -> int:
    try:
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, ValueError) as e:
        print(f"error: {path}: {e}; pass the file KPH_TEST_TIMELINE named", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("worker", "main") != "main":
            runs.setdefault(r.get("run", ""), []).append(r)
    if not runs:
        print(f"error: {path}: no xdist worker's test in it (run with -n)", file=sys.stderr)
        return 2
    rows = max(runs.values(), key=lambda rs: max(r["end"] for r in rs) -
               min(r["asked"] for r in rs))
    if len(runs) > 1:
        print(f"(the longest of {len(runs)} xdist runs in the file; the others ran inside it)")
    t0 = min(r["asked"] for r in rows)
    t1 = max(r["end"] for r in rows)
    print(f"{len(rows)} tests over {t1 - t0:.0f} s (first asked to last ended)")
    for w in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == w]
        busy = sum(r["end"] - r["start"] for r in mine)
        wait = sum(r["start"] - r["asked"] for r in mine)
        end = max(r["end"] for r in mine)
        idle = max(0.0, end - t0 - busy - wait)
        print(f"  {w}: {len(mine)} tests, busy {busy:.0f} s, waited for the run lock "
              f"{wait:.0f} s, idle {idle:.0f} s, done at {end - t0:.0f} s "
              f"({t1 - end:.0f} s before the end)")
    print(f"the {top} longest tests (seconds, worker, started at):")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:top]:
        print(f"  {r['end'] - r['start']:7.1f}  {r['worker']}  {r['start'] - t0:6.0f}  "
              f"{r['nodeid']}")
    mods: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for r in rows:
        module = r["nodeid"].split("::")[0]
        mods[module] += r["end"] - r["start"]
        count[module] += 1
    print(f"the {top} longest modules (seconds, tests):")
    for m, s in mods.most_common(top):
        print(f"  {s:7.1f}  {count[m]:4d}  {m}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:     # `| head`: the reader had enough; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
