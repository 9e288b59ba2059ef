"""Results as KCIDB I/O data (kernelci.org's reporting schema, v5.3: checkouts, builds,
tests, issues, incidents), for ``kcidb-submit``. Decides nothing: it writes the
:class:`~harness.diff.ktap.Case` tree :mod:`harness.diff.ktap` made of a verb's result.

- one checkout and one build per kernel the cases ran on (Debian's binary kernel, or a
  tree's build), ``x86_64``, id ``ORIGIN:KERNEL``: the same kernel in two submissions is
  the same checkout and build;
- one test per case, parents included, at path ``kph.VERB.NAME[.SUB...]`` (KCIDB paths
  are dot-separated ``[a-zA-Z0-9_-]`` words: other characters become ``_``), id
  ``ORIGIN:RUN.N``, status PASS, FAIL, SKIP or ERROR;
- a known bug shown (``xfail``) is a FAIL with an issue (``ORIGIN:SCENARIO``) and an
  incident linking the test to it: KCIDB's way to say the failure is known and triaged.
"""
from __future__ import annotations

import re
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from .ktap import Case

SCHEMA = {"major": 5, "minor": 3}
STATUS = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP", "xfail": "FAIL", "error": "ERROR"}


def _word(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_-]+", "_", text).strip("_") or "_"


def _text(text: str) -> str:
    return text.replace("\0", "")


def report(cases: list[Case], *, verb: str, origin: str = "kph", run_id: str | None = None,
           start: float | None = None, default_kernel: str = "default") -> dict[str, Any]:
    """The KCIDB document of one verb's cases (validated by ``kcidb_io.schema`` in the
    tests)."""
    if not re.fullmatch(r"[a-z0-9_]+", origin):
        raise ValueError(f"KCIDB origin {origin!r}: lower-case letters, digits and _ only")
    run = run_id or f"{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    when = datetime.fromtimestamp(start if start is not None else time.time(),
                                  timezone.utc).isoformat()
    builds: dict[str, str] = {}
    doc: dict[str, Any] = {"version": dict(SCHEMA), "checkouts": [], "builds": [],
                           "tests": [], "issues": [], "incidents": []}

    def build_of(kernel: str) -> str:
        if kernel not in builds:
            kid = f"{origin}:{kernel}"
            builds[kernel] = kid
            doc["checkouts"].append({"id": kid, "origin": origin, "valid": True,
                                     "tree_name": "debian" if "cloud-amd64" in kernel
                                     or "+deb" in kernel else "kph",
                                     "comment": _text(f"the kernel {kernel}"),
                                     "start_time": when})
            doc["builds"].append({"id": kid, "checkout_id": kid, "origin": origin,
                                  "architecture": "x86_64", "status": "PASS",
                                  "comment": _text(f"{kernel}, booted under QEMU by kph"),
                                  "start_time": when})
        return builds[kernel]

    issues: set[str] = set()
    n = 0

    def walk(c: Case, path: list[str], kernel: str) -> None:
        nonlocal n
        kernel = c.kernel or kernel
        here = [*path, _word(c.name)]
        n += 1
        tid = f"{origin}:{run}.{n}"
        comment = "; ".join(x for x in [c.reason, *c.diagnostics] if x)
        test: dict[str, Any] = {"id": tid, "build_id": build_of(kernel), "origin": origin,
                                "path": ".".join(here), "status": STATUS[c.status],
                                "start_time": when,
                                "misc": {"kph_status": c.status, "kph_verb": verb,
                                         "kph_name": c.name}}
        if comment:
            test["comment"] = _text(comment)
        doc["tests"].append(test)
        if c.status == "xfail" and c.issue:
            iid = f"{origin}:{_word(c.issue)}"
            if iid not in issues:
                issues.add(iid)
                doc["issues"].append({"id": iid, "version": 1, "origin": origin,
                                      "comment": _text(c.reason or c.issue),
                                      "misc": {"kph_scenario": c.issue}})
            doc["incidents"].append({"id": f"{origin}:{run}.{n}.incident", "origin": origin,
                                     "issue_id": iid, "issue_version": 1, "test_id": tid,
                                     "present": True})
        for s in c.subtests:
            walk(s, here, kernel)

    for c in cases:
        walk(c, ["kph", _word(verb)], default_kernel)
    return doc
