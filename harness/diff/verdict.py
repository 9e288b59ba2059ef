"""Compare what two sides recorded for one workload and name the first divergence.

Pure: ``SideResult`` records in, a ``DiffResult`` out, no I/O. Both sides observe the
*same* execution (``harness.diff.runner`` arms the in-guest probes first and the host-side ones
on top), so every field of every hit is comparable: pointers, comms, return values.

Normalizations: the registry in ``harness.diff.rules`` (each rule with its kernel reason,
the evidence it needs before it applies, and its apply step), run in order; nothing else is
normalized, and each one applied is counted and named in every report.

Compared, or named: every field of every compared pair of hits, the order of hits across
probes within one task on one CPU in one context (``field`` ``order``), and ``nmissed``
wherever both sides have a counter; a probe that one side has no counter for is named
(``DiffResult.uncounted``), never passed over in silence.

Nothing measured is no verdict: when no probe both sides armed has a hit on either side,
the result is *empty*, not equivalent (unless the caller expects it, ``expect_empty``),
and each armed probe without a hit on either side is named (``DiffResult.silent``).
``strict``: any normalization applied that the caller did not ``allow`` is a failure.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from itertools import compress, islice

from ..records import Hit, Outcome, SideResult, gc_paused
from . import rules as _rules
from .rules import (AGENT_COMMS, GUEST_SIDES, NORMALIZATIONS, UNKNOWN_RULES, UNKNOWN_TEXT,
                    Ctx, stack_match)

__all__ = ["compare", "DiffResult", "Divergence", "Normalized", "NORMALIZATIONS",
           "AGENT_COMMS", "UNKNOWN_TEXT", "UNKNOWN_RULES", "stack_match"]


@dataclass(frozen=True)
class Divergence:
    """The first place where the two sides disagree for one probe."""

    probe: str
    field: str                  # registration, count, kind, comm, ip, ret_from, arg:NAME, nmissed, nhit
    index: int                  # hit number (0-based), -1 for registration and counters
    a_value: str
    b_value: str
    a_context: tuple[Hit, ...] = ()
    b_context: tuple[Hit, ...] = ()

    def describe(self, a_side: str, b_side: str) -> str:
        where = f"hit #{self.index + 1}" if self.index >= 0 else "probe"
        return (f"{self.probe}: {where}, field {self.field}: "
                f"{a_side} {self.a_value!r} vs {b_side} {self.b_value!r}")


@dataclass(frozen=True)
class Normalized:
    """One field of one compared hit pair that a normalization made equal (for reports)."""

    probe: str
    index: int                  # hit number (0-based) in ``DiffResult.compared[probe]``;
                                # -1 for a rule on the whole probe (thread-order, nhit)
    field: str                  # ip, comm, arg:NAME
    rule: str                   # a key of NORMALIZATIONS
    a_value: str
    b_value: str


@dataclass
class DiffResult:
    a_side: str
    b_side: str
    matched: dict[str, int] = field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    applied: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, tuple[Outcome | None, Outcome | None]] = field(default_factory=dict)
    #: Per probe, the two hit sequences exactly as compared (agent hits left out, uprobe
    #: hits in thread order): ``Divergence.index`` and ``Normalized.index`` point into them.
    compared: dict[str, tuple[list[Hit], list[Hit]]] = field(default_factory=dict)
    #: Every field a normalization made equal, in comparison order.
    normalized: list[Normalized] = field(default_factory=list)
    #: Probes one side counted and the other has no counter for (``nmissed`` not
    #: compared there): probe -> the side without one.
    uncounted: dict[str, str] = field(default_factory=dict)
    #: Per probe, how many hits each side had that the ``agent`` rule left out.
    left_out: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: An empty result (no armed probe fired) is what the caller expects.
    expect_empty: bool = False
    #: Fail on any normalization applied that is not in ``allow``.
    strict: bool = False
    allow: frozenset[str] = frozenset()

    @property
    def agrees(self) -> bool:
        """No divergence (whether or not anything was measured)."""
        return not self.divergences

    @property
    def silent(self) -> list[str]:
        """Probes both sides armed that have no hit on either side (agent hits aside)."""
        out = []
        for k in self.armed:
            p = self.outcomes[k][0].probe      # type: ignore[union-attr]
            if self.counts.get(p, (0, 0)) == (0, 0) and p not in out:
                out.append(p)
        return out

    @property
    def empty(self) -> bool:
        """Both sides armed probes and none fired on either side: nothing was measured."""
        return bool(self.armed) and len(self.silent) == len(
            {self.outcomes[k][0].probe for k in self.armed})   # type: ignore[union-attr]

    @property
    def strict_violations(self) -> dict[str, int]:
        """Under ``strict``: each normalization applied that ``allow`` does not name."""
        if not self.strict:
            return {}
        return {k: n for k, n in self.applied.items() if n and k not in self.allow}

    @property
    def verdict_word(self) -> str:
        """``equivalent``, ``diverged``, ``empty`` (nothing measured) or ``not-strict``."""
        if self.divergences:
            return "diverged"
        if self.empty and not self.expect_empty:
            return "empty"
        if self.strict_violations:
            return "not-strict"
        return "equivalent"

    @property
    def equivalent(self) -> bool:
        """No divergence, something measured (or an empty result expected), and under
        ``strict`` no normalization the caller did not allow."""
        return self.verdict_word == "equivalent"

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    @property
    def total_matched(self) -> int:
        return sum(self.matched.values())

    @property
    def armed(self) -> list[str]:
        """Lines both sides accepted and registered (their hits were compared). A line is
        pending (never fires) only where *both* sides say so: the guest's own state
        (its kprobes list) confirms what the host says of itself."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and x.accepted and y.accepted and not (x.pending and y.pending)]

    @property
    def both_refused(self) -> list[str]:
        """Lines both sides refused with the same errno: agreement, on a refusal."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and not x.accepted and not y.accepted and x.errno == y.errno]

    @property
    def pending(self) -> list[str]:
        """Lines both sides accepted without registering a probe (they cannot fire)."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and x.accepted and y.accepted and x.pending and y.pending]


