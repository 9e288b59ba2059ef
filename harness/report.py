"""Render a differential result as text, JSON or one self-contained HTML page. Decides nothing."""
from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

from .diff import NORMALIZATIONS, DiffResult
from .records import Hit, RunResult


def text(res: DiffResult, *, workload: str = "", status: int | None = None,
         stderr: str = "") -> str:
    a, b = res.a_side, res.b_side
    out = [f"kph diff: {a} vs {b}" + (f", workload {workload!r}" if workload else "")
           + (f" ({workload_status(status, stderr)})" if status is not None else "")]
    for probe, (na, nb) in res.counts.items():
        mode = f"  [{res.modes[probe]}]" if probe in res.modes else ""
        out.append(f"  {probe:28s} {a} {na:5d}  {b} {nb:5d}  matched {res.matched.get(probe, 0):5d}{mode}")
    for probe, (x, y) in res.outcomes.items():
        if (x and not x.accepted) or (y and not y.accepted):
            out.append(f"  {probe:28s} registration: {a} {_o(x)}; {b} {_o(y)}")
        elif x and y and (x.pending or y.pending):
            out.append(f"  {probe:28s} accepted, not registered: {a}: {x.pending or 'registered'}; "
                       f"{b}: {y.pending or 'registered'}")
    applied = [f"{k} ({v})" for k, v in res.applied.items() if v]
    if applied:
        out.append("normalizations applied: " + ", ".join(applied)
                   + "  (see harness/diff.py; nothing else is normalized)")
    if res.equivalent:
        out.append("result: " + verdict(res))
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


def verdict(res: DiffResult) -> str:
    """The verdict of an equivalent result, naming only what was measured: hits compared
    on probes both sides armed, refusals both sides made (with the kernel's reason), and
    lines both sides accepted without arming anything."""
    parts = []
    if res.armed:
        if res.total_matched:
            per = ", ".join(str(n) for n in res.matched.values())
            parts.append(f"equivalent: {res.total_matched} events matched on each side ({per})")
        else:
            parts.append("equivalent: no events on either side (nothing to compare field by "
                         "field)")
    refused = res.both_refused
    if refused:
        one = len(res.outcomes) == 1
        parts.append("both refused: " + "; ".join(refusal_text(res, k, label=not one)
                                                  for k in refused))
    pending = res.pending
    if pending:
        parts.append("accepted, but nothing armed that could fire: " + "; ".join(
            f"{k} ({res.outcomes[k][0].pending})" for k in pending))  # type: ignore[union-attr]
    return "; ".join(parts) if parts else "nothing was placed"


def refusal_text(res: DiffResult, key: str, *, label: bool = True) -> str:
    """``EINVAL (blacklisted: do_int3; events: Failed to register probe event)``: the
    errno, the reason side a gives, and side b's text when it says something else."""
    import errno

    x, y = res.outcomes[key]
    assert x is not None and y is not None
    name = errno.errorcode.get(x.errno, str(x.errno))
    why = x.reason or x.message
    if y.message and y.message != why:
        why = f"{why}; {res.b_side}: {y.message}" if why else y.message
    return (f"{key} " if label else "") + f"{name} ({why})"


def workload_status(status: int | None, stderr: str = "", *, tail: int = 3) -> str:
    """``exit 0``, or ``exit 1: <the last lines of its stderr>``."""
    if not status:
        return f"exit {status}"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()][-tail:]
    return f"exit {status}" + (": " + " | ".join(lines) if lines else "")


def _o(o: Any) -> str:
    if o is None:
        return "not placed"
    if o.accepted:
        return "accepted"
    import errno
    why = o.reason or o.message
    return f"refused {errno.errorcode.get(o.errno, o.errno)}" + (f" ({why})" if why else "")


