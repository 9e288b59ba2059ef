"""What kprobe fetch args are and yield: the tree, host-side evaluation, the printed text.

The grammar is :mod:`harness.kernel.grammar`, which builds the :class:`FetchArg` trees defined
here; this leaf module imports nothing from the package. :func:`evaluate` runs the
``fetch_insn`` program :mod:`harness.kernel.grammar.common` compiles for each argument, the way
``process_fetch_insn()`` (kernel/trace/trace_kprobe.c) and ``process_fetch_insn_bottom()``
(kernel/trace/trace_probe_tmpl.h) of Linux 6.1 run it, with x86_64's memory rules
(``copy_from_kernel_nofault_allowed()`` in arch/x86/mm/maccess.c, ``__access_ok()``).
Strings are laid out in one simulated dynamic area per event, as ``store_trace_args()``
does, so the kernel's quirks come out too: ``maxlen`` is pooled over the event's strings,
an empty ``ustring`` prints ``(fault)``, and a ``symstr`` runs on into a following string
(``fetch_store_symstring()`` consumes no byte for its NUL). These follow from the 6.1.192
source; a guest run has not confirmed them yet.

:func:`format_value` prints a value as the trace file does (``print_type_*()``), and
:func:`parse_trace_line` reads a line of ``/sys/kernel/tracing/trace`` back.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, Tuple, Union

from ..evfilter import field_kind

log = logging.getLogger(__name__)

__all__ = ["FetchArg", "Reg", "StackEntry", "StackPointer", "RetVal", "Comm", "FuncArg", "Imm",
           "ImmString", "MemAddr", "MemSymbol", "FileOffset", "Deref", "Bitfield", "render_fetch",
           "EntryArg", "Current", "PerCpu", "BtfVar", "EventField", "field_kind",
           "FetchContext", "FetchType", "FETCH_TYPES", "FaultError", "UnknowableRead", "FAULT",
           "UNKNOWN", "UNKNOWN_WHY",
           "evaluate", "format_value", "format_fields", "format_ip", "escape_bytes", "TraceRecord",
           "parse_trace_line"]

MAX_STRING_SIZE = 4096                       # PATH_MAX (trace_probe.h)
THREAD_SIZE = 16384                          # x86_64 without KASAN
TASK_SIZE_MAX = (1 << 47) - 4096             # 4-level paging
VSYSCALL_ADDR = 0xFFFFFFFFFF600000
FAULT_STRING = "(fault)"                     # kernel/trace/trace.h
_M = (1 << 64) - 1
_ARG_REGS = ("di", "si", "dx", "cx", "r8", "r9")   # regs_get_kernel_argument(), x86_64
_EFAULT, _ENOMEM, _EILSEQ = -14, -12, -84

#: ``regoffset_table`` in arch/x86/kernel/ptrace.c: the names ``%REG`` accepts on x86_64.
REGISTERS = ("r15", "r14", "r13", "r12", "r11", "r10", "r9", "r8", "bx", "cx", "dx", "si",
             "di", "bp", "ax", "orig_ax", "ip", "cs", "flags", "sp", "ss")

#: One ``struct fetch_insn`` as :mod:`harness.kernel.grammar.common` compiles it: ``(op, *params)``.
Insn = Tuple[Any, ...]


@dataclass(frozen=True)
class FetchType:
    """One row of ``probe_fetch_types[]``: bytes in the record, and the print format."""

    name: str
    size: int
    is_signed: bool
    is_string: bool
    fmt: str


FETCH_TYPES: dict[str, FetchType] = {t.name: t for t in (
    FetchType("string", 4, True, True, '"%s"'), FetchType("ustring", 4, True, True, '"%s"'),
    FetchType("symstr", 4, True, True, '"%s"'),
    FetchType("u8", 1, False, False, "%u"), FetchType("u16", 2, False, False, "%u"),
    FetchType("u32", 4, False, False, "%u"), FetchType("u64", 8, False, False, "%Lu"),
    FetchType("s8", 1, True, False, "%d"), FetchType("s16", 2, True, False, "%d"),
    FetchType("s32", 4, True, False, "%d"), FetchType("s64", 8, True, False, "%Ld"),
    FetchType("x8", 1, False, False, "0x%x"), FetchType("x16", 2, False, False, "0x%x"),
    FetchType("x32", 4, False, False, "0x%x"), FetchType("x64", 8, False, False, "0x%Lx"),
    FetchType("symbol", 8, False, False, "%pS"),
    # 6.12+ (probe_fetch_types[]: ASSIGN_FETCH_TYPE_ALIAS(char, u8, u8, 0), "'%c'")
    FetchType("char", 1, False, False, "'%c'"))}


@dataclass(frozen=True)
class FetchArg:
    """Root of the fetch-argument tree (the part of ``NAME=FETCHARG:TYPE`` before ``:``)."""


@dataclass(frozen=True)
class Reg(FetchArg):
    """``%REG``: a ``struct pt_regs`` field (``harness.kernel.grammar.REGISTERS``)."""
    name: str


@dataclass(frozen=True)
class StackEntry(FetchArg):
    """``$stackN``: ``regs_get_kernel_stack_nth(regs, N)``."""
    n: int


@dataclass(frozen=True)
class StackPointer(FetchArg):
    """``$stack``: ``kernel_stack_pointer(regs)``."""


@dataclass(frozen=True)
class RetVal(FetchArg):
    """``$retval``: ``regs_return_value(regs)``; return probes only."""


@dataclass(frozen=True)
class Comm(FetchArg):
    """``$comm`` (or ``$COMM``): ``current->comm``, always of type string."""


@dataclass(frozen=True)
class FuncArg(FetchArg):
    """``$argN`` (1-based): ``regs_get_kernel_argument(regs, N-1)``; entry probes only."""
    n: int


@dataclass(frozen=True)
class Imm(FetchArg):
    """``\\IMM``: an immediate ``unsigned long`` (negative values wrap, as in the kernel)."""
    value: int


@dataclass(frozen=True)
class ImmString(FetchArg):
    """``\\"text"``: an immediate string (FETCH_OP_DATA)."""
    text: str


@dataclass(frozen=True)
class MemAddr(FetchArg):
    """``@ADDR``: the memory at a kernel address."""
    addr: int


@dataclass(frozen=True)
class MemSymbol(FetchArg):
    """``@SYM[+|-OFFS]``: the memory at a symbol, resolved at register time."""
    symbol: str
    offset: int = 0


@dataclass(frozen=True)
class FileOffset(FetchArg):
    """``@+OFFS`` (uprobes only): memory at file offset OFFS of the probed file, in the
    current mapping (``translate_user_vaddr()`` in kernel/trace/trace_uprobe.c)."""
    offset: int


@dataclass(frozen=True)
class Deref(FetchArg):
    """``+|-[u]OFFS(FETCHARG)``: memory at ``base + offset``; ``user`` for the ``u`` form."""
    offset: int
    base: FetchArg
    user: bool = False


@dataclass(frozen=True)
class EntryArg(FetchArg):
    """``$argN`` of a return probe (6.12+): the argument as the function got it, saved by
    the kretprobe's entry handler (``FETCH_OP_EDATA``, ``store_trace_entry_data()``)."""
    n: int


