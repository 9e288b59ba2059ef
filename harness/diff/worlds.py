"""Three worlds on one execution: the gdbstub engine, the plugin engine, and the guest.

``kph diff --host both``. The machine runs with the plugin loaded; the gdbstub engine is
made explicitly beside it (``vm.host`` is the plugin's). The two host engines never
share an address in the sense that matters: a gdbstub breakpoint stops the vCPU before
the plugin's callback could run, so the gdbstub engine here single-steps every probed
instruction (``HostEngine(emulate=False)``) with its breakpoint lifted, and the plugin's
callback runs during that step. One hit is thus seen three times, in this order: the
gdbstub stop, the plugin callback, the guest's own probe. Return probes hijack the same
return-address slot in that order too, so each later world records the earlier one's
trampoline as the return address: the guest sees the plugin's (``_etext+0x1``), the
plugin sees the gdbstub engine's (``_etext+0x0``); for uretprobes the bytes one and two
past the program's text. All compare equal to the real return address (the
``trampoline`` normalization of ``harness.diff.verdict``).

Arming order: gdbstub first (its address checks read the original instructions), then
the plugin, then the guest; enabling in the reverse order.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..backends import make_backend
from ..backends.host import HostBackend
from ..backends.plugin import PluginBackend
from ..backends.tracelayer import write_switch
from .verdict import DiffResult, compare
from ..errors import SetupError
from ..kernel.grammar import ProbeSpec
from ..records import SideResult
from .runner import events_listed, events_modelled, preempt_model, resolve_uprobes, trampoline_text
from ..machine.kwatch import KernelWatch
from ..engines.gdbstub_engine import HostEngine
from ..vmctl import Machine

log = logging.getLogger(__name__)


@dataclass
class ThreeWay:
    """The pairwise comparisons of three runs of one execution."""

    runs: tuple[SideResult, SideResult, SideResult]      # gdbstub, plugin, guest
    pairs: tuple[DiffResult, DiffResult, DiffResult]  # gdbstub-guest, plugin-guest, gdbstub-plugin

    @property
    def equivalent(self) -> bool:
        return all(p.equivalent for p in self.pairs)

    def first_divergence(self) -> DiffResult | None:
        """The first pair (in the order above) that diverges, or None."""
        return next((p for p in self.pairs if not p.equivalent), None)


def run_three(vm: Machine, specs: Sequence[ProbeSpec], workload: str, *, guest: str = "events",
              timeout: float = 120.0, buffer_mib: int | None = None,
              **verdict: Any) -> ThreeWay:
    """Arm ``specs`` in the gdbstub engine, the plugin engine and the guest; run once.

    :param verdict: ``harness.diff.verdict.compare``'s ``strict``, ``allow``, ``expect_empty``,
        for every pair.
    :param buffer_mib: the guest side's record buffer, MiB (``make_backend``).
    """
    if getattr(vm, "host_kind", "") != "plugin":
        raise SetupError("three worlds need the plugin loaded", "boot with host='plugin'")

    watch = KernelWatch(vm)     # the kernel's splats, a panic or a hang: kernel findings
    with watch.watching():
        return _three(vm, watch, specs, workload, guest=guest, timeout=timeout,
                      buffer_mib=buffer_mib, **verdict)


def _three(vm: Machine, watch: KernelWatch, specs: Sequence[ProbeSpec], workload: str, *,
           guest: str, timeout: float, buffer_mib: int | None = None,
           **verdict: Any) -> ThreeWay:
    specs = resolve_uprobes(vm, specs)
    comm_rule = "saved_cmdlines" if guest == "events" else "at_hit"
    stub = HostEngine(vm, emulate=False)
    g = h = p = None
    try:
        h = HostBackend(vm, comm_rule=comm_rule)
        h.engine = stub                   # the gdbstub engine, not vm.host (the plugin's)
        p = PluginBackend(vm, comm_rule=comm_rule)
        g = make_backend(guest, vm, buffer_mib=buffer_mib)
        outs = h.register(specs), p.register(specs), g.register(specs)
        stub.invalidate_code()
        # As harness.diff.runner does it, so that every world counts nmissed over the
        # same span as the guest: the module's probes are live from its registration to
        # its unloading, so both host engines arm right after registering it and disarm
        # after its counters are read; a kprobe event's nhit and nmissed are read in the
        # two halts of the window (EventsBackend.mark_nhits, through the stub that holds
        # them), since its profile counts from its enabling (a miss as the harness set
        # up, a kfree() in an interrupt while a guest kprobe handler ran, is not the run's).
        if guest == "module":
            h.arm()
            p.arm()
        # All three switch in one settled halt of the guest (harness.diff.runner): the
        # gdbstub engine's breakpoints, the guest's tracing_on or recording flag (written
        # through the stub) and the plugin's recording window (its vCPUs are stopped: the
        # first to run again applies it before any guest instruction).
        g.enable(**({"tracing": False} if guest == "events" else {"recording": False}))
        p.enable(opened=False)

        writes = {on: g.switch_writes(on) for on in (True, False)}
        marks = guest == "events"
        unsettled = stub.stats.get("unsettled", 0)

        def switch(on: bool) -> None:
            write_switch(stub, writes[on])
            p.engine.window(on)
            if marks:
                g.mark_nhits(stub)
        h.enable(also=lambda: switch(True))
        r = vm.run(workload, timeout=timeout)
        h.disable(disarm=guest != "module", also=lambda: switch(False))
        p.disable(disarm=guest != "module")
        g.disable()
        settled = stub.stats.get("unsettled", 0) == unsettled
        text = r.stdout + r.stderr
        g_left = events_listed(vm, specs) if guest == "events" else None
        lefts = (events_modelled(h), events_modelled(p), g_left) if g_left is not None \
            else (None, None, None)
        model = preempt_model(vm)
        g_hits = g.collect()
        g_counters = g.counters(window=settled) if marks else g.counters()
        h.disarm()
        p.disarm()
        runs = tuple(SideResult(be.side, o, g_hits if be is g else be.collect(),
                                g_counters if be is g else be.counters(), r.status, text,
                                r.stderr, events_left=left,
                                preempt=model if be is g else None)
                     for be, o, left in zip((h, p, g), outs, lefts, strict=True))
    finally:
        for be in (h, p, g):
            if be is not None:
                be.close()
        stub.close()
    splats = watch.finish()
    runs = tuple(dataclasses.replace(r, splats=splats) for r in runs)
    hs = vm.symbols.symbolize(stub.trampoline)
    # the gdbstub engine's trampoline as an ip and as a value: the plugin's probes run
    # after the gdbstub world's hijack, so a plugin $stack0 at an entry the gdbstub
    # engine's return probe hooked reads it (measured on 6.1: each engine alone, and the
    # guest alone, reads the caller there: all follow add_new_kprobe()'s newest first)
    tramps = tuple(trampoline_text(vm)) + ((f"{hs[0].name}+{hs[1]:#x}",) if hs else ()) \
        + (f"0x{stub.trampoline:x}",)
    if stub._uprobes is not None:       # the gdbstub engine's uretprobe trampolines
        tramps += tuple(f"0x{t:x}" for t in stub._uprobes.used_trampolines)
    pairs = (compare(runs[0], runs[2], trampoline=tramps, **verdict),
             compare(runs[1], runs[2], trampoline=tramps, **verdict),
             compare(runs[0], runs[1], trampoline=tramps, **verdict))
    return ThreeWay(runs, pairs)  # type: ignore[arg-type]
