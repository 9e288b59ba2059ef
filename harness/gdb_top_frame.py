"""Loaded *into GDB* (``source``), not imported by the harness: a frame unwinder for the
innermost frame only, built from the registers GDB already holds.

Why: on every stop GDB computes the frame of the stop for its ``*stopped`` record, and
without symbols its amd64 epilogue sniffer reads one byte at pc (is it a ``ret``?), twice
per stop: two round trips to QEMU's gdbstub on the hot path of every probe hit (seen
with ``set debug remote 1``; ``bench/hit_cost.py --packets`` prints them). Python
unwinders are consulted before that sniffer, so claiming frame 0 from the registers
ends the stop with no memory read.

The frame id is (rsp, 0), not (rsp, rip): a code address that moved with every
instruction made each ``stepi`` look like a step into a new function, and GDB then
kept running to a step-resume breakpoint instead of stopping (``stepi`` hung). Outer frames get no unwinder of ours
(GDB's own apply), but frame 0 records no caller registers, so a backtrace stops there:
the harness never asks GDB for frames (stacks are symbolized from memory in
``harness.repro``).
"""
import gdb  # noqa: F401  (GDB's own module)
from gdb.unwinder import Unwinder, register_unwinder


class _FrameId:
    """What ``PendingFrame.create_unwind_info`` reads (``gdb.unwinder.FrameId`` is GDB 14+)."""

    def __init__(self, sp, pc):
        self.sp, self.pc = sp, pc


class InnermostFromRegisters(Unwinder):
    def __init__(self):
        super().__init__("kph-innermost")

    def __call__(self, pending_frame):
        if pending_frame.level() != 0:
            return None
        return pending_frame.create_unwind_info(
            _FrameId(pending_frame.read_register("rsp"), 0))


register_unwinder(None, InnermostFromRegisters(), replace=True)
