"""The normalizations of the differential verdict, as one registry (no I/O).

Each :class:`Rule` is one object: its name (what ``--allow`` takes and every report
prints), its one-line summary, the kernel source of its reason, the evidence it needs
before it applies, and its apply step. ``harness.diff.verdict.compare()`` runs the
registry in order, stage by stage; nothing that is not here is normalized, and
docs/diff.md lists this registry (a unit test holds the two together, and each rule has a
test where it refuses a real difference).

A rule applies only where its evidence was *measured* on the sides' own records, never
because one side (a host engine) says so: a host ``(unknown)`` needs the kernel's reason
and that reason's own check; a trampoline value needs an argument that reads the return
slot and the trampoline's whole text; a reorder needs one CPU and the run the other side
recorded. Stages:

- ``line``: a registration (one spec line on both sides);
- ``hits``: which hits are compared at all;
- ``order``: the order in which one probe's hits are compared;
- ``field``: one field of one compared pair of hits;
- ``counter``: the probes' counters.
"""
from __future__ import annotations

import operator

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..kernel.ringbuf import rb_data_len
from ..records import Hit

__all__ = ["Rule", "REGISTRY", "NORMALIZATIONS", "rule", "by_stage", "help_text", "markdown_table",
           "AGENT_COMMS", "GUEST_SIDES", "UNKNOWN_TEXT", "UNKNOWN_RULES",
           "unknown_match", "stack_match", "is_trampoline", "moves", "slot_args"]

AGENT_COMMS = ("qemu-ga",)
#: The sides whose records the guest kernel made (its trace, its module's buffer).
GUEST_SIDES = ("events", "module")
UNKNOWN_TEXT = "(unknown)"


@dataclass(frozen=True)
class Rule:
    """One normalization.

    ``evidence`` says what must be measured before the rule applies; ``check`` is that
    check where it is a predicate of its own (the rules of the ``field`` stage take
    ``(hit_a, hit_b, field, value_a, value_b, ctx)``), ``None`` where the apply step
    itself finds the evidence (an order rule finds the run it moves across)."""

    name: str
    stage: str
    summary: str
    reason: str
    evidence: str
    check: Callable[..., bool] | None = None


def unknown_match(a: str, b: str) -> bool:
    """``a`` (host) has (unknown) where ``b`` has anything, element by element for arrays."""
    if UNKNOWN_TEXT not in a:
        return False
    if a == UNKNOWN_TEXT:
        return True
    if a.startswith("{") and b.startswith("{"):
        ea, eb = a[1:-1].split(","), b[1:-1].split(",")
        return len(ea) == len(eb) and all(x == y or x == UNKNOWN_TEXT for x, y in zip(ea, eb))
    return False


def is_trampoline(text: str, trampolines: tuple[str, ...]) -> bool:
    """``text`` is one of the host trampolines, matched whole: a ``sym+0x0`` text is the
    whole ip or its ``sym+0x0/0xSIZE`` print (the kernel's ``%pS`` with the symbol's
    size); a ``0x...`` value is the whole value."""
    for t in trampolines:
        if text == t or (not t.startswith("0x") and text.startswith(t + "/")):
            return True
    return False


def slot_args(h: Hit) -> tuple[str, ...]:
    """The arguments of an entry hit that read the word at the probed sp (``$stack0``,
    ``+0($stack)``, ``+0(%sp)``): at a function's entry the return-address slot, which a
    return probe placed earlier on the same call hijacked
    (``arch/x86/kernel/rethook.c: arch_rethook_prepare()``,
    ``kernel/events/uprobes.c: prepare_uretprobe()``)."""
    return h.slot_args


# -- the field rules' evidence --------------------------------------------------------------


def _why(h: Hit, k: str) -> str | None:
    return dict(h.unknown).get(k[4:]) if k.startswith("arg:") else None


