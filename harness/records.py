"""The records every probe backend produces and ``harness.diff.verdict`` compares (no I/O).

A ``Hit`` is one probe firing as the kernel's trace file would show it: values are the
*text* the kernel prints for each fetch arg (``format_value`` of ``harness.kernel.grammar.fetch``),
so host-side, tracefs and module records compare field by field. An ``Outcome`` is what
registering one spec gave: accepted, or refused with the kernel's errno (a result, not an
error: the diff compares refusals too).
"""
from __future__ import annotations

import contextlib
import gc
import threading

from dataclasses import dataclass, field
from typing import Any, Iterator


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_on = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a block makes tens of thousands of
    records (decoding a run's records, comparing two sides): each pass of it walks every
    object made so far, 2 us of a hit's ~5 on this machine (bench/hot_path.py). Records
    hold no reference cycles, so nothing waits for it. Threads may nest it (the plugin
    backend decodes on a thread of its own): the collector is back on, as it was, when
    the last block ends."""
    global _gc_holders, _gc_was_on
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_on:
                gc.enable()


#: what :meth:`Hit.changed` and :meth:`Hit.placed` make a hit with: a bare object given a
#: dict of its own (a frozen dataclass refuses setattr, and ``__init__`` checks nothing
#: a copy needs)
_new, _setattr = object.__new__, object.__setattr__

#: Distinct record payloads a backend keeps decoded while it collects (:meth:`Hit.placed`);
#: bounded, so a probe whose every record differs costs what it did before, a dict look-up
DECODED_MAX = 1 << 16


@dataclass(frozen=True)
class Hit:
    """One probe hit. ``probe`` is ``GROUP/EVENT``; ``kind`` ``p`` or ``r``."""

    side: str                    # "host", "events", "module"
    probe: str
    kind: str
    seq: int                     # order of this hit on its side
    cpu: int
    pid: int | None
    comm: str
    ip: str                      # what the trace prints in the parentheses (before " <- ")
    ret_from: str | None = None  # return probes: the function returned from
    args: tuple[tuple[str, str], ...] = ()
    mode: str = ""               # in-guest probe mode: ftrace, int3, optimized ("" host-side)
    #: Host side: comms this pid took *after* the hit (an exec renames it); the trace may
    #: print one of them (``harness.diff.verdict``'s ``comm-change`` normalization).
    comm_alts: tuple[str, ...] = ()
    #: The context of the probed call: ``task`` or ``irq`` (a softirq or hardirq; "" not
    #: known): the trace entry's ``common_flags`` in the guest, ``preempt_count`` host-side.
    irq: str = ""
    #: Host side, return probes: the arguments fetched from the return ip
    #: (``ProbeSpec.ret_ip_args``), for ``harness.diff.verdict``'s ``trampoline`` rule.
    ret_ip_args: tuple[str, ...] = ()
    #: Host side, entry probes: the arguments that read the word at the probed sp
    #: (``ProbeSpec.slot_args``: at a function's entry, the return-address slot), the
    #: only ones ``harness.diff.rules``' ``trampoline`` rule looks at in an entry hit.
    slot_args: tuple[str, ...] = ()
    #: Host side: the arguments whose value was read from memory at the hit
    #: (``ProbeSpec.mem_args``), the only ones ``harness.diff.rules``' ``raced`` rule
    #: looks at.
    mem_args: tuple[str, ...] = ()
    #: Host side: the arguments whose value holds ``(unknown)``, each with the kernel's
    #: reason (``harness.kernel.grammar.fetch.UNKNOWN_WHY``, or ``flags`` for the plugin engine's
    #: lazily kept flags). Only these may match any guest value in ``harness.diff.verdict``.
    unknown: tuple[tuple[str, str], ...] = ()
    #: Host side: for each argument whose reason is ``stale``, the address whose read
    #: failed in its fetch (a fault the engine confirmed, or an address the kernel's
    #: probe_mem_read() refuses): the evidence ``harness.diff.rules``' ``stale`` asks for.
    failed: tuple[tuple[str, int], ...] = ()
    #: Host side, entry probes: recorded at the breakpoint, and the halt that ended the
    #: recording found the vCPU still between that breakpoint and the guest's handler
    #: (``HostEngine.in_flight_hits``): a guest probe's handler runs after its tracing
    #: was switched off, so it records nothing (``harness.diff.rules``' ``in-flight``).
    in_flight: bool = False
    #: With a ``stacktrace`` trigger on the event (``harness.backends.triggers``): the
    #: functions of the stack trace taken after the hit, innermost first (the ``=>``
    #: lines of the trace); None without one
    stack: tuple[str, ...] | None = None
    #: In-guest side: bytes the ring-buffer record holds beyond its fields and the data
    #: its data_locs reach (``harness.kernel.ringbuf.record_excess``; 0 on a sound kernel,
    #: and host-side, which has no record)
    excess: int = 0
    #: In-guest side: where that record's data ends (its fixed fields, then as far as its
    #: data_locs reach), the length :attr:`excess` is measured from
    reach: int = 0
    #: Host side: the bytes of the dynamic area the kernel's first pass reserves and its
    #: second leaves unwritten, as the fetch model makes both passes
    #: (``harness.kernel.grammar.fetch.evaluate``); the ``record-slack`` rule's evidence
    slack: int = 0
    #: Host side: ``irq`` was measured for a caller in a hardirq alone (no softirq
    #: served), which a guest probe run from int3 records as ``task`` (rule ``int3-nmi``)
    hardirq: bool = False
    #: Module side, with post_handlers: where the post_handler's ``regs->ip`` is not where
    #: the probed instruction goes (``ModuleBackend._post_ip``: an emulated branch that
    #: went the wrong way), what differs; "" when they agree or nothing was checked
    post_ip: str = ""

    @classmethod
    def template(cls, side: str, probe: str, kind: str, **fixed: Any) -> "Hit":
        """What every hit of one probe shares, to make each hit from with :meth:`changed`
        (``Hit()`` takes 3.3 us, ``changed`` 0.5: a backend collects 100,000 of them)."""
        return cls(side=side, probe=probe, kind=kind, seq=0, cpu=0, pid=None, comm="", ip="",
                   **fixed)

    def changed(self, **changes: Any) -> "Hit":
        """``dataclasses.replace(self, **changes)`` without re-running ``__init__`` (a
        hit has no ``__post_init__``): 0.4 us where replace() takes 5; collecting 100,000
        hits renames most of them (``saved_cmdlines``, ``comm_alts``)."""
        d = self.__dict__.copy()
        for k in changes:
            if k not in d:
                raise TypeError(f"Hit has no field {k!r}")
        d.update(changes)
        new = _new(Hit)
        _setattr(new, "__dict__", d)
        return new

    def placed(self, seq: int, cpu: int, pid: int | None, comm: str, irq: str) -> "Hit":
        """This hit at another place in the run: :meth:`changed` of those five fields, for
        a backend that decodes a record's payload once and places it at every record that
        carries it. The copy of the dict is the new hit's own (0.5 us, where updating the
        empty dict of a new object took 0.9, on this machine under load)."""
        d = self.__dict__.copy()
        d["seq"], d["cpu"], d["pid"], d["comm"], d["irq"] = seq, cpu, pid, comm, irq
        new = _new(Hit)
        _setattr(new, "__dict__", d)
        return new

    def arg(self, name: str) -> str:
        for k, v in self.args:
            if k == name:
                return v
        raise KeyError(name)

    def line(self) -> str:
        """The hit as a trace-file-like line (for reports)."""
        ip = self.ip + (f" <- {self.ret_from}" if self.ret_from else "")
        args = "".join(f" {k}={v}" for k, v in self.args)
        return f"{self.comm}-{self.pid} [{self.cpu:03d}] {self.probe}: ({ip}){args}"


@dataclass(frozen=True)
class Outcome:
    """What registering one spec line gave on one side.

    ``index`` is the line's position in the run (several lines may define one event, so
    ``probe`` alone does not name a line). ``reason`` says why in a few words where the
    side knows more (host-side: the rule, ``blacklisted: do_int3``). ``pending`` is set when
    the line was accepted but nothing was registered (6.1 keeps a ``MOD:SYM`` event of a
    module not loaded, and a raw address it cannot resolve): it never fires.

    A refusal carries the kernel's own words, as ``tracing/error_log`` prints its entry
    (kernel/trace/trace.c: ``tracing_log_err()``, ``tracing_err_log_seq_show()``)::

        [ts] SUBSYSTEM: error: MESSAGE
          Command: COMMAND
                   ^ (at COLUMN)

    - ``subsystem``: who logged it: ``trace_kprobe`` (``p``/``r`` lines), ``trace_uprobe``
      (uprobe lines), ``trace_fprobe`` (``f`` and ``t`` lines), ``event_probe`` (``e``
      lines), ``event filter parse error`` (an ``e`` line's ``if`` filter: its command is
      the filter), ``dynevent`` (7.3: a ``dynamic_events`` line no kind takes); "" when the
      kernel logs nothing for this refusal.
    - ``message``: the text after ``error: ``; when nothing is logged, the write's
      ``strerror()`` text (what the shell prints: ``Invalid argument``).
    - ``column``: the caret's position in the command, counted in the line as written
      (its words joined by single spaces, as ``__trace_probe_log_err()`` joins ``argv``;
      the words the kernel logs where it rewrote them, ``%pd``); in the filter for an
      event filter error; -1 when nothing is logged.
    - ``words``: "" when this side has the kernel's words (read from the guest's
      ``error_log``, or predicted host-side); else the name of the documented case in which
      it cannot know them (:data:`harness.kernel.dynevent.UNKNOWN_WORDS`).
    """

    probe: str
    accepted: bool
    errno: int = 0
    message: str = ""
    mode: str = ""               # ftrace, int3, optimized (in-guest), host
    index: int = -1
    reason: str = ""
    pending: str = ""
    subsystem: str = ""
    column: int = -1
    words: str = ""

    @classmethod
    def rejected(cls, probe: str, errno: int, message: str = "", *, index: int = -1,
                 reason: str = "", subsystem: str = "", column: int = -1,
                 words: str = "") -> "Outcome":
        return cls(probe, False, errno, message, index=index, reason=reason,
                   subsystem=subsystem, column=column, words=words)

    def error_log(self) -> tuple[str, str, int]:
        """(subsystem, message, column): the kernel's words of a refusal."""
        return self.subsystem, self.message, self.column