@dataclass(frozen=True)
class EventField(FetchArg):
    """``$FIELD`` (7.3: also a bare ``FIELD``) of an event probe: a field of the attached
    event's record (``FETCH_OP_TP_ARG``, kernel/trace/trace_eprobe.c: ``get_event_field()``)."""
    name: str
    bare: bool = False


@dataclass(frozen=True)
class Current(FetchArg):
    """``$current`` (7.3): the ``struct task_struct *`` of the running task."""


@dataclass(frozen=True)
class PerCpu(FetchArg):
    """``this_cpu_ptr(X)`` / ``this_cpu_read(X)`` (7.3): X as a per-cpu pointer made this
    CPU's (``FETCH_OP_CPU_PTR``), read once more for ``this_cpu_read``."""
    base: FetchArg
    read: bool = False


@dataclass(frozen=True)
class BtfVar(FetchArg):
    """A BTF variable (``file->f_pos``, ``$retval->name``) parsed before any kernel's BTF
    was known: each backend resolves it again for the booted kernel."""
    text: str


@dataclass(frozen=True)
class Bitfield:
    """``b<width>@<offset>/<container>``: bits of a ``u<container>`` value."""

    width: int
    offset: int
    container: int

    def __str__(self) -> str:
        return f"b{self.width}@{self.offset}/{self.container}"


def render_fetch(node: FetchArg) -> str:
    """The canonical ``FETCHARG`` text of a tree (``@ADDR`` in hex, offsets in decimal)."""
    if isinstance(node, Reg):
        return f"%{node.name}"
    if isinstance(node, StackEntry):
        return f"$stack{node.n}"
    if isinstance(node, FuncArg):
        return f"$arg{node.n}"
    if isinstance(node, Imm):
        return f"\\{node.value}"
    if isinstance(node, ImmString):
        return f'\\"{node.text}"'
    if isinstance(node, MemAddr):
        return f"@0x{node.addr:x}"
    if isinstance(node, MemSymbol):
        return f"@{node.symbol}" + (f"{node.offset:+d}" if node.offset else "")
    if isinstance(node, FileOffset):
        return f"@+{node.offset}"
    if isinstance(node, EntryArg):
        return f"$arg{node.n}"
    if isinstance(node, PerCpu):
        return f"this_cpu_{'read' if node.read else 'ptr'}({render_fetch(node.base)})"
    if isinstance(node, BtfVar):
        return node.text
    if isinstance(node, EventField):
        return node.name if node.bare else f"${node.name}"
    if isinstance(node, Deref):
        sign = "-" if node.offset < 0 else "+"
        return f"{sign}{'u' if node.user else ''}{abs(node.offset)}({render_fetch(node.base)})"
    fixed = {StackPointer: "$stack", RetVal: "$retval", Comm: "$comm", Current: "$current"}
    return fixed[type(node)]


class FaultError(Exception):
    """Memory a :class:`FetchContext` cannot read (``copy_from_kernel_nofault()`` failing).

    :ivar address: ``unsigned long`` start of the read.
    """

    def __init__(self, address: int, size: int = 1) -> None:
        super().__init__(f"cannot read {size} byte(s) at {address:#x}")
        self.address = address
        self.size = size


class UnknowableRead(FaultError):
    """Memory the host cannot know the kernel's view of: the stack below the probed
    context's stack pointer. By the time a kernel kprobe handler reads it, the probe's own
    machinery has written its frames there (the ftrace trampoline's ``pt_regs``, the int3
    entry frame, the rethook trampoline's), so the guest records those bytes while the host,
    stopped at the breakpoint, sees what was there before. An argument that reads such
    memory is :data:`UNKNOWN` host-side, whatever its type (found by ``kph fuzz``)."""


def below_sp(sp: int, addr: int, size: int) -> None:
    """Raise :class:`UnknowableRead` when ``[addr, addr + size)`` touches the current
    kernel stack (the ``THREAD_SIZE`` block holding ``sp``) below ``sp``."""
    base = sp & ~(THREAD_SIZE - 1)
    if addr < sp and addr + size > base and sp >= 0xFFFF800000000000:
        raise UnknowableRead(addr, size)