def _unknown_rule(reason: str) -> Callable[..., bool]:
    """A host ``(unknown)`` of argument ``k`` matches when its record gives ``reason``
    and the value is (unknown) where the other side has a value."""
    def check(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
        if k == "record-size":
            return _unstable_record(ha, hb, reason)
        return ((_why(ha, k) == reason and unknown_match(va, vb)) or
                (_why(hb, k) == reason and unknown_match(vb, va)))
    return check


def _unstable_record(ha: Hit, hb: Hit, reason: str, proven: bool = False) -> bool:
    """A record whose length is not its data's (``record-size``, a field only the
    in-guest side has) where the host's record of the same hit says an argument read
    memory for ``reason``: the kernel's two passes over an argument (its length, then
    its store: kernel/trace/trace_probe_tmpl.h: __get_data_size(), store_trace_args())
    read memory that may differ between them or keep a stale data_loc, and the record's
    length follows. With ``proven``, that argument's failed read must be in the record
    (``Hit.failed``, the ``stale`` rule's evidence)."""
    for h in (ha, hb):
        failed = dict(h.failed)
        if any(w == reason and (not proven or n in failed) for n, w in h.unknown):
            return True
    return False


def _stale_check(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """:func:`_unknown_rule` ``stale``, where the record also holds its evidence: the
    address whose read failed in that argument's fetch (``Hit.failed``)."""
    if k == "record-size":
        return _unstable_record(ha, hb, "stale", proven=True)

    def proven(h: Hit) -> bool:
        return k.startswith("arg:") and k[4:] in dict(h.failed)
    return ((_why(ha, k) == "stale" and proven(ha) and unknown_match(va, vb)) or
            (_why(hb, k) == "stale" and proven(hb) and unknown_match(vb, va)))


def _record_slack(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """``record-size`` on the in-guest side, exactly the length the host's fetch model
    gives the record: its data's end (``Hit.reach``) plus the host's slack (``Hit.slack``),
    after the ring buffer's rounding."""
    if k != "record-size":
        return False
    return any(g.excess and g.reach and h.slack > 0 and not h.excess and
               rb_data_len(g.reach + h.slack) - rb_data_len(g.reach) == g.excess
               for g, h in ((ha, hb), (hb, ha)))


def _flags_check(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """Only on the plugin engine's side (the gdbstub engine reads the real flags)."""
    return ((ctx.a_side == "plugin" and _why(ha, k) == "flags" and unknown_match(va, vb)) or
            (ctx.b_side == "plugin" and _why(hb, k) == "flags" and unknown_match(vb, va)))


def _trampoline(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """Side b shows a host trampoline (whole) where side a has the real return address:
    the ip of a return hit on both sides from the same function; an entry argument that
    reads the return slot (:func:`slot_args`); in a return hit whose side-b ip is a
    trampoline, an argument fetched from %ip (it read the trampoline's bytes)."""
    tr = ctx.trampolines
    same_ret = ha.kind == "r" and hb.kind == "r" and ha.ret_from == hb.ret_from
    if k == "ip":
        return same_ret and is_trampoline(vb, tr)
    if not k.startswith("arg:"):
        return False
    if ha.kind == "r":
        return same_ret and k[4:] in ha.ret_ip_args and is_trampoline(hb.ip, tr)
    return k[4:] in slot_args(ha) and is_trampoline(vb, tr)


def _raced(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """Side a (a host engine) read an argument from memory at its breakpoint, side b (the
    guest) in its handler later, and the memory changed once in between: side a's own
    next read of it (the probe's next pair) already has side b's value, and so has side
    b's. In time the three reads are host k < guest k < host k + 1, so one write between
    the first two explains all three. A guest that reads one step late at every hit (a
    handler run after the probed instruction wrote that memory) has a next pair that
    differs too; a handler run after its instruction is the ``post-ip`` oracle's."""
    if not k.startswith("arg:") or ctx.a_side in GUEST_SIDES or ctx.b_side not in GUEST_SIDES:
        return False
    name = k[4:]
    # both reads measured a value: an (unknown) is no value that changed (the (unknown)
    # rules judge it, each by its own evidence)
    if name not in ha.mem_args or ctx.following is None or UNKNOWN_TEXT in va + vb:
        return False
    na, nb = ctx.following
    if not (na.arg(name) == nb.arg(name) == vb != va and na.pid == ha.pid and na.cpu == ha.cpu
            and nb.pid == hb.pid and nb.cpu == hb.cpu):
        return False
    return True


def _int3_nmi(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """The context: side a (a host engine) measured ``irq`` for a caller in a hardirq
    alone (``Hit.hardirq``), side b's probe ran its handler from int3 (its mode), and
    side b says ``task``."""
    return k == "irq" and va == "irq" and vb == "task" and ha.hardirq and \
        hb.mode == "int3"


def _comm_change(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """Both sides saw the pid take that comm after the hit: the host through its hidden
    probe on ``__set_task_comm()``, the guest in its own ``task:task_rename`` records
    (``harness.backends.events``); one side's word alone is no evidence."""
    return k == "comm" and vb in ha.comm_alts and vb in hb.comm_alts


def _stack_machinery(ha: Hit, hb: Hit, k: str, va: str, vb: str, ctx: "Ctx") -> bool:
    """Extra frames on the guest's side only (a host breakpoint never runs the kernel's
    probe machinery), and only between two sides of which b is the guest's."""
    return k == "stack" and ctx.b_side in GUEST_SIDES and stack_match(va, vb)


# -- stacks ---------------------------------------------------------------------------------

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


#: The ftrace_ops callbacks that a per-ops trampoline calls (arch/x86/kernel/kprobes/
#: ftrace.c: kprobe_ftrace_handler; kernel/trace/fprobe.c: fprobe_handler (6.12),
#: fprobe_ftrace_entry (7.3); kernel/trace/ftrace.c: ftrace_ops_assist_func,
#: arch_ftrace_ops_list_func). The frame between one of them and the probed context is
#: the trampoline (arch/x86/kernel/ftrace.c: create_trampoline() copies
#: ftrace_regs_caller), an allocation kallsyms does not list: the unwinder prints its bare
#: address, or, when it lies in a module's memory range, the name of that module's last
#: symbol (6.12 under CI: ``kprobe_ftrace_handler pvpanic_pci_driver_exit do_sys_openat2``).
_OPS_CALLBACKS = ("kprobe_ftrace_handler", "fprobe_handler", "fprobe_ftrace_entry",
                  "ftrace_ops_assist_func", "arch_ftrace_ops_list_func", "ftrace_ops_list_func")


def stack_match(host: str, guest: str) -> bool:
    """``guest`` (a stacktrace trigger's frames, innermost first) is ``host``'s with frames
    of the kernel's probe machinery on top: from the probed context down, frame for frame,
    the same functions. Where the trigger's unwinder starts, the probe's own handler is
    running (``kprobe_trace_func`` ... ``ftrace_regs_call``); a host breakpoint never ran it.
    One frame directly under an ftrace_ops callback is its trampoline, whatever its name."""
    h, g = host.split(), guest.split()
    extra = len(g) - len(h)
    if extra < 0 or g[extra:] != h:
        return False
    top = g[:extra]
    if len(top) >= 2 and top[-2] in _OPS_CALLBACKS:
        top = top[:-1]
    return all(_machinery(f) for f in top)


# -- reorders -------------------------------------------------------------------------------


_sig = operator.attrgetter("pid", "irq", "cpu")


#: The preemption models whose interrupt exit may switch tasks (kernel/sched/core.c:
#: sched_dynamic_update() enables irqentry_exit_cond_resched for "full" and "lazy" and
#: makes it a NOP for "none" and "voluntary", on 6.1, 6.12 and 7.3;
#: kernel/entry/common.c: irqentry_exit())
PREEMPTING_MODELS = ("full", "lazy")


def moves(first: list[Hit], later: list[Hit], *, preempt: bool = False
          ) -> tuple[list[Hit], list[tuple[int, str]]]:
    """``later`` with each hit that it recorded after hits the other way round moved back
    in front of them, where ``first`` recorded it before them; and the positions moved
    to, each with its rule.

    A move is allowed only for the window its reason names: the host records at its
    breakpoint, the guest in its handler a few instructions later, and in between

    - ``irq-order``: an interrupt on the same CPU recorded its own hits; the hits crossed
      are exactly the run ``first`` recorded next (pid, context, CPU, in order), all in
      interrupt context, the moved one in task context (no task-context code runs inside
      an interrupt's window);
    - ``preempt-order``: that interrupt ended in a preemption (``preempt_schedule_irq()``)
      and other tasks ran on the same CPU; the hits crossed are other pids' (and the
      moved task's own in interrupt context: the interrupt that preempted it, 7.3 lazy:
      host ls task, ls irq, kdamond x3; guest ls irq, kdamond x3, ls task) that
      ``first`` recorded after the moved one, at least one of another pid. Several
      tasks can each be preempted in their own window and resume in any order
      (preempt=full: the host recorded pids 130 129 128, the guest 128 130 129: two
      moves). Only with ``preempt``, the guest kernel's model preempting on interrupt
      exit (:data:`PREEMPTING_MODELS`), and only for a task-context hit: nothing is
      preempted in interrupt context (kernel/entry/common.c:
      raw_irqentry_exit_cond_resched() preempts only where ``preempt_count()`` is 0).

    Every hit crossed is on the moved hit's CPU. Stops at the first difference no such
    move explains; sides that lack a pid or a context of any hit move nothing by that
    key."""
    n = min(len(first), len(later))
    sf, sl = list(map(_sig, first[:n])), list(map(_sig, later[:n]))
    if sf == sl:            # nothing out of place (two lists compared in C)
        return later, []
    start = next(i for i in range(n) if sf[i] != sl[i])
    out, done = list(later), []
    pids = all(h.pid is not None for h in (*first, *later))
    ctxs = all(h.irq for h in (*first, *later))
    for i in range(start, n):
        want = first[i]
        if _sig(out[i]) == _sig(want):
            continue
        j = next((k for k in range(i + 1, len(out)) if _sig(out[k]) == _sig(want)), None)
        if j is None:
            break
        run = out[i:j]
        if any(h.cpu != want.cpu for h in run):
            break
        sigs = [_sig(h) for h in run]
        if ctxs and want.irq == "task" and all(h.irq != want.irq for h in run) \
                and sigs == [_sig(h) for h in first[i + 1:j + 1]]:
            name = "irq-order"
        elif preempt and pids and want.irq != "irq" \
                and any(h.pid != want.pid for h in run) \
                and all(h.pid != want.pid or (ctxs and h.irq != want.irq) for h in run) \
                and not Counter(sigs) - Counter(_sig(h) for h in first[i + 1:]):
            name = "preempt-order"
        else:
            break
        out.insert(i, out.pop(j))
        done.append((i, name))
    return (out, done) if done else (later, [])


# -- the registry ---------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a rule may look at beyond the two hits: the sides' names and the host
    trampolines' texts (``harness.diff.runner.trampoline_text``)."""

    a_side: str
    b_side: str
    trampolines: tuple[str, ...] = ()
    #: the guest kernel's preemption model (``SideResult.preempt``), None when unread
    preempt: str | None = None
    #: the next pair of the probe whose pair the field rules judge (``raced``)
    following: "tuple[Hit, Hit] | None" = None


REGISTRY: tuple[Rule, ...] = (
    Rule("refused-missing", "line",
         "a line one side refused that the other side never placed: no registration to "
         "compare",
         "a run stops at its first setup failure; the lines after it have no outcome",
         "one side's outcome is a refusal and the other side has no outcome for that line"),
    Rule("refusal-text", "line",
         "a refusal with the same errno on both sides whose words the host cannot know: "
         "compared by errno",
         "the kernel's words come from deep in registration (Outcome.words names the case)",
         "both refused with the same errno, and the side whose words differ names why it "
         "cannot know them (Outcome.words)"),
    Rule("agent", "hits",
         "hits of the harness's guest agent (comm qemu-ga) left out on both sides, and "
         "from each side's nhit",
         "the agent switches tracing on and off, at moments the two sides see differently; "
         "a return probe's nhit counts at the return (kernel/trace/trace_kprobe.c: "
         "kretprobe_dispatcher()), so the agent's call in flight when the window opened "
         "(back in ppoll() after enabling the events) counts on the side armed first only",
         "the comm is the agent's, exactly; a child of the agent under its later comm only "
         "as many of the guest's first hits of that pid as the host left out; nhit less "
         "each side's own recorded agent hits, which must then be equal"),
    Rule("in-flight", "hits",
         "a host entry hit still in flight when the recording ended left out",
         "the host records at its breakpoint, the guest in its handler later "
         "(kernel/trace/trace_kprobe.c: kprobe_dispatcher()); both stop in one halt of "
         "the guest, where a vCPU between the two has its hit on the host's side only "
         "(the guest's handler runs after its recording was switched off: "
         "kernel/trace/ring_buffer.c: ring_buffer_lock_reserve() refuses once tracing_on "
         "is 0; the module's handler checks its recording flag)",
         "no settled halt in the engine's tries, and that halt found the hit's probe "
         "address + 1 or + 5 (the int3 frame's, an ftrace call's return) on a stack of "
         "the vCPU that recorded it, its latest record there (HostEngine.in_flight_hits); "
         "the verdict keeps the mark only on the host's side and only where the order "
         "bears it out: no later hit on its CPU but ones also in flight or, for a "
         "task-context hit, the interrupt hits nested in its window"),
    Rule("thread-order", "order",
         "uprobe hits compared per thread (pid), in order within each",
         "kernel/events/uprobes.c: uprobe_notify_resume() records on the way back to user "
         "mode, after exit_to_user_mode_loop() may have scheduled another thread",
         "the guest's mode of the probe is uprobe and both sides know every pid"),
    Rule("irq-order", "order",
         "a hit one side recorded after a run of the other context's hits (an interrupt "
         "between the two sides' records, on that CPU) moved back in front of that run",
         "the host records at its breakpoint, the guest in its handler later "
         "(kernel/trace/trace_kprobe.c: kprobe_dispatcher()); an interrupt taken between "
         "records its own hits in between",
         "every hit's context known on both sides; one task-context hit moved across "
         "exactly the run the other side recorded next, all on its CPU, all in interrupt "
         "context"),
    Rule("preempt-order", "order",
         "a hit one side recorded after a run of other tasks' hits (a preemption between "
         "the two sides' records, on that CPU) moved back in front of that run",
         "kernel/entry/common.c: irqentry_exit() -> preempt_schedule_irq() between the "
         "host's breakpoint and the guest's handler",
         "the guest kernel preempts on interrupt exit (its sched/preempt model is full "
         "or lazy: kernel/sched/core.c: sched_dynamic_update()); every pid known on both "
         "sides; a task-context hit (kernel/entry/common.c: "
         "raw_irqentry_exit_cond_resched() preempts only at preempt_count() 0) moved "
         "back across hits that the other side recorded after it, of other pids (tasks "
         "each preempted in their own window resume in any order) and at least one, or "
         "its own pid's in interrupt context (the interrupt that preempted it), all on "
         "its CPU; an entry probe's only on the guest's side (the host records first)"),
    Rule("trampoline", "field",
         "a guest ip or return-slot value showing a host trampoline compares equal to the "
         "host's real return address",
         "the host hijacks the return address first (kernel/kprobes.c: "
         "__kretprobe_trampoline_handler(), kernel/events/uprobes.c: handle_trampoline() "
         "set regs->ip to the saved one, which is the host's trampoline)",
         "the host trampoline's text matched whole; the ip of a return hit on both sides "
         "from the same function; an argument only where it holds the return slot "
         "($stack0, +0($stack), +0(%sp) at an entry; %ip in a return hit whose guest ip "
         "is the trampoline)"),
    Rule("record-slack", "field",
         "an in-guest record longer than its data (record-size) compares equal where the "
         "host's model of the kernel's two passes reserves that many bytes more than it "
         "stores",
         "kernel/trace/trace_probe_tmpl.h: __get_data_size() counts what "
         "store_trace_args() then stores; an empty user string counts 1 byte "
         "(mm/maccess.c: strnlen_user_nofault() includes the NUL) and stores 0 "
         "(strncpy_from_user_nofault() returns 0 for it: 6.1, 6.12; 7.3 stores its NUL)",
         "the host made both passes for that hit (harness.kernel.grammar.fetch.evaluate, "
         "no value unknown) and the record's length is exactly its data's end plus the "
         "host's slack, after rb_calculate_event_length()'s rounding; any other excess "
         "(a length counted twice) stays a divergence",
         _record_slack),
    Rule("stale", "field",
         "a host (unknown) where the fetch took a real fault, or a user-half read the "
         "kernel refuses (the kernel keeps stale ring-buffer bytes) matches any value, "
         "that argument only, and the record's length (record-size) of that hit",
         "kernel/trace/trace_probe_tmpl.h: process_fetch_insn() stores nothing on a fault "
         "(store_trace_args())",
         "the host's record gives the reason for that argument with its evidence, the "
         "address whose read failed in that fetch (Hit.failed), and the engine confirmed "
         "a fault there with a second read (else the run fails: EngineReadError), or "
         "read current->mm and cpu_tlbstate.loaded_mm at the hit and found them apart "
         "(copy_from_user_nofault() refuses: mm/maccess.c, nmi_uaccess_okay())",
         _stale_check),
    Rule("below-sp", "field",
         "a host (unknown) where the fetch read the stack below the probed sp (the guest "
         "probe's own frames) matches any value, that argument only, and the record's "
         "length (record-size) of that hit",
         "the guest's handler frames overwrite the stack below the probed context's sp",
         "the host's record gives the reason for that argument",
         _unknown_rule("below-sp")),
    Rule("flags", "field",
         "a plugin-engine (unknown) %flags (TCG's lazy flags) matches any value, that "
         "argument only",
         "QEMU's TCG keeps the arithmetic flags lazily; the plugin API cannot read them",
         "the side is the plugin engine's and its record gives the reason for that "
         "argument",
         _flags_check),
    Rule("kernel-data", "field",
         "a host (unknown) where an event probe records the address of the kernel's own "
         "copy of an immediate string matches any value, that argument only",
         "kernel/trace/trace_probe.c: parse_probe_arg() keeps the string in the kernel",
         "the host's record gives the reason for that argument",
         _unknown_rule("kernel-data")),
    Rule("raced", "field",
         "an argument read from memory that changed between the host's read and the "
         "guest's (another context wrote it in between) compares equal",
         "the host records at its breakpoint, the guest in its handler later "
         "(kernel/trace/trace_kprobe.c: kprobe_dispatcher(), trace_fprobe.c: "
         "fentry_dispatcher()); an interrupt taken in between, or the preemption it ends "
         "in (kernel/entry/common.c: irqentry_exit() -> preempt_schedule_irq()), writes "
         "memory an argument may read: the switch clears the task's NEED_RESCHED_LAZY "
         "(kernel/sched/core.c: __schedule()) and sets its TIF_NEED_FPU_LOAD "
         "(arch/x86/include/asm/fpu/sched.h: switch_fpu())",
         "the argument reads memory (ProbeSpec.mem_args: never a register) and both "
         "sides read a value (no (unknown)); the probe's "
         "next pair has the guest's value on both sides, the same pid and CPU as this "
         "pair (the host's own second read saw the memory change)",
         _raced),
    Rule("int3-nmi", "field",
         "a host irq (a caller in a hardirq, no softirq served) compares equal to a guest "
         "task where the guest's probe ran its handler from int3",
         "arch/x86/kernel/traps.c: exc_int3() runs a kernel-mode int3 in "
         "irqentry_nmi_enter(), which sets NMI and HARDIRQ in preempt_count for every "
         "caller; kernel/trace/trace.c: tracing_gen_ctx_irq_test() records both, and an "
         "NMI hides the caller's hardirq (the module's in_hardirq() && !in_nmi() alike)",
         "the host read the caller's preempt_count: HARDIRQ set, SOFTIRQ and NMI clear "
         "(Hit.hardirq); the guest's mode of the probe is int3 (kprobes/list, the "
         "module's list)",
         _int3_nmi),
    Rule("comm-change", "field",
         "a guest comm the same pid took after the hit (an exec renamed it before "
         "saved_cmdlines recorded it) compares equal",
         "kernel/trace/trace.c: tracing_record_taskinfo() saves a comm at the CPU's next "
         "switch or wakeup",
         "both sides saw the pid take that comm after the hit: the host through a hidden "
         "probe on __set_task_comm(), the guest in its own task:task_rename records"),
    Rule("stack-machinery", "field",
         "a stacktrace trigger's frames compared from the probed context down; the "
         "guest's frames above it, of its own probe machinery (kprobe_trace_func ... "
         "ftrace_regs_call), left out",
         "the trigger's unwinder starts inside the guest probe's handler, which a host "
         "breakpoint never runs",
         "the extra frames are on the guest's side only, every one of them machinery"),
    Rule("pid", "field",
         "a side whose records carry no pid at all (no task_struct offsets) has the pid "
         "left out of every comparison",
         "the host reads task->pid at its offset from the image's BTF",
         "no hit of that side carries a pid; a side that knows some pids is compared on "
         "all of them"),
    Rule("nhit", "counter",
         "nhit not compared where a side did not count it over the recording window",
         "the guest's counters count from the event's enabling (kprobe_profile, "
         "uprobe_profile, the module's stats from its loading)",
         "a guest side's Counters.window is unset (a host engine's counts are always "
         "over the window: one that is not diverges): compared wherever both sides "
         "counted over the "
         "one window (--guest events: the guest's per-cpu trace_kprobe.nhit read where the "
         "window opens and closes, in the gdbstub engine's halts or by the plugin's "
         "switching vCPU, both settled); nmissed is compared where both sides count the "
         "probe, and a host side counts every probe it placed"),
)

for _r in REGISTRY:
    if _r.stage == "field" and _r.check is None:
        object.__setattr__(_r, "check", {"trampoline": _trampoline,
                                         "comm-change": _comm_change,
                                         "stack-machinery": _stack_machinery}.get(_r.name))
del _r

#: name -> one-line summary, for reports and ``--allow``.
NORMALIZATIONS: dict[str, str] = {r.name: r.summary for r in REGISTRY}
#: The rules that make a host (unknown) match, by the reason its record gives.
UNKNOWN_RULES = ("stale", "below-sp", "flags", "kernel-data")


def rule(name: str) -> Rule:
    return next(r for r in REGISTRY if r.name == name)


def by_stage(stage: str) -> tuple[Rule, ...]:
    return tuple(r for r in REGISTRY if r.stage == stage)


def markdown_table() -> str:
    """The registry as docs/diff.md lists it (a unit test holds the page to this)."""
    rows = ["| rule | stage | what | why (kernel source) | only when |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{r.name}` | {r.stage} | {r.summary} | {r.reason} | {r.evidence} |"
             .replace("$", "\\$") for r in REGISTRY]
    return "\n".join(rows)


def help_text() -> str:
    """The registry as ``kph diff --allow help`` prints it."""
    out = ["The normalizations kph diff may apply (in the order compare() runs them); "
           "--strict refuses each one --allow does not name:", ""]
    for r in REGISTRY:
        out += [f"{r.name}  [{r.stage}]", f"    {r.summary}", f"    why: {r.reason}",
                f"    only when: {r.evidence}", ""]
    return "\n".join(out)

