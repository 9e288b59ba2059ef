"""kprobe-harness: Linux kprobes semantics, placed from the host through QEMU's gdbstub
and inside the guest as real kprobes, compared.

Public surface, most important first; errors from general to specific.
"""
from __future__ import annotations

import logging

from .errors import (GdbMIError, GuestAgentError, GuestExecError, GuestPanicError,
                     GuestShutdownError, HarnessError, ProbeSpecError, SetupError, StateError,
                     SymbolNotFoundError, VMError, VMLostError, ProbeRejectedError)
from .engine import HostEngine
from .kprobes import (KPROBE_FLAG_DISABLED, Jprobe, Kprobe, Kretprobe, KretprobeInstance,
                      ProbeFlags, PtRegs)
from .vmctl import Machine, RunResult, VmState

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Machine", "Kprobe", "Kretprobe", "KretprobeInstance", "Jprobe", "PtRegs", "ProbeFlags",
    "KPROBE_FLAG_DISABLED", "HostEngine", "RunResult", "VmState",
    "HarnessError", "SetupError", "VMError", "GuestPanicError", "GuestShutdownError",
    "VMLostError", "StateError", "GuestAgentError", "GuestExecError", "GdbMIError",
    "SymbolNotFoundError", "ProbeRejectedError", "ProbeSpecError",
]
