"""Render a differential result as text, JSON or one self-contained HTML page. Decides nothing."""
from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

from .diff import NORMALIZATIONS, DiffResult
from .records import Hit, RunResult


def text(res: DiffResult, *, workload: str = "", status: int | None = None) -> str:
    a, b = res.a_side, res.b_side
    out = [f"kph diff: {a} vs {b}" + (f", workload {workload!r}" if workload else "")
           + (f" (exit {status})" if status is not None else "")]
    for probe, (na, nb) in res.counts.items():
        mode = f"  [{res.modes[probe]}]" if probe in res.modes else ""
        out.append(f"  {probe:28s} {a} {na:5d}  {b} {nb:5d}  matched {res.matched.get(probe, 0):5d}{mode}")
    for probe, (x, y) in res.outcomes.items():
        if (x and not x.accepted) or (y and not y.accepted):
            out.append(f"  {probe:28s} registration: {a} {_o(x)}; {b} {_o(y)}")
    applied = [f"{k} ({v})" for k, v in res.applied.items() if v]
    if applied:
        out.append("normalizations applied: " + ", ".join(applied)
                   + "  (see harness/diff.py; nothing else is normalized)")
    if res.equivalent:
        per = ", ".join(f"{n}" for n in res.matched.values())
        out.append(f"result: equivalent: {res.total_matched} events matched on each side ({per})")
    else:
        d = res.divergences[0]
        out.append(f"result: DIVERGED at {d.describe(a, b)}")
        for side, ctx in ((a, d.a_context), (b, d.b_context)):
            if ctx:
                out.append(f"  context on {side}:")
                out += [f"    {h.seq:4d} {h.line()}" for h in ctx]
        if len(res.divergences) > 1:
            out.append(f"  ({len(res.divergences) - 1} more probe(s) diverge)")
    return "\n".join(out) + "\n"


def _o(o: Any) -> str:
    if o is None:
        return "not placed"
    if o.accepted:
        return "accepted"
    import errno
    return f"refused {errno.errorcode.get(o.errno, o.errno)}"


def to_json(res: DiffResult, runs: tuple[RunResult, RunResult] | None = None) -> str:
    doc: dict[str, Any] = {
        "equivalent": res.equivalent, "sides": [res.a_side, res.b_side],
        "matched": res.matched, "counts": {k: list(v) for k, v in res.counts.items()},
        "modes": res.modes, "normalizations": {k: NORMALIZATIONS[k] for k in res.applied if res.applied[k]},
        "divergences": [dataclasses.asdict(d) for d in res.divergences],
    }
    if runs:
        doc["runs"] = [dataclasses.asdict(r) for r in runs]
    return json.dumps(doc, indent=2, default=str) + "\n"


def hits_json(hits: list[Hit]) -> str:
    return json.dumps([dataclasses.asdict(h) for h in hits], indent=1) + "\n"


def to_html(res: DiffResult, runs: tuple[RunResult, RunResult], *, workload: str = "") -> str:
    a, b = runs
    rows = []
    first = res.first
    for probe in res.counts:
        la = [h for h in a.hits if h.probe == probe and h.comm != "qemu-ga"]
        lb = [h for h in b.hits if h.probe == probe and h.comm != "qemu-ga"]
        for i in range(max(len(la), len(lb))):
            bad = first is not None and first.probe == probe and first.index == i
            cls = ' class="bad"' if bad else ""
            ca = html.escape(la[i].line()) if i < len(la) else ""
            cb = html.escape(lb[i].line()) if i < len(lb) else ""
            rows.append(f"<tr{cls}><td>{html.escape(probe)}</td><td>{i + 1}</td>"
                        f"<td><code>{ca}</code></td><td><code>{cb}</code></td></tr>")
    verdict = ("equivalent" if res.equivalent else
               html.escape("diverged at " + res.divergences[0].describe(res.a_side, res.b_side)))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kph diff</title>
<style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;vertical-align:top}}tr.bad{{background:#fcc}}
code{{font-size:12px}}</style></head><body>
<h1>kph diff: {html.escape(res.a_side)} vs {html.escape(res.b_side)}</h1>
<p>workload <code>{html.escape(workload)}</code>: <b>{verdict}</b>;
{res.total_matched} events matched on each side.</p>
<p>normalizations: {html.escape("; ".join(NORMALIZATIONS[k] for k, v in res.applied.items() if v))}</p>
<table><tr><th>probe</th><th>#</th><th>{html.escape(res.a_side)}</th><th>{html.escape(res.b_side)}</th></tr>
{''.join(rows)}</table></body></html>
"""