def to_json(res: DiffResult, runs: tuple[RunResult, RunResult] | None = None) -> str:
    doc: dict[str, Any] = {
        "equivalent": res.equivalent, "sides": [res.a_side, res.b_side],
        "verdict": verdict(res) if res.equivalent else
        "DIVERGED at " + res.divergences[0].describe(res.a_side, res.b_side),
        "both_refused": res.both_refused, "pending": res.pending,
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
    said = html.escape(verdict(res) if res.equivalent else
                       "diverged at " + res.divergences[0].describe(res.a_side, res.b_side))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kph diff</title>
<style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;vertical-align:top}}tr.bad{{background:#fcc}}
code{{font-size:12px}}</style></head><body>
<h1>kph diff: {html.escape(res.a_side)} vs {html.escape(res.b_side)}</h1>
<p>workload <code>{html.escape(workload)}</code>: <b>{said}</b>;
{res.total_matched} events matched on each side.</p>
<p>normalizations: {html.escape("; ".join(NORMALIZATIONS[k] for k, v in res.applied.items() if v))}</p>
<table><tr><th>probe</th><th>#</th><th>{html.escape(res.a_side)}</th><th>{html.escape(res.b_side)}</th></tr>
{''.join(rows)}</table></body></html>
"""


# ---------------------------------------------------------------- trap-flow demo

def trapflow_text(flows: list) -> str:
    out = []
    for f in flows:
        out.append(f"== {f.kind}: {f.probe}")
        for s in f.steps:
            changed = f"  changed: {', '.join(s.changed)}" if s.changed else ""
            out.append(f"{s.n:3d}. [{s.lane}] {s.title}")
            out.append(f"     {s.where}  {s.addr:#x}  {s.insn}")
            out.append(f"     ip={s.regs.get('rip', 0):#x} sp={s.regs.get('rsp', 0):#x} "
                       f"{s.flags_text()} cs={s.regs.get('cs', 0):#x}{changed}")
            if s.note:
                out.append(f"     note: {s.note}")
        out += [f"   * {x}" for x in f.facts]
        out.append("")
    return "\n".join(out)


def _svg(flow) -> str:
    from .trapflow import LANES

    lane_w, top, row_h = 150, 40, 34
    width = lane_w * len(LANES) + 220  # room for the labels right of the last lane
    height = top + row_h * (len(flow.steps) + 1)
    x = {ln: 20 + lane_w * i + lane_w // 2 for i, ln in enumerate(LANES)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" '
             'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>']
    for ln in LANES:
        parts.append(f'<text x="{x[ln]}" y="20" text-anchor="middle" font-weight="bold">{html.escape(ln)}</text>')
        parts.append(f'<line x1="{x[ln]}" y1="28" x2="{x[ln]}" y2="{height - 5}" stroke="#bbb" stroke-dasharray="4 3"/>')
    prev = None
    for s in flow.steps:
        y = top + row_h * s.n
        cx = x.get(s.lane, x["CPU"])
        if prev is not None and prev[0] != cx:
            parts.append(f'<line x1="{prev[0]}" y1="{prev[1]}" x2="{cx}" y2="{y}" stroke="#333" '
                         f'marker-end="url(#arr)"/>')
        parts.append(f'<circle cx="{cx}" cy="{y}" r="9" fill="#4a7ab5"/>'
                     f'<text x="{cx}" y="{y + 4}" text-anchor="middle" fill="white">{s.n}</text>')
        parts.append(f'<text x="{cx + 13}" y="{y + 4}">{html.escape(s.where.split("/")[0])}</text>')
        prev = (cx, y)
    parts.append("</svg>")
    return "".join(parts)


def trapflow_html(flows: list, *, title: str = "kprobe trap flow") -> str:
    body = []
    for f in flows:
        rows = "".join(
            f"<tr><td>{s.n}</td><td>{html.escape(s.lane)}</td><td>{html.escape(s.title)}</td>"
            f"<td><code>{html.escape(s.where)}</code><br><code>{s.addr:#x}</code></td>"
            f"<td><code>{html.escape(s.insn)}</code></td>"
            f"<td><code>ip={s.regs.get('rip', 0):#x}<br>sp={s.regs.get('rsp', 0):#x}<br>"
            f"{s.flags_text()} cs={s.regs.get('cs', 0):#x}</code></td>"
            f"<td>{html.escape(', '.join(s.changed))}</td><td>{html.escape(s.note)}</td></tr>"
            for s in f.steps)
        facts = "".join(f"<li>{html.escape(x)}</li>" for x in f.facts)
        body.append(f'<section class="flow" id="{html.escape(f.kind)}"><h2>{html.escape(f.kind)}: '
                    f'{html.escape(f.probe)}</h2>{_svg(f)}<ul>{facts}</ul>'
                    f'<table class="steps"><tr><th>#</th><th>lane</th><th>step</th><th>where</th>'
                    f'<th>instruction</th><th>registers</th><th>changed</th><th>note</th></tr>'
                    f'{rows}</table></section>')
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font:14px sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top;font-size:12px}}
code{{font-size:11px}}section{{margin-bottom:3em}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>A real in-guest kprobe, observed from the host through QEMU's gdbstub: silent breakpoints
along the kernel's path, each passed by a single-step. Lanes: user task, CPU, exception
entry, kprobes core, probe handler, instruction slot.</p>
{''.join(body)}</body></html>
"""


# ---------------------------------------------------------------- kernel matrix

def _kernel_verdict(k: Any) -> str:
    if k.error:
        return f"not run: {k.error}"
    d = k.diff
    if d.equivalent:
        return f"host = guest ({d.total_matched} events matched)"
    return "host != guest: " + d.divergences[0].describe(d.a_side, d.b_side)


def _registered(k: Any) -> str:
    if k.guest is None:
        return "-"
    ok = sum(1 for o in k.guest.outcomes if o.accepted)
    return f"{ok}/{len(k.guest.outcomes)}"


def _events_cell(k: Any) -> str:
    if k.diff is None:
        return "-"
    return ", ".join(f"{p.split('/')[-1]} {nb}" for p, (_, nb) in k.diff.counts.items()) or "0"


def _diff_line(d: Any) -> str:
    vals = " | ".join(f"{v!s} ({', '.join(ks)})" for v, ks in d.groups())
    where = f" (event {d.index + 1})" if d.index >= 0 else ""
    note = f"  [{d.note}]" if d.note else ""
    return f"  {d.probe:22s} {d.what}{where}: {vals}{note}"


def matrix_text(res: Any) -> str:
    """The matrix as text: a row per kernel, then what the guests do differently."""
    out = [f"kph matrix: {len(res.kernels)} kernel(s), workload {res.workload!r}",
           f"  {'kernel':7s} {'abi':30s} {'registered':10s} {'guest events':28s} host vs guest"]
    for k in res.kernels:
        out.append(f"  {k.series:7s} {k.abi:30s} {_registered(k):10s} {_events_cell(k):28s} "
                   f"{_kernel_verdict(k)}")
    ran = [k for k in res.kernels if k.guest is not None]
    if len(ran) >= 2:
        out.append("between kernels (the guests, on the same specs and workload):")
        out += [_diff_line(d) for d in res.differences] or ["  no difference"]
    verdict = ("every kernel: host and guest agree" if res.all_equivalent else
               "host and guest disagree (or did not run) on: "
               + ", ".join(k.series for k in res.kernels if not k.equivalent))
    out.append(f"result: {verdict}")
    return "\n".join(out) + "\n"


def matrix_json(res: Any) -> str:
    doc = {
        "workload": res.workload,
        "kernels": [{
            "series": k.series, "abi": k.abi, "error": k.error or None,
            "equivalent": k.equivalent,
            "outcomes": [dataclasses.asdict(o) for o in (k.guest.outcomes if k.guest else [])],
            "counts": {p: list(c) for p, c in (k.diff.counts.items() if k.diff else ())},
            "divergences": [dataclasses.asdict(d) for d in (k.diff.divergences if k.diff else [])],
            "guest_hits": [dataclasses.asdict(h) for h in (k.guest.hits if k.guest else [])],
        } for k in res.kernels],
        "differences": [dataclasses.asdict(d) for d in res.differences],
        "all_equivalent": res.all_equivalent,
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def matrix_html(res: Any) -> str:
    e = html.escape
    bad = ' class="bad"'
    rows = "".join(
        f"<tr{bad if not k.equivalent else ''}><td>{e(k.series)}</td>"
        f"<td><code>{e(k.abi)}</code></td><td>{e(_registered(k))}</td>"
        f"<td>{e(_events_cell(k))}</td><td>{e(_kernel_verdict(k))}</td></tr>"
        for k in res.kernels)
    series = [k.series for k in res.kernels if k.guest is not None]
    head = "".join(f"<th>{e(s)}</th>" for s in series)
    drows = "".join(
        f"<tr><td>{e(d.probe)}</td><td>{e(d.what)}"
        f"{'' if d.index < 0 else f' (event {d.index + 1})'}</td>"
        + "".join(f"<td><code>{e(dict(d.values).get(s, ''))}</code></td>" for s in series)
        + f"<td>{e(d.note)}</td></tr>" for d in res.differences)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kph matrix</title>
<style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 6px;vertical-align:top}}tr.bad{{background:#fcc}}
code{{font-size:12px}}</style></head><body>
<h1>kph matrix</h1><p>workload <code>{e(res.workload)}</code></p>
<table><tr><th>kernel</th><th>abi</th><th>registered</th><th>guest events</th>
<th>host vs guest</th></tr>{rows}</table>
<h2>Between kernels (the guests)</h2>
<table><tr><th>probe</th><th>what</th>{head}<th></th></tr>
{drows or '<tr><td colspan="9">no difference</td></tr>'}</table></body></html>
"""