@dataclass(frozen=True)
class Counters:
    """``nhit``/``nmissed`` of one probe on one side (the kprobe_profile columns)."""

    probe: str
    nhit: int
    nmissed: int = 0
    #: ``nhit`` counts the hits of the recording window only (both sides' windows open and
    #: close in one halt of the guest), not from the probe's registration or enabling
    window: bool = False


@dataclass
class SideResult:
    """Everything one backend produced for one workload."""

    side: str
    outcomes: list[Outcome] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    counters: dict[str, Counters] = field(default_factory=dict)
    workload_status: int = 0
    workload_output: str = ""
    workload_stderr: str = ""
    #: The dynamic events left after this side's lines (each remaining line's
    #: ``GROUP/EVENT``, sorted): the guest's ``dynamic_events`` listing read after the run,
    #: or the host side's model of it (``harness.kernel.dynevent.EventTable``); None where
    #: the side has no such list (the module backend). Compared by ``harness.diff.verdict``
    #: (field ``event-list``).
    events_left: tuple[str, ...] | None = None
    #: What the kernel printed over the run (``harness.kernel.splat.Splat``: console and
    #: dmesg, those before the run's window marked so), the same on every side of one run.
    splats: tuple[object, ...] = ()
    #: The guest kernel's preemption model over the run, on an in-guest side: the mode
    #: ``/sys/kernel/debug/sched/preempt`` marks (none, voluntary, full, lazy), or what
    #: its config builds without PREEMPT_DYNAMIC; None where it was not read (a host
    #: side). ``preempt-order`` needs a model that preempts on interrupt exit.
    preempt: str | None = None