def _partition(hits: list[Hit], flying: bool) -> tuple[list[Hit], list[Hit], list[Hit]]:
    """(the hits compared: neither the agent's nor in flight, the agent's hits not in
    flight, every hit of the agent's comms), each in order; ``flying``: some hit is in
    flight. Selected in C (a hot probe's 100,000 hits), by each hit's comm."""
    agent = list(map(AGENT_COMMS.__contains__, map(_comm, hits)))
    every = list(compress(hits, agent))
    if flying:
        return ([h for h in hits if h.comm not in AGENT_COMMS and not h.in_flight],
                [h for h in every if not h.in_flight], every)
    return list(compress(hits, map(operator.not_, agent))), every, every


_in_flight = operator.attrgetter("in_flight")
_comm = operator.attrgetter("comm")


def _in_flight_checked(side: SideResult) -> tuple[SideResult, bool]:
    """``side`` with each ``in_flight`` mark the recorded order does not bear out taken off
    (the hit is then compared like any other), and whether a mark is left: only a host
    side marks, and a hit in flight when the recording ended is its CPU's last, but for
    hits also in flight or, for a task-context one, the interrupt hits nested in its
    window."""
    if not any(map(_in_flight, side.hits)):
        return side, False
    keep = side.side not in _rules.GUEST_SIDES

    def borne_out(f: Hit) -> bool:
        return keep and all(h.in_flight or (f.irq == "task" and h.irq == "irq")
                            for h in side.hits if h.cpu == f.cpu and h.seq > f.seq)
    hits = [h if not h.in_flight or borne_out(h) else dataclasses.replace(h, in_flight=False)
            for h in side.hits]
    return dataclasses.replace(side, hits=hits), any(map(_in_flight, hits))


