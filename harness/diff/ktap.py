"""Results as KTAP v1 (the kernel's Documentation/dev-tools/ktap.rst), for kernel CI.

Decides nothing, as :mod:`harness.diff.report`: each verb's result is turned into a tree
of :class:`Case` (one per probe line, per kernel, per scenario, per fuzz finding), each
with the status the verb's own verdict gave it, and :func:`render` writes the tree as
KTAP. :mod:`harness.diff.kcidb` writes the same tree as KCIDB.

The statuses and their KTAP lines (docs/ci.md):

- ``pass``: ``ok N NAME``;
- ``fail``: ``not ok N NAME``, what failed in a diagnostic line before it;
- ``skip``: ``ok N NAME # SKIP REASON`` (nothing measured: no hit on either side, a line
  both sides accepted without arming anything);
- ``xfail``: ``ok N NAME # XFAIL REASON``, a known bug shown where it is expected (a
  scenario of probes/scenarios/upstream/ met on the kernel without its fix), as kselftest
  writes it (``ksft_test_result_xfail()``);
- ``error``: ``not ok N NAME # ERROR REASON``: the harness could not run it (a kernel that
  did not boot, a verb that failed).

The kernel's own parser (tools/testing/kunit/kunit_parser.py) counts ``xfail`` as passed
(it knows no directive but SKIP) and ``error`` as failed; :func:`counts` gives what kph
decided in both ways.
"""
from __future__ import annotations

import errno as _errno_mod
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from .verdict import DiffResult

STATUSES = ("pass", "fail", "skip", "xfail", "error")


@dataclass
class Case:
    """One test: a leaf with a status, or a parent of subtests (its status from them)."""

    name: str
    status: str = "pass"
    reason: str = ""
    subtests: list[Case] = field(default_factory=list)
    #: diagnostic lines written before the result line (without the ``# ``)
    diagnostics: list[str] = field(default_factory=list)
    #: the kernel it ran on (a series, an ABI), for KCIDB's builds; inherited by subtests
    kernel: str = ""
    #: the known bug an ``xfail`` shows (KCIDB: an issue and its incident)
    issue: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")

    @classmethod
    def parent(cls, name: str, subtests: list[Case], **kw: Any) -> Case:
        """A parent's status from its subtests (ktap.rst: a parent fails when one of its
        subtests fails; skipped subtests do not change it; all skipped is skipped)."""
        leaves = [c.status for c in subtests]
        status = ("fail" if any(s in ("fail", "error") for s in leaves) else
                  "skip" if leaves and all(s == "skip" for s in leaves) else "pass")
        return cls(name, status, subtests=subtests, **kw)

    def leaves(self) -> Iterator[Case]:
        if not self.subtests:
            yield self
        for c in self.subtests:
            yield from c.leaves()


def counts(cases: list[Case]) -> dict[str, int]:
    """What kph decided, per leaf: each status's count, and the same as the kernel's
    parser counts it (``passed`` = pass + xfail, ``failed`` = fail + error)."""
    n = {s: 0 for s in STATUSES}
    for c in cases:
        for leaf in c.leaves():
            n[leaf.status] += 1
    return {**n, "passed": n["pass"] + n["xfail"], "failed": n["fail"] + n["error"],
            "skipped": n["skip"]}


def _clean(text: str) -> str:
    """One line without ``#`` (KTAP: a description is anything but ``#`` and newline)."""
    return re.sub(r"\s+", " ", text.replace("#", "no.")).strip()


def render(cases: list[Case], *, diagnostics: list[str] | tuple[str, ...] = ()) -> str:
    """The KTAP v1 document: version line, plan, each case (subtests indented two spaces,
    with a ``# Subtest: NAME`` line as KUnit writes it), then ``diagnostics``."""
    out = ["KTAP version 1", f"1..{len(cases)}"]
    _emit(cases, out, "")
    out += [f"# {_clean(d)}" for d in diagnostics]
    return "\n".join(out) + "\n"


