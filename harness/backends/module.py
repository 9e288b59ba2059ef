"""In-guest probes through the harness's own kernel module, ``kph_kprobes.ko``.

The module (``probes/kmod/kph_kprobes.c``, built into the default image as
``/lib/modules/kph_kprobes.ko`` and loaded on first use) calls ``register_kprobe()`` and
``register_kretprobe()`` for lines written to ``/sys/kernel/debug/kph/control`` and records
every hit in a buffer that ``records`` drains (its bytes, which :func:`parse_records`
decodes; ``events`` drains the same records as text, for people). Each fetch arg
travels as a small postfix program (the C file's header documents the ops): this
module compiles a ``ProbeArg``'s fetch tree and type into one, and turns the raw items
the module recorded back into the text the trace file would print
(:func:`harness.kernel.grammar.fetch.format_value`), so module hits compare with tracefs
and host-side hits field by field.

What the compiled programs keep from ``process_fetch_insn()`` (Linux 6.1): a failed
dereference ends the argument (a string then prints ``(fault)``, a number is
``(unknown)``, the kernel leaving stale ring-buffer bytes there); a failed final memory
read of a number is ``(unknown)``; strings are read with the semantics of
``strncpy_from_kernel_nofault()``/``strncpy_from_user_nofault()`` (an empty ``ustring``
prints ``(fault)``); array elements are read one by one; as x86_64 selects
``CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE``, a kernel-typed read below ``TASK_SIZE``
is a user read (``probe_mem_read()``), so ``+0(%si):string`` reads a user path. What differs: each string may
be up to ``maxlen`` bytes on its own, where the kernel pools the sizes measured in a first
pass over the event; ``symstr`` and ``symbol`` values are symbolized host-side with
``vm.symbols``, as ``%pS`` would print them.
"""
from __future__ import annotations

import dataclasses
import errno as _errno
import io
import logging
import struct
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from ..errors import (GuestAgentError, GuestLossError, HarnessError, NotMirroredError,
                      ProbeSpecError, SymbolNotFoundError, needed_mib)
from ..kernel.grammar.fetch import (FAULT, FETCH_TYPES, MAX_STRING_SIZE, UNKNOWN, BtfVar, Comm, Current,
                         Deref, EntryArg, FetchArg, PerCpu,
                         FuncArg, Imm, ImmString, MemAddr, MemSymbol, Reg, RetVal,
                         StackEntry, StackPointer, format_ip, format_value)
from ..kernel.emulate import next_ip
from ..kernel.kprobes import kernel_rethook_trampoline
from ..kernel.symbols import remembered_symbolizer
from ..kernel.grammar import ProbeArg, ProbeSpec
from ..records import DECODED_MAX, Counters, Hit, Outcome, gc_paused
from .tracelayer import GuestWrite, TraceLayer, refused, write_switch
from ..vmctl import Machine

log = logging.getLogger(__name__)

__all__ = ["ModuleBackend", "ModuleError", "UnsupportedFetchArgError", "compile_arg",
           "buffer_stats",
           "add_line", "parse_events_line", "parse_records", "decode_arg", "decode_args",
           "ModuleRecord", "Item",
           "REG_OFFSET", "GUEST_KO", "KPH_DIR", "symbol_in_section"]

MODULE_NAME = "kph_kprobes"
GUEST_KO = f"/lib/modules/{MODULE_NAME}.ko"
KPH_DIR = "/sys/kernel/debug/kph"
KPROBES_LIST = "/sys/kernel/debug/kprobes/list"
#: ``add ... FLAGS`` bit 0: install a post_handler (the kprobe is then never optimized).
#: bit 1: the pre_handler dereferences NULL (reproducing a crashing handler).
FLAG_POST = 1
FLAG_BUG_NULL = 2
_M = (1 << 64) - 1
_MODES = {"ftrace", "optimized", "int3"}

#: ``offsetof(struct pt_regs, X)`` on x86_64 (arch/x86/include/asm/ptrace.h).
REG_OFFSET = {name: 8 * i for i, name in enumerate((
    "r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
    "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss"))}


class ModuleError(HarnessError):
    """``kph_kprobes.ko`` could not be loaded, refused a control line, left probes behind
    after unloading, or printed something this module cannot read."""


class UnsupportedFetchArgError(ProbeSpecError):
    """A fetch arg the module's programs cannot express; ``arg`` names it."""

    def __init__(self, arg: str, why: str, text: str = "") -> None:
        super().__init__(f"fetch arg {arg!r}: {why}", text)
        self.arg = arg


# ---------------------------------------------------------------- compiling fetch args

class _Unsupported(Exception):
    pass


def _value(node: FetchArg, resolve: Callable[[str], int] | None) -> list[str]:
    """Ops that leave the ``unsigned long`` value of ``node`` on the stack."""
    if isinstance(node, Reg):
        if node.name not in REG_OFFSET:
            raise _Unsupported(f"no pt_regs field {node.name!r}")
        return [f"reg:{REG_OFFSET[node.name]}"]
    if isinstance(node, StackEntry):
        return [f"stack:{node.n}"]
    if isinstance(node, StackPointer):
        return ["sp"]
    if isinstance(node, RetVal):
        return ["retval"]
    if isinstance(node, FuncArg):
        return [f"arg:{node.n - 1}"]
    if isinstance(node, Imm):
        return [f"imm:0x{node.value & _M:x}"]
    if isinstance(node, Current):            # FETCH_OP_CURRENT (7.3)
        return ["current"]
    if isinstance(node, EntryArg) and node.n <= 6:   # FETCH_OP_EDATA (6.12+)
        return [f"edata:{node.n - 1}"]
    if isinstance(node, PerCpu) and not node.read:   # FETCH_OP_CPU_PTR (7.3)
        return _value(node.base, resolve) + ["cpuptr"]
    if isinstance(node, (EntryArg, BtfVar)):
        what = {EntryArg: "$argN past the sixth of a return probe (entry data, 6.12+)",
                BtfVar: "a BTF argument not resolved for the booted kernel"}[type(node)]
        raise NotMirroredError(f"not mirrored by the module backend: {what}",
                               hint="compare with --guest events (kprobe_events)")
    loc = _location(node, resolve)
    if loc is not None:
        base, off, user = loc
        return base + [f"{'uld' if user else 'ld'}:{off}"]
    raise _Unsupported(f"{type(node).__name__} has no value to dereference")


