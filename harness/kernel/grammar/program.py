"""Fetch args compiled for the QEMU plugin, and the plugin's captures read back.

The plugin engine (``harness.engines.plugin_engine``) records spec-probe hits inside QEMU, with
no round trip to the host. Each argument's ``fetch_insn`` program (the kernel's list, as
:mod:`harness.kernel.grammar.common` builds it into ``ProbeArg.code``) is encoded here into 16-byte
``kph_insn`` records for ``probes/plugin/fetch.c``, which runs the program the way
``process_fetch_insn()`` (kernel/trace/trace_kprobe.c, Linux 6.1) walks it, and keeps
every memory read it makes: bytes, or a fault. Nothing is formatted in C.

On the host, :class:`CaptureContext` serves :func:`harness.kernel.grammar.fetch.evaluate` from
those reads, so a plugin hit is evaluated and printed by the very code the gdbstub engine
uses, from memory read at the hit by the vCPU that hit. :func:`simulate` is the C
interpreter in Python: the unit tests check that its captures answer every read
``evaluate`` makes (and the C program against it).

Layout of one captured block (8-byte aligned, little endian):
``u64 addr, u32 len, u16 kind, u16 pad, data[len]`` with kind ``DATA`` (a read that
worked), ``FAULT`` (a read that failed: ``len`` bytes at ``addr``), ``STR`` (a string up to
and including its NUL) or ``STR_LIMIT`` (a string cut at ``MAX_STRING_SIZE`` bytes).
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ...errors import EngineReadError, NotMirroredError
from .fetch import MAX_STRING_SIZE, THREAD_SIZE, FaultError
from .common import split_symbol_offset

log = logging.getLogger(__name__)

__all__ = ["compile_spec", "compile_code", "INSN_SIZE", "REGS", "REG_INDEX", "Block",
           "parse_blocks", "CaptureContext", "simulate", "CaptureMiss"]

INSN_SIZE = 16
_INSN = struct.Struct("<BBHIQ")
_BLK = struct.Struct("<QIHH")
_M = (1 << 64) - 1
#: ``struct pt_regs`` order (arch/x86/include/asm/ptrace.h): the record's register array.
REGS = ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
        "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss")
REG_INDEX = {name: i for i, name in enumerate(REGS)}

# probes/plugin/fetch.h
KOP = {"end": 0, "reg": 1, "stack": 2, "stackp": 3, "retval": 4, "imm": 5, "comm": 6,
       "data": 7, "arg": 8, "ustack": 9, "foffs": 10, "tp_arg": 11, "current": 12, "edata": 13, "deref": 16, "uderef": 17, "cpu_ptr": 18,
       "st_raw": 32, "st_mem": 33, "st_umem": 34, "st_string": 35, "st_ustring": 36,
       "st_symstr": 37, "st_string_uprobe": 38, "mod_bf": 48, "lp_array": 49}
DATA, FAULT, STR, STR_LIMIT, EDATA, PERCPU = 1, 2, 3, 4, 5, 6
#: probes/plugin/fetch.h: KTP_*, how get_event_field() reads a field
KTP = {"int": 0, "dyn": 1, "rdyn": 2, "static": 3, "ptr": 4, "rdyn4": 5}
_STRING_STORES = ("st_string", "st_ustring", "st_string_uprobe")


def _insn(op: str, a: int = 0, b: int = 0, imm: int = 0, pad: int = 0) -> bytes:
    return _INSN.pack(KOP[op], a, pad, b & 0xFFFFFFFF, imm & _M)


#: 6.12+/7.3 fetch ops the plugin's programs do not have (the gdbstub engine evaluates them).
_NOT_MIRRORED = {"btf": "a BTF argument not resolved for the booted kernel"}


def compile_code(code: Sequence[tuple[Any, ...]], *,
                 resolve: Callable[[str], int] | None = None,
                 file_offset_vaddr: Callable[[int], int] | None = None,
                 event_entry: int | None = None) -> bytes:
    """One argument's ``fetch_insn`` tuples (``ProbeArg.code``) as ``kph_insn`` records.

    ``event_entry``: for an event probe's fields (``tp_arg``), ``offsetof(struct
    trace_event_buffer, entry)``: the probe is at ``trace_event_buffer_commit(fbuffer)``
    and the record is ``fbuffer->entry``.

    ``@SYM`` (``nop_symbol``) is resolved here, as ``traceprobe_update_arg()`` does at
    registration; an unknown symbol becomes 0 (the host evaluation raises for it, as
    ``harness.kernel.grammar.fetch.evaluate`` does for the gdbstub engine).
    """
    out = []
    i = 0
    while i < len(code):
        op = code[i]
        kind = op[0]
        if kind == "nop_symbol":
            # The raw SYM[+|-OFFS] text (traceprobe_split_symbol_offset()); the trace
            # layer has normally resolved it already (harness.kernel.dynevent).

            name, off = split_symbol_offset(op[1])
            try:
                addr = resolve(name) if resolve is not None and name else 0
            except KeyError:
                addr = 0
            out.append(_insn("imm", imm=(addr + (off or 0)) & ((1 << 64) - 1)))
            i += 2          # the ("imm", None) the kernel fills in
            continue
        if kind == "reg":
            out.append(_insn("reg", a=REG_INDEX[op[1]]))
        elif kind == "tp_arg":
            _, name, off, size, signed, fkind = op
            if off is None or event_entry is None:
                raise ValueError(f"event field {name!r} without its record's offsets")
            out.append(_insn("tp_arg", a=KTP[fkind], b=size | int(signed) << 8, imm=off,
                             pad=event_entry))
        elif kind in ("stack", "arg", "ustack"):
            out.append(_insn(kind, imm=op[1]))
        elif kind in ("stackp", "retval", "comm", "data", "end", "current", "cpu_ptr"):
            out.append(_insn(kind))
        elif kind == "edata":
            out.append(_insn("edata", imm=op[1]))
        elif kind == "imm":
            out.append(_insn("imm", imm=op[1] or 0))
        elif kind == "foffs":
            out.append(_insn("foffs", imm=file_offset_vaddr(op[1]) if file_offset_vaddr else 0))
        elif kind in ("deref", "uderef"):
            out.append(_insn(kind, imm=op[1]))
        elif kind == "st_raw":
            out.append(_insn(kind, b=op[2], imm=op[1]))
        elif kind in ("st_mem", "st_umem"):
            out.append(_insn(kind, b=op[2], imm=op[1]))
        elif kind in _STRING_STORES + ("st_symstr",):
            out.append(_insn(kind, imm=op[1]))
        elif kind == "mod_bf":
            out.append(_insn(kind))           # bit shifts happen host-side
        elif kind == "lp_array":
            out.append(_insn(kind, b=op[1]))
        elif kind in _NOT_MIRRORED:
            raise NotMirroredError(f"not mirrored by the plugin engine: {_NOT_MIRRORED[kind]}",
                                   hint="use the gdbstub engine (--host gdbstub)")
        else:
            raise ValueError(f"no plugin encoding for fetch instruction {op!r}")
        i += 1
    return b"".join(out)


def compile_spec(args: Iterable[Any], *, resolve: Callable[[str], int] | None = None,
                 file_offset_vaddr: Callable[[int], int] | None = None,
                 event_entry: int | None = None) -> bytes:
    """Every ``ProbeArg`` of a spec, one program after the other (each ends in ``end``)."""
    return b"".join(compile_code(a.code, resolve=resolve, file_offset_vaddr=file_offset_vaddr,
                                 event_entry=event_entry)
                    for a in args)


@dataclass(frozen=True)
class Block:
    """One read the plugin made at a hit."""

    addr: int
    kind: int
    data: bytes = b""
    length: int = 0

    @property
    def end(self) -> int:
        return self.addr + (self.length if self.kind == FAULT else len(self.data))


def parse_blocks(buf: bytes | memoryview, n: int, off: int = 0) -> list[Block]:
    """``n`` blocks from ``buf`` at ``off``."""
    out = []
    for _ in range(n):
        addr, length, kind, _pad = _BLK.unpack_from(buf, off)
        off += 16
        if kind == FAULT:
            out.append(Block(addr, kind, b"", length))
            continue
        data = bytes(buf[off:off + length])
        off += (length + 7) & ~7
        out.append(Block(addr, kind, data, length))
    return out


class CaptureMiss(EngineReadError):
    """``evaluate`` asked for memory the plugin did not capture: a bug in the compiler,
    the interpreter or the plugin (never expected). Not a fault and not a value: the hit
    cannot be evaluated and the run fails (``harness.errors.EngineReadError``)."""


class CaptureContext:
    """The memory side of ``harness.kernel.grammar.fetch.FetchContext``, answered from a capture.

    Rules (see the module docstring for why they are exact): a read inside a ``DATA``
    block, or a string block, returns its bytes; a read of the rest of a page that starts
    in a string block whose NUL (or MAX_STRING_SIZE cut) comes before the page's end
    returns the block's bytes followed by zeros (the kernel's string copy never looks
    past the NUL); a read at a ``FAULT`` block's address, or in the page of a string
    fault, raises :class:`FaultError`; anything else is a :class:`CaptureMiss`.
    """

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.blocks = list(blocks)
        self.misses = 0

    def read(self, addr: int, size: int) -> bytes:
        end = addr + size
        for b in self.blocks:
            if b.kind == DATA and b.addr <= addr and end <= b.addr + len(b.data):
                return b.data[addr - b.addr:end - b.addr]
            if b.kind == FAULT and b.addr == addr and b.length == size:
                raise FaultError(addr, size)
        for b in self.blocks:
            if b.kind in (STR, STR_LIMIT) and b.addr <= addr <= b.addr + len(b.data):
                rel = addr - b.addr
                have = b.data[rel:rel + size]
                if len(have) == size:
                    return have
                if b.kind == STR_LIMIT or b"\0" in b.data:
                    if rel < len(b.data) or b.kind == STR_LIMIT:
                        return have + bytes(size - len(have))
            if b.kind == FAULT and b.addr >> 12 == addr >> 12 and (end - 1) >> 12 == addr >> 12 \
                    and b.length <= 4096 - (b.addr & 4095):
                raise FaultError(addr, size)
        self.misses += 1
        raise CaptureMiss(f"the plugin engine captured no read of {size} byte(s) at "
                          f"{addr:#x}", addr, size)

    read_user = read


def _read_from(mem: Callable[[int, int], bytes | None]) -> Callable[[int, int], bytes | None]:
    return mem


@dataclass
class _Sim:
    mem: Callable[[int, int], bytes | None]
    blocks: list[Block] = field(default_factory=list)

    def read(self, addr: int, size: int) -> int | None:
        addr &= _M
        data = self.mem(addr, size)
        if data is None or len(data) != size:
            self.blocks.append(Block(addr, FAULT, b"", size))
            return None
        self.blocks.append(Block(addr, DATA, data, size))
        return int.from_bytes(data[:8], "little")

    def string(self, addr: int) -> None:
        addr &= _M
        got = bytearray()
        while True:
            a = addr + len(got)
            want = min(256, 4096 - (a & 4095), MAX_STRING_SIZE - len(got))
            if want == 0:
                self.blocks.append(Block(addr, STR_LIMIT, bytes(got), len(got)))
                return
            piece = self.mem(a, want)
            if piece is None:
                self.blocks.append(Block(addr, STR, bytes(got), len(got)))
                self.blocks.append(Block(a, FAULT, b"", 4096 - (a & 4095)))
                return
            z = piece.find(b"\0")
            if z >= 0:
                got += piece[:z + 1]
                self.blocks.append(Block(addr, STR, bytes(got), len(got)))
                return
            got += piece


def simulate(code: Sequence[tuple[Any, ...]], regs: dict[str, int],
             mem: Callable[[int, int], bytes | None], *,
             resolve: Callable[[str], int] | None = None,
             event_entry: int | None = None, task: int = 0, percpu: int | None = None,
             edata: dict[int, int] | None = None) -> list[Block]:
    """What ``fetch.c`` captures for one argument (the reference the tests hold C to).

    ``mem(addr, size)`` returns the bytes, or None when any of them cannot be read;
    ``task`` is ``current``, ``percpu`` this CPU's per-cpu offset (None: not known),
    ``edata`` a return hit's entry-saved arguments by number.
    """
    sim = _Sim(mem)
    # Decode our own encoding back, so the simulation runs what C runs.
    raw = compile_code(code, resolve=resolve, event_entry=event_entry)
    prog = [_INSN.unpack_from(raw, i) for i in range(0, len(raw), INSN_SIZE)]
    names = {v: k for k, v in KOP.items()}
    ins = [(names[op], a, b, imm) for op, a, _, b, imm in prog]
    pads = [pad for _, _, pad, _, _ in prog]
    r = [regs.get(n, 0) & _M for n in REGS]
    sp = r[REG_INDEX["sp"]]

    def stack_nth(n: int) -> int:
        a = (sp + 8 * n) & _M
        if a & ~(THREAD_SIZE - 1) != sp & ~(THREAD_SIZE - 1):
            return 0
        v = sim.read(a, 8)
        return 0 if v is None else v

    op, a, b, imm = ins[0]
    blob = False
    if op == "reg":
        val = r[a]
    elif op == "stack":
        val = stack_nth(imm)
    elif op == "stackp":
        val = sp
    elif op == "retval":
        val = r[REG_INDEX["ax"]]
    elif op in ("imm", "foffs"):
        val = imm
    elif op in ("comm", "data"):
        val, blob = 0, True
    elif op == "ustack":
        v = sim.read(sp + 8 * imm, 8)
        val = 0 if v is None else v
    elif op == "arg":
        regs6 = ("di", "si", "dx", "cx", "r8", "r9")
        val = r[REG_INDEX[regs6[imm]]] if imm < 6 else stack_nth(imm - 5)
    elif op == "current":
        val = task
    elif op == "edata":
        if edata is None or imm not in edata:
            raise ValueError(f"argument {imm} was not saved at the entry")
        val = edata[imm] & _M
        sim.blocks.append(Block(imm, EDATA, val.to_bytes(8, "little"), 8))
    elif op == "tp_arg":        # fetch.c: KOP_TP_ARG
        rec = sim.read(r[REG_INDEX["di"]] + pads[0], 8)
        if rec is None:
            return sim.blocks
        addr, size = (rec + imm) & _M, b & 0xFF
        if a == KTP["static"]:
            val = addr
        elif a in (KTP["dyn"], KTP["rdyn"], KTP["rdyn4"]):
            loc = sim.read(addr, 4)
            if loc is None:
                return sim.blocks
            base = rec if a == KTP["dyn"] else addr if a == KTP["rdyn"] else addr + 4
            val = (base + (loc & 0xFFFF)) & _M
        elif a == KTP["ptr"]:
            v = sim.read(addr, 8)
            if v is None:
                return sim.blocks
            val = v
        else:
            size = size if size in (1, 2, 4) else 8
            v = sim.read(addr, size)
            if v is None:
                return sim.blocks
            if b >> 8 & 1 and size < 8 and v >> (8 * size - 1) & 1:
                v |= _M ^ ((1 << 8 * size) - 1)
            val = v
    else:
        raise ValueError(op)
    pc, lval, count = 1, val, 0
    while True:
        while ins[pc][0] in ("deref", "uderef", "cpu_ptr"):
            if ins[pc][0] == "cpu_ptr":
                if percpu is None or blob:
                    return sim.blocks
                sim.blocks.append(Block(0, PERCPU, (percpu & _M).to_bytes(8, "little"), 8))
                val, pc = (val + percpu) & _M, pc + 1
                continue
            lval = val
            v = None if blob else sim.read(val + ins[pc][3], 8)
            if v is None:
                return sim.blocks
            val, pc = v, pc + 1
        s3 = pc
        while True:
            op, a, b, imm = ins[pc]
            if not op.startswith("st_"):
                return sim.blocks
            if not blob:
                if op in _STRING_STORES:
                    sim.string(val + imm)
                elif op in ("st_mem", "st_umem"):
                    sim.read(val + imm, b)
            if ins[pc + 1][0] == "mod_bf":
                pc += 1
            pc += 1
            if ins[pc][0] != "lp_array":
                return sim.blocks
            count += 1
            if count >= ins[pc][2]:
                return sim.blocks
            pc = s3
            if ins[s3][0] not in _STRING_STORES:
                val = (val + ins[s3][2]) & _M
                continue
            pc, val = s3 - 1, (lval + 8) & _M
            break
        if ins[pc][0] not in ("deref", "uderef"):
            return sim.blocks
