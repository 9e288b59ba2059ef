"""Render a differential result as text, JSON or one self-contained HTML page. Decides nothing."""
from __future__ import annotations

import dataclasses
import html
import json
from typing import Any, Sequence

from .verdict import NORMALIZATIONS, DiffResult
from ..kernel.splat import headline
from ..records import Hit, SideResult


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
    if res.silent:
        out.append("no hit on either side (armed on both, not part of any agreement): "
                   + ", ".join(res.silent))
    if res.uncounted:
        out.append(f"nmissed not compared for {len(res.uncounted)} probe(s), no counter on one "
                   "side: " + ", ".join(f"{p} (none on {s})" for p, s in res.uncounted.items()))
    applied = [f"{k} ({v})" for k, v in res.applied.items() if v]
    if applied:
        out.append("normalizations applied: " + ", ".join(applied)
                   + "  (see docs/diff.md; nothing else is normalized)")
    out.append("result: " + result_line(res))
    if not res.agrees:
        d = res.divergences[0]
        for side, ctx in ((a, d.a_context), (b, d.b_context)):
            if ctx:
                out.append(f"  context on {side}:")
                out += [f"    {h.seq:4d} {h.line()}" for h in ctx]
        if len(res.divergences) > 1:
            out.append(f"  ({len(res.divergences) - 1} more probe(s) diverge)")
    return "\n".join(out) + "\n"


def findings_text(splats: Sequence[Any], *, full_text: str | None = None) -> str:
    """The kernel's splats of a run (``harness.kernel.splat``) for people: the run's
    verdict when its window had one, then each splat's headline and text; "" for none.
    ``full_text`` names the file that holds the texts: then only the headlines are shown
    (``kph repro``, whose scenario already quotes the lines it matched)."""
    if not splats:
        return ""
    head = headline(splats)
    n = len([s for s in splats if not s.before])
    out = [f"kernel: {head}: {n} kernel report(s) during the run" if head else
           "kernel: nothing during the run; printed before it (boot or an earlier run):"]
    for s in splats:
        out.append("  " + s.headline())
        if full_text is None:
            out += ["    | " + ln for ln in s.text.splitlines()]
    if full_text is not None:
        out.append(f"  (the kernel's text: {full_text})")
    return "\n".join(out) + "\n"


def findings_json(splats: Sequence[Any]) -> dict[str, Any]:
    """The same as JSON: ``verdict`` (None: no splat during the run) and ``splats``."""
    return {"verdict": headline(splats), "splats": [s.to_json() for s in splats]}


def result_line(res: DiffResult) -> str:
    """The verdict in one line, its first word the result's kind: ``DIVERGED at ...``,
    ``EMPTY: ...`` (nothing measured), ``NOT STRICT: ...`` or the equivalent verdict."""
    word = res.verdict_word
    if word == "diverged":
        return "DIVERGED at " + res.divergences[0].describe(res.a_side, res.b_side)
    if word == "empty":
        return ("EMPTY: no probe both sides armed had a hit on either side ("
                + ", ".join(res.silent) + "): nothing was compared (--expect-empty if "
                "that is the expected result)")
    if word == "not-strict":
        v = res.strict_violations
        return ("NOT STRICT: normalizations applied that were not allowed: "
                + ", ".join(f"{k} ({n})" for k, n in v.items())
                + f" (allow them with --allow {','.join(v)})")
    return verdict(res)


def verdict(res: DiffResult) -> str:
    """The verdict of an equivalent result, naming only what was measured: hits compared
    on probes both sides armed, refusals both sides made (with the kernel's reason), and
    lines both sides accepted without arming anything."""
    parts = []
    if res.armed:
        if res.total_matched:
            per = ", ".join(str(n) for n in res.matched.values())
            parts.append(f"equivalent: {res.total_matched} events matched on each side ({per})")
            if res.silent:
                parts.append("no hit on either side: " + ", ".join(res.silent))
        elif res.empty:
            parts.append("empty, as expected: no events on either side (nothing compared "
                         "field by field)")
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


_HIT_FIELDS = tuple(f.name for f in dataclasses.fields(Hit))


def hit_doc(h: Hit) -> dict[str, Any]:
    """A hit as JSON's dict: ``dataclasses.asdict(h)`` without its deep copy (a hit's
    fields are text, numbers and tuples of them; ``json`` writes the tuples as lists).
    A run of 100,000 hits spent seconds in ``asdict``'s copying."""
    return {f: getattr(h, f) for f in _HIT_FIELDS}