def _agent_in_b(a: list[Hit], b: list[Hit]) -> list[Hit]:
    """Side ``b``'s hits that are side ``a``'s agent hits (``a``: those of the agent's
    comms, in their order) under a later comm: a child the
    agent forked hits before it execs (it opens /dev/null for the command's stdin), side
    ``a`` (the host) saw comm ``qemu-ga`` there, and the trace prints the comm the pid had
    when ``saved_cmdlines`` caught it, after the exec (``comm-change``). Per pid, as many
    of ``b``'s first hits of that pid as ``a`` left out, when their comm is one the pid
    took after ``a``'s hit, as both sides saw it (``a``'s and the hit's own ``comm_alts``)."""
    owed: dict[int, list[Hit]] = {}
    for h in a:
        if h.comm in AGENT_COMMS and h.pid is not None and h.comm_alts:
            owed.setdefault(h.pid, []).append(h)
    out: list[Hit] = []
    if not owed:
        return out
    for h in [h for h in b if h.pid in owed]:      # (None is never a key of owed)
        left = owed[h.pid]
        if left and h.probe == left[0].probe and h.comm in left[0].comm_alts \
                and h.comm in h.comm_alts:
            left.pop(0)
            out.append(h)
    return out


#: What :func:`_fields` is made of, raw: two hits equal here have equal fields (a
#: ``ret_from`` of None on one side and "" on the other differ here and not in
#: :func:`_fields`: such a pair goes on to :func:`_compare_pair`, which finds them equal).
#: One C call per hit, so a whole probe's pairs compare as two lists.
_same = operator.attrgetter("kind", "cpu", "comm", "ip", "ret_from", "pid", "irq", "args",
                            "stack", "excess", "post_ip")


def _fields(h: Hit) -> dict[str, str]:
    out = {"kind": h.kind, "cpu": str(h.cpu), "comm": h.comm, "ip": h.ip,
           "ret_from": h.ret_from or ""}
    if h.pid is not None:
        out["pid"] = str(h.pid)
    if h.irq:
        out["irq"] = h.irq
    out.update({f"arg:{k}": v for k, v in h.args})
    if h.stack is not None:
        out["stack"] = " ".join(h.stack)
    if h.excess:        # the record's length is not its data's (no side may differ here)
        out["record-size"] = f"{h.excess:+d} bytes beyond its fields and strings"
    if h.post_ip:       # the post_handler's ip is not where the instruction goes
        out["post-ip"] = h.post_ip
    return out