def _emit(cases: list[Case], out: list[str], ind: str) -> None:
    for i, c in enumerate(cases, 1):
        name = _clean(c.name) or f"test{i}"
        if c.subtests:
            sub = ind + "  "
            out += [f"{sub}KTAP version 1", f"{sub}# Subtest: {name}", f"{sub}1..{len(c.subtests)}"]
            _emit(c.subtests, out, sub)
        out += [f"{ind}# {name}: {_clean(d)}" for d in c.diagnostics]
        ok = "not ok" if c.status in ("fail", "error") else "ok"
        directive = {"skip": "SKIP", "xfail": "XFAIL", "error": "ERROR"}.get(c.status)
        line = f"{ind}{ok} {i} {name}"
        if directive:
            line += f" # {directive}" + (f" {_clean(c.reason)}" if c.reason else "")
        elif c.reason:
            out.append(f"{ind}# {name}: {_clean(c.reason)}")
        out.append(line)


def error(verb: str, message: str) -> list[Case]:
    """A verb that failed before it had a result (a setup error, a lost VM): one test,
    ``not ok 1 kph-VERB # ERROR MESSAGE``."""
    return [Case(f"kph-{verb}", "error", message.strip().splitlines()[0] if message.strip()
                 else "failed")]


# -- kph diff ---------------------------------------------------------------------------

def diff_cases(res: DiffResult, *, kernel: str = "", empty_fails: bool = False,
               findings: list[str] | tuple[str, ...] = ()) -> list[Case]:
    """One test per probe line of a host-vs-guest result, its status what the verdict made
    of it: a divergence on it fails it, hits matched or a refusal both sides made (same
    errno) pass it, no hit on either side or a line both accepted without arming anything
    skips it. Then whatever else the verdict decided: ``strict`` fails when a normalization
    ran that --allow does not name; ``empty_fails`` (kph matrix, which counts an empty
    kernel as not agreeing) adds a failing ``measured`` test to an empty result; the
    kernel's own findings of the run (``findings``: one line each, a splat's headline) are
    a failing test ``kernel``, whatever the comparison said."""
    a, b = res.a_side, res.b_side
    cases: list[Case] = []
    silent = set(res.silent)
    armed, refused, pending = set(res.armed), set(res.both_refused), set(res.pending)
    for label, (x, y) in res.outcomes.items():
        probe = (x or y).probe if (x or y) is not None else label   # type: ignore[union-attr]
        divs = [d for d in res.divergences if d.probe in (label, probe)]
        if divs:
            c = Case(label, "fail", kernel=kernel,
                     diagnostics=[f"DIVERGED at {d.describe(a, b)}" for d in divs])
        elif label in refused:
            c = Case(label, "pass", f"both refused: {_errno(x)}", kernel=kernel)
        elif label in pending:
            why = (x.pending or y.pending) if x and y else ""   # type: ignore[union-attr]
            c = Case(label, "skip", f"accepted, not registered on either side: {why}".rstrip(": "),
                     kernel=kernel)
        elif label in armed and probe in silent:
            c = Case(label, "skip", "no hit on either side", kernel=kernel)
        elif label in armed:
            na, nb = res.counts.get(probe, (0, 0))
            c = Case(label, "pass", f"{res.matched.get(probe, 0)} events matched "
                     f"({a} {na}, {b} {nb})", kernel=kernel)
        else:
            c = Case(label, "pass", "not compared: " + _outcome(x, a) + "; " + _outcome(y, b),
                     kernel=kernel)
        cases.append(c)
    word = res.verdict_word
    if word == "diverged" and not any(c.status == "fail" for c in cases):
        cases.append(Case("verdict", "fail", kernel=kernel,
                          diagnostics=[f"DIVERGED at {res.divergences[0].describe(a, b)}"]))
    if word == "not-strict":
        v = res.strict_violations
        cases.append(Case("strict", "fail", kernel=kernel, diagnostics=[
            "NOT STRICT: normalizations applied that were not allowed: "
            + ", ".join(f"{k} ({n})" for k, n in v.items())]))
    if word == "empty" and empty_fails:
        cases.append(Case("measured", "fail", kernel=kernel, diagnostics=[
            "EMPTY: no probe both sides armed had a hit on either side"]))
    if findings:
        cases.append(Case("kernel", "fail", kernel=kernel, diagnostics=list(findings)))
    return cases