class _Marker:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: A string fetch that failed: the kernel prints ``(fault)``.
FAULT = _Marker("FAULT")
#: A value the kernel leaves undefined (a failed deref or memory store keeps whatever the
#: ring buffer held): no prediction is possible, compare it as a wildcard.
UNKNOWN = _Marker("UNKNOWN")

#: What :func:`evaluate` gives per argument (a list of the others for arrays).
Value = Union[int, bytes, _Marker, "list[Any]"]


class FetchContext(Protocol):
    """The stopped CPU and memory a probe hit sees; the host engine implements it.

    ``read`` and ``read_user`` return exactly ``size`` bytes or raise :class:`FaultError`.
    :func:`evaluate` makes the x86_64 range checks itself (``read`` is never asked for a
    user-half, non-canonical or vsyscall address; ``read_user`` never above TASK_SIZE_MAX).
    """

    def reg(self, name: str) -> int:
        """A ``struct pt_regs`` field by its kernel name (``di``, ``sp``, ``flags`` ...)."""

    def read(self, addr: int, size: int) -> bytes:
        """Kernel virtual memory (``copy_from_kernel_nofault()``)."""

    def read_user(self, addr: int, size: int) -> bytes:
        """The current task's user memory (``copy_from_user_nofault()``)."""

    def comm(self) -> str:
        """``current->comm``."""

    def retval(self) -> int:
        """``regs_return_value(regs)``: ``ax`` at the return."""

    def symbol_addr(self, name: str) -> int:
        """``kallsyms_lookup_name()``; raises KeyError for an unknown symbol."""

    def symbolize(self, addr: int) -> str | None:
        """``sprint_symbol()`` text, ``sym+0x5/0x140`` (`` [mod]`` for modules), or None."""

    def file_offset_vaddr(self, offset: int) -> int:
        """Uprobes only: the user address of file offset ``offset`` of the probed file."""

    # Optional (6.12+ ops); a context without them cannot evaluate those arguments:
    # entry_arg(n) -> int: argument n (0-based) saved at the function's entry (EDATA);
    # current_task() -> int: ``current``; percpu_offset() -> int: this CPU's per-cpu base.


class _Cached:
    """One hit's view of ``ctx``: the kernel reads strings twice (size, then store), and
    every read here may be a gdbstub round trip, while memory cannot change under a stop."""

    def __init__(self, ctx: FetchContext) -> None:
        self._ctx = ctx
        self._memo: dict[tuple[bool, int, int], bytes | FaultError] = {}
        #: Set when a read hit :class:`UnknowableRead` (evaluate() resets it per argument).
        self.unknowable = False
        #: The first address whose read failed (a fault, or an address the kernel's
        #: probe_mem_read() refuses), per argument as ``unknowable``: a ``stale``
        #: value's evidence (``evaluate(..., failed=...)``).
        self.failed_at: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def _get(self, user: bool, addr: int, size: int) -> bytes:
        key = (user, addr, size)
        if key not in self._memo:
            try:
                self._memo[key] = (self._ctx.read_user if user else self._ctx.read)(addr, size)
            except FaultError as exc:
                self._memo[key] = exc
        got = self._memo[key]
        if isinstance(got, UnknowableRead):
            self.unknowable = True
        if isinstance(got, FaultError):
            raise got
        return got

    def read(self, addr: int, size: int) -> bytes:
        return self._get(False, addr, size)

    def read_user(self, addr: int, size: int) -> bytes:
        return self._get(True, addr, size)


@dataclass(frozen=True)
class _Blob:
    """Kernel memory that always reads: ``current->comm`` or an immediate string
    (``kind`` "comm" or "data")."""
    data: bytes
    kind: str = "comm"


def _read(ctx: FetchContext, addr: Any, size: int, user: bool, *,
          string: bool = False) -> bytes | None:
    """``probe_mem_read()`` / ``probe_mem_read_user()`` on x86_64; None on failure (its
    address kept in ``ctx.failed_at`` where ``ctx`` keeps one). ``string``: a string's
    bytes (``strncpy_from_user_nofault()``, which has no ``nmi_uaccess_okay()`` check)."""
    if isinstance(addr, _Blob):
        return (addr.data + b"\0" * size)[:size]
    addr &= _M
    got = _read_at(ctx, addr, size, user, string)
    if got is None and isinstance(ctx, _Cached) and ctx.failed_at is None:
        ctx.failed_at = addr
    return got


def _read_at(ctx: FetchContext, addr: int, size: int, user: bool,
             string: bool = False) -> bytes | None:
    if not user and addr < TASK_SIZE_MAX:
        # probe_mem_read(): with CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE (x86_64)
        # a kernel-typed read below TASK_SIZE goes to probe_mem_read_user().
        user = True
    if user:
        if addr + size > TASK_SIZE_MAX:
            return None
        # probe_mem_read_user() is copy_from_user_nofault() (kernel/trace/
        # trace_probe_kernel.h), -EFAULT when nmi_uaccess_okay() is false (mm/maccess.c):
        # current->mm is not the mm the CPU runs on, as in a task past exit_mm(). A
        # context that cannot tell (a uprobe's: its reads are copy_from_user()) has no
        # uaccess_okay.
        okay = getattr(ctx, "uaccess_okay", None)
        if not string and okay is not None and not okay():
            return None
    elif addr < 0xFFFF800000000000 or addr & ~0xFFF == VSYSCALL_ADDR:
        return None             # non-canonical or vsyscall: refused, -ERANGE
    try:
        data = (ctx.read_user if user else ctx.read)(addr, size)
    except FaultError:
        return None
    return data if len(data) == size else None