@gc_paused()
def compare(a: SideResult, b: SideResult, *, trampoline: str | tuple[str, ...] | None = None,
            context: int = 3, strict: bool = False, allow: "tuple[str, ...] | frozenset[str]" = (),
            expect_empty: bool = False) -> DiffResult:
    """Compare side ``a`` (usually host) with side ``b`` (events or module), running the
    rules of ``harness.diff.rules.REGISTRY`` stage by stage; last, the dynamic events
    each side says its lines left (``SideResult.events_left``, field ``event-list``).

    :param trampoline: how the host trampolines print in the guest (``_etext+0x0`` as an
        ip, ``0x...`` as a value: ``harness.diff.runner.trampoline_text``), for the
        ``trampoline`` rule; matched whole.
    :param strict: the result is not equivalent if any normalization other than those
        in ``allow`` was applied (``DiffResult.strict_violations``).
    :param expect_empty: a run in which no armed probe fired is equivalent, not empty.
    :raise ValueError: ``allow`` names a rule that is not in :data:`NORMALIZATIONS`.
    """
    bad = sorted(set(allow) - set(NORMALIZATIONS))
    if bad:
        raise ValueError(f"unknown normalization(s) {', '.join(bad)}; "
                         f"known: {', '.join(NORMALIZATIONS)}")
    res = DiffResult(a.side, b.side, expect_empty=expect_empty, strict=strict,
                     allow=frozenset(allow))
    tramps = () if not trampoline else (trampoline,) if isinstance(trampoline, str) \
        else tuple(trampoline)
    ctx = Ctx(a.side, b.side, tramps, b.preempt or a.preempt)
    _registrations(res, a, b)
    per_a, per_b = _compared_hits(res, a, b)
    pidless = (bool(a.hits) and all(h.pid is None for h in a.hits),
               bool(b.hits) and all(h.pid is None for h in b.hits))
    for probe in dict.fromkeys([*per_a, *per_b, *(x.probe for x, y in res.outcomes.values()
                                                   if x and y and x.accepted and y.accepted)]):
        pa, pb = per_a.get(probe, []), per_b.get(probe, [])
        n = min(len(pa), len(pb))
        # the pairs' raw fields, in C (two lists of _same tuples): pairs all alike have
        # nothing out of order either (_same holds the order rules' pid, context and CPU)
        sa, sb = list(map(_same, islice(pa, n))), list(map(_same, islice(pb, n)))
        la, lb = _ordered(res, probe, pa, pb, preempt=ctx.preempt in _rules.PREEMPTING_MODELS,
                          in_step=sa == sb)
        if la is not pa or lb is not pb:        # moved (or sorted): their tuples again
            sa, sb = list(map(_same, la[:n])), list(map(_same, lb[:n]))
        res.counts[probe] = (len(la), len(lb))
        res.compared[probe] = (la, lb)
        div = None
        matched = n
        # the pairs whose raw fields differ; only those go through the field rules, in
        # order, up to the first divergence
        unequal = () if sa == sb else (i for i in range(n) if sa[i] != sb[i])
        for i in unequal:
            ctx.following = (la[i + 1], lb[i + 1]) if i + 1 < n else None
            bad_field = _compare_pair(res, ctx, probe, i, la[i], lb[i], pidless)
            if bad_field is not None:
                fld, va, vb = bad_field
                div = Divergence(probe, fld, i, va, vb,
                                 tuple(la[max(0, i - context):i + context + 1]),
                                 tuple(lb[max(0, i - context):i + context + 1]))
                matched = i
                break
        if div is None and len(la) != len(lb):
            i = min(len(la), len(lb))
            div = Divergence(probe, "count", i, str(len(la)), str(len(lb)),
                             tuple(la[max(0, i - context):i + context]),
                             tuple(lb[max(0, i - context):i + context]))
        res.matched[probe] = matched
        if div is not None:
            res.divergences.append(div)
    order = _cross_order(res, context)
    if order is not None:
        res.divergences.append(order)
    _counters(res, a, b)
    _event_lists(res, a, b)
    return res


def _event_lists(res: DiffResult, a: SideResult, b: SideResult) -> None:
    """Stage ``event-list``: the dynamic events each side says are left after its lines
    (``SideResult.events_left``: the guest's ``dynamic_events`` after the run, the host's
    model of it), compared where both sides have one. A line one side still lists and the
    other does not (a refused line left behind, a removed one not gone) is a divergence
    of the probe ``dynamic_events``, field ``event-list``, each side's extra lines as its
    value."""
    la, lb = a.events_left, b.events_left
    if la is None or lb is None or sorted(la) == sorted(lb):
        return
    rest_b = list(lb)
    only_a = []
    for n in sorted(la):
        if n in rest_b:
            rest_b.remove(n)
        else:
            only_a.append(n)
    res.divergences.append(Divergence("dynamic_events", "event-list", -1,
                                      "only here: " + (", ".join(only_a) or "(nothing)"),
                                      "only here: " + (", ".join(sorted(rest_b)) or "(nothing)")))


def _count(res: DiffResult, rule: str, n: int = 1) -> None:
    res.applied[rule] = res.applied.get(rule, 0) + n