def _errno(o: Any) -> str:
    return _errno_mod.errorcode.get(o.errno, str(o.errno)) if o is not None else "?"


def _outcome(o: Any, side: str) -> str:
    if o is None:
        return f"{side}: not placed"
    return f"{side}: " + ("accepted" if o.accepted else f"refused {_errno(o)}")


def three_cases(pairs: list[DiffResult], *, kernel: str = "") -> list[Case]:
    """``kph diff --host both``: one test per pair of worlds, the probe lines its subtests."""
    return [Case.parent(f"{r.a_side}-vs-{r.b_side}", diff_cases(r, kernel=kernel), kernel=kernel)
            for r in pairs]


# -- kph matrix -------------------------------------------------------------------------

def matrix_cases(res: Any) -> tuple[list[Case], list[str]]:
    """One test per kernel, its probe lines as subtests (:func:`diff_cases`); a kernel
    that could not be run is ``not ok ... # ERROR`` with its reason. The differences
    between the kernels' guests (informative, no verdict) are the diagnostics."""
    cases = []
    for k in res.kernels:
        kernel = getattr(k, "abi", "") or k.name
        if k.diff is None:
            cases.append(Case(k.name, "error", k.error or "not run", kernel=kernel))
            continue
        cases.append(Case.parent(k.name, diff_cases(k.diff, kernel=kernel, empty_fails=True),
                                 kernel=kernel))
    diags = [f"between kernels: {d.probe} {d.what}"
             + (f" (event {d.index + 1})" if d.index >= 0 else "") + ": "
             + " | ".join(f"{v} ({', '.join(ks)})" for v, ks in d.groups())
             for d in getattr(res, "differences", [])]
    return cases, diags


# -- kph repro --------------------------------------------------------------------------

def _known_bug(scn: Any) -> bool:
    """A scenario of an upstream finding (it names the kernels and the fix: ``[kernels]``)
    reproduces a known bug of the kernels without that fix."""
    return bool(getattr(scn, "kernels", None))


def _scn_name(scn: Any) -> str:
    path = getattr(scn, "path", None)
    return path.stem if path is not None else str(scn.name)


def repro_cases(scn: Any, res: Any, *, kernel: str = "") -> list[Case]:
    """``kph repro SCENARIO``: one test. Met passes, or is ``XFAIL`` when the scenario is
    a known bug (probes/scenarios/upstream/); not met fails, with its reasons."""
    name = _scn_name(scn)
    if res.met and _known_bug(scn):
        return [Case(name, "xfail", f"known bug: {scn.name}", kernel=kernel, issue=name,
                     diagnostics=[res.cause])]
    if res.met:
        return [Case(name, "pass", res.cause, kernel=kernel)]
    return [Case(name, "fail", kernel=kernel, diagnostics=[res.cause, *res.reasons])]


def repro_kernels_cases(scn: Any, runs: list[Any]) -> list[Case]:
    """``kph repro --kernels``: one test for the scenario, one subtest per kernel. A kernel
    as expected passes (``XFAIL`` when that is the known bug shown: met, on a kernel
    without the fix), one not as expected fails."""
    name = _scn_name(scn)
    subs = []
    for r in runs:
        kernel = getattr(r.image, "version", "") or r.name
        if not r.as_expected:
            want = "MET" if r.expect_met else "NOT MET"
            subs.append(Case(r.name, "fail", kernel=kernel, diagnostics=[
                f"expected {want}: {r.result.cause}", *r.result.reasons]))
        elif r.result.met and _known_bug(scn):
            subs.append(Case(r.name, "xfail", f"known bug: {scn.name}", kernel=kernel,
                             issue=name, diagnostics=[r.result.cause]))
        else:
            subs.append(Case(r.name, "pass", r.result.cause, kernel=kernel))
    return [Case.parent(name, subs)]