def _cstr(ctx: FetchContext, addr: Any, limit: int, user: bool) -> tuple[bytes, bool] | None:
    """At most ``limit`` bytes at ``addr`` up to a NUL: (bytes before it, NUL seen), or None
    when a byte before the NUL cannot be read. Reads whole rest-of-pages (a page reads
    entirely or not at all), never past the NUL's page, so both passes share cached reads."""
    if isinstance(addr, _Blob):
        z = addr.data.find(b"\0")
        s = addr.data if z < 0 else addr.data[:z]
        return (s, True) if len(s) < limit else (s[:limit], False)
    out = b""
    while len(out) < limit:
        a = (addr + len(out)) & _M
        chunk = _read(ctx, a, 4096 - (a & 0xFFF), user, string=True)
        if chunk is None:
            return None
        chunk = chunk[:limit - len(out)]
        z = chunk.find(b"\0")
        if z >= 0:
            return out + chunk[:z], True
        out += chunk
    return out, False


def _stack_nth(ctx: FetchContext, n: int) -> int:
    """``regs_get_kernel_stack_nth()``: 0 outside the current THREAD_SIZE stack or on a fault."""
    sp = ctx.reg("sp") & _M
    addr = (sp + 8 * n) & _M
    if addr & ~(THREAD_SIZE - 1) != sp & ~(THREAD_SIZE - 1):
        return 0
    data = _read(ctx, addr, 8, False)
    return 0 if data is None else int.from_bytes(data, "little")


def _symtext(ctx: FetchContext, addr: int) -> str:
    return ctx.symbolize(addr & _M) or f"0x{addr & _M:x}"


@dataclass
class _Store:
    """The record being written: per-element values or data_locs, and the dynamic area."""
    dyn: bytearray
    known: bytearray
    loc: tuple[int, int] = (0, 0)
    elems: list[Any] = field(default_factory=list)


def _store_string(op: str, ctx: FetchContext, addr: Any, st: _Store) -> int:
    """``fetch_store_string*()`` / ``fetch_store_symstring()`` at ``st.loc``; appends the
    element's data_loc to ``st.elems`` and returns the bytes consumed (or -errno)."""
    maxlen, offs = st.loc
    if maxlen == 0:
        st.elems.append(st.loc)
        return _ENOMEM
    if op == "st_symstr":     # sprint_symbol(): keeps the data_loc, consumes no NUL
        text = _symtext(ctx, addr).encode()
        data, ret, loc = text + b"\0", len(text), st.loc
    elif op == "st_string_uprobe":
        # trace_uprobe.c's fetch_store_string(): strncpy_from_user() (or current->comm);
        # "" stores one NUL and prints "", a full buffer is cut with a NUL in its last byte.
        got = _cstr(ctx, addr, maxlen, True)
        ret = _EFAULT if got is None else (len(got[0]) + 1 if got[1] else maxlen)
        data = got[0][:ret - 1] + b"\0" if got is not None else b""
        loc = (max(ret, 0), offs)
    else:
        # kern_fetch_store_string(): below TASK_SIZE the kernel string fetch is the user one
        # (CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE, trace_probe_kernel.h).
        user = op == "st_ustring" or _user_half(addr)
        got = _cstr(ctx, addr, maxlen, user)
        if got is None:
            ret = _EFAULT
        elif user:            # strncpy_from_user_nofault(): "" gives 0, printed (fault),
            # up to 6.12, and 1 in 7.3 (KernelRules.empty_user_string_len)
            ret = maxlen if not got[1] else (len(got[0]) + 1 if got[0] else
                                             getattr(ctx, "empty_user_string_len", 0))
        else:                 # strncpy_from_kernel_nofault()
            ret = len(got[0]) + 1 if got[1] else maxlen
        data = got[0][:ret - 1] + b"\0" if got is not None and ret > 0 else b""
        loc = (max(ret, 0), offs)
    end = offs + len(data)
    if end > len(st.dyn):
        st.dyn.extend(bytes(end - len(st.dyn)))
        st.known.extend(bytes(end - len(st.known)))
    st.dyn[offs:end], st.known[offs:end] = data, b"\1" * len(data)
    st.elems.append(loc)
    return ret


def _user_half(addr: Any) -> bool:
    return not isinstance(addr, _Blob) and (addr & _M) < TASK_SIZE_MAX


def _strlen(op: str, ctx: FetchContext, addr: Any) -> int:
    """The sizing pass: ``fetch_store_strlen()``, ``_user()`` or ``fetch_store_symstrlen()``."""
    if op == "st_symstr":
        return len(_symtext(ctx, addr)) + 1
    if op == "st_string_uprobe":    # strnlen_user(): 0 on a fault or past MAX_STRING_SIZE
        got = _cstr(ctx, addr, MAX_STRING_SIZE, True)
        return 0 if got is None or not got[1] else len(got[0]) + 1
    user = op == "st_ustring" or _user_half(addr)
    got = _cstr(ctx, addr, MAX_STRING_SIZE, user)
    if not user:
        return _EFAULT if got is None else min(len(got[0]) + 1, MAX_STRING_SIZE)
    return 0 if got is None else (len(got[0]) + 1 if got[1] else MAX_STRING_SIZE + 1)