def _registrations(res: DiffResult, a: SideResult, b: SideResult) -> None:
    """Stage ``line``: each spec line's outcome on both sides."""
    oa, ob = _by_line(a.outcomes), _by_line(b.outcomes)
    for label, key in _labels([*oa.values(), *ob.values()]).items():
        x, y = oa.get(key), ob.get(key)
        res.outcomes[label] = (x, y)
        probe = (x or y).probe      # type: ignore[union-attr]
        if y is not None and y.mode:
            res.modes.setdefault(probe, y.mode)
        acc_x = x is not None and x.accepted
        acc_y = y is not None and y.accepted
        if (x is None and y is not None and not y.accepted) or (
                y is None and x is not None and not x.accepted):
            # refused on one side, never placed on the other: nothing to compare there
            _count(res, "refused-missing")
            res.normalized.append(Normalized(label, -1, "registration", "refused-missing",
                                             _outcome_text(x), _outcome_text(y)))
        elif acc_x != acc_y or (not acc_x and x is not None and y is not None
                                and x.errno != y.errno):
            res.divergences.append(Divergence(
                label, "registration", -1, _outcome_text(x), _outcome_text(y)))
        elif not acc_x and x is not None and y is not None:
            _refusal_words(res, label, x, y)
        elif x is not None and y is not None and bool(x.pending) != bool(y.pending):
            # pending on one side only: a side that lists the probe as armed in its own
            # kprobes list (its mode) says the other's "pending" is wrong
            armed = y if x.pending else x
            if armed.mode in _LISTED_MODES:
                res.divergences.append(Divergence(
                    label, "registration", -1, _pending_text(x), _pending_text(y)))


#: The modes a guest reads from its own /sys/kernel/debug/kprobes/list: the probe is armed.
_LISTED_MODES = ("ftrace", "int3", "optimized")


def _pending_text(o: Outcome) -> str:
    return f"accepted, pending ({o.pending})" if o.pending else \
        "accepted, armed" + (f" [{o.mode}]" if o.mode else "")


def _words(o: Outcome) -> tuple[str, str, int]:
    return o.error_log()


def _refusal_words(res: DiffResult, label: str, x: Outcome, y: Outcome) -> None:
    """Two refusals with one errno: the kernel's words (subsystem, message, caret column)
    are compared too, unless a side whose words differ names the case in which it cannot
    know them (``Outcome.words``; then ``refusal-text``, counted). A side that logged
    nothing (no message: the kernel's refusal at registration, the module's errno) is
    compared by errno."""
    if not x.message or not y.message or _words(x) == _words(y):
        return
    if x.words or y.words:
        _count(res, "refusal-text")
        res.normalized.append(Normalized(label, -1, "registration", "refusal-text",
                                         x.message, y.message))
        return
    res.divergences.append(Divergence(label, "refusal", -1, _words_text(x), _words_text(y)))


def _words_text(o: Outcome) -> str:
    sub, msg, col = _words(o)
    return (f"{sub}: " if sub else "") + msg + (f" (at {col})" if col >= 0 else "")


def _compared_hits(res: DiffResult, a: SideResult, b: SideResult
                   ) -> tuple[dict[str, list[Hit]], dict[str, list[Hit]]]:
    """Stage ``hits``: the ``agent`` and ``in-flight`` rules, then the hits of each side
    per probe."""
    (a, fly_in_a), (b, fly_in_b) = _in_flight_checked(a), _in_flight_checked(b)
    in_flight = fly_in_a, fly_in_b
    (ha, agent_a, every_a), (hb, agent_b, _) = _partition(a.hits, fly_in_a), \
        _partition(b.hits, fly_in_b)
    renamed = _agent_in_b(every_a, hb)
    if renamed:
        gone = {id(h) for h in renamed}
        hb = [h for h in hb if id(h) not in gone]
    fly_a, fly_b = ([h for h in s.hits if h.in_flight and h.comm not in AGENT_COMMS]
                    if f else [] for s, f in zip((a, b), in_flight))
    flying = fly_a + fly_b
    res.applied["agent"] = (len(a.hits) - len(ha)) + (len(b.hits) - len(hb)) - len(flying)
    if flying:
        _count(res, "in-flight", len(flying))
        for h in flying:
            res.normalized.append(Normalized(h.probe, -1, "hits", "in-flight",
                                             f"{h.comm}-{h.pid} cpu{h.cpu} {h.ip}", ""))
    # left out: the agent's hits not in flight, and side b's renamed ones
    for side, out in ((0, agent_a), (1, agent_b + renamed)):
        for h in out:
            n = list(res.left_out.get(h.probe, (0, 0)))
            n[side] += 1
            res.left_out[h.probe] = (n[0], n[1])
    return _per_probe(ha), _per_probe(hb)


