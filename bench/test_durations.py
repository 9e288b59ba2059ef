"""Write ``tests/durations.json`` from a run's JUnit XML (``pytest --junitxml=FILE``): the
tests that took at least ``--min`` seconds (call plus setup), which tests/conftest.py
schedules first so that no worker ends the run alone on a long test.

    python bench/test_durations.py run.xml --machine "2 cores, Debian 12" [--min 30]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def nodeid(classname: str, name: str) -> str:
    return classname.replace(".", "/") + ".py::" + name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--machine", required=True, help="where the run was measured")
    ap.add_argument("--min", type=float, default=30.0, help="seconds (default 30)")
    a = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