def _event_field(op: Insn, ctx: FetchContext) -> int:
    """``get_event_field()`` (kernel/trace/trace_eprobe.c, 6.12 and 7.3) on the attached
    event's record, ``ctx.event_record()``: op is ``("tp_arg", name, offset, size,
    signed, kind)`` (kind: :func:`harness.kernel.evfilter.field_kind`)."""
    _, name, off, size, signed, kind = op
    if off is None:
        raise ValueError(f"event field {name!r} was not resolved for a kernel")
    rec = ctx.event_record() & _M
    addr = (rec + off) & _M
    if kind == "static":
        return addr
    if kind in ("dyn", "rdyn", "rdyn4"):
        # rdyn4: a __rel_loc string as an event filter finds it, after the u32
        # (trace_events_filter.c: filter_pred_strrelloc())
        loc = int.from_bytes(ctx.read(addr, 4), "little") & 0xFFFF
        base = rec if kind == "dyn" else addr if kind == "rdyn" else addr + 4
        return (base + loc) & _M
    if kind == "ptr":
        return int.from_bytes(ctx.read(addr, 8), "little")
    n = size if size in (1, 2, 4) else 8
    return int.from_bytes(ctx.read(addr, n), "little", signed=bool(signed)) & _M


def _fetch(op: Insn, ctx: FetchContext) -> Any:
    """Stage 1 of ``process_fetch_insn()``: the value the program starts from."""
    kind = op[0]
    if kind == "reg":
        return ctx.reg(op[1]) & _M
    if kind == "stack":
        return _stack_nth(ctx, op[1])
    if kind == "stackp":
        return ctx.reg("sp") & _M
    if kind == "retval":
        return ctx.retval() & _M
    if kind == "imm":
        return op[1]
    if kind == "comm":      # the bytes of current->comm when the context has them
        raw = getattr(ctx, "comm_bytes", None)
        return _Blob(raw() if raw is not None else ctx.comm().encode("utf-8", "surrogateescape"))
    if kind == "data":
        return _Blob(op[1].encode("utf-8", "surrogateescape"), "data")
    if kind == "tp_arg":    # FETCH_OP_TP_ARG: trace_eprobe.c, get_event_field()
        return _event_field(op, ctx)
    if kind == "ustack":    # get_user_stack_nth() (trace_uprobe.c): 0 when the read faults
        data = _read(ctx, (ctx.reg("sp") + 8 * op[1]) & _M, 8, True)
        return 0 if data is None else int.from_bytes(data, "little")
    if kind == "foffs":     # translate_user_vaddr(): bp_addr - probe offset + file offset
        return ctx.file_offset_vaddr(op[1]) & _M
    if kind == "arg":       # regs_get_kernel_argument(): past the sixth, the stack
        return ctx.reg(_ARG_REGS[op[1]]) & _M if op[1] < 6 else _stack_nth(ctx, op[1] - 5)
    if kind == "edata":     # FETCH_OP_EDATA: what the entry handler stored (6.12+)
        return ctx.entry_arg(op[1]) & _M
    if kind == "current":   # FETCH_OP_CURRENT (7.3)
        return ctx.current_task() & _M
    if kind == "btf":
        raise ValueError(f"{op[1]!r} is a BTF variable not resolved for a kernel")
    raise ValueError(f"not a fetch instruction: {op!r}")


_STRINGS = ("st_string", "st_ustring", "st_symstr", "st_string_uprobe")


def _run(code: Sequence[Insn], ctx: FetchContext, st: _Store | None) -> int:
    """``process_fetch_insn()``: the sizing pass when ``st`` is None, else the store pass.

    Returns what the kernel's returns: bytes of dynamic data (or -errno).
    """
    if code[0][0] == "nop_symbol":
        # An @SYM left unresolved: backends resolve it once at registration, as
        # traceprobe_update_arg() does (harness.kernel.dynevent.resolve_fetch_symbols), so this
        # only serves direct callers; a malformed offset is a KeyError like a bad name.
        data = code[0][1]
        cut = next((i for i, ch in enumerate(data) if ch in "+-"), len(data))
        try:
            off = int(data[cut:], 0) if cut < len(data) else 0
        except ValueError:
            raise KeyError(data) from None
        val: Any = (ctx.symbol_addr(data[:cut]) + off) & _M
        pc = 2
    else:
        val, pc = _fetch(code[0], ctx), 1
    total = ret = i = 0
    lval, loc = val, (0, 0)
    while True:
        while code[pc][0] in ("deref", "uderef", "cpu_ptr"):   # stage 2
            if code[pc][0] == "cpu_ptr":                    # this_cpu_ptr() (7.3)
                val, pc = (val + ctx.percpu_offset()) & _M, pc + 1
                continue
            lval = val
            data = _read(ctx, (val + code[pc][1]) & _M, 8, code[pc][0] == "uderef")
            if data is None:
                _unstored(st, i)
                return _EFAULT
            val, pc = int.from_bytes(data, "little"), pc + 1
        s3 = pc
        while True:
            op = code[pc]                                   # stage 3
            if op[0] not in _STRINGS + ("st_raw", "st_mem", "st_umem"):
                _unstored(st, i)
                return _EILSEQ
            addr = val if isinstance(val, _Blob) else (val + op[1]) & _M
            if st is None:
                if op[0] not in _STRINGS:
                    return _EILSEQ
                ret = _strlen(op[0], ctx, addr)
            elif op[0] in _STRINGS:
                loc = st.loc
                ret = _store_string(op[0], ctx, addr, st)
            else:
                if op[0] == "st_raw" and isinstance(val, _Blob):
                    # an event probe's untyped $comm (or \"STR"): the address of
                    # current->comm (of the kernel's own copy of the string)
                    # (only the immediate string's is unknowable: a context that cannot
                    # say where current->comm is raises, never a value)
                    v = UNKNOWN
                    if val.kind == "comm":
                        v = ctx.comm_address() & ((1 << 8 * op[2]) - 1)
                elif op[0] == "st_raw":
                    v: Any = val & ((1 << 8 * op[2]) - 1)
                else:
                    data = _read(ctx, addr, op[2], op[0] == "st_umem")
                    v = UNKNOWN if data is None else int.from_bytes(data, "little")
                if code[pc + 1][0] == "mod_bf":             # stage 4
                    _, basesize, lsh, rsh = code[pc + 1]
                    if v is not UNKNOWN:
                        v = ((v << lsh) & ((1 << 8 * basesize) - 1)) >> rsh
                    pc += 1
                st.elems.append(v)
            pc += 1
            if code[pc][0] != "lp_array":                   # stage 5
                return ret if code[pc][0] == "end" else _EILSEQ
            ret = max(ret, 0)
            total, i = total + ret, i + 1
            if i >= code[pc][1]:
                return total if code[pc + 1][0] == "end" else _EILSEQ
            pc = s3
            if code[s3][0] not in ("st_string", "st_ustring", "st_string_uprobe"):
                val = (val + code[s3][2]) & _M
                continue
            pc, val = s3 - 1, (lval + 8) & _M              # the next char * in the array
            if st is not None:                              # update_data_loc()
                st.loc = (loc[0] - ret, loc[1] + ret)
            break


