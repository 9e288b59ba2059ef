"""Run probe specs on one side, or on two sides observing one execution, for a workload.

Why one execution and not two runs: fetch args such as ``%dx`` at ``do_sys_openat2`` are
kernel stack pointers, different in every process; only the very same hits can be
compared field by field. So both sides are armed at once: host-side first (its address
checks see the original instructions, not the guest's int3), then in-guest, then the host
forgets what it decoded (the guest's probes changed the text). At a shared address the
host breakpoint fires before the guest's own ftrace call, int3 or jump, records, then
executes the instruction, which runs the guest's probe. One workload, the same calls.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from .backends import make_backend
from .backends.host import FetchHook, HostBackend
from .probespec import ProbeSpec
from .records import RunResult

log = logging.getLogger(__name__)


def run_single(vm: Any, backend: str, specs: Sequence[ProbeSpec], workload: str, *,
               timeout: float = 120.0) -> RunResult:
    """Place ``specs`` with one backend, run ``workload``, collect, unregister."""
    be = make_backend(backend, vm)
    try:
        outcomes = be.register(specs)
        be.enable()
        r = vm.run(workload, timeout=timeout)
        be.disable()
        return RunResult(be.side, outcomes, be.collect(), be.counters(), r.status,
                         r.stdout + r.stderr)
    finally:
        be.close()


def run_differential(vm: Any, specs: Sequence[ProbeSpec], workload: str, *,
                     guest: str = "events", hook: FetchHook | None = None,
                     timeout: float = 120.0) -> tuple[RunResult, RunResult]:
    """Host-side and in-guest (``guest``: events or module) on one execution of ``workload``."""
    g = make_backend(guest, vm)
    h: HostBackend | None = None
    try:
        h = HostBackend(vm, hook=hook,
                        comm_rule="saved_cmdlines" if guest == "events" else "at_hit")
        h_out = h.register(specs)
        g_out = g.register(specs)
        vm.host.invalidate_code()
        g.enable()
        h.enable()
        r = vm.run(workload, timeout=timeout)
        h.disable()
        g.disable()
        host = RunResult(h.side, h_out, h.collect(), h.counters(), r.status, r.stdout + r.stderr)
        guest_res = RunResult(g.side, g_out, g.collect(), g.counters(), r.status,
                              r.stdout + r.stderr)
        return host, guest_res
    finally:
        if h is not None:
            h.close()
        g.close()


def trampoline_text(vm: Any) -> str:
    """How the host trampoline prints in a guest trace (``_etext+0x0``)."""
    hit = vm.symbols.symbolize(vm.host.trampoline)
    return f"{hit[0].name}+{hit[1]:#x}" if hit else f"0x{vm.host.trampoline:x}"
