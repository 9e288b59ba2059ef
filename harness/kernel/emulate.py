"""Execute simple probed instructions on the host instead of single-stepping them.

Why: a single-step through the gdbstub costs a step-over (remove breakpoint, step,
reinsert) and a second stop; for the instructions that sit where probes usually go (the
5-byte ftrace nop at every function entry, the pushes and register moves of a prologue)
the effect is computable from the registers alone. The kernel does the same
(``arch/x86/kernel/kprobes/core.c``: ``prepare_emulation()`` emulates nop, push, pop,
jmp, call, ret...; "boostable" instructions run out of line without a trap).

Classes emulated here, each checked against a real single-step (tests/vm/test_emulate.py):
  nop      0f 1f /0 (any length, 66 prefixes), 90, endbr64 (f3 0f 1e fa)
  push     push r64 (50+r, REX.B)
  pop      pop r64 (58+r, REX.B; not pop rsp)
  mov      mov r/m64,r64 / mov r64,r/m64 with a register operand (89 /r, 8b /r, mod=11),
           32-bit forms zero-extend as the CPU does
  call     call rel32 (e8 cd): the ftrace site's call once a guest ftrace user (a kprobe,
           fprobe, tprobe, function tracer) enabled it, the hottest probed instruction
           (arch/x86/kernel/kprobes/core.c: prepare_emulation() -> kprobe_emulate_call())
Anything else (memory operands, flags, branches, faults) is single-stepped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

REGS64 = ("ax", "cx", "dx", "bx", "sp", "bp", "si", "di",
          "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
MASK64 = (1 << 64) - 1
ENDBR64 = bytes.fromhex("f30f1efa")


@dataclass(frozen=True)
class Effect:
    """What executing the instruction does: register writes, memory writes, next ip."""

    regs: dict[str, int]
    mem: tuple[tuple[int, bytes], ...]
    next_ip: int


@dataclass(frozen=True)
class Emulation:
    """A decoded, emulable instruction at ``addr``."""

    kind: str          # nop, push, pop, mov, call
    addr: int
    length: int
    dst: str = ""
    src: str = ""
    width: int = 64
    rel: int = 0       # call: the displacement from the next instruction

    def apply(self, get: Callable[[str], int], read: Callable[[int, int], bytes]) -> Effect:
        """The effect, given register values (``get``) and guest memory (``read``)."""
        nxt = self.addr + self.length
        if self.kind == "nop":
            return Effect({}, (), nxt)
        if self.kind == "push":
            sp = (get("sp") - 8) & MASK64
            return Effect({"sp": sp}, ((sp, get(self.src).to_bytes(8, "little")),), nxt)
        if self.kind == "pop":
            sp = get("sp")
            val = int.from_bytes(read(sp, 8), "little")
            return Effect({self.dst: val, "sp": (sp + 8) & MASK64}, (), nxt)
        if self.kind == "call":
            sp = (get("sp") - 8) & MASK64
            return Effect({"sp": sp}, ((sp, nxt.to_bytes(8, "little")),),
                          (nxt + self.rel) & MASK64)
        if self.kind == "mov":
            val = get(self.src)
            if self.width == 32:
                val &= 0xFFFFFFFF  # a 32-bit destination zero-extends to 64 bits
            return Effect({self.dst: val}, (), nxt)
        raise ValueError(f"unknown emulation {self.kind}")


def decode(code: bytes, addr: int) -> Emulation | None:
    """An ``Emulation`` for the instruction at the start of ``code``, or None to single-step."""
    if code.startswith(ENDBR64):
        return Emulation("nop", addr, 4)
    i = 0
    while i < len(code) and code[i] == 0x66:  # operand-size prefixes (only for nops)
        i += 1
    opsize = i > 0
    rex = 0
    if i < len(code) and 0x40 <= code[i] <= 0x4F:
        rex = code[i]
        i += 1
    if i >= len(code):
        return None
    op = code[i]
    w, r, b = bool(rex & 8), (rex >> 2) & 1, rex & 1
    if op == 0x0F and i + 2 < len(code) and code[i + 1] == 0x1F:
        n = modrm_len(code, i + 2)
        if n is None or (code[i + 2] >> 3) & 7 != 0:
            return None
        return Emulation("nop", addr, i + 2 + n)
    if opsize:
        return None
    if op == 0xE8 and not rex and i + 5 <= len(code):
        return Emulation("call", addr, i + 5,
                         rel=int.from_bytes(code[i + 1:i + 5], "little", signed=True))
    if op == 0x90 and not rex:
        return Emulation("nop", addr, i + 1)
    if 0x50 <= op <= 0x57 and not w:
        return Emulation("push", addr, i + 1, src=REGS64[(op & 7) | b << 3])
    if 0x58 <= op <= 0x5F and not w:
        dst = REGS64[(op & 7) | b << 3]
        if dst == "sp":
            return None
        return Emulation("pop", addr, i + 1, dst=dst)
    if op in (0x89, 0x8B) and i + 1 < len(code):
        modrm = code[i + 1]
        if modrm >> 6 != 3:
            return None
        reg = REGS64[((modrm >> 3) & 7) | r << 3]
        rm = REGS64[(modrm & 7) | b << 3]
        dst, src = (rm, reg) if op == 0x89 else (reg, rm)
        return Emulation("mov", addr, i + 2, dst=dst, src=src, width=64 if w else 32)
    return None


def modrm_len(code: bytes, j: int) -> int | None:
    """Bytes taken by a ModRM operand (ModRM, SIB, displacement) starting at ``code[j]``."""
    if j >= len(code):
        return None
    modrm = code[j]
    mod, rm = modrm >> 6, modrm & 7
    n = 1
    if mod != 3 and rm == 4:
        if j + 1 >= len(code):
            return None
        sib = code[j + 1]
        n += 1
        if mod == 0 and sib & 7 == 5:
            n += 4
    if mod == 0 and rm == 5:
        n += 4  # rip-relative disp32
    elif mod == 1:
        n += 1
    elif mod == 2:
        n += 4
    return n


# -- where an instruction hands control (the post_handler's regs->ip) -------------------

#: Legacy prefixes (Intel SDM Vol. 2A, 2.1.1): lock/rep, segment overrides and branch
#: hints, operand and address size
PREFIXES = frozenset({0xF0, 0xF2, 0xF3, 0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67})
#: One-byte opcodes that transfer control somewhere the flags and the bytes do not tell
#: (ret, far and indirect branches, interrupts, loop/jcxz on rcx, xbegin's group, hlt)
_ELSEWHERE = frozenset({0xC2, 0xC3, 0xCA, 0xCB, 0xCF, 0xCC, 0xCD, 0xCE, 0xF1, 0xE0, 0xE1,
                        0xE2, 0xE3, 0xEA, 0x9A, 0xF4, 0xFF, 0xC7})
#: Two-byte (0x0f) ones: sysenter/syscall/sysret/sysexit, the 0f 00 and 0f 01 system
#: groups, the undefined-instruction traps BUG() and WARN() use (ud2, ud1, ud0)
_ELSEWHERE_0F = frozenset({0x00, 0x01, 0x05, 0x07, 0x0B, 0x34, 0x35, 0xB9, 0xFF})
#: Jcc's conditions by the opcode's low nibble >> 1 (Intel SDM Vol. 2A "Jcc"; an odd
#: nibble is the negation): O, B/C, E/Z, BE, S, P, L (SF != OF), LE (ZF or SF != OF)
_CC_NAMES = ("o", "b", "e", "be", "s", "p", "l", "le")
CF, PF, ZF, SF, OF = 1 << 0, 1 << 2, 1 << 6, 1 << 7, 1 << 11


def jcc_taken(cc: int, flags: int) -> bool:
    """Whether Jcc with condition ``cc`` (0-15, the opcode's low nibble) jumps under
    ``flags`` (RFLAGS): the CPU's rule, Intel SDM Vol. 2A "Jcc" (the kernel's
    ``int3_emulate_jcc()``, arch/x86/include/asm/text-patching.h, emulates it for a
    kprobe on a Jcc: arch/x86/kernel/kprobes/core.c: kprobe_emulate_jcc())."""
    cf, pf, zf = bool(flags & CF), bool(flags & PF), bool(flags & ZF)
    sf, of = bool(flags & SF), bool(flags & OF)
    cond = (of, cf, zf, cf or zf, sf, pf, sf != of, zf or sf != of)[(cc >> 1) & 7]
    return cond != bool(cc & 1)


def jcc_name(cc: int) -> str:
    return "j" + ("n" if cc & 1 else "") + _CC_NAMES[(cc >> 1) & 7]


def next_ip(code: bytes, addr: int, flags: int) -> tuple[str, int] | None:
    """Where the whole instruction ``code`` (exactly its bytes) at ``addr`` goes next, as
    the CPU runs it with ``flags`` (RFLAGS; a Jcc reads them and changes none): (what it
    is, the address). A Jcc goes to its target or falls through, jmp and call rel go to
    theirs, any other instruction that is not a transfer of control to the next one.
    None for those whose target the bytes and flags do not tell (ret, indirect and far
    branches, interrupts, loop/jcxz, system instructions, ud2) and for a 16-bit
    branch. Where the instruction was probed, a kprobe's post_handler sees this address
    in ``regs->ip`` (kernel/kprobes.c, arch/x86/kernel/kprobes/core.c:
    kprobe_post_process(), after the emulation or the single-step)."""
    i, n = 0, len(code)
    while i < n and code[i] in PREFIXES:
        i += 1
    opsize16 = 0x66 in code[:i]
    if i < n and 0x40 <= code[i] <= 0x4F:      # REX
        i += 1
    if i >= n:
        return None
    op, end = code[i], (addr + n) & MASK64

    def rel(at: int, size: int) -> int | None:
        if at + size != n:          # the displacement must end the instruction
            return None
        return int.from_bytes(code[at:at + size], "little", signed=True)

    if 0x70 <= op <= 0x7F or (op == 0x0F and i + 1 < n and 0x80 <= code[i + 1] <= 0x8F):
        short = op != 0x0F
        cc = (op if short else code[i + 1]) & 0xF
        d = rel(i + 1, 1) if short else (None if opsize16 else rel(i + 2, 4))
        if d is None:
            return None
        return jcc_name(cc), ((end + d) & MASK64) if jcc_taken(cc, flags) else end
    if op in (0xEB, 0xE9, 0xE8):
        d = rel(i + 1, 1) if op == 0xEB else (None if opsize16 else rel(i + 1, 4))
        if d is None:
            return None
        return ("jmp" if op != 0xE8 else "call"), (end + d) & MASK64
    if op in _ELSEWHERE or (op == 0x0F and (i + 1 >= n or code[i + 1] in _ELSEWHERE_0F)):
        return None
    return "insn", end