def _location(node: FetchArg, resolve: Callable[[str], int] | None
              ) -> tuple[list[str], int, bool] | None:
    """For a memory fetch (``+OFF(..)``, ``@ADDR``, ``@SYM``): (ops leaving the base
    address, offset, user); None for other nodes."""
    if isinstance(node, Deref):
        return _value(node.base, resolve), node.offset, node.user
    if isinstance(node, MemAddr):
        return [f"imm:0x{node.addr & _M:x}"], 0, False
    if isinstance(node, PerCpu) and node.read:   # this_cpu_read(X): *this_cpu_ptr(X)
        return _value(node.base, resolve) + ["cpuptr"], 0, False
    if isinstance(node, MemSymbol):
        if resolve is None:
            raise _Unsupported(f"@{node.symbol} needs a symbol table")
        return [f"imm:0x{(resolve(node.symbol) + node.offset) & _M:x}"], 0, False
    return None


def _elements(base: list[str], count: int, one: Callable[[int], list[str]]) -> list[str]:
    """``base`` once, then ``one(i)`` per element, each on its own copy of the base."""
    ops = list(base)
    for i in range(count):
        ops += (["dup"] if i < count - 1 else []) + one(i)
    return ops


def compile_arg(arg: ProbeArg, *, resolve: Callable[[str], int] | None = None,
                maxlen: int = MAX_STRING_SIZE) -> str:
    """The module program (``op:a:b,op,...``) that fetches ``arg`` as the kernel would.

    Strings and memory stores follow the kernel's plan (``traceprobe_parse_probe_arg_body``):
    the last dereference becomes the store, at the dereference's offset; for arrays of
    strings the last dereference is repeated 8 bytes apart (an array of ``char *``).

    :param resolve: ``kallsyms_lookup_name()`` for ``@SYM``; raises KeyError when unknown.
    :raise UnsupportedFetchArgError: for a construct the module cannot express.
    :raise SymbolNotFoundError: from ``resolve``.
    """
    try:
        return ",".join(_compile(arg, resolve, maxlen))
    except _Unsupported as exc:
        raise UnsupportedFetchArgError(arg.name, str(exc), arg.comm) from None


def _compile(arg: ProbeArg, resolve: Callable[[str], int] | None, maxlen: int) -> list[str]:
    t = FETCH_TYPES[arg.type]
    fetch = arg.fetch
    if t.name == "symstr":                  # sprint_symbol() of the value, host-side
        if arg.count:
            raise _Unsupported("symstr arrays")
        return _value(fetch, resolve) + ["val"]
    if t.is_string:
        user_type = t.name == "ustring"
        loc = _location(fetch, resolve)
        if arg.count:
            if loc is None:
                raise _Unsupported(f"a {t.name} array needs a memory fetch (+OFF(...), @ADDR)")
            base, off, user = loc
            op = "ustr" if user_type else "str"
            ld = "uld" if user else "ld"
            return _elements(base, arg.count, lambda i: [f"{ld}:{off + 8 * i}", f"{op}:0:{maxlen}"])
        if isinstance(fetch, Comm):
            return ["comm"]
        if isinstance(fetch, ImmString):
            return [f"data:{fetch.text.encode('utf-8', 'surrogateescape').hex()}"]
        if loc is not None:
            base, off, user = loc
            return base + [f"{'ustr' if user_type or user else 'str'}:{off}:{maxlen}"]
        if isinstance(fetch, Imm):          # a string at an immediate address
            return _value(fetch, resolve) + [f"{'ustr' if user_type else 'str'}:0:{maxlen}"]
        raise _Unsupported(f"type {t.name} needs a memory fetch")
    loc = _location(fetch, resolve)
    if loc is not None:
        base, off, user = loc
        op = "umem" if user else "mem"
        return _elements(base, arg.count or 1, lambda i: [f"{op}:{off + i * t.size}:{t.size}"])
    if arg.count:
        raise _Unsupported("an array needs a memory fetch (+OFF(...), @ADDR, @SYM)")
    if isinstance(fetch, (Comm, ImmString)):
        raise _Unsupported(f"{type(fetch).__name__} is a string, not {t.name}")
    return _value(fetch, resolve) + ["val"]


def add_line(probe_id: int, kind: str, addr: int, programs: Sequence[str], *,
             maxactive: int = 0, flags: int = 0) -> str:
    """One ``add`` control line."""
    return " ".join([f"add {probe_id} {kind} {addr:x} {maxactive} {flags}", *programs])


# ---------------------------------------------------------------- reading records back

class Item(NamedTuple):
    """One result item: ``i`` a value, ``f`` a failed memory read (``ret`` the errno),
    ``s`` a string (``ret`` what strncpy_*_nofault() returned), ``e`` an aborted fetch.
    (Named tuples, as :class:`ModuleRecord`: a run reads one per hit and argument, and a
    frozen dataclass takes 2-3 us to make.)"""

    type: str
    ret: int = 0
    value: int = 0
    data: bytes = b""


class ModuleRecord(NamedTuple):
    """One line of ``events``. ``kind`` is ``pre``, ``post`` or ``ret``; ``addr`` the probed
    address, ``ip`` the raw ``regs->ip`` the handler saw, ``ret_addr`` a return's address
    (a post record's: ``regs->flags``, what an emulated Jcc decided on)."""

    seq: int
    id: int
    kind: str
    mode: str
    cpu: int
    pid: int
    comm: str
    addr: int
    ip: int
    ret_addr: int
    args: tuple[tuple[Item, ...], ...]
    #: the context of the probed call, ``irq`` or ``task`` (MODE's ``:CTX``; "" without)
    irq: str = ""


def _item(text: str) -> Item:
    kind, body = text[:1], text[1:]
    if kind == "i":
        return Item("i", value=int(body, 16))
    if kind == "s":
        ret, _, data = body.partition(":")
        return Item("s", ret=int(ret), data=bytes.fromhex(data))
    if kind in ("f", "e"):
        return Item(kind, ret=int(body))
    raise ValueError(f"unknown item {text!r}")


