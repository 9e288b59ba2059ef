"""Probe backends: the same specs placed host-side or inside the guest.

Every backend implements ``ProbeBackend``; adding one (eBPF, say) is adding a file here.

- ``host``   host-side kprobes through the gdbstub (``harness.engines.gdbstub_engine``), fetch args
             evaluated on the host exactly as the kernel does (``harness.kernel.grammar.fetch``);
- ``events`` the guest's own tracefs ``kprobe_events``;
- ``plugin`` host-side kprobes in QEMU's TCG plugin (``harness.engines.plugin_engine``), fetch
             args compiled and run in C at each hit, evaluated on the host afterwards;
- ``module`` the harness's kernel module ``kph_kprobes.ko`` (``probes/kmod/``), real
             kprobes/kretprobes registered by a module with pre, post, entry and return
             handlers.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from ..kernel.grammar import ProbeSpec
from ..records import Counters, Hit, Outcome
from .host import HostBackend
from .events import EventsBackend
from .module import ModuleBackend
from .plugin import PluginBackend
from ..vmctl import Machine


class ProbeBackend(Protocol):
    """One side of a differential run, bound to one booted Machine."""

    side: str

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """Place every spec (refusals are Outcomes, not exceptions)."""

    def enable(self) -> None:
        """Start recording."""

    def disable(self) -> None:
        """Stop recording."""

    def collect(self) -> list[Hit]:
        """The hits recorded since ``enable``, in order."""

    def counters(self) -> dict[str, Counters]:
        """nhit/nmissed per probe."""

    def close(self) -> None:
        """Unregister everything; the guest is left as it was."""


def make_backend(name: str, vm: Machine, *, post_handler: bool = False,
                 buffer_mib: int | None = None) -> ProbeBackend:
    """The backend called ``name`` (host, events, module) on ``vm``; a host engine's as
    in a host-only run (``alone``: it puts tracepoint probes' stubs on itself).
    ``post_handler``: the module's kprobes get a post_handler each (checked where the
    probed instruction went: ``ModuleBackend._post_ip``). ``buffer_mib``: an in-guest
    side's record buffer (the events side's ring buffer a CPU, the module's buffer), MiB;
    each side's own default without it."""
    if name == "host":        # alone: a host-only run (run_single)
        return HostBackend(vm, alone=True)
    if name == "events":
        return EventsBackend(vm, buffer_kb=buffer_mib * 1024 if buffer_mib else None)
    if name == "module":
        return ModuleBackend(vm, post_handler=post_handler,
                             bufsize=buffer_mib << 20 if buffer_mib else None)
    if name == "plugin":
        return PluginBackend(vm, alone=True)
    raise ValueError(f"unknown backend {name!r}: use host, plugin, events or module")


BACKENDS = ("host", "events", "module", "plugin")