def _per_probe(hits: list[Hit]) -> dict[str, list[Hit]]:
    """``hits`` per probe, each probe's in their order (one probe's hits: the list)."""
    probes = set(map(_probe, hits))
    if len(probes) == 1:        # hits: a list of the caller's own (_partition's)
        return {hits[0].probe: hits}
    out: dict[str, list[Hit]] = {}
    for h in hits:
        out.setdefault(h.probe, []).append(h)
    return out


_probe = operator.attrgetter("probe")


def _ordered(res: DiffResult, probe: str, la: list[Hit], lb: list[Hit], *,
             preempt: bool = False, in_step: bool = False) -> tuple[list[Hit], list[Hit]]:
    """Stage ``order``: ``thread-order`` for uprobes, else the single moves of
    ``irq-order`` and ``preempt-order`` (``harness.diff.rules.moves``). ``in_step``: the
    caller found every pair's pid, context and CPU alike, so no move applies (``moves``
    would find nothing out of place). The lists themselves come back when nothing
    moved."""
    if res.modes.get(probe) == "uprobe":
        if len({h.pid for h in la}) > 1 and all(h.pid is not None for h in [*la, *lb]):
            la = sorted(la, key=lambda h: h.pid or 0)
            lb = sorted(lb, key=lambda h: h.pid or 0)
            _count(res, "thread-order")
            res.normalized.append(Normalized(probe, -1, "order", "thread-order", "", ""))
        return la, lb
    if in_step:
        return la, lb
    # an entry probe's host side (at its breakpoint) records before the guest's (its
    # handler); on a return either trampoline may come first
    # (the guest's side is the one moved, whichever of a and b it is)
    guest_first = res.a_side in _rules.GUEST_SIDES and res.b_side not in _rules.GUEST_SIDES
    entry = ((la, lb),) if guest_first else ((lb, la),)
    ways = entry if {*map(_kind, la), *map(_kind, lb)} <= {"p"} else ((lb, la), (la, lb))
    for moved, first in ways:
        fixed, done = _rules.moves(first, moved, preempt=preempt)
        if done:
            la, lb = (first, fixed) if moved is lb else (fixed, first)
            for i, name in done:
                _count(res, name)
                res.normalized.append(Normalized(
                    probe, i, "order", name, f"{la[i].comm}-{la[i].pid}",
                    f"{lb[i].comm}-{lb[i].pid}"))
            break
    return la, lb


def _compare_pair(res: DiffResult, ctx: Ctx, probe: str, i: int, ha: Hit, hb: Hit,
                  pidless: tuple[bool, bool]) -> tuple[str, str, str] | None:
    """Stage ``field``: every field of one pair; each difference goes through the field
    rules in registry order, the first whose check holds makes it equal (counted). The
    first difference left, as ``(field, a, b)``; None when they agree."""
    # the context (irq or task) is compared wherever one side knows it: every side reads
    # it for every kernel hit (trace entry flags, the module's in_serving_softirq(), the
    # engines' preempt_count()), so a side without it failed to measure it, which is a
    # difference, not a pass; uprobe hits carry none on any side
    if _same(ha) == _same(hb):      # every field _fields() shows alike: nothing to judge
        return None
    fa, fb = _fields(ha), _fields(hb)
    for k in dict.fromkeys([*fa, *fb]):
        va, vb = fa.get(k, "<none>"), fb.get(k, "<none>")
        if va == vb:
            continue
        if k == "pid" and ((va == "<none>" and pidless[0]) or (vb == "<none>" and pidless[1])):
            res.normalized.append(Normalized(probe, i, "pid", "pid", va, vb))
            _count(res, "pid")
            continue
        for r in _FIELD_RULES:
            if r.check is not None and r.check(ha, hb, k, va, vb, ctx):
                res.normalized.append(Normalized(probe, i, k, r.name, va, vb))
                _count(res, r.name)
                break
        else:
            return k, va, vb
    return None


