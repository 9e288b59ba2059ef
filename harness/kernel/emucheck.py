"""Prove host-side emulation right: emulate an instruction, undo, single-step it, compare.

Runs inside a probe hit (the vCPU halted in kernel mode). For an instruction at its own
address, or for arbitrary bytes written to a scratch address (``code=``, e.g. endbr64,
which a kernel built without IBT does not contain), it records every general register,
rip, eflags and the stack bytes around rsp after (a) ``harness.kernel.emulate`` and (b) a real
single-step from the same starting state, then puts the starting state back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .emulate import decode
from .kprobes import GDB_TO_FIELD, PT_REGS_FIELDS

_STACK = 32  # bytes each side of rsp compared
#: Registers given distinctive values (upper halves set) before comparing, so that a
#: missed zero-extension or a swapped operand cannot hide behind zeros.
_SEEDED = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12",
           "r13", "r14", "r15")


@dataclass(frozen=True)
class EmulationCheck:
    addr: int
    code: bytes
    kind: str
    emulated: dict[str, int]
    stepped: dict[str, int]
    emulated_stack: bytes
    stepped_stack: bytes
    restepped: int = 0      # single-steps that reported no progress and were redone

    @property
    def equal(self) -> bool:
        return self.emulated == self.stepped and self.emulated_stack == self.stepped_stack

    def differences(self) -> dict[str, tuple[int, int]]:
        return {k: (self.emulated.get(k, -1), v) for k, v in self.stepped.items()
                if self.emulated.get(k) != v}


def check(engine: Any, th: int, addr: int, code: bytes | None = None,
          scratch: int | None = None) -> EmulationCheck:
    """Compare emulation with a single-step of the instruction at ``addr`` (or of ``code``
    placed at ``scratch``) on vCPU ``th``; the vCPU's state is restored afterwards."""
    stub = engine.stub
    regs0 = stub.read_registers(tuple(PT_REGS_FIELDS.values()), thread=th)
    sp = regs0["rsp"]
    stack0 = stub.read_memory(sp - _STACK, 2 * _STACK)
    where = addr
    saved_code = None
    if code is not None:
        where = scratch if scratch is not None else engine.trampoline + 0x40
        saved_code = stub.read_memory(where, len(code) + 1)
        stub.write_memory(where, code)
    text = code if code is not None else stub.read_memory(where, 16)
    emu = decode(text + b"\xcc" * 16, where)
    if emu is None:
        raise ValueError(f"{text[:8].hex()} is not an emulated instruction")
    start = dict(regs0, rip=where)
    for i, name in enumerate(_SEEDED):
        start[name] = 0xF0E0_0000_8000_0000 | (i + 1) << 40 | (0x11111111 * (i + 1)) & 0x7FFFFFFF
    fields = {GDB_TO_FIELD[k]: v for k, v in start.items()}

    def state() -> tuple[dict[str, int], bytes]:
        r = stub.read_registers(tuple(PT_REGS_FIELDS.values()), thread=th)
        return r, stub.read_memory(sp - _STACK, 2 * _STACK)

    try:
        # (a) emulate
        stub.write_registers(start, thread=th)
        eff = emu.apply(lambda n: fields["ip"] if n == "ip" else fields[n], stub.read_memory)
        for a, data in eff.mem:
            stub.write_memory(a, data)
        stub.write_registers({PT_REGS_FIELDS[k]: v for k, v in eff.regs.items()}
                             | {"rip": eff.next_ip}, thread=th)
        emulated, emulated_stack = state()
        # restore, (b) single-step
        stub.write_memory(sp - _STACK, stack0)
        stub.write_registers(start, thread=th)
        stub.step(thread=th)
        stepped, stepped_stack = state()
        restepped = 0
        # Seen once in ~50 runs under load: the stub reports a step that did not move
        # rip at all. None of these instructions can jump to itself, so step again.
        while stepped["rip"] == where and restepped < 2:
            restepped += 1
            stub.step(thread=th)
            stepped, stepped_stack = state()
    finally:
        stub.write_memory(sp - _STACK, stack0)
        stub.write_registers(regs0, thread=th)
        if saved_code is not None:
            stub.write_memory(where, saved_code)
    return EmulationCheck(where, bytes(text[:emu.length]), emu.kind, emulated, stepped,
                          emulated_stack, stepped_stack, restepped)
