"""The records every probe backend produces and ``harness.diff.verdict`` compares (no I/O).

A ``Hit`` is one probe firing as the kernel's trace file would show it: values are the
*text* the kernel prints for each fetch arg (``format_value`` of ``harness.kernel.grammar.fetch``),
so host-side, tracefs and module records compare field by field. An ``Outcome`` is what
registering one spec gave: accepted, or refused with the kernel's errno (a result, not an
error: the diff compares refusals too).
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    #: Host side: the arguments whose value holds ``(unknown)``, each with the kernel's
    #: reason (``harness.kernel.grammar.fetch.UNKNOWN_WHY``, or ``flags`` for the plugin engine's
    #: lazily kept flags). Only these may match any guest value in ``harness.diff.verdict``.
    unknown: tuple[tuple[str, str], ...] = ()
    #: With a ``stacktrace`` trigger on the event (``harness.backends.triggers``): the
    #: functions of the stack trace taken after the hit, innermost first (the ``=>``
    #: lines of the trace); None without one
    stack: tuple[str, ...] | None = None

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
    ``probe`` alone does not name a line). ``message`` is the kernel's ``error_log`` text
    for a refusal; ``reason`` says why in a few words where the side knows more (host-side:
    the rule, ``blacklisted: do_int3``). ``pending`` is set when the line was accepted but
    nothing was registered (6.1 keeps a ``MOD:SYM`` event of a module not loaded, and a raw
    address it cannot resolve): it never fires.
    """

    probe: str
    accepted: bool
    errno: int = 0
    message: str = ""
    mode: str = ""               # ftrace, int3, optimized (in-guest), host
    index: int = -1
    reason: str = ""
    pending: str = ""

    @classmethod
    def rejected(cls, probe: str, errno: int, message: str = "", *, index: int = -1,
                 reason: str = "") -> "Outcome":
        return cls(probe, False, errno, message, index=index, reason=reason)


@dataclass(frozen=True)
class Counters:
    """``nhit``/``nmissed`` of one probe on one side (the kprobe_profile columns)."""

    probe: str
    nhit: int
    nmissed: int = 0


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