def side_doc(r: SideResult) -> dict[str, Any]:
    """A side's result as JSON's dict (``dataclasses.asdict``, its hits by :func:`hit_doc`)."""
    doc = dataclasses.asdict(dataclasses.replace(r, hits=[]))
    doc["hits"] = [hit_doc(h) for h in r.hits]
    return doc


def json_doc(res: DiffResult, runs: tuple[SideResult, SideResult] | None = None) -> dict[str, Any]:
    """The comparison as JSON's document (:func:`to_json` writes it)."""
    doc: dict[str, Any] = {
        "equivalent": res.equivalent, "result": res.verdict_word,
        "sides": [res.a_side, res.b_side],
        "verdict": result_line(res),
        "both_refused": res.both_refused, "pending": res.pending, "silent": res.silent,
        "strict": res.strict, "allow": sorted(res.allow),
        "strict_violations": res.strict_violations,
        "matched": res.matched, "counts": {k: list(v) for k, v in res.counts.items()},
        "modes": res.modes, "uncounted": res.uncounted,
        "normalizations": {k: {"count": n, "rule": NORMALIZATIONS[k]}
                           for k, n in res.applied.items() if n},
        "divergences": [dataclasses.asdict(d) for d in res.divergences],
        "normalized": [dataclasses.asdict(n) for n in res.normalized],
    }
    if runs:
        doc["runs"] = [side_doc(r) for r in runs]
    return doc


def to_json(res: DiffResult, runs: tuple[SideResult, SideResult] | None = None) -> str:
    return json.dumps(json_doc(res, runs), indent=2, default=str) + "\n"


def hits_json(hits: list[Hit]) -> str:
    return json.dumps([hit_doc(h) for h in hits], indent=1) + "\n"


#: Above this many hits a probe gets a timeline and its full table folds away
#: (the rows around the first divergence, or the first few, stay visible).
TIMELINE_MIN = 12
_SHOWN_ROWS = 8

_CSS = """
body{font:14px/1.4 sans-serif;margin:1.5em;color:#222}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .4em}
table{border-collapse:collapse;margin:.5em 0;width:100%;table-layout:auto}
td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top;text-align:left}
th{background:#f3f3f3}
td.hit{font:12px/1.35 monospace;overflow-wrap:anywhere;word-break:break-word;width:45%}
td.n{width:3em;text-align:right;white-space:nowrap}
tr.bad td{background:#fde2e2}tr.bad td.n{font-weight:bold}
tr.norm td.n{background:#fff4cc}
.verdict{padding:.5em .8em;border-radius:4px;font-weight:bold;overflow-wrap:anywhere}
.ok{background:#e3f5e1}.div{background:#fde2e2}
span.f{border-radius:2px}
span.badf{background:#f08080;outline:2px solid #c00;font-weight:bold}
span.normf{background:#ffe08a}
sup.rule{font:bold 10px sans-serif;color:#7a5a00;background:#fff4cc;border:1px solid #e0c060;
 border-radius:3px;padding:0 2px;margin-left:2px;white-space:nowrap}
code{font-size:12px;overflow-wrap:anywhere}
.legend span{display:inline-block;margin-right:1.2em}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
svg.timeline{display:block;width:100%;height:auto;max-width:1400px}
td.status{white-space:nowrap}
"""


def _hit_html(h: Hit | None, bad_field: str | None, norms: dict[str, str]) -> str:
    """A hit as the trace prints it, each field a span (``data-field``): the diverging
    field marked ``badf``, a normalized one ``normf`` with its rule as a badge."""
    if h is None:
        return '<span class="f badf" data-field="count">(no hit)</span>' if bad_field == "count" else ""
    e = html.escape

    def span(fld: str, text: str) -> str:
        cls = "f"
        badge = ""
        if fld == bad_field:
            cls += " badf"
        elif fld in norms:
            cls += " normf"
            badge = f'<sup class="rule" title="{e(NORMALIZATIONS.get(norms[fld], ""))}">{e(norms[fld])}</sup>'
        return f'<span class="{cls}" data-field="{e(fld)}">{e(text)}</span>{badge}'
    ip = span("ip", h.ip) + (f" &lt;- {span('ret_from', h.ret_from)}" if h.ret_from else "")
    args = "".join(" " + span(f"arg:{k}", f"{k}={v}") for k, v in h.args)
    kind = span("kind", h.kind) if bad_field == "kind" else ""
    return (f"{span('comm', h.comm)}-{span('pid', str(h.pid))} [{h.cpu:03d}] {kind}"
            f"{e(h.probe)}: ({ip}){args}")