def _unstored(st: "_Store | None", i: int) -> None:
    """A string array's element ``i`` > 0 that ends the fetch before its store (a failed
    dereference, or a base that is no dereference, ``\\0:ustring[2]``: stage 3 meets a
    non-store op, -EILSEQ): process_fetch_insn_bottom() wrote its data_loc when it went
    back for it (``update_data_loc(loc, ret)``: the rest of the area after the element
    before), so it prints what that data_loc says."""
    if st is not None and i > 0:
        st.elems.append(st.loc)


#: Why a value is :data:`UNKNOWN` host-side (``evaluate(..., why=...)``), each a case the
#: kernel itself makes unknowable (docs/diff.md names the sources):
#: ``below-sp``: the read touched the probed context's stack below its sp, where the
#: guest probe's own frames are by the time its handler reads (:class:`UnknowableRead`);
#: ``stale``: a fetch that failed (a real fault) stored nothing, so the event keeps the
#: ring buffer's old bytes there (``store_trace_args()``, ``process_fetch_insn()``).
#: ``kernel-data``: an event probe's untyped ``\\"STR"`` records the address of the
#: kernel's own copy of the string (``parse_probe_arg()``: ``kstrdup()`` into
#: ``code->data``), which only the guest's probe holds.
UNKNOWN_WHY = ("below-sp", "stale", "kernel-data")


_REG_FETCH = ("reg", "stackp", "retval", "arg")


def register_plan(args: Sequence[Any]) -> tuple[tuple[str, Any, int, FetchType], ...] | None:
    """Registers only: when every argument is one register-like fetch and its ``st_raw``
    store (``%dx:u64``, ``$arg2``, ``$retval``, ``$stack``), it reads no memory and the
    whole of ``process_fetch_insn()`` is ``val & mask``, typed: per argument (fetch kind,
    register, mask, type), which :func:`evaluate` runs without the interpreter (a spec
    keeps its plan: ``ProbeSpec.register_plan``). None otherwise."""
    plan = []
    for a in args:
        code, t = a.code, FETCH_TYPES[a.type]
        if (a.count or t.is_string or len(code) != 3 or code[0][0] not in _REG_FETCH
                or code[1][0] != "st_raw" or code[2][0] != "end"
                or (code[0][0] == "arg" and code[0][1] >= 6)):
            return None
        op = code[0]
        reg = "sp" if op[0] == "stackp" else _ARG_REGS[op[1]] if op[0] == "arg" else \
            op[1] if op[0] == "reg" else None
        plan.append((op[0], reg, (1 << 8 * code[1][2]) - 1, t))
    return tuple(plan)