_FIELD_RULES = tuple(r for r in _rules.by_stage("field") if r.name != "pid")


def _cross_order(res: DiffResult, context: int) -> Divergence | None:
    """The order of the matched hits across probes, within what the kernel guarantees:
    one task on one CPU in one context (task or interrupt; uprobe hits, which the guest
    records on the way back to user mode, apart from the kernel's). Each side's hits of
    such a group must come in the same order of pairs."""
    live = [p for p, m in res.matched.items() if m]
    if len(live) == 1:
        # one probe: its pairs come in pair order on both sides wherever each side's
        # seqs rise with the pair (every group of them sorted by seq is then in pair
        # order on both sides)
        la, lb = res.compared[live[0]]
        m = res.matched[live[0]]
        if _rising(list(map(_seq, la[:m]))) and _rising(list(map(_seq, lb[:m]))):
            return None
    groups_a: dict[tuple[object, ...], list[tuple[int, str, int]]] = {}
    groups_b: dict[tuple[object, ...], list[tuple[int, str, int]]] = {}
    for probe, (la, lb) in res.compared.items():
        up = res.modes.get(probe) == "uprobe"
        for i in range(res.matched.get(probe, 0)):
            ha, hb = la[i], lb[i]
            key = (ha.cpu, ha.pid, ha.irq if ha.irq and hb.irq else "", up)
            ga = groups_a.get(key)
            if ga is None:
                ga = groups_a[key] = []
                groups_b[key] = []
            ga.append((ha.seq, probe, i))
            groups_b[key].append((hb.seq, probe, i))
    for key, ga in groups_a.items():
        gb = groups_b[key]
        ga.sort(key=_by_seq)       # stable: hits of one seq stay in the order added
        gb.sort(key=_by_seq)
        pa, pb = [x[1:] for x in ga], [y[1:] for y in gb]
        if pa == pb:
            continue
        n = next(n for n, (x, y) in enumerate(zip(pa, pb)) if x != y)
        px, py = pa[n], pb[n]
        hits: dict[str, dict[tuple[str, int], Hit]] = {"a": {}, "b": {}}  # around it
        for side, g, at in (("a", ga, 0), ("b", gb, 1)):
            for _, probe, i in g[max(0, n - context):n + context + 1]:
                hits[side][(probe, i)] = res.compared[probe][at][i]
        return Divergence(px[0], "order", px[1],
                          f"{px[0]} hit #{px[1] + 1}", f"{py[0]} hit #{py[1] + 1}",
                          tuple(hits["a"].values()), tuple(hits["b"].values()))
    return None


_by_seq = operator.itemgetter(0)
_kind = operator.attrgetter("kind")
_seq = operator.attrgetter("seq")


def _rising(xs: list[int]) -> bool:
    """Strictly rising (in C: sorted, and no two alike)."""
    return xs == sorted(xs) and len(set(xs)) == len(xs)