def _timeline(probe: str, la: list[Hit], lb: list[Hit], bad: int | None,
              norm_rows: set[int], names: tuple[str, str]) -> str:
    """One tick per hit on each side, in comparison order: matched, normalized,
    diverging, not compared (after the divergence, or only on one side)."""
    n = max(len(la), len(lb), 1)
    w, pad, lab = 1000, 6, 70
    step = (w - lab - 2 * pad) / max(n - 1, 1)
    out = [f'<svg class="timeline" viewBox="0 0 {w} 64" role="img" '
           f'aria-label="hit timeline of {html.escape(probe)}" font-family="sans-serif" font-size="11">']
    for row, (hits, name) in enumerate(((la, names[0]), (lb, names[1]))):
        y = 14 + row * 24
        out.append(f'<text x="0" y="{y + 4}">{html.escape(name)}</text>')
        out.append(f'<line x1="{lab}" y1="{y}" x2="{w - pad}" y2="{y}" stroke="#ddd"/>')
        for i in range(len(hits)):
            color = ("#c00" if i == bad else "#bbb" if bad is not None and i > bad else
                     "#bbb" if i >= min(len(la), len(lb)) else
                     "#d9a400" if i in norm_rows else "#3a9a3a")
            x = lab + pad + i * step
            out.append(f'<rect x="{x - 1.5:.1f}" y="{y - 8}" width="3" height="16" fill="{color}">'
                       f'<title>hit #{i + 1}</title></rect>')
    out.append(f'<text x="{lab}" y="56" fill="#666">hit 1</text>'
               f'<text x="{w - pad}" y="56" fill="#666" text-anchor="end">hit {n}</text></svg>')
    return "".join(out)


def _probe_status(res: DiffResult, probe: str) -> tuple[str, bool]:
    d = next((d for d in res.divergences if d.probe == probe), None)
    if d is not None:
        where = f"hit #{d.index + 1}, " if d.index >= 0 else ""
        return f"DIVERGED: {where}{d.field}", True
    x, y = res.outcomes.get(probe, (None, None))
    if x is not None and y is not None and not x.accepted and not y.accepted:
        return "both refused", False
    if x is not None and x.pending:
        return "accepted, nothing armed", False
    return f"equivalent ({res.matched.get(probe, 0)} matched)", False


def to_html(res: DiffResult, runs: tuple[SideResult, SideResult], *, workload: str = "") -> str:
    """The whole result as one self-contained page: a summary row for every probe (the
    diverging one highlighted), the normalizations that applied, and per probe its
    registration, counters, a hit timeline when there are many hits, and its hits side
    by side with the diverging hit and field highlighted and normalized fields marked
    with their rule."""
    e = html.escape
    a_run, b_run = runs
    A, B = res.a_side, res.b_side
    probes = list(dict.fromkeys([*res.outcomes, *res.counts, *(d.probe for d in res.divergences)]))
    said = result_line(res)
    rows, sections = [], []
    for k, probe in enumerate(probes):
        status, bad = _probe_status(res, probe)
        x, y = res.outcomes.get(probe, (None, None))
        na, nb = res.counts.get(probe, (0, 0))
        mode = res.modes.get(probe, "")
        anchor = f"p{k}"
        cls = ' class="bad"' if bad else ""
        rows.append(f'<tr{cls} data-probe="{e(probe)}">'
                    f'<td><a href="#{anchor}">{e(probe)}</a></td><td>{e(mode)}</td>'
                    f'<td>{e(_o(x))}</td><td>{e(_o(y))}</td><td class="n">{na}</td>'
                    f'<td class="n">{nb}</td><td class="n">{res.matched.get(probe, 0)}</td>'
                    f'<td class="status">{e(status)}</td></tr>')
        sections.append(_probe_section(res, probe, anchor, status, bad, a_run, b_run))
    legend = "".join(
        f"<li><b>{e(k)}</b> ({v}): {e(NORMALIZATIONS[k])}</li>"
        for k, v in res.applied.items() if v)
    return f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kph diff: {e(A)} vs {e(B)}</title><style>{_CSS}</style></head><body>