def evaluate(target: Any, ctx: FetchContext, why: dict[int, str] | None = None,
             failed: dict[int, int] | None = None, slack: list[int] | None = None) -> Any:
    """Fetch what the kernel would record for a probe hit with ``ctx`` as its registers.

    :param target: a ``ProbeSpec`` (all its args, one tuple of values back, strings sharing
        one dynamic area as in one event) or a single ``ProbeArg``.
    :param why: filled, per argument index whose value holds :data:`UNKNOWN`, with the
        reason (one of :data:`UNKNOWN_WHY`). A read that fails for any other reason than
        a fault the kernel would take (an engine error) is not a value: it raises.
    :param failed: filled, per argument whose reason is ``stale``, with the address whose
        read failed in its fetch: the evidence the verdict's ``stale`` rule asks for.
    :param slack: given a list, the bytes of the dynamic area the record reserves and no
        data_loc reaches are appended to it (the first pass counted more than the second
        stored: on 6.1 and 6.12 an empty user string, 1 byte), unless a value is
        :data:`UNKNOWN`: what the guest's record length must show (the verdict's
        ``record-slack``).
    :return: per argument an ``int`` (signed for ``s*`` types), ``bytes`` for strings
        (without the NUL), :data:`FAULT`, :data:`UNKNOWN`, or a list of those for arrays.
    :raise KeyError: from ``ctx.symbol_addr`` for an ``@SYM`` the kernel could not resolve.
    """
    plan = getattr(target, "register_plan", None)
    if plan is not None:
        return tuple(_typed(t, ((ctx.retval() if kind == "retval" else ctx.reg(reg)) & _M) & mask)
                     for kind, reg, mask, t in plan)
    args = tuple(target.args) if hasattr(target, "args") else (target,)
    ctx = _Cached(ctx)                              # the same Protocol, reads memoized
    dsize = 0
    unknowable: set[int] = set()
    for i, a in enumerate(args):                    # __get_data_size()
        if FETCH_TYPES[a.type].is_string:
            ctx.unknowable = False
            n = _run(a.code, ctx, None)
            dsize += n if n > 0 else 0
            if ctx.unknowable:
                unknowable.add(i)
    st = _Store(bytearray(dsize), bytearray(dsize))
    pos, out = 0, []
    failed_at: dict[int, int] = {}
    for i, a in enumerate(args):                    # store_trace_args()
        t = FETCH_TYPES[a.type]
        st.elems, st.loc = [], (dsize - pos, pos)
        first = st.loc
        ctx.unknowable, ctx.failed_at = False, None
        ret = _run(a.code, ctx, st)
        if ctx.unknowable:
            unknowable.add(i)
        if ctx.failed_at is not None:
            failed_at[i] = ctx.failed_at
        if t.is_string and ret > 0:
            pos += ret
        out.append((a, t, list(st.elems), first))
    if slack is not None and not unknowable:
        reach = 0           # the farthest data_loc end, as ringbuf.record_excess finds it
        for a, t, elems, first in out:
            if t.is_string:
                for ln, offs in (elems or [first]):
                    if offs + ln <= dsize:
                        reach = max(reach, offs + ln)
        slack.append(dsize - reach)
    values = []
    for i, (a, t, elems, first) in enumerate(out):
        n = a.count or 1
        if i in unknowable:
            values.append([UNKNOWN] * n if a.count else UNKNOWN)
            if why is not None:
                why[i] = "below-sp"
            continue
        if t.is_string and not elems:
            # A fetch that failed before its store (a dereference in the 2nd stage of
            # process_fetch_insn_bottom(), kernel/trace/trace_probe_tmpl.h, 6.1 to 7.3)
            # leaves the data_loc store_trace_args() set up: (the dynamic space left, the
            # current offset). No space left prints (fault); else whatever the next
            # dynamic args store there (kph fuzz, seed 8128: "+0(%di):symstr $comm"
            # prints arg1="qemu-ga"), and past the event's data, stale bytes.
            elems = [first]
        elems += [UNKNOWN] * (n - len(elems))
        if t.is_string:
            elems = [_loc_string(st, e) if isinstance(e, tuple) else UNKNOWN for e in elems]
        else:
            elems = [_typed(t, e) for e in elems]
        if why is not None and any(e is UNKNOWN for e in elems):
            why[i] = "kernel-data" if a.code and a.code[0][0] == "data" else "stale"
            if failed is not None and why[i] == "stale" and i in failed_at:
                failed[i] = failed_at[i]
        values.append(elems if a.count else elems[0])
    return tuple(values) if hasattr(target, "args") else values[0]


def _loc_string(st: _Store, loc: tuple[int, int]) -> Any:
    """What ``print_type_string()`` shows for a data_loc: (fault), or text up to a NUL."""
    if loc[0] == 0:
        return FAULT
    end = st.dyn.find(b"\0", loc[1])
    if end < 0 or b"\0" in st.known[loc[1]:end + 1]:
        return UNKNOWN
    return bytes(st.dyn[loc[1]:end])


def _typed(t: FetchType, v: Any) -> Any:
    if not isinstance(v, int):
        return v
    v &= (1 << 8 * t.size) - 1
    return v - (1 << 8 * t.size) if t.is_signed and v >> (8 * t.size - 1) else v


def format_value(arg: Any, value: Value,
                 symbolize: Callable[[int], str | None] | None = None) -> str:
    """The text the trace file shows for ``value`` of ``arg`` (``print_type_*()``).

    ``%u``/``%d`` for ``u*``/``s*`` (bitfields print as their ``u`` container), ``0x%x`` for
    ``x*``, ``"%s"`` or ``(fault)`` for strings, ``%pS`` for ``symbol`` (needs
    ``symbolize``; ``0x%lx`` when it finds nothing), ``{a,b}`` for arrays. A string's bytes
    are shown escaped by :func:`escape_bytes` (the trace file prints them raw, which a
    newline or a byte that is not UTF-8 makes ambiguous). An :data:`UNKNOWN` value prints
    ``(unknown)``: the kernel prints stale bytes there.

    :raise ValueError: for a ``symbol`` value when ``symbolize`` is None.
    """
    t = FETCH_TYPES[arg.type]
    if arg.count:
        items = value if isinstance(value, list) else [value] * arg.count
        return "{" + ",".join(_format1(t, v, symbolize) for v in items) + "}"
    return _format1(t, value, symbolize)