def _counters(res: DiffResult, a: SideResult, b: SideResult) -> None:
    """Stage ``counter``: ``nmissed`` wherever both sides count the probe; a probe one side
    has no counter for is named (``uncounted``); ``nhit`` where both sides counted it over
    the one recording window (``Counters.window``), else named by the rule ``nhit``."""
    for probe, ca in a.counters.items():
        cb = b.counters.get(probe)
        if cb is not None and ca.nmissed != cb.nmissed:
            res.divergences.append(Divergence(probe, "nmissed", -1, str(ca.nmissed),
                                              str(cb.nmissed)))
    for probe in dict.fromkeys([*a.counters, *b.counters, *res.counts]):
        if (probe in a.counters) != (probe in b.counters):
            lacking, other = (b, a) if probe in a.counters else (a, b)
            placed = any(o.probe == probe and o.accepted and not o.pending
                         for o in lacking.outcomes)
            if lacking.side in GUEST_SIDES or not placed:   # none for this kind, or never
                res.uncounted[probe] = lacking.side         # placed there: named
            else:                               # a host engine counts every probe it placed
                res.divergences.append(Divergence(
                    probe, "counter", -1, "counted" if lacking is b else "no counter",
                    "counted" if lacking is a else "no counter"))
    unwindowed = 0
    # The agent rule on nhit: the agent's own hits are not compared, and a return probe's
    # nhit counts at the return (kernel/trace/trace_kprobe.c: kretprobe_dispatcher()), so
    # the agent's call in flight when the window opened (qemu-ga back in ppoll() after
    # enabling the guest's events, inside x64_sys_call) counts on the side whose probe
    # was armed first only. Each side's nhit is compared without the hits the agent rule
    # left out of that side (res.left_out, made by the hits stage: the agent's comm, and
    # the guest's hits of an agent's child under its later comm)
    for probe, ca in a.counters.items():
        cb = b.counters.get(probe)
        if cb is None:
            continue
        host_unwindowed = [x for x, c in ((a, ca), (b, cb))
                           if x.side not in GUEST_SIDES and not c.window]
        if host_unwindowed:     # a host engine counts its recorded hits, over the window
            res.divergences.append(Divergence(
                probe, "counter", -1, "not over the window" if not ca.window else "window",
                "not over the window" if not cb.window else "window"))
            continue
        if ca.window and cb.window:     # both counted over the one window: compared
            out_a, out_b = res.left_out.get(probe, (0, 0))
            if ca.nhit - out_a != cb.nhit - out_b:
                res.divergences.append(Divergence(probe, "nhit", -1, str(ca.nhit),
                                                  str(cb.nhit)))
            elif ca.nhit != cb.nhit:
                _count(res, "agent")
                res.normalized.append(Normalized(probe, -1, "nhit", "agent", str(ca.nhit),
                                                 str(cb.nhit)))
            continue
        unwindowed += 1
        res.normalized.append(Normalized(probe, -1, "nhit", "nhit", str(ca.nhit),
                                         str(cb.nhit)))
    res.applied["nhit"] = unwindowed


def _by_line(outcomes: list[Outcome]) -> dict[object, Outcome]:
    """Outcomes keyed by spec line (``index``), or by probe for sides that do not say."""
    return {(o.index if o.index >= 0 else o.probe): o for o in outcomes}


def _labels(outcomes: list[Outcome]) -> dict[str, object]:
    """A name per line: the probe, with ``#N`` for the N-th line of an event that several
    lines define (``p:kprobes/e f1`` + ``p:kprobes/e f2``: ``kprobes/e``, ``kprobes/e#2``)."""
    keys: dict[object, str] = {}
    for o in outcomes:
        keys.setdefault(o.index if o.index >= 0 else o.probe, o.probe)
    seen: dict[str, int] = {}
    out: dict[str, object] = {}
    for key, probe in sorted(keys.items(), key=lambda kv: (not isinstance(kv[0], int),
                                                            kv[0] if isinstance(kv[0], int) else 0)):
        n = seen[probe] = seen.get(probe, 0) + 1
        out[probe if n == 1 else f"{probe}#{n}"] = key
    return out


def _outcome_text(o: Outcome | None) -> str:
    if o is None:
        return "not registered"
    if o.accepted:
        return "accepted"
    import errno as _e
    return f"refused {_e.errorcode.get(o.errno, o.errno)}: {o.message}"
