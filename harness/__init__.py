"""kprobe-harness: Linux kprobes semantics, placed from the host through QEMU's gdbstub
and inside the guest as real kprobes, compared.

Public surface, most important first; errors from general to specific. The names are
imported on first use (PEP 562), so ``kph --help`` and a Ctrl-C during start-up do not
wait for QEMU, GDB and capstone bindings to load.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

_WHERE = {
    "Machine": "vmctl", "RunResult": "vmctl", "VmState": "vmctl",
    "Kprobe": "kernel.kprobes", "Kretprobe": "kernel.kprobes", "KretprobeInstance": "kernel.kprobes",
    "Jprobe": "kernel.kprobes", "PtRegs": "kernel.kprobes", "ProbeFlags": "kernel.kprobes",
    "KPROBE_FLAG_DISABLED": "kernel.kprobes", "HostEngine": "engines.gdbstub_engine", "KernelFacts": "machine.image.facts",
    "HarnessError": "errors", "SetupError": "errors", "VMError": "errors",
    "GuestPanicError": "errors", "GuestShutdownError": "errors", "VMLostError": "errors",
    "StateError": "errors", "GuestStoppedError": "errors", "HandlerError": "errors",
    "GuestAgentError": "errors", "GuestExecError": "errors", "GdbMIError": "errors",
    "SymbolNotFoundError": "errors", "ProbeRejectedError": "errors", "ProbeSpecError": "errors",
    "MemoryFaultError": "errors", "EngineReadError": "errors", "PluginRecordError": "errors",
}

__all__ = [
    "Machine", "Kprobe", "Kretprobe", "KretprobeInstance", "Jprobe", "PtRegs", "ProbeFlags",
    "KPROBE_FLAG_DISABLED", "HostEngine", "KernelFacts", "RunResult", "VmState",
    "HarnessError", "SetupError", "VMError", "GuestPanicError", "GuestShutdownError",
    "VMLostError", "StateError", "GuestStoppedError", "HandlerError", "GuestAgentError",
    "GuestExecError", "GdbMIError", "MemoryFaultError", "EngineReadError",
    "PluginRecordError", "SymbolNotFoundError", "ProbeRejectedError", "ProbeSpecError",
]


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
