"""Compare what two sides recorded for one workload and name the first divergence.

Pure: ``SideResult`` records in, a ``DiffResult`` out, no I/O. Both sides observe the
*same* execution (``harness.diff.runner`` arms the in-guest probes first and the host-side ones
on top), so every field of every hit is comparable: pointers, comms, return values.

Normalizations, all listed here and named in every report (nothing else is normalized):

- ``agent``: hits whose comm is ``qemu-ga`` are left out on both sides. They are the
  harness's own guest agent switching tracing on and off, at moments the two sides see
  differently by construction. A child the agent forked hits before it execs the
  command (comm ``qemu-ga`` host-side); the trace prints that hit under the comm the pid
  took by the exec (``comm-change``), and it is left out too.
- ``trampoline``: when a host-side return probe and an in-guest one sit on the same
  function, the host hijacks the return address first, so the guest's record shows the
  host trampoline (``_etext+0x0``; for uretprobes the padding address past the program's
  text, ``0x478c71``) as the return address. Such an ip compares equal to
  the host's record of the real return address.
- ``thread-order``: uprobe hits (guest mode ``uprobe``) are compared thread by thread
  (a stable sort by pid on both sides). The host records at the breakpoint; the guest
  records in ``uprobe_notify_resume()`` on the way back to user mode, after
  ``exit_to_user_mode_loop()`` may have scheduled another thread, so across threads the
  two orders differ by construction while each thread's order is the same.
- ``trampoline`` also covers a guest *value* that is a uretprobe trampoline: a fetch of
  the return-address slot at the entry (``$stack0``, ``+0($stack)``) reads what the host
  put there first; and, in a return hit whose ip shows the host trampoline, every value
  the guest fetched from ``%ip`` (``+0(%ip)`` reads the trampoline's bytes: the kernel
  sets ``regs->ip`` to the saved return address before the handlers run,
  kernel/events/uprobes.c: ``handle_trampoline()``, kernel/kprobes.c:
  ``__kretprobe_trampoline_handler()``).
- ``stale``, ``below-sp``, ``flags``, ``kernel-data``: a host ``(unknown)`` matches any
  value, for that
  argument of that hit only, and only where the host's record says why the kernel makes
  it unknowable (``Hit.unknown``; a host read that fails for any other reason is no value:
  the run fails, ``harness.errors.EngineReadError``). ``stale``: the fetch took a real
  fault (the guest does not map the memory), so the kernel stores nothing and the event
  keeps the ring buffer's old bytes (``store_trace_args()``, ``process_fetch_insn()``).
  ``below-sp``: the fetch read the probed context's stack below its sp, where the guest
  probe's own frames are by the time its handler reads. ``flags``: the plugin engine's
  ``%flags`` (TCG keeps the arithmetic flags lazily; the plugin API cannot read them).
  ``kernel-data``: an event probe's untyped ``\\"STR"`` records the address of the
  kernel's own copy of the string (kernel/trace/trace_probe.c: ``parse_probe_arg()``).
- ``stack-machinery``: a ``stacktrace`` trigger's frames (``kph diff --trigger``) are
  compared from the probed context down, frame for frame; the guest's frames above it
  are its own probe machinery, between the probed function and the trigger's unwinder
  (``kprobe_trace_func``, ``kprobe_dispatcher``, ``kprobe_ftrace_handler``,
  ``ftrace_regs_call``; a return probe's ``arch_rethook_trampoline``), which a host
  breakpoint never runs: left out when every one of them is such a function, counted.
- ``pid``: a hit whose pid one side cannot know (no ``task_struct`` offsets, or the task
  not readable at the hit) has its pid left out of that comparison, counted. Where both
  sides know it, the pid is compared, and so is the cpu, always.
- ``refused-missing``: a line one side refused that the other side never placed (it
  stopped before it): there is no registration on that side to compare, counted.
- ``refusal-text``: a line both sides refused with the same errno is compared by errno;
  where the words differ (the events side's "Failed to register probe event", the
  host's rule), counted.
- ``comm-change``: the trace prints a comm from ``saved_cmdlines``, saved at the CPU's
  first sched switch or wakeup after an event (kernel/trace/trace.c:
  ``tracing_record_taskinfo()``); a task that exec'd in between prints under its new
  name. The host follows renames (a hidden probe on ``__set_task_comm``) and a guest comm
  that is one the same pid took after the hit compares equal.
- ``irq-order``: a probe's hits are compared per context of the probed call, those made
  in task context in order, those made in an interrupt (softirq, hardirq) in order, when
  both sides know every hit's context (the guest's trace entry flags; ``preempt_count()``
  host-side). The host records at its breakpoint, the guest in its handler a few
  instructions later: an interrupt taken in between (RCU callbacks freeing on a probed
  ``kfree()``) records its own hits between the two, so across contexts the orders differ
  by construction. (An int3-based guest kprobe runs its handler inside
  ``irqentry_nmi_enter()``, so its entries carry NMI and HARDIRQ whatever the caller was;
  NMI entries count as task context, their SOFTIRQ bit as the caller's.)
- ``preempt-order``: the same window across tasks. An interrupt taken between one side's
  record and the other's may end in a preemption (``preempt_schedule_irq()``), and the
  tasks that run then record their own hits in between: one side has task A's hit, then
  B's run of hits; the other has B's run, then A's. Such a hit is moved back in front of
  that run when the run is exactly the hits the first side recorded next (pids in the
  same order): for entry probes only a hit of side b (the host records first, at its
  breakpoint), for return probes of either side. Nothing else is reordered, and every
  field is still compared.
- ``nhit``: raw hit counters are not compared (each side counts from its own
  registration, which happens at different moments); hits recorded during the workload
  are compared one by one instead. ``nmissed`` is compared exactly.

Nothing measured is no verdict: when no probe both sides armed has a hit on either side,
the result is *empty*, not equivalent (unless the caller expects it, ``expect_empty``),
and each armed probe without a hit on either side is named (``DiffResult.silent``).
``strict``: any normalization applied that the caller did not ``allow`` is a failure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..records import Hit, Outcome, SideResult

AGENT_COMMS = ("qemu-ga",)
NORMALIZATIONS = {
    "agent": "hits of the harness's guest agent (comm qemu-ga) left out on both sides",
    "trampoline": "a guest return probe's ip showing the host trampoline compares equal "
                  "to the host's real return address",
    "thread-order": "uprobe hits compared per thread (pid), in order within each thread",
    "nhit": "raw nhit counters not compared; recorded hits are compared one by one",
    "irq-order": "hits compared per context of the probed call (task, interrupt), in order "
                 "within each",
    "preempt-order": "a hit one side recorded after a run of other tasks' hits (a preemption "
                     "between the two sides' records) moved back in front of that run",
    "comm-change": "a guest comm the same pid took after the hit (an exec renamed it before "
                   "saved_cmdlines recorded it) compares equal",
    "stale": "a host (unknown) where the fetch took a real fault (the kernel keeps stale "
             "ring-buffer bytes) matches any value, that argument only",
    "below-sp": "a host (unknown) where the fetch read the stack below the probed sp (the "
                "guest probe's own frames) matches any value, that argument only",
    "flags": "a plugin-engine (unknown) %flags (TCG's lazy flags) matches any value, that "
             "argument only",
    "kernel-data": "a host (unknown) where an event probe records the address of the "
                   "kernel's own copy of an immediate string matches any value, that "
                   "argument only",
    "pid": "a pid one side cannot know left out of that hit's comparison",
    "stack-machinery": "a stacktrace trigger's frames compared from the probed context "
                       "down; the guest's frames above it, of its own probe machinery "
                       "(kprobe_trace_func ... ftrace_regs_call), left out",
    "refused-missing": "a line one side refused that the other side never placed: no "
                       "registration to compare",
    "refusal-text": "a refusal with the same errno on both sides and other words: "
                    "compared by errno",
}
UNKNOWN_TEXT = "(unknown)"
#: The rules that make a host (unknown) match, by the reason its record gives.
UNKNOWN_RULES = ("stale", "below-sp", "flags", "kernel-data")


def _unknown_match(a: str, b: str) -> bool:
    """``a`` (host) has (unknown) where ``b`` has anything, element by element for arrays."""
    if UNKNOWN_TEXT not in a:
        return False
    if a == UNKNOWN_TEXT:
        return True
    if a.startswith("{") and b.startswith("{"):
        ea, eb = a[1:-1].split(","), b[1:-1].split(",")
        return len(ea) == len(eb) and all(x == y or x == UNKNOWN_TEXT for x, y in zip(ea, eb))
    return False


@dataclass(frozen=True)
class Divergence:
    """The first place where the two sides disagree for one probe."""

    probe: str
    field: str                  # registration, count, kind, comm, ip, ret_from, arg:NAME, nmissed
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
        """Lines both sides accepted and registered (their hits were compared)."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and x.accepted and y.accepted and not x.pending]

    @property
    def both_refused(self) -> list[str]:
        """Lines both sides refused with the same errno: agreement, on a refusal."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and not x.accepted and not y.accepted and x.errno == y.errno]

    @property
    def pending(self) -> list[str]:
        """Lines both sides accepted without registering a probe (they cannot fire)."""
        return [k for k, (x, y) in self.outcomes.items()
                if x and y and x.accepted and y.accepted and x.pending]


def _relevant(hits: list[Hit]) -> list[Hit]:
    return [h for h in hits if h.comm not in AGENT_COMMS]


def _agent_in_b(a: list[Hit], b: list[Hit]) -> list[Hit]:
    """Side ``b``'s hits that are side ``a``'s agent hits under a later comm: a child the
    agent forked hits before it execs (it opens /dev/null for the command's stdin), side
    ``a`` (the host) saw comm ``qemu-ga`` there, and the trace prints the comm the pid had
    when ``saved_cmdlines`` caught it, after the exec (``comm-change``). Per pid, as many
    of ``b``'s first hits of that pid as ``a`` left out, when their comm is one the pid
    took after ``a``'s hit."""
    owed: dict[int, list[Hit]] = {}
    for h in a:
        if h.comm in AGENT_COMMS and h.pid is not None and h.comm_alts:
            owed.setdefault(h.pid, []).append(h)
    out = []
    for h in b:
        left = owed.get(h.pid) if h.pid is not None else None
        if left and h.probe == left[0].probe and h.comm in left[0].comm_alts:
            left.pop(0)
            out.append(h)
    return out


def _fields(h: Hit) -> dict[str, str]:
    out = {"kind": h.kind, "cpu": str(h.cpu), "comm": h.comm, "ip": h.ip,
           "ret_from": h.ret_from or ""}
    if h.pid is not None:
        out["pid"] = str(h.pid)
    out.update({f"arg:{k}": v for k, v in h.args})
    if h.stack is not None:
        out["stack"] = " ".join(h.stack)
    return out


#: Where the kernel's own probe and trace machinery runs between a probed function and a
#: stacktrace trigger's unwinder (kernel/trace/: trace_kprobe.c, trace_fprobe.c,
#: trace_eprobe.c, trace_events_trigger.c, trace.c; kernel/kprobes.c, kernel/trace/fprobe.c,
#: rethook.c, ftrace.c, fgraph.c; arch/x86/kernel/kprobes/, ftrace_64.S, rethook.c): the
#: frames of 6.12's and 7.3's traces above the probed context, by name.
_MACHINERY_PREFIXES = ("kprobe_", "kretprobe_", "aggr_", "opt_pre_handler", "optimized_callback",
                       "optprobe_template", "fprobe_", "fentry_", "fexit_", "ftrace_", "arch_ftrace",
                       "function_graph", "return_to_handler", "__ftrace", "rethook_",
                       "arch_rethook", "trace_", "__trace", "event_triggers", "eprobe_",
                       "__eprobe", "stacktrace_", "exc_int3", "asm_exc_int3", "do_int3",
                       "perf_trace", "__traceiter_", "__probestub_", "tracing_")


#: Where x86_64 keeps executable allocations (MODULES_VADDR..MODULES_END): a frame there
#: that no symbol holds, above the probed context, is a trampoline ftrace made for one
#: ftrace_ops (arch/x86/kernel/ftrace.c: create_trampoline(); kallsyms does not list it)
_EXEC_AREA = (0xFFFFFFFFA0000000, 0xFFFFFFFFFF000000)


def _machinery(name: str) -> bool:
    if name.startswith("0x"):
        try:
            return _EXEC_AREA[0] <= int(name, 16) < _EXEC_AREA[1]
        except ValueError:
            return False
    return name.startswith(_MACHINERY_PREFIXES)


def stack_match(host: str, guest: str) -> bool:
    """``guest`` (a stacktrace trigger's frames, innermost first) is ``host``'s with frames
    of the kernel's probe machinery on top: from the probed context down, frame for frame,
    the same functions. Where the trigger's unwinder starts, the probe's own handler is
    running (``kprobe_trace_func`` ... ``ftrace_regs_call``); a host breakpoint never ran it."""
    h, g = host.split(), guest.split()
    extra = len(g) - len(h)
    return extra >= 0 and g[extra:] == h and all(_machinery(f) for f in g[:extra])


def _is_trampoline(ip: str, trampoline: str | tuple[str, ...]) -> bool:
    """``ip`` is a host trampoline: a ``sym+0x0`` prefix (``/size`` follows in kernel
    prints) or a whole ``0x...`` user address."""
    for t in (trampoline,) if isinstance(trampoline, str) else trampoline:
        if ip == t or (not t.startswith("0x") and ip.startswith(t)):
            return True
    return False


def compare(a: SideResult, b: SideResult, *, trampoline: str | tuple[str, ...] | None = None,
            context: int = 3, strict: bool = False, allow: "tuple[str, ...] | frozenset[str]" = (),
            expect_empty: bool = False) -> DiffResult:
    """Compare side ``a`` (usually host) with side ``b`` (events or module).

    :param trampoline: how the host trampoline prints in the guest (``_etext+0x0/...``
        prefix), for the ``trampoline`` normalization.
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
            res.applied["refused-missing"] = res.applied.get("refused-missing", 0) + 1
            res.normalized.append(Normalized(label, -1, "registration", "refused-missing",
                                             _outcome_text(x), _outcome_text(y)))
        elif acc_x != acc_y or (not acc_x and x is not None and y is not None
                                and x.errno != y.errno):
            res.divergences.append(Divergence(
                label, "registration", -1, _outcome_text(x), _outcome_text(y)))
        elif (not acc_x and x is not None and y is not None and x.message and y.message
              and x.message != y.message):
            # the same errno, other words (the events side writes "Failed to register
            # probe event" where the host names the rule): compared by errno, counted
            res.applied["refusal-text"] = res.applied.get("refusal-text", 0) + 1
            res.normalized.append(Normalized(label, -1, "registration", "refusal-text",
                                             x.message, y.message))
    ha, hb = _relevant(a.hits), _relevant(b.hits)
    renamed = _agent_in_b(a.hits, hb)
    if renamed:
        gone = {id(h) for h in renamed}
        hb = [h for h in hb if id(h) not in gone]
    res.applied["agent"] = (len(a.hits) - len(ha)) + (len(b.hits) - len(hb))
    for side, hits in ((0, a.hits), (1, b.hits)):
        for h in hits:
            if h.comm in AGENT_COMMS or (side == 1 and any(h is r for r in renamed)):
                n = list(res.left_out.get(h.probe, (0, 0)))
                n[side] += 1
                res.left_out[h.probe] = (n[0], n[1])
    per_a: dict[str, list[Hit]] = {}
    per_b: dict[str, list[Hit]] = {}
    for h in ha:
        per_a.setdefault(h.probe, []).append(h)
    for h in hb:
        per_b.setdefault(h.probe, []).append(h)
    for probe in dict.fromkeys([*per_a, *per_b, *(x.probe for x, y in res.outcomes.values()
                                                   if x and y and x.accepted and y.accepted)]):
        la, lb = per_a.get(probe, []), per_b.get(probe, [])
        if res.modes.get(probe) == "uprobe" and len({h.pid for h in la}) > 1:
            la = sorted(la, key=lambda h: h.pid or 0)
            lb = sorted(lb, key=lambda h: h.pid or 0)
            res.applied["thread-order"] = res.applied.get("thread-order", 0) + 1
            res.normalized.append(Normalized(probe, -1, "order", "thread-order", "", ""))
        elif (la and lb and all(h.irq for h in la) and all(h.irq for h in lb)
              and any(h.irq == "irq" for h in [*la, *lb])):
            la = sorted(la, key=lambda h: h.irq == "irq")
            lb = sorted(lb, key=lambda h: h.irq == "irq")
            res.applied["irq-order"] = res.applied.get("irq-order", 0) + 1
            res.normalized.append(Normalized(probe, -1, "order", "irq-order", "", ""))
        if res.modes.get(probe) != "uprobe":
            # an entry probe's side a (the host, at its breakpoint) records before side b
            # (the guest's handler); on a return either trampoline may come first
            ways = ((lb, la),) if all(h.kind == "p" for h in [*la, *lb]) else ((lb, la), (la, lb))
            for moved, first in ways:
                fixed, moves = _preempted(first, moved)
                if moves:
                    la, lb = (first, fixed) if moved is lb else (fixed, first)
                    res.applied["preempt-order"] = res.applied.get("preempt-order", 0) + len(moves)
                    for i in moves:
                        res.normalized.append(Normalized(
                            probe, i, "order", "preempt-order",
                            f"{la[i].comm}-{la[i].pid}", f"{lb[i].comm}-{lb[i].pid}"))
                    break
        res.counts[probe] = (len(la), len(lb))
        res.compared[probe] = (la, lb)
        matched = 0

        def note(i: int, fld: str, rule: str, va: str, vb: str) -> None:
            res.normalized.append(Normalized(probe, i, fld, rule, va, vb))
        div = None
        for i in range(min(len(la), len(lb))):
            fa, fb = _fields(la[i]), _fields(lb[i])
            if trampoline and _is_trampoline(fb.get("ip", ""), trampoline) and la[i].kind == "r":
                if fb["ip"] != fa["ip"]:
                    note(i, "ip", "trampoline", fa["ip"], fb["ip"])
                fb["ip"] = fa["ip"]
                res.applied["trampoline"] = res.applied.get("trampoline", 0) + 1
                # the guest's regs->ip was the host trampoline in this hit: so is what
                # its arguments fetched from %ip (read from the trampoline's bytes)
                for name in la[i].ret_ip_args:
                    k = f"arg:{name}"
                    if k in fa and k in fb and fa[k] != fb[k]:
                        note(i, k, "trampoline", fa[k], fb[k])
                        fb[k] = fa[k]
                        res.applied["trampoline"] += 1
            for k in fa:
                if (k.startswith("arg:") and trampoline and k in fb and fa[k] != fb[k]
                        and fb[k].startswith("0x") and _is_trampoline(fb[k], trampoline)):
                    note(i, k, "trampoline", fa[k], fb[k])
                    fb[k] = fa[k]
                    res.applied["trampoline"] = res.applied.get("trampoline", 0) + 1
                if k.startswith("arg:") and k in fb and fa[k] != fb[k]:
                    # only an argument the record says the kernel makes unknowable
                    ra, rb = dict(la[i].unknown).get(k[4:]), dict(lb[i].unknown).get(k[4:])
                    rule = (ra if ra in UNKNOWN_RULES and _unknown_match(fa[k], fb[k]) else
                            rb if rb in UNKNOWN_RULES and _unknown_match(fb[k], fa[k]) else None)
                    if rule is not None:
                        note(i, k, rule, fa[k], fb[k])
                        fb[k] = fa[k]
                        res.applied[rule] = res.applied.get(rule, 0) + 1
            if fa["comm"] != fb.get("comm") and fb.get("comm") in la[i].comm_alts:
                note(i, "comm", "comm-change", fa["comm"], fb.get("comm", ""))
                fb["comm"] = fa["comm"]
                res.applied["comm-change"] = res.applied.get("comm-change", 0) + 1
            if "stack" in fa and "stack" in fb and fa["stack"] != fb["stack"]:
                for x, y in ((fa, fb), (fb, fa)):
                    if stack_match(x["stack"], y["stack"]):
                        note(i, "stack", "stack-machinery", fa["stack"], fb["stack"])
                        y["stack"] = x["stack"]
                        res.applied["stack-machinery"] = res.applied.get("stack-machinery", 0) + 1
                        break
            if ("pid" in fa) != ("pid" in fb):      # a side that cannot know this pid
                note(i, "pid", "pid", fa.get("pid", "<none>"), fb.get("pid", "<none>"))
                fa.pop("pid", None)
                fb.pop("pid", None)
                res.applied["pid"] = res.applied.get("pid", 0) + 1
            bad = next((k for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)), None)
            if bad is not None:
                div = Divergence(probe, bad, i, fa.get(bad, "<none>"), fb.get(bad, "<none>"),
                                 tuple(la[max(0, i - context):i + context + 1]),
                                 tuple(lb[max(0, i - context):i + context + 1]))
                break
            matched += 1
        if div is None and len(la) != len(lb):
            i = min(len(la), len(lb))
            div = Divergence(probe, "count", i, str(len(la)), str(len(lb)),
                             tuple(la[max(0, i - context):i + context]),
                             tuple(lb[max(0, i - context):i + context]))
        res.matched[probe] = matched
        if div is not None:
            res.divergences.append(div)
    for probe, ca in a.counters.items():
        cb = b.counters.get(probe)
        if cb is not None and ca.nmissed != cb.nmissed:
            res.divergences.append(Divergence(probe, "nmissed", -1, str(ca.nmissed), str(cb.nmissed)))
    res.applied["nhit"] = len(set(a.counters) & set(b.counters))
    for probe in a.counters:
        if probe in b.counters:
            res.normalized.append(Normalized(probe, -1, "nhit", "nhit", str(a.counters[probe].nhit),
                                             str(b.counters[probe].nhit)))
    return res


def _preempted(first: list[Hit], later: list[Hit]) -> tuple[list[Hit], list[int]]:
    """``later`` with each hit that it recorded after a run of other tasks' hits moved back
    in front of that run, where ``first`` recorded it before the same run (the same pids
    in the same order); and the positions moved to. Stops at the first difference that is
    not such a run. Sides without pids are left as they are."""
    if any(h.pid is None for h in (*first, *later)):
        return later, []
    out, moves = list(later), []
    for i in range(min(len(first), len(out))):
        pid = first[i].pid
        if out[i].pid == pid:
            continue
        j = next((k for k in range(i + 1, len(out)) if out[k].pid == pid), None)
        if j is None or [h.pid for h in out[i:j]] != [h.pid for h in first[i + 1:j + 1]]:
            break
        out.insert(i, out.pop(j))
        moves.append(i)
    return (out, moves) if moves else (later, [])


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