<h1>kph diff: {e(A)} vs {e(B)}</h1>
<p>workload <code>{e(workload)}</code> ({e(workload_status(a_run.workload_status, a_run.workload_stderr))})</p>
<p class="verdict {"ok" if res.equivalent else "div"}" id="verdict">{e(said)}</p>
<h2>Probes</h2>
<table class="summary"><tr><th>probe</th><th>mode</th><th>{e(A)}</th><th>{e(B)}</th>
<th>{e(A)} hits</th><th>{e(B)} hits</th><th>matched</th><th>status</th></tr>
{"".join(rows)}</table>
<h2>Normalizations</h2>
<ul class="normalizations">{legend or "<li>none applied</li>"}</ul>
<p class="legend"><span><i class="sw" style="background:#f08080"></i>diverging field</span>
<span><i class="sw" style="background:#ffe08a"></i>normalized field (its rule as a badge)</span>
<span><i class="sw" style="background:#3a9a3a"></i>matched hit</span>
<span><i class="sw" style="background:#bbb"></i>not compared</span></p>
{"".join(sections)}
</body></html>
"""


def _probe_section(res: DiffResult, probe: str, anchor: str, status: str, bad: bool,
                   a_run: SideResult, b_run: SideResult) -> str:
    e = html.escape
    A, B = res.a_side, res.b_side
    la, lb = res.compared.get(probe, ([], []))
    div = next((d for d in res.divergences if d.probe == probe), None)
    bad_i = div.index if div is not None and div.index >= 0 else None
    norms: dict[int, dict[str, str]] = {}
    for nm in res.normalized:
        if nm.probe == probe and nm.index >= 0:
            norms.setdefault(nm.index, {})[nm.field] = nm.rule
    parts = [f'<section class="probe" id="{anchor}"><h2>{e(probe)} '
             f'<span class="verdict {"div" if bad else "ok"}">{e(status)}</span></h2>']
    x, y = res.outcomes.get(probe, (None, None))
    if x is not None or y is not None:
        parts.append(f"<p>registration: {e(A)} {e(_o(x))}; {e(B)} {e(_o(y))}</p>")
    whole = {nm.field: nm.rule for nm in res.normalized if nm.probe == probe and nm.index < 0}
    ca, cb = a_run.counters.get(probe), b_run.counters.get(probe)
    if ca is not None or cb is not None:
        nm_bad = div is not None and div.field == "nmissed"
        nh_bad = div is not None and div.field == "nhit"
        nhit = (f'<sup class="rule" title="{e(NORMALIZATIONS["nhit"])}">nhit</sup>'
                if "nhit" in whole else "")
        parts.append("<p>counters: " + "; ".join(
            f"{e(side)} <span class=\"f{' normf' if nhit else ''}{' badf' if nh_bad else ''}\" "
            f"data-field=\"nhit\">nhit "
            f"{c.nhit}</span>{nhit}, <span class=\"f{' badf' if nm_bad else ''}\" "
            f"data-field=\"nmissed\">nmissed {c.nmissed}</span>"
            for side, c in ((A, ca), (B, cb)) if c is not None) + "</p>")
    if "order" in whole:
        rule = whole["order"]
        how = {"thread-order": "thread by thread",
               "irq-order": "per context of the probed call (task, interrupt)"}.get(rule, "")
        parts.append(f'<p>hits compared {e(how)} <sup class="rule" title="'
                     f'{e(NORMALIZATIONS[rule])}">{e(rule)}</sup></p>')
    moved = [nm.index for nm in res.normalized if nm.probe == probe and nm.rule == "preempt-order"]
    if moved:
        parts.append(f"<p>{len(moved)} hit(s) moved back in front of a preempting task's hits "
                     f"(#{', #'.join(str(i + 1) for i in moved)}) <sup class=\"rule\" title=\""
                     f'{e(NORMALIZATIONS["preempt-order"])}">preempt-order</sup></p>')
    out_a, out_b = res.left_out.get(probe, (0, 0))
    if out_a or out_b:
        parts.append(f"<p>left out by <b>agent</b>: {out_a} {e(A)} and {out_b} {e(B)} hits of "
                     "the harness's guest agent</p>")
    if div is not None:
        parts.append(f'<p class="verdict div">{e(div.describe(A, B))}</p>')
    n = max(len(la), len(lb))
    if n == 0:
        parts.append("<p>no hits on either side</p></section>")
        return "".join(parts)

    def row(i: int) -> str:
        is_bad = i == bad_i
        bf = div.field if is_bad and div is not None else None
        nr = norms.get(i, {})
        cls = "bad" if is_bad else "norm" if nr else ""
        return (f'<tr class="{cls}" data-index="{i}"><td class="n">{i + 1}</td>'
                f'<td class="hit">{_hit_html(la[i] if i < len(la) else None, bf, nr)}</td>'
                f'<td class="hit">{_hit_html(lb[i] if i < len(lb) else None, bf, nr)}</td></tr>')
    head = f'<tr><th>#</th><th>{e(A)}</th><th>{e(B)}</th></tr>'
    if n < TIMELINE_MIN:
        parts.append(f'<table class="hits">{head}{"".join(row(i) for i in range(n))}</table>')
    else:
        parts.append(_timeline(probe, la, lb, bad_i, set(norms), (A, B)))
        if bad_i is not None:
            shown = range(max(0, bad_i - 3), min(n, bad_i + 4))
            what = f"hits {shown.start + 1}-{shown.stop} (around the divergence)"
        else:
            shown = range(min(n, _SHOWN_ROWS))
            what = f"the first {len(shown)} hits"
        parts.append(f'<p>{n} hits; {what}:</p><table class="hits">{head}'
                     f'{"".join(row(i) for i in shown)}</table>'
                     f'<details><summary>all {n} hits</summary><table class="hits">{head}'
                     f'{"".join(row(i) for i in range(n))}</table></details>')
    parts.append("</section>")
    return "".join(parts)


# ---------------------------------------------------------------- kernel matrix

def _kernel_verdict(k: Any) -> str:
    if k.error:
        return f"not run: {k.error}"
    d = k.diff
    if d.equivalent:
        return f"host = guest ({d.total_matched} events matched)"
    if d.agrees:
        return result_line(d)
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
    w = max([7] + [len(k.name) for k in res.kernels])
    rules = any(k.rules and k.rules != k.name for k in res.kernels)
    out = [f"kph matrix: {len(res.kernels)} kernel(s), workload {res.workload!r}",
           f"  {'kernel':{w}s} {'abi':30s} " + ("rules " if rules else "")
           + f"{'registered':10s} {'guest events':28s} host vs guest"]
    for k in res.kernels:
        out.append(f"  {k.name:{w}s} {k.abi:30s} " + (f"{k.rules:5s} " if rules else "")
                   + f"{_registered(k):10s} {_events_cell(k):28s} {_kernel_verdict(k)}")
    ran = [k for k in res.kernels if k.guest is not None]
    if len(ran) >= 2:
        out.append("between kernels (the guests, on the same specs and workload):")
        out += [_diff_line(d) for d in res.differences] or ["  no difference"]
    verdict = ("every kernel: host and guest agree" if res.all_equivalent else
               "host and guest disagree (or did not run) on: "
               + ", ".join(k.name for k in res.kernels if not k.equivalent))
    out.append(f"result: {verdict}")
    return "\n".join(out) + "\n"


def matrix_json(res: Any) -> str:
    doc = {
        "workload": res.workload,
        "kernels": [{
            "series": k.name, "abi": k.abi, "rules": k.rules, "error": k.error or None,
            "equivalent": k.equivalent,
            "outcomes": [dataclasses.asdict(o) for o in (k.guest.outcomes if k.guest else [])],
            "counts": {p: list(c) for p, c in (k.diff.counts.items() if k.diff else ())},
            "divergences": [dataclasses.asdict(d) for d in (k.diff.divergences if k.diff else [])],
            "guest_hits": [hit_doc(h) for h in (k.guest.hits if k.guest else [])],
        } for k in res.kernels],
        "differences": [dataclasses.asdict(d) for d in res.differences],
        "all_equivalent": res.all_equivalent,
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def matrix_html(res: Any) -> str:
    e = html.escape
    bad = ' class="bad"'
    rows = "".join(
        f"<tr{bad if not k.equivalent else ''}><td>{e(k.name)}</td>"
        f"<td><code>{e(k.abi)}</code></td><td>{e(_registered(k))}</td>"
        f"<td>{e(_events_cell(k))}</td><td>{e(_kernel_verdict(k))}</td></tr>"
        for k in res.kernels)
    series = [k.name for k in res.kernels if k.guest is not None]
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