_SPACE_ESC = {0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t", 0x0B: "v"}   # escape_space()
_SPECIAL_ESC = {0x5C: "\\", 0x07: "a", 0x1B: "e", 0x22: '"'}           # escape_special()


def escape_bytes(data: bytes) -> str:
    r"""``string_escape_mem(src, len, ..., ESCAPE_ANY | ESCAPE_NAP | ESCAPE_APPEND, "\"\\")``
    (lib/string_helpers.c): printable ASCII as is, except ``"`` and ``\``; ``\n`` ``\t``
    ``\r`` ``\f`` ``\v`` ``\a`` ``\e`` ``\"`` ``\\`` ``\0``; every other byte as three octal
    digits. The result is printable ASCII and names the bytes exactly, so strings compare
    as the bytes the kernel stored and show the same on every side."""
    out = []
    for c in data:
        if 0x20 <= c < 0x7F and c not in (0x22, 0x5C):     # isascii && isprint, not in @only
            out.append(chr(c))
        elif c in _SPACE_ESC:
            out.append("\\" + _SPACE_ESC[c])
        elif c in _SPECIAL_ESC:
            out.append("\\" + _SPECIAL_ESC[c])
        elif c == 0:
            out.append("\\0")                             # escape_null()
        else:
            out.append(f"\\{c:03o}")                      # escape_octal()
    return "".join(out)


def _format1(t: FetchType, v: Any, symbolize: Callable[[int], str | None] | None) -> str:
    if v is UNKNOWN:
        return "(unknown)"
    if t.is_string:
        return FAULT_STRING if v is FAULT else '"' + escape_bytes(v) + '"'
    v &= (1 << 8 * t.size) - 1
    if t.name == "char":    # "'%c'": the byte itself, shown escaped as strings are
        return "'" + escape_bytes(bytes([v])) + "'"
    if t.name == "symbol":
        if symbolize is None:
            raise ValueError("formatting a symbol-type value needs symbolize")
        return symbolize(v) or f"0x{v:x}"
    if t.name[0] == "x":
        return f"0x{v:x}"
    return str(_typed(t, v))


def format_fields(spec: Any, values: Sequence[Any],
                  symbolize: Callable[[int], str | None] | None = None) -> str:
    """The `` name=value`` run ``print_probe_args()`` appends after the ``(ip)``."""
    return "".join(f" {a.name}={format_value(a, v, symbolize)}"
                   for a, v in zip(spec.args, values))


def format_ip(ip: int, symbolize: Callable[[int], str | None], func: int | None = None, *,
              kretprobe_trampoline: int = 0) -> str:
    """What ``print_kprobe_event()`` puts between the parentheses (``seq_print_ip_sym()``).

    :param func: for a return probe, the probed function (``ip`` is then the return address);
        it prints by name only (``kallsyms_lookup()``), after `` <- ``.
    :param kretprobe_trampoline: the kernel's kretprobe trampoline, which prints as
        ``[unknown/kretprobe'd]`` (kernel/trace/trace_output.c: ``kretprobed()``, in
        ``trace_seq_print_sym()``): the return address of a kretprobe instance taken
        after another one hooked the same call.
    """
    if kretprobe_trampoline and ip == kretprobe_trampoline:
        text = "[unknown/kretprobe'd]"
    else:
        text = "0" if ip == 0 else (symbolize(ip) or f"0x{ip:08x}")
    if func is not None:
        name = symbolize(func) if func else None
        name = name.split("+", 1)[0].split(" ", 1)[0] if name else None
        text += " <- " + ("0" if func == 0 else name or f"0x{func:08x}")
    return text


@dataclass(frozen=True)
class TraceRecord:
    """One kprobe event line of the trace file.

    ``ip_text`` is the probed address (a return probe's return address) as printed,
    ``ret_from`` the function a return probe left. ``fields`` has strings unquoted (escapes
    are never added by the kernel, so none are removed); ``raw_fields`` keeps the printed
    text, which is what :func:`format_value` produces.
    """

    comm: str
    pid: int
    cpu: int
    flags: str | None
    timestamp: float
    event: str
    ip_text: str
    ret_from: str | None
    fields: dict[str, str]
    raw_fields: dict[str, str]
    tgid: int | None = None


_LINE = re.compile(
    r"\s*(?P<comm>.*?)-(?P<pid>\d+)\s+(?:\(\s*(?P<tgid>\d+|-+)\)\s+)?\[(?P<cpu>\d+)\]\s+"
    r"(?:(?P<flags>[^\s\d]\S*)\s+)?(?P<ts>\d+(?:\.\d+)?):\s+(?P<event>[^\s:]+):\s+"
    r"\((?P<ip>[^)]*)\)(?P<rest>.*)")
_FIELD = re.compile(r" ([A-Za-z_][A-Za-z0-9_]*)=")


def parse_trace_line(line: str, names: Sequence[str] | None = None) -> TraceRecord | None:
    """Read a line ``print_kprobe_event()`` / ``print_kretprobe_event()`` wrote.

    :param names: the event's argument names in order, if known; they settle where a string
        containing `` x=`` ends. Without them a quoted value ends at the first quote that is
        followed by `` name=`` or the end of the line.
    :return: None for comments, blank lines and lines of other event kinds.
    """
    line = line.rstrip("\r\n")
    if not line.strip() or line.lstrip().startswith("#"):
        return None
    m = _LINE.fullmatch(line)
    if m is None:
        return None
    rest, raw = m["rest"], {}
    i, k = 0, 0
    while i < len(rest):
        f = _FIELD.match(rest, i)
        if f is None or (names is not None and (k >= len(names) or f[1] != names[k])):
            return None
        j = f.end()
        nxt = names[k + 1] if names is not None and k + 1 < len(names) else None
        end = _value_end(rest, j, nxt, names is not None)
        raw[f[1]] = rest[j:end]
        i, k = end, k + 1
    ip, _, ret_from = m["ip"].partition(" <- ")
    tgid = m["tgid"]
    return TraceRecord(
        m["comm"].strip(), int(m["pid"]), int(m["cpu"]), m["flags"], float(m["ts"]),
        m["event"], ip, ret_from or None,
        {n: v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v for n, v in raw.items()},
        raw, int(tgid) if tgid and tgid[0] != "-" else None)


def _value_end(rest: str, j: int, nxt: str | None, named: bool) -> int:
    """Where the value starting at ``rest[j]`` ends (see :func:`parse_trace_line`)."""
    if named:
        if nxt is None:
            return len(rest)
        heads = [h.start() for h in re.finditer(" " + re.escape(nxt) + "=", rest[j:])]
    else:
        heads = [h.start() for h in _FIELD.finditer(rest, j)]
        heads = [h - j for h in heads]
    close = {'"': '"', "{": "}"}.get(rest[j:j + 1])
    for h in heads:
        if close is None or (h > 0 and rest[j + h - 1] == close):
            return j + h
    return len(rest)