def parse_events_line(line: str) -> ModuleRecord:
    """Parse ``SEQ ID KIND MODE CPU PID COMM ADDR IP RETADDR NARGS ARG...``.

    :raise ModuleError: when the line does not have that shape.
    """
    parts = line.split()
    try:
        ctx = ""
        if len(parts) > 3 and ":" in parts[3]:
            parts[3], ctx = parts[3].split(":", 1)
            if ctx not in ("irq", "task"):
                raise ValueError(f"context {ctx!r}")
        nargs = int(parts[10])
        if len(parts) != 11 + nargs or parts[3] not in _MODES or \
                parts[2] not in ("pre", "post", "ret"):
            raise ValueError("wrong field count, kind or mode")
        args = tuple(() if a == "-" else tuple(_item(x) for x in a.split(","))
                     for a in parts[11:])
        comm = "" if parts[6] == "-" else bytes.fromhex(parts[6]).decode("utf-8",
                                                                       "surrogateescape")
        return ModuleRecord(int(parts[0]), int(parts[1]), parts[2], parts[3], int(parts[4]),
                            int(parts[5]), comm, int(parts[7], 16), int(parts[8], 16),
                            int(parts[9], 16), args, ctx)
    except (ValueError, IndexError) as exc:
        raise ModuleError(f"unreadable {KPH_DIR}/events line {line!r}: {exc}") from None


#: ``struct kph_rec`` (probes/kmod/kph_kprobes.c; its init checks the size, 72, and
#: ``comm`` at 56): len, id, seq, addr, ip, ret_addr, pid, cpu, kind, mode, nargs, irq
REC = struct.Struct("<IIQQQQIIccHB3x16s")
#: ``struct kph_rec``'s place alone (the rest skipped): len, seq, pid, cpu, comm
REC_PLACE = struct.Struct("<I4xQ24xII8x16s")
#: ``struct kph_item``: arg, type, pad, ret, val
ITEM = struct.Struct("<Hcxiq")
_KINDS = {b"p": "pre", b"s": "post", b"r": "ret"}
_MODE_OF = {b"f": "ftrace", b"o": "optimized", b"i": "int3"}
#: a record's bytes but for its place (seq at 8, pid and cpu at 40, comm at 56): what
#: decoding it depends on (``ModuleBackend.collect``'s memo)
_UNPLACED = ((4, 8), (16, 40), (48, 56))


def _items(data: bytes, pos: int, end: int, nargs: int) -> tuple[tuple[Item, ...], ...]:
    """A record's items from ``pos`` to ``end``, grouped by argument, as
    :func:`parse_events_line` reads them from the text (``kph_format()``): a value's
    ``value``, a string's ``ret`` and bytes, a failed or aborted read's ``ret``."""
    args: list[list[Item]] = [[] for _ in range(nargs)]
    unpack = ITEM.unpack_from
    while pos < end:
        if end - pos < ITEM.size:
            raise ValueError(f"an item cut short at {pos}")
        arg, kind, ret, val = unpack(data, pos)
        pos += ITEM.size
        if arg >= nargs:
            raise ValueError(f"an item of arg {arg} in a record of {nargs}")
        if kind == b"i":
            args[arg].append(Item("i", value=val & _M))
        elif kind == b"s":
            if val < 0 or pos + val > end:
                raise ValueError(f"a string of {val} bytes past its record")
            args[arg].append(Item("s", ret=ret, data=data[pos:pos + val]))
            pos += (val + 7) & ~7
        elif kind in (b"f", b"e"):
            args[arg].append(Item(kind.decode(), ret=ret))
        else:
            raise ValueError(f"unknown item type {kind!r}")
    return tuple(map(tuple, args))


def _record(data: bytes, pos: int) -> tuple[ModuleRecord, int]:
    """The record at ``pos`` of a ``records`` drain and where the next one starts."""
    if len(data) - pos < REC.size:
        raise ValueError(f"a record cut short at {pos}")
    (ln, rid, seq, addr, ip, ret_addr, pid, cpu, kind, mode, nargs, irq,
     comm) = REC.unpack_from(data, pos)
    if ln < REC.size or pos + ln > len(data) or kind not in _KINDS or mode not in _MODE_OF:
        raise ValueError(f"a record of length {ln}, kind {kind!r}, mode {mode!r} at {pos}")
    return (ModuleRecord(seq, rid, _KINDS[kind], _MODE_OF[mode], cpu, pid, _comm(comm),
                         addr, ip, ret_addr, _items(data, pos + REC.size, pos + ln, nargs),
                         "irq" if irq else "task"), pos + ln)