def upstream_verify_cases(name: str, runs: list[Any],
                          changed: dict[str, tuple[str, str]] | None = None) -> list[Case]:
    """``kph upstream verify``: one test for the series, one subtest per kernel. The
    selftest failing where the fix is missing is the known bug shown (``XFAIL``), passing
    where it is applied passes; anything else fails, a kernel that could not run it is an
    error. Each subtest carries ftracetest's own result line; with ``changed`` (``--others``)
    one more subtest fails when another case's result moved with the fix."""
    subs = []
    for r in runs:
        line = r.line
        if r.result == "error" and r.why:
            subs.append(Case(r.kernel, "error", r.why, kernel=r.selector))
        elif not r.ok:
            subs.append(Case(r.kernel, "fail", kernel=r.selector, diagnostics=[
                f"expected the selftest to {r.expected}, it gave {r.result}", line]))
        elif r.expected == "fail":
            subs.append(Case(r.kernel, "xfail", f"known bug: {name}", kernel=r.selector,
                             issue=name, diagnostics=[line]))
        else:
            subs.append(Case(r.kernel, "pass", kernel=r.selector, diagnostics=[line]))
    if changed is not None:     # --others: every other case the same with the fix
        subs.append(Case("other cases unchanged", "fail" if changed else "pass", diagnostics=[
            f"{n}: {a} -> {b}" for n, (a, b) in changed.items()]))
    return [Case.parent(name, subs)]


def replay_cases(bundle: str, same: bool, met: bool, reasons: list[str]) -> list[Case]:
    """``kph repro --replay``: one test, passed when the replay is identical and met."""
    ok = same and met
    return [Case("replay", "pass" if ok else "fail", diagnostics=
                 [f"bundle {bundle}"] + ([] if ok else list(reasons) or ["replay differs"]))]


# -- kph fuzz ---------------------------------------------------------------------------

def fuzz_cases(doc: dict[str, Any], shards: list[dict[str, Any]], *, kernel: str = "") -> list[Case]:
    """``kph fuzz``: the examples that agreed (one test), those not mirrored (skipped,
    with the reasons), and one failing test per finding (its kind and first line)."""
    agreed_runs = sum(s.get("agreed_runs", 0) for s in shards)
    agreed_ref = sum(s.get("agreed_refusals", 0) for s in shards)
    cases = [Case("agreed", "pass", f"{doc.get('examples', 0)} examples: {agreed_runs} agreed "
                  f"on events, {agreed_ref} on refusals", kernel=kernel)]
    unmirrored = sum(s.get("not_mirrored", 0) for s in shards)
    if unmirrored:
        why: dict[str, int] = {}
        for s in shards:
            for w, n in s.get("not_mirrored_why", {}).items():
                why[w] = why.get(w, 0) + n
        cases.append(Case("not-mirrored", "skip", f"{unmirrored} example(s) not mirrored: "
                          + "; ".join(f"{w}: {n}" for w, n in sorted(why.items(),
                                                                   key=lambda kv: -kv[1])),
                          kernel=kernel))
    for i, f in enumerate(doc.get("findings", []), 1):
        detail = (f.get("detail") or "").splitlines()
        cases.append(Case(f"finding-{i}-{f.get('kind', '?')}", "fail", kernel=kernel,
                          diagnostics=[*(detail[:1] or ["finding"]),
                                       *(f"line: {ln}" for ln in f.get("lines", ())),
                                       *(["flaky: did not repeat on replay"] if f.get("flaky")
                                         else [])]))
    return cases