def _comm(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def parse_records(data: bytes) -> list[ModuleRecord]:
    """Every record of a ``records`` drain (the module's buffer as it lay: the header
    of probes/kmod/kph_kprobes.c documents the layout), as :func:`parse_events_line`
    reads the same record from ``events``.

    :raise ModuleError: when the bytes are not records of that layout.
    """
    out, pos = [], 0
    try:
        while pos < len(data):
            rec, pos = _record(data, pos)
            out.append(rec)
    except (ValueError, struct.error) as exc:
        raise ModuleError(f"unreadable {KPH_DIR}/records: {exc}") from None
    return out


def _probe_stats(text: str) -> dict[int, dict[str, str]]:
    """The ``probe ID KIND nhit N nmissed N ...`` lines of the module's ``stats``: id ->
    its fields (nhit, nmissed, nentry, npost, mode)."""
    out = {}
    for line in text.splitlines():
        p = line.split()
        if p and p[0] == "probe":
            out[int(p[1])] = dict(zip(p[3::2], p[4::2]))
    return out


def _string(it: Item) -> Any:
    if it.type != "s":
        return UNKNOWN if it.type == "i" else FAULT
    return FAULT if it.ret <= 0 else it.data


def _number(it: Item, arg: ProbeArg) -> Any:
    if it.type != "i":
        return UNKNOWN
    v = it.value
    if arg.bitfield is not None:             # FETCH_OP_MOD_BF
        bits = arg.bitfield.container      # 64 for a BTF bitfield (parse_btf_bitfield())
        lsh, rsh = bits - (arg.bitfield.width + arg.bitfield.offset), bits - arg.bitfield.width
        v = ((v << lsh) & ((1 << bits) - 1)) >> rsh
    return v


def decode_arg(arg: ProbeArg, items: Sequence[Item],
               symbolize: Callable[[int], str | None] | None = None) -> Any:
    """The value :func:`harness.kernel.grammar.fetch.evaluate` would give, from the module's items:
    an int, bytes, ``FAULT``, ``UNKNOWN``, or a list of those for an array."""
    t = FETCH_TYPES[arg.type]
    aborted = any(it.type == "e" for it in items)
    got = [it for it in items if it.type != "e"]
    if t.name == "symstr":
        if not got or got[0].type != "i":
            return FAULT
        v = got[0].value
        return ((symbolize(v) if symbolize else None) or f"0x{v:x}").encode()
    if t.is_string:
        elems = [_string(it) for it in got]
        if aborted:                          # store_trace_args(): the first data_loc faults
            elems = [FAULT] + elems[1:] if elems else [FAULT]
    else:
        elems = [_number(it, arg) for it in got]
    n = arg.count or 1
    elems = (elems + [UNKNOWN] * n)[:n]
    return elems if arg.count else elems[0]


def decode_args(args: Sequence[ProbeArg], items: Sequence[Sequence[Item]],
                symbolize: Callable[[int], str | None] | None = None) -> list[Any]:
    """:func:`decode_arg` for each argument of one event, with what the kernel's event
    shares between them: one dynamic area. A scalar string argument whose fetch was aborted
    before its store (a failed dereference in the 2nd stage of
    ``process_fetch_insn_bottom()``, kernel/trace/trace_probe_tmpl.h) keeps the data_loc
    ``store_trace_args()`` set up: (the dynamic space left, the current offset). It prints
    (fault) when no space is left, else what the next dynamic arguments store there (as
    :func:`harness.kernel.grammar.fetch.evaluate` computes it host-side)."""
    vals = [decode_arg(a, it, symbolize) for a, it in zip(args, items)]
    dyn = [i for i, a in enumerate(args) if FETCH_TYPES[a.type].is_string and not a.count]
    if not any(any(x.type == "e" for x in items[i]) for i in dyn):
        return vals

    def stored(i: int) -> bytes | None:
        return vals[i] if isinstance(vals[i], bytes) else None
    # __get_data_size(): what each stored string took (with its NUL), failures nothing
    dsize = sum(len(v) + 1 for i in dyn if (v := stored(i)) is not None)
    area, known, pos, first = bytearray(dsize), bytearray(dsize), 0, {}
    for i in dyn:
        first[i] = (dsize - pos, pos)
        v = stored(i)
        if v is None:
            continue
        area[pos:pos + len(v) + 1], known[pos:pos + len(v) + 1] = v + b"\0", b"\1" * (len(v) + 1)
        # fetch_store_symstring() consumes no NUL: the next string starts on it
        pos += len(v) + (0 if args[i].type == "symstr" else 1)
    for i in dyn:
        if any(x.type == "e" for x in items[i]):
            left, at = first[i]
            end = area.find(b"\0", at)
            vals[i] = FAULT if left == 0 else (
                UNKNOWN if end < 0 or b"\0" in known[at:end + 1] else bytes(area[at:end]))
    return vals


#: The module's record buffer (``bufsize``, bytes; two are allocated) as the harness loads
#: it: 16 MiB, as the events side's ring buffer a CPU (``events.BUFFER_KB``), ~200,000
#: records of a probe with one argument (72 bytes of header and 16 an item; the module's
#: own default, 4 MiB, held ~50,000).
BUFSIZE = 16 << 20


def buffer_stats(text: str) -> dict[str, int]:
    """The ``buffer size N used N records N dropped N seq N`` line of the module's
    ``stats`` (``kph_stats_show()``), as ``{size, used, records, dropped, seq}``.

    :raise ModuleError: when ``stats`` has no such line.
    """
    for line in text.splitlines():
        p = line.split()
        if p[:2] == ["buffer", "size"] and len(p) >= 10:
            try:
                return {"size": int(p[2]), "used": int(p[4]), "records": int(p[6]),
                        "dropped": int(p[8]), "seq": int(p[10]) if len(p) > 10 else 0}
            except ValueError:
                break
    raise ModuleError(f"no 'buffer size ... dropped N' line in {KPH_DIR}/stats: {text[:200]!r}")


def _kprobes_list(text: str) -> Counter[tuple[int, str]]:
    """(address, k|r) -> how many probes ``/sys/kernel/debug/kprobes/list`` shows there."""
    out: Counter[tuple[int, str]] = Counter()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[(int(parts[0], 16), parts[1])] += 1
            except ValueError:
                continue
    return out


# ---------------------------------------------------------------- the backend

@dataclass(frozen=True)
class _Placed:
    id: int
    name: str
    spec: ProbeSpec
    addr: int
    kind: str                                # p or r
    accepted: bool = False


#: per machine: (section, offset) of ``recording`` in its ``/lib/modules/kph_kprobes.ko``
_KO_SYMBOL: "weakref.WeakKeyDictionary[Any, tuple[str, int]]" = weakref.WeakKeyDictionary()


def symbol_in_section(elf_bytes: bytes, name: str) -> tuple[str, int] | None:
    """``(section name, offset)`` of the local or global data symbol ``name`` in a
    relocatable ELF (a ``.ko``): a module's symbol is at its section's load address plus
    ``st_value``. None when the bytes are not ELF or hold no such symbol."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        elf = ELFFile(io.BytesIO(elf_bytes))
        symtab = elf.get_section_by_name(".symtab")
        if symtab is None:
            return None
        for sym in symtab.get_symbol_by_name(name) or ():
            shndx = sym["st_shndx"]
            if sym["st_info"]["type"] == "STT_OBJECT" and isinstance(shndx, int):
                return elf.get_section(shndx).name, sym["st_value"]
    except (ELFError, ValueError, IndexError):
        return None
    return None


class ModuleBackend:
    """Real kprobes/kretprobes registered by ``kph_kprobes.ko`` in the guest.

    ``post_handler=True`` installs a post_handler on every ``p`` probe (never optimized
    then); its records are kept in :attr:`post_records`, not returned as hits.
    """

    #: kprobes as a kernel module registers them: ``register_kprobe()`` alone, without
    #: ``trace_kprobe``'s checks around it (``TraceLayer.raw``; set before ``register()``)
    raw_kprobes = False

    side = "module"

    def __init__(self, vm: Machine, *, post_handler: bool = False,
                 maxlen: int = MAX_STRING_SIZE, timeout: float = 60.0,
                 buggy: frozenset[str] = frozenset(), bufsize: int | None = None) -> None:
        """``buggy``: probe names (GROUP/EVENT) whose module pre_handler dereferences NULL
        once recording starts (``kph repro`` uses it to reproduce a crashing handler).
        ``bufsize``: the module's ``bufsize`` parameter (bytes per record buffer, two
        allocated; :data:`BUFSIZE` unless given) when this backend loads it; a run whose
        records did not fit fails (:class:`harness.errors.GuestLossError`)."""
        self.vm = vm
        self.bufsize = bufsize or BUFSIZE
        self._dropped0: int | None = None
        self._counts0: dict[int, dict[str, str]] = {}      # stats at enable()
        self.post_handler = post_handler
        self.buggy = buggy
        self.maxlen = maxlen
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self.hits: list[Hit] = []
        self.post_records: list[ModuleRecord] = []
        #: (probe id, event, kind) -> the fields its hits share
        self._templates: dict[tuple[int, str, str], Hit] = {}
        #: probe id -> its instruction as the kprobe's slot holds it (``list``)
        self.insns: dict[int, bytes] = {}
        #: post records whose regs->ip was checked against the instruction's outcome
        self.posts_checked = 0
        self._placed: dict[int, _Placed] = {}
        self._next_id = 1
        self._loaded = False
        self.layer: TraceLayer | None = None

    def __enter__(self) -> "ModuleBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sh(self, cmd: str, *, stdin: bytes | None = None) -> str:
        return self.vm.run(cmd, check=True, timeout=self.timeout, stdin=stdin).stdout

    def _read(self, path: str) -> str:
        """A guest file's text, read as a file (``Machine.pull``: kph-reader, else the
        agent's file API): no ``cat`` process, ~15-30 ms each under TCG, and none of a
        process's output for qemu-ga to lose (seen once in a CI run, 7.3, 2026-11-30).

        :raise GuestAgentError: it cannot be read (the module is not loaded)."""
        return self.vm.pull(path, timeout=self.timeout).decode("utf-8", "replace")

    def buffer_stats_now(self) -> dict[str, int]:
        """:func:`buffer_stats` of ``stats`` read now.

        :raise ModuleError: ``stats`` has no buffer line."""
        return buffer_stats(self._read(f"{KPH_DIR}/stats"))

    def is_loaded(self) -> bool:
        out = self._read("/proc/modules")
        return any(line.split(" ", 1)[0] == MODULE_NAME for line in out.splitlines())

    def load(self) -> None:
        """``insmod`` the module unless it is loaded.

        :raise ModuleError: when insmod fails (an image built before the module existed).
        """
        if self._loaded or self.is_loaded():
            self._loaded = True
            return
        param = f" bufsize={int(self.bufsize)}" if self.bufsize else ""
        r = self.vm.run(f"insmod {GUEST_KO}{param}", timeout=self.timeout)
        if r.status != 0:
            why = (r.stderr or r.stdout).strip()
            fix = ("give it a smaller buffer (kph diff --guest-buffer) or the guest more "
                   "memory (--memory)" if "memory" in why.lower() else
                   "rebuild the image with `kph image build`")
            raise ModuleError(f"insmod {GUEST_KO}{param} failed: {why}; {fix}")
        self._loaded = True

    def instructions(self, addr: int, size: int, *, first_id: int = 1 << 24
                     ) -> list[tuple[int, bytes]]:
        """The instructions in ``[addr, addr + size)`` the kernel puts a kprobe on, as
        (offset, bytes), asked of the kernel itself: a kprobe at every byte, those
        registered read back with their instructions (``list``), then all removed.
        register_kprobe() refuses a place inside an instruction (arch/x86/kernel/kprobes/
        core.c: can_probe() decodes from the function's start: -EILSEQ) and one it does
        not probe (-EINVAL, -EBUSY...); the host needs no x86 decoder."""
        self.load()
        ids = range(first_id, first_id + size)
        self.control("".join(add_line(i, "p", addr + i - first_id, ()) + "\n" for i in ids))
        try:
            listing = self.list()
        finally:
            self.control("".join(f"del {i}\n" for i in ids if i in listing))
        return [(i - first_id, self.insns.pop(i)) for i in ids
                if listing.get(i, ("",))[0] == "registered" and i in self.insns]

    def control(self, text: str) -> None:
        """Write control lines; :raise ModuleError: with the module's reason on refusal."""
        r = self.vm.run(f"cat > {KPH_DIR}/control", stdin=text.encode(), timeout=self.timeout)
        if r.status != 0:
            raise ModuleError(f"{MODULE_NAME} refused {text.strip()!r}: {self._error()}")

    def _error(self) -> str:
        for line in self._read(f"{KPH_DIR}/stats").splitlines():
            if line.startswith("error "):
                return line[6:]
        return "no reason given"

    def _address(self, spec: ProbeSpec) -> int:
        if spec.addr is not None:
            return spec.addr
        name = spec.symbol_name or ""
        try:
            return self.vm.symbols.lookup(name).addr + spec.offset
        except SymbolNotFoundError:
            if spec.module is None:
                raise
            self.vm.refresh_module_symbols()
            return self.vm.symbols.lookup(name).addr + spec.offset

    def _resolve(self, name: str) -> int:
        return self.vm.symbols.lookup(name).addr

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """Compile and add every spec; the kernel's refusals come back as Outcomes.

        The module calls ``register_kprobe()`` itself, so what ``kprobe_events`` decides
        around that call is applied here, as host-side (``harness.backends.tracelayer``):
        symbol counts, EEXIST for event names, ``@SYM`` resolved at registration (ENOENT),
        the -ENOENT kept as a pending event for a raw address or a module not loaded. Lines
        go to the module in batches; a line naming the event of an earlier line of its
        batch starts a new one, since whether it is appended depends on that line's fate.

        :raise UnsupportedFetchArgError: for a fetch arg the module cannot express.
        :raise ModuleError: when the module cannot be loaded or refuses a line.
        """
        self.load()
        # where the recording flag lives, read now: once the host's probes are armed a
        # grep of /proc/kallsyms may hit them (vfs_read) thousands of times (a missing
        # flag is an error where it is needed: switch())
        try:
            self._recording_addr()
        except ModuleError as exc:
            log.debug("%s", exc)
        if self.layer is None:
            self.layer = TraceLayer(self.vm, raw=self.raw_kprobes)
        self.layer.prepare(specs)
        out: list[Outcome] = []
        batch: list[tuple[int, ProbeSpec]] = []
        for i, spec in enumerate(specs):
            if any((s.group, s.event) == (spec.group, spec.event) for _, s in batch):
                out += self._register_batch(batch)
                batch = []
            batch.append((i, spec))
        out += self._register_batch(batch)
        self.outcomes += out
        return out

    def _register_batch(self, batch: Sequence[tuple[int, ProbeSpec]]) -> list[Outcome]:
        layer = self.layer
        assert layer is not None
        results: list[Outcome | tuple[int, ProbeSpec]] = []
        lines = []
        for index, spec in batch:
            name = f"{spec.group}/{spec.event}"
            if spec.kind == "-":
                results.append(Outcome.rejected(
                    name, _errno.EINVAL, "kph_kprobes.ko has no -: lines (dyn_event_release() "
                    "is kprobe_events'); compare them with --guest events", index=index))
                continue
            if spec.is_uprobe:
                results.append(Outcome.rejected(
                    name, _errno.EINVAL, "kph_kprobes.ko registers kprobes only; compare "
                    "uprobes with --guest events (uprobe_events)", index=index))
                continue
            if spec.is_fprobe or spec.is_eprobe:
                raise NotMirroredError(
                    f"not mirrored by the module backend: {spec.kind}: lines (fprobe events, "
                    "tracepoint probes and event probes: kph_kprobes.ko registers kprobes)",
                    spec.text, 0, hint="compare with --guest events (dynamic_events)")
            adm = layer.admit(spec)
            spec = adm.spec          # as the booted kernel parsed it
            if adm.refusal is None and not adm.pending:
                try:
                    addr = self._address(spec)
                except SymbolNotFoundError:
                    adm = layer.registered(spec, _errno.ENOENT)
            if adm.refusal is not None:
                # the kernel's error_log words, as the host side predicts them
                results.append(refused(name, spec, adm.refusal, index=index,
                                       reason=adm.reason))
                continue
            if adm.pending:
                layer.accept_pending(spec)
                results.append(Outcome(name, True, index=index, pending=adm.pending))
                continue
            programs = [compile_arg(a, resolve=self._resolve, maxlen=self.maxlen)
                        for a in spec.args]
            kind = "r" if spec.is_return else "p"
            pid, self._next_id = self._next_id, self._next_id + 1
            flags = FLAG_POST if self.post_handler and kind == "p" else 0
            if name in self.buggy:
                flags |= FLAG_BUG_NULL
            lines.append(add_line(pid, kind, addr, programs, maxactive=spec.maxactive,
                                  flags=flags))
            self._placed[pid] = _Placed(pid, name, spec, addr, kind)
            results.append((pid, spec))
        if lines:
            self.control("\n".join(lines) + "\n")
        listing = self.list() if lines else {}
        out = []
        for res, (index, _) in zip(results, batch):
            if isinstance(res, Outcome):
                out.append(res)
                continue
            pid, spec = res
            placed = self._placed[pid]
            state, err, mode = listing.get(pid, ("missing", -_errno.EIO, "-"))
            if state == "registered":
                layer.registered(spec, None)
                self._placed[pid] = _Placed(placed.id, placed.name, placed.spec, placed.addr,
                                            placed.kind, True)
                out.append(Outcome(placed.name, True, mode=mode, index=index))
                continue
            adm = layer.registered(spec, -err)
            fn = "register_kretprobe" if placed.kind == "r" else "register_kprobe"
            code = _errno.errorcode.get(-err, str(err))
            if adm.refusal is None:
                out.append(Outcome(placed.name, True, index=index, pending=adm.pending))
            else:
                # register_kprobe()'s errno, with the words kprobe_events logs for it
                out.append(dataclasses.replace(
                    refused(placed.name, spec, adm.refusal, index=index,
                            reason=f"{fn}() returned -{code}"), errno=-err))
        return out

    def list(self) -> dict[int, tuple[str, int, str]]:
        """id -> (registered|rejected, errno as the kernel returned it, mode). Each
        registered probe's instruction as its slot holds it (``insn HEX``) is kept in
        :attr:`insns`."""
        out = {}
        for line in self._read(f"{KPH_DIR}/list").splitlines():
            p = line.split()
            out[int(p[0])] = (p[3], int(p[4]), p[5])
            if "insn" in p[:-1] and p[p.index("insn") + 1] != "-":
                self.insns[int(p[0])] = bytes.fromhex(p[p.index("insn") + 1])
        return out

    def enable(self, *, recording: bool = True) -> None:
        """Drop what was recorded so far and start recording. The control write goes
        through the agent's file API: no shell is spawned to do it. ``recording=False``
        leaves the start to the caller's :meth:`switch`, in a halt of the guest."""
        # the drain read and dropped, then stats (in this order: kph_events_open()
        # takes the drain at its open)
        got = self.vm.pull_many([f"{KPH_DIR}/events", f"{KPH_DIR}/stats"], timeout=self.timeout)
        for d in got:
            if isinstance(d, GuestAgentError):
                raise d
        text = bytes(got[1]).decode("utf-8", "replace")  # type: ignore[arg-type]
        self._dropped0 = buffer_stats(text)["dropped"]
        self._counts0 = _probe_stats(text)
        self.hits.clear()
        self.post_records.clear()
        if recording:
            self.vm.write_file(f"{KPH_DIR}/control", b"record on\n")
        else:
            self._recording_addr()

    def _recording_addr(self) -> int:
        """The address of the module's ``static bool recording``: its section's base
        (``/sys/module/kph_kprobes/sections/SECTION``, kernel/module/sysfs.c:
        add_sect_attrs()) plus its offset there (the guest's ``.ko`` symbol table, read
        once per machine); where that cannot be read, its kallsyms line (data symbols are
        listed with CONFIG_KALLSYMS_ALL, which every image's kernel has). Reading
        /proc/kallsyms whole takes 6 to 7 s under TCG, sysfs a few ms."""
        if getattr(self, "_recording_at", None) is None:
            at = self._recording_from_sections()
            if at is None:
                out = self._sh(f"grep -E ' recording\\s+\\[{MODULE_NAME}\\]$' /proc/kallsyms"
                               " || true")
                if not out.strip():
                    raise ModuleError(f"{MODULE_NAME}'s 'recording' flag is not in "
                                      "/proc/kallsyms", "a kernel with CONFIG_KALLSYMS_ALL=y")
                at = int(out.split()[0], 16)
            self._recording_at = at
        return self._recording_at

    def _recording_from_sections(self) -> int | None:
        where = _KO_SYMBOL.get(self.vm)
        if where is None:
            try:
                where = symbol_in_section(self.vm.pull(GUEST_KO, timeout=self.timeout),
                                          "recording")
            except HarnessError as exc:
                log.debug("reading %s: %s", GUEST_KO, exc)
                return None
            if where is None:
                return None
            _KO_SYMBOL[self.vm] = where
        section, offset = where
        try:
            base = int(self._read(f"/sys/module/{MODULE_NAME}/sections/{section}").strip(), 16)
        except (HarnessError, ValueError):
            return None
        return base + offset if base else None

    def switch_writes(self, on: bool) -> list[GuestWrite]:
        """``record on|off`` as a guest memory write (``WRITE_ONCE(recording, ...)`` of the
        control write), for a host engine that makes it at one instant: the host's probes
        and the module's then start and stop at the same guest instruction."""
        return [(self._recording_addr(), 1, 1 if on else 0, 0xFF)]

    def switch(self, on: bool) -> None:
        """``switch_writes`` made through a host engine that holds the guest halted
        (``harness.engines.gdbstub_engine.HostEngine.halted``)."""
        write_switch(self.vm.host, self.switch_writes(on))

    def disable(self) -> None:
        self.vm.write_file(f"{KPH_DIR}/control", b"record off\n")

    def records(self) -> list[ModuleRecord]:
        """Drain the module's buffer: the raw records since the last drain."""
        return parse_records(self._drain()[0])

    def _drain(self) -> tuple[bytes, dict[str, int]]:
        """Drain ``records`` (``kph_events_open()`` swaps the buffers at open and copies
        the drained one: the records as the handlers wrote them, nothing formatted in the
        guest) and read ``stats`` after it, in one request (``Machine.pull_many``:
        kph-reader's raw bytes, else the agent's file API): the bytes and
        :func:`buffer_stats`.

        :raise GuestAgentError: either file cannot be read (the module is not loaded).
        """
        got = self.vm.pull_many([f"{KPH_DIR}/records", f"{KPH_DIR}/stats"], timeout=self.timeout)
        for g in got:
            if isinstance(g, GuestAgentError):
                raise g
        data, stats = got
        return bytes(data), buffer_stats(bytes(stats).decode("utf-8", "replace"))

    def check_dropped(self, stats: dict[str, int] | None = None, data: bytes = b"") -> None:
        """Fail the run on records the module dropped since :meth:`enable`: its ``dropped``
        counter (``kph_record()``, probes/kmod/kph_kprobes.c: a record that does not fit
        in what is left of the active buffer is not written, and counted), read from
        ``stats`` (now, or ``stats``: :func:`buffer_stats` read after the drain). The
        counter lives as long as the module, so the run's drops are the difference from
        the value read at :meth:`enable`. ``data``: the drained buffer, whose records say
        what a buffer holding the run would be (the stats after a drain count the other,
        empty, buffer's).

        :raise GuestLossError: with the count.
        """
        st = stats if stats is not None else self.buffer_stats_now()
        lost = st["dropped"] - (self._dropped0 or 0)
        if lost > 0:
            kept, pos = st["records"], 0
            if data:                        # the records' lengths (REC's first field)
                kept = 0
                while pos + 4 <= len(data) and (ln := int.from_bytes(data[pos:pos + 4],
                                                                     "little")) >= REC.size:
                    kept, pos = kept + 1, pos + ln
            raise GuestLossError(self.side, lost, f"{MODULE_NAME} dropped {lost} record(s): "
                                 f"its buffer ({st['size']} bytes) was full ({KPH_DIR}/stats "
                                 f"dropped {st['dropped']}, {self._dropped0 or 0} at the "
                                 "window's start)",
                                 needed_mib=needed_mib(st["size"], kept, lost))

    @gc_paused()
    def collect(self) -> list[Hit]:
        """The hits recorded since :meth:`enable`.

        :raise GuestLossError: when the module dropped records (:meth:`check_dropped`).
        :raise ModuleError: when the drain is not records of the module's layout.
        """
        symbolize = remembered_symbolizer(self.vm.symbols)
        data, stats = self._drain()
        self.check_dropped(stats, data)
        last_pre: dict[tuple[int, int], int] = {}    # (probe, cpu) -> its last pre hit
        # A pre or ret record's hit, but for its place (SEQ, PID, CPU, COMM), is what the
        # rest of its bytes say: decoded once per distinct rest (a hot probe's records
        # repeat a few: vfs_read's count=1), and placed (Hit.placed) at each record.
        decoded: dict[bytes, Hit] = {}
        comms: dict[bytes, str] = {}
        (a0, a1), (b0, b1), (c0, c1) = _UNPLACED
        head = REC_PLACE.unpack_from
        hits = self.hits
        pos, size = 0, len(data)
        try:
            while pos < size:
                if size - pos < REC.size:
                    raise ValueError(f"a record cut short at {pos}")
                ln, seq, pid, cpu, craw = head(data, pos)
                if ln < REC.size or pos + ln > size:
                    raise ValueError(f"a record of length {ln} at {pos}")
                key = data[pos + a0:pos + a1] + data[pos + b0:pos + b1] + \
                    data[pos + c0:pos + c1] + data[pos + REC.size:pos + ln]
                base = decoded.get(key)
                if base is not None:
                    comm = comms.get(craw)
                    if comm is None:
                        comm = comms[craw] = _comm(craw)
                    if data[pos + 48] == 0x70:          # b"p": a pre record
                        last_pre[(int.from_bytes(data[pos + 4:pos + 8], "little"), cpu)] = \
                            len(hits)
                    hits.append(base.placed(seq, cpu, pid, comm, base.irq))
                    pos += ln
                    continue
                rec, pos = _record(data, pos)
                placed = self._placed.get(rec.id)
                if placed is None:
                    log.debug("record of unknown probe %d dropped", rec.id)
                elif rec.kind == "post":
                    self.post_records.append(rec)
                    at = last_pre.pop((rec.id, rec.cpu), None)
                    wrong = self._post_ip(rec)
                    if wrong and at is not None:
                        hits[at] = hits[at].changed(post_ip=wrong)
                else:
                    if rec.kind == "pre":
                        last_pre[(rec.id, rec.cpu)] = len(hits)
                    hit = self._hit(rec, placed, symbolize)
                    hits.append(hit)
                    if len(decoded) < DECODED_MAX:
                        decoded[key] = hit
        except (ValueError, struct.error) as exc:
            raise ModuleError(f"unreadable {KPH_DIR}/records: {exc}") from None
        return list(hits)

    def _post_ip(self, rec: ModuleRecord) -> str:
        """The post_handler's ``regs->ip`` against where the probed instruction goes
        (:func:`harness.kernel.emulate.next_ip` from its bytes and the flags the record
        carries): "" when they agree or the bytes do not tell, else what differs. The
        kernel emulates a probed Jcc, jmp or call (arch/x86/kernel/kprobes/core.c:
        prepare_emulation()) and single-steps the rest out of line; either way
        kprobe_post_process() hands the post_handler the address the instruction went
        to."""
        code = self.insns.get(rec.id)
        if code is None:
            return ""
        want = next_ip(code, rec.addr, rec.ret_addr)
        if want is None:
            return ""
        self.posts_checked += 1
        what, to = want
        if rec.ip == to:
            return ""
        return (f"{what} ({code.hex()}) at {rec.addr:#x} with flags {rec.ret_addr:#x}: the "
                f"post_handler saw ip {rec.ip:#x}, the instruction goes to {to:#x}")

    def _hit(self, rec: ModuleRecord, placed: _Placed,
             symbolize: Callable[[int], str | None]) -> Hit:
        spec = placed.spec
        if rec.kind == "ret":
            ip, _, ret_from = format_ip(
                rec.ret_addr, symbolize, rec.addr,
                kretprobe_trampoline=kernel_rethook_trampoline(self.vm.symbols)).partition(" <- ")
        else:
            ip, ret_from = format_ip(rec.addr, symbolize), ""
        args = tuple((a.name, format_value(a, v, symbolize)) for a, v in
                     zip(spec.args, decode_args(spec.args, rec.args, symbolize)))
        key = (rec.id, placed.name, placed.kind)
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = Hit.template(self.side, placed.name, placed.kind)
        return tpl.changed(seq=rec.seq, cpu=rec.cpu, pid=rec.pid, comm=rec.comm, ip=ip,
                           ret_from=ret_from or None, args=args, mode=rec.mode, irq=rec.irq)

    def stats(self) -> dict[int, dict[str, str]]:
        """id -> the ``stats`` fields of one probe (nhit, nmissed, nentry, npost, mode)."""
        return _probe_stats(self._read(f"{KPH_DIR}/stats"))

    def counters(self) -> dict[str, Counters]:
        """nhit/nmissed of each event, counted from :meth:`enable` (the kprobe's own
        ``nmissed`` counts from its registration: a hit the kernel missed while the
        harness set the run up, say a kfree() in an interrupt that came while the module's
        handler ran, is not the run's; as ``EventsBackend.counters`` leaves it out)."""
        totals: dict[str, tuple[int, int]] = {}
        before = getattr(self, "_counts0", {})
        for pid, st in self.stats().items():
            placed = self._placed.get(pid)
            if placed is None:
                continue
            b = before.get(pid, {})
            nhit, nmissed = totals.get(placed.name, (0, 0))
            totals[placed.name] = (nhit + int(st["nhit"]) - int(b.get("nhit", 0)),
                                   nmissed + int(st["nmissed"]) - int(b.get("nmissed", 0)))
        return {name: Counters(name, h, m) for name, (h, m) in totals.items()}

    def close(self) -> None:
        """``reset`` and ``rmmod``; then no probe of ours may be left in the kernel's list.

        :raise ModuleError: when rmmod fails or the kprobes list still shows our probes.
        """
        if not self._loaded:                 # never loaded by this backend, or closed
            return
        if self.vm.aborting:                 # interrupted: the guest is about to vanish
            self._loaded = False
            return
        before = _kprobes_list(self._read(KPROBES_LIST))
        self.control("record off\nreset\n")
        r = self.vm.run(f"rmmod {MODULE_NAME}", timeout=self.timeout)
        self._loaded = False
        if r.status != 0:
            raise ModuleError(f"rmmod {MODULE_NAME} failed: {(r.stderr or r.stdout).strip()}")
        after = _kprobes_list(self._read(KPROBES_LIST))
        ours: Counter[tuple[int, str]] = Counter()
        for p in self._placed.values():
            if p.accepted:
                key = (p.addr, "r" if p.kind == "r" else "k")
                # arch_adjust_kprobe_addr(): on IBT kernels (6.12, 7.3) SYM+0 is at +4
                if not before[key] and before[(p.addr + 4, key[1])]:
                    key = (p.addr + 4, key[1])
                ours[key] += 1
        left = {k: n for k, n in ours.items() if after[k] > before[k] - n}
        self._placed.clear()
        if left:
            raise ModuleError("probes left in %s after rmmod: %s" % (KPROBES_LIST, ", ".join(
                f"{self.vm.symbols.format(a)} ({t})" for a, t in left)))
        if self.is_loaded():
            raise ModuleError(f"{MODULE_NAME} is still loaded after rmmod")

