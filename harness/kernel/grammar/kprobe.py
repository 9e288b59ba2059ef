"""The ``kprobe_events`` grammar of Linux 6.1 on x86_64: parse, format, error log.

Pure text in, frozen records out, no I/O (like pygdbmi's ``gdbmiparser.py``); evaluating
fetch args against a stopped vCPU lives in :mod:`harness.kernel.grammar.fetch`. The rules are read from
Debian's ``linux-source-6.1`` (6.1.192), the kernel family the default image boots:
``__trace_kprobe_create()`` in kernel/trace/trace_kprobe.c, and ``traceprobe_parse_probe_arg()``,
``traceprobe_parse_probe_arg_body()``, ``parse_probe_arg()``, ``parse_probe_vars()`` and
``traceprobe_parse_event_name()`` in kernel/trace/trace_probe.c. That 6.1 stable tree has the
``symstr`` type (backported from 6.2) and immediates (``\\IMM``, ``\\"str"``, from 5.14)::

    p[:[GRP/][EVENT]] [MOD:]SYM[+OFFS]|ADDR [FETCHARGS]
    r[MAXACTIVE][:[GRP/][EVENT]] [MOD:]SYM[+0] [FETCHARGS]
    p[:[GRP/][EVENT]] [MOD:]SYM[+0]%return [FETCHARGS]
    -:[GRP/][EVENT] [SYM [NAME=FETCHARG]...]

Checks that need the symbol table (``kprobe_on_func_entry()``, ``number_of_same_symbols()``,
``register_kprobe()``) are not made here, except through the optional ``on_func_entry``
callback of :func:`parse`: a refused probe is a result, not a parse error.

``format(parse(s)) == s`` for canonical ``s``: one space between tokens, no comment, symbol
offsets as ``+0x..``, raw addresses as ``0x..``. Fetch args keep their spelling, because the
kernel keeps it too (``probe_arg.comm``, printed back by ``trace_kprobe_show()``).

Why this module runs past 600 lines: it follows those kernel functions check by check, so
that every refusal comes with the kernel's wording and a column; the fetch-arg tree, the
evaluation and the trace-file side already live in :mod:`harness.kernel.grammar.fetch`.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import common as FP, common as _kstrtox
from ...errors import NotMirroredError, ProbeSpecError
from .fetch import (FETCH_TYPES, REGISTERS, THREAD_SIZE, Bitfield, Comm, Deref, FetchArg, FetchType,
                        FileOffset, FuncArg, Imm, ImmString, Insn, MemAddr, MemSymbol, Reg, RetVal,
                        StackEntry, StackPointer, render_fetch)
from ..rules import KernelRules, rules_for
from .common import FL_FENTRY, FL_KERNEL, FL_RETURN

log = logging.getLogger(__name__)

__all__ = [
    "ProbeSpec", "ProbeArg", "parse", "parse_arg", "format", "kernel_format", "format_error",
    "default_event_name", "kstrtoul", "kstrtol", "split_symbol_offset", "REGISTERS",
    "KernelView", "guest_line",
    # the fetch-arg tree, defined in harness.kernel.grammar.fetch and re-exported here
    "FetchArg", "Reg", "StackEntry", "StackPointer", "RetVal", "Comm", "FuncArg", "Imm",
    "ImmString", "MemAddr", "MemSymbol", "Deref", "Bitfield",
]

# kernel/trace/trace_probe.h, trace.h and trace_kprobe.c (6.1); x86_64 without KASAN.
MAX_TRACE_ARGS = 128
MAX_ARGSTR_LEN = 63
MAX_ARRAY_LEN = 64
MAX_ARG_NAME_LEN = 32
MAX_PROBE_EVENT_SIZE = 3072
MAX_EVENT_NAME_LEN = 64
FETCH_INSN_MAX = 16                     # fetch + deref*N + store + mod + end
KRETPROBE_MAXACTIVE_MAX = 4096
PARAM_MAX_STACK = THREAD_SIZE // 8
KPROBE_EVENT_SYSTEM = "kprobes"
DEFAULT_FETCH_TYPE = "x64"              # DEFAULT_FETCH_TYPE: x##BITS_PER_LONG
_UINT_MAX = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_RULES_6_1 = rules_for("6.1")

#: Reserved field names (``reserved_field_names[]``) an argument may not take.
_RESERVED = ("common_type", "common_flags", "common_preempt_count", "common_pid",
             "common_tgid", "__probe_ip", "__probe_ret_ip", "__probe_func")


def _default_type(fetch: FetchArg) -> str:
    """The type of an argument written without ``:TYPE``."""
    return "string" if isinstance(fetch, (Comm, ImmString)) else DEFAULT_FETCH_TYPE


@dataclass(frozen=True)
class ProbeArg:
    """One fetch argument, the kernel's ``struct probe_arg``.

    ``type`` is the fetch type the kernel resolves (``x64`` when none is written; ``u32`` for
    ``b4@3/32``). ``comm`` is the argument text after ``NAME=`` as written, which the kernel
    keeps and shows in ``kprobe_events``. ``code`` is the compiled ``fetch_insn`` program
    :mod:`harness.kernel.grammar.fetch` runs; both are left out of equality. An argument built in
    Python is compiled from its canonical text (any non-default type counts as written).

    :raise ValueError: when built in Python with a combination the kernel refuses.
    """

    name: str
    fetch: FetchArg
    type: str = DEFAULT_FETCH_TYPE
    count: int = 0
    bitfield: Bitfield | None = None
    explicit_name: bool = True
    explicit_type: bool = False
    comm: str = field(default="", compare=False)
    code: tuple[Insn, ...] = field(default=(), compare=False, repr=False)
    #: ``comm`` is the kernel's own text for this argument (a 6.12+ parse, where BTF may
    #: have typed or renamed it): written back as it is
    written: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.count or self.bitfield or self.type != _default_type(self.fetch):
            object.__setattr__(self, "explicit_type", True)     # such a type is written
        if not self.code:       # built in Python: compile its canonical text
            try:
                code = _parse_body(render_body(self), _FL_ANY, [0])[5]
            except _Fail as exc:
                raise ValueError(f"{render_body(self)!r}: {exc}") from None
            object.__setattr__(self, "code", code)

    @property
    def fetch_type(self) -> FetchType:
        return FETCH_TYPES[self.type]


@dataclass(frozen=True)
class ProbeSpec:
    """One ``kprobe_events`` line.

    ``kind`` is ``"p"``, ``"r"`` or ``"-"``; a ``p`` line ending in ``%return`` has
    ``return_suffix`` and is a return probe too (:attr:`is_return`). ``symbol`` excludes the
    module (``module``); :attr:`symbol_name` is the kernel's ``kprobe.symbol_name``. ``addr``
    is set instead of ``symbol`` for raw-address probes. ``event`` is the name the kernel
    uses, generated when not written (``explicit_event``). For ``-`` lines ``group`` is ""
    when not written (any group) and ``match`` holds the optional tokens compared literally.
    ``fentry`` records whether the probe was taken to be on a function entry
    (``TPARG_FL_FENTRY``), which decides whether ``$argN`` is accepted.
    """

    kind: str
    group: str = KPROBE_EVENT_SYSTEM
    event: str = ""
    module: str | None = None
    symbol: str | None = None
    offset: int = 0
    addr: int | None = None
    maxactive: int = 0
    args: tuple[ProbeArg, ...] = ()
    return_suffix: bool = False
    explicit_group: bool = False
    explicit_event: bool = False
    match: tuple[str, ...] = ()
    fentry: bool = field(default=False, compare=False)
    text: str = field(default="", compare=False)
    #: uprobes (``uprobe_events``): the probed file; ``offset`` is then its file offset,
    #: or ``symbol`` names an ELF symbol the harness resolves (``harness.kernel.grammar.uprobe``).
    path: str | None = None
    ref_ctr_offset: int | None = None

    def __post_init__(self) -> None:
        if not self.event and self.kind != "-":
            if self.path is not None:
                from .uprobe import default_uprobe_event_name
                name = default_uprobe_event_name(self.is_return, self.path, self.offset)
            else:
                name = default_event_name(self.is_return, self.symbol_name, self.offset,
                                          self.addr)
            object.__setattr__(self, "event", name)

    @property
    def is_uprobe(self) -> bool:
        return self.path is not None

    @property
    def is_return(self) -> bool:
        return self.kind == "r" or self.return_suffix

    @property
    def symbol_name(self) -> str | None:
        if self.symbol is None:
            return None
        return f"{self.module}:{self.symbol}" if self.module is not None else self.symbol

    @property
    def ret_ip_args(self) -> tuple[str, ...]:
        """A return probe's arguments whose value starts from ``%ip``: the return address
        (``__kretprobe_trampoline_handler()`` / ``handle_trampoline()`` set ``regs->ip``
        to the saved one before the handlers run). Where a host-side return probe
        hijacked the same call first, the guest's saved one is the host trampoline, and so
        is every value it fetches from there (``harness.diff.verdict``'s ``trampoline`` rule)."""
        if not self.is_return:
            return ()
        return tuple(a.name for a in self.args if a.code and a.code[0] == ("reg", "ip"))


# ---------------------------------------------------------------- numbers (lib/kstrtox.c)

# lib/kstrtox.c, as harness.kernel.grammar.common holds it (one copy for every kernel's parser)
kstrtoul = _kstrtox.kstrtoul
kstrtol = _kstrtox.kstrtol


def _simple_strtoul(s: str, start: int) -> tuple[int, int]:
    """``simple_strtoul(s + start, &end, 0)``: (value mod 2**64, index of ``end``)."""
    return _kstrtox.simple_strtoul(s, start)


def split_symbol_offset(data: str) -> tuple[str, int | None]:
    """``traceprobe_split_symbol_offset()`` (kernel/trace/trace_probe.c): the text before
    the first ``+`` or ``-`` and ``kstrtol()`` of the rest from that sign on (0 without
    one); the offset is None where the kernel returns -EINVAL."""
    cut = next((i for i, ch in enumerate(data) if ch in "+-"), len(data))
    return data[:cut], (kstrtol(data[cut:]) if cut < len(data) else 0)


def _is_good_name(name: str, hash_ok: bool = False) -> bool:
    """``__is_good_name()`` in kernel/trace/trace.h: a C identifier (``-`` too for groups)."""
    extra = "_-" if hash_ok else "_"
    return (name != "" and (name[0].isascii() and name[0].isalpha() or name[0] in extra)
            and all(c.isascii() and c.isalnum() or c in extra for c in name[1:]))


# ---------------------------------------------------------------- parsing

class _Fail(Exception):
    """A parse error at ``pos`` in the token being parsed, worded as the kernel's ``ERRORS``
    list in trace_probe.h words it (or, where the kernel logs nothing, as ours)."""

    def __init__(self, msg: str, pos: int, errno: int = 22, logged: bool = True,
                 words: list[str] | None = None) -> None:
        super().__init__(msg)
        self.pos = pos
        self.errno = errno
        self.logged = logged
        #: the words the kernel's log holds when they are not the line's own (then ``pos``
        #: is a column of those words joined by single spaces)
        self.words = words


_FL_RETURN, _FL_FENTRY = 1, 4          # TPARG_FL_RETURN, TPARG_FL_FENTRY (KERNEL always set)
_FL_ANY = 8                             # ours: accept $retval and $argN (compiling only)
_FL_UPROBE = 16                         # ours: a uprobe_events line (TPARG_FL_KERNEL clear)
#: How trace_uprobe.c's process_fetch_insn() differs: every memory access is
#: copy_from_user(), $stackN is get_user_stack_nth(), strings strncpy_from_user().
_UPROBE_OPS = {"deref": "uderef", "st_mem": "st_umem", "stack": "ustack",
               "st_string": "st_string_uprobe", "st_ustring": "st_string_uprobe"}


def _push(ops: list[Insn], insn: Insn, pos: int,
          msg: str = "Dereference is too much nested") -> None:
    # Slot FETCH_INSN_MAX - 1 holds FETCH_OP_END, so a 16th instruction cannot be added.
    if len(ops) >= FETCH_INSN_MAX - 1:
        raise _Fail(msg, pos)
    ops.append(insn)


def _parse_var(s: str, pos: int, flags: int) -> tuple[FetchArg, Insn]:
    """``parse_probe_vars()``: ``s`` is the text after ``$``, ``pos`` where ``$`` is."""
    if s == "retval":
        if not flags & (_FL_RETURN | _FL_ANY):
            raise _Fail("$retval is not available on probe", pos)
        return RetVal(), ("retval",)
    if s.startswith("stack"):
        rest = s[5:]
        if rest == "":
            return StackPointer(), ("stackp",)
        n = kstrtoul(rest, 10) if rest[0].isascii() and rest[0].isdigit() else None
        if n is None:
            raise _Fail("Invalid $-variable specified", pos)
        if n > PARAM_MAX_STACK:
            raise _Fail("Invalid stack number", pos)
        return StackEntry(n), ("stack", n)
    if s in ("comm", "COMM"):
        return Comm(), ("comm",)
    if flags in (_FL_FENTRY, _FL_ANY) and s.startswith("arg"):  # flags == KERNEL|FENTRY
        n = kstrtoul(s[3:], 10)
        if n is None:
            raise _Fail("Invalid $-variable specified", pos)
        if n == 0 or n > PARAM_MAX_STACK:
            raise _Fail("Invalid argument number", pos)
        return FuncArg(n), ("arg", n - 1)
    raise _Fail("Invalid $-variable specified", pos)


def _parse_fetch(s: str, pos: int, flags: int, ops: list[Insn]) -> FetchArg:
    """``parse_probe_arg()``: build the tree and the kernel's instruction list together."""
    c = s[:1]
    if c == "$":
        var, insn = _parse_var(s[1:], pos, flags)
        ops.append(insn)
        return var
    if c == "%":
        if s[1:] not in REGISTERS:
            raise _Fail("Invalid register name", pos)
        ops.append(("reg", s[1:]))
        return Reg(s[1:])
    if c == "@":
        if s[1:2].isascii() and s[1:2].isdigit():
            addr = kstrtoul(s[1:])
            if addr is None:
                raise _Fail("Invalid memory address", pos)
            node: FetchArg = MemAddr(addr)
            ops.append(("imm", addr))
        elif s[1:2] == "+":
            if not flags & _FL_UPROBE:
                raise _Fail("File offset is not available with kprobe", pos)
            foff = kstrtol(s[2:])
            if foff is None:
                raise _Fail("Invalid file offset value", pos)
            node = FileOffset(foff)
            ops.append(("foffs", foff & _MASK64))
        elif flags & _FL_UPROBE:
            raise _Fail("Symbol is not available with uprobe", pos)
        else:
            # FETCH_NOP_SYMBOL keeps the text after '@' as written: parse_probe_arg() checks
            # nothing more. traceprobe_update_arg() splits and resolves it at register time
            # (harness.kernel.dynevent.resolve_fetch_symbols): a bad offset is EINVAL, an unknown
            # or empty name ENOENT, so "@", "@bogus" and "@_sdata*10" all parse.
            data = s[1:]
            sym, off = split_symbol_offset(data)
            node = MemSymbol(sym, off) if off is not None else MemSymbol(data)
            ops.append(("nop_symbol", data))
            _push(ops, ("imm", None), pos)
        _push(ops, ("deref", 0), pos)
        return node
    if c in ("+", "-"):
        user = s[1:2] == "u"
        rest = s[2:] if user else s[1:]
        lp = rest.find("(")
        if lp < 0:
            raise _Fail("Dereference needs a brace", pos)
        off = kstrtol(rest[:lp] if c == "+" else "-" + rest[:lp])
        if off is None:
            raise _Fail("Invalid dereference offset", pos)
        # parse_probe_arg() (6.1): for "+u"/"-u" it overwrites the 'u' with the sign and
        # steps over it, then adds (tmp + 1 - arg) + (arg[0] != '-') to the offset: the
        # 'u' is never counted, so every caret inside a user deref is one column left of
        # the text (found by kph fuzz: "p do_sys_openat2 +u0($retval)", caret 20, not 21).
        ipos = pos + 1 + lp + 1
        inner = rest[lp + 1:]
        rp = inner.rfind(")")
        if rp < 0:
            raise _Fail("Dereference brace is not closed", ipos + len(inner))
        if inner[rp + 1:]:
            log.debug("ignoring %r after ')' in %r, as the kernel does", inner[rp + 1:], s)
        base = _parse_fetch(inner[:rp], ipos, flags, ops)
        if ops[-1][0] in ("comm", "data"):
            raise _Fail("$comm can not be dereferenced", ipos)
        _push(ops, ("uderef" if user else "deref", off), ipos)
        return Deref(off, base, user)
    if c == "\\":
        if s[1:2] == '"':
            body = s[2:]
            if not body.endswith('"'):
                raise _Fail("String is not closed with '\"'", pos + 2 + len(body))
            ops.append(("data", body[:-1]))
            return ImmString(body[:-1])
        t = s[1:]
        v = (kstrtoul(t) if t[:1].isascii() and t[:1].isdigit() else
             kstrtol(t) if t[:1] == "-" else kstrtol(t[1:]) if t[:1] == "+" else None)
        if v is None:
            raise _Fail("Invalid immediate value", pos + 1)
        ops.append(("imm", v & _MASK64))
        return Imm(v)
    raise _Fail("Invalid fetch argument", pos)


def _parse_body(body: str, flags: int, size: list[int]) -> tuple[Any, ...]:
    """``traceprobe_parse_probe_arg_body()``: (fetch, type, count, bitfield, explicit, code).

    ``size`` is the running record size of the earlier arguments (``trace_probe.size``).
    ``code`` is the kernel's ``fetch_insn`` list as tuples, ending in ``("end",)``.
    """
    if len(body) > MAX_ARGSTR_LEN:
        raise _Fail("Argument expression is too long", 0)
    if body == "":
        raise _Fail("No argument expression", 0)
    arg, tstr, tpos, count = body, None, 0, 0
    colon = body.find(":")
    if colon >= 0:
        arg, tstr, tpos = body[:colon], body[colon + 1:], colon + 1
        lb = tstr.find("[")
        if lb >= 0:
            inside, npos = tstr[lb + 1:], tpos + lb + 1
            tstr = tstr[:lb]
            rb = inside.find("]")
            if rb < 0:
                raise _Fail("Array is not closed", len(body))
            if inside[rb + 1:]:
                raise _Fail("Array has wrong suffix", npos + rb + 1)
            n = kstrtoul(inside[:rb])
            if n is None or n == 0 or n > _UINT_MAX:
                raise _Fail("Invalid array size", npos)
            if n > MAX_ARRAY_LEN:
                raise _Fail("Array number is too big", npos)
            count = n
    if arg in ("$comm", "$COMM") or arg.startswith('\\"'):
        if count or (tstr is not None and tstr != "string"):
            # The kernel fails with -EINVAL here without an error_log entry.
            raise _Fail("$comm and immediate strings are of type string, never arrays", tpos,
                        logged=False)
        tname: str | None = "string"
    else:
        tname = _find_fetch_type(tstr)
    if tname is None:
        raise _Fail("Unknown type is specified", tpos)
    ftype = FETCH_TYPES[tname]
    size[0] += ftype.size * (count or 1)
    if size[0] > MAX_PROBE_EVENT_SIZE:
        raise _Fail("Event too big (too many fields?)", 0)

    ops: list[Insn] = []
    fetch = _parse_fetch(arg, 0, flags, ops)
    last = ops[-1]
    if ftype.is_string:
        symstr = tname == "symstr"
        allowed = (("reg", "stack", "retval", "arg", "deref") if symstr else
                   ("deref", "uderef", "imm", "comm", "data"))
        if last[0] not in allowed:
            raise _Fail("Symbol String doesn't accept data/userdata" if symstr else
                        "String accepts only memory argument", tpos)
        if symstr or last[0] in ("imm", "comm", "data") or count:
            _push(ops, ("nop",), 0)
        cur = ops[-1]
        off = cur[1] if cur[0] in ("deref", "uderef") else 0
        op = ("st_ustring" if tname == "ustring" or cur[0] == "uderef" else
              "st_symstr" if symstr else "st_string")
        ops[-1] = (op, off)
    elif last[0] in ("deref", "uderef"):
        ops[-1] = ("st_mem" if last[0] == "deref" else "st_umem", last[1], ftype.size)
    else:
        _push(ops, ("st_raw", 0, ftype.size), 0)
    store = ops[-1][0]
    bitfield = None
    if tstr is not None and tstr.startswith("b"):
        bitfield = _parse_bitfield(tstr, ftype.size, tpos)
        bits = ftype.size * 8
        _push(ops, ("mod_bf", ftype.size, bits - (bitfield.width + bitfield.offset),
                    bits - bitfield.width), tpos, "Invalid bitfield")
        if bits < bitfield.width + bitfield.offset:
            raise _Fail("Invalid bitfield", tpos)
    if count:
        if store not in ("st_mem", "st_string", "st_ustring"):
            raise _Fail("String accepts only memory argument", tpos)
        _push(ops, ("lp_array", count), 0)
    return fetch, tname, count, bitfield, tstr is not None, tuple(ops) + (("end",),)


def _find_fetch_type(t: str | None) -> str | None:
    """``find_fetch_type()``: the bitfield ``b.../N`` form maps to ``uN``."""
    if t is None:
        return DEFAULT_FETCH_TYPE
    if t.startswith("b"):
        slash = t.find("/")
        bs = kstrtoul(t[slash + 1:]) if slash >= 0 else None
        return f"u{bs}" if bs in (8, 16, 32, 64) else None
    return t if t in _RULES_6_1.fetch_types else None


def _parse_bitfield(t: str, size: int, pos: int) -> Bitfield:
    """``__parse_bitfield_probe_arg()`` for ``b<width>@<offset>/<container>``."""
    bw, i = _simple_strtoul(t, 1)
    if bw == 0 or t[i:i + 1] != "@":
        raise _Fail("Invalid bitfield", pos)
    bo, j = _simple_strtoul(t, i + 1)
    if j == i + 1 or t[j:j + 1] != "/":
        raise _Fail("Invalid bitfield", pos)
    return Bitfield(bw, bo, size * 8)


def _flags(is_return: bool, fentry: bool) -> int:
    return (_FL_RETURN if is_return else 0) | (_FL_FENTRY if fentry else 0)


def parse_arg(text: str, *, index: int = 0, is_return: bool = False, fentry: bool = True,
              used: tuple[str, ...] = ()) -> ProbeArg:
    """Parse one ``[NAME=]FETCHARG[:TYPE]`` token, as ``traceprobe_parse_probe_arg()`` does.

    :param index: 0-based position in the line; an unnamed argument is called ``arg<index+1>``.
    :param used: names of the earlier arguments (a repeat is USED_ARG_NAME).
    :raise ProbeSpecError: with ``column`` relative to ``text``.
    """
    try:
        return _parse_arg(text, index, _flags(is_return, fentry), used, [0])
    except _Fail as exc:
        raise ProbeSpecError(str(exc), text, exc.pos) from None


def _parse_arg(tok: str, index: int, flags: int, used: tuple[str, ...],
               size: list[int]) -> ProbeArg:
    eq = tok.find("=")
    if eq >= 0:
        if eq > MAX_ARG_NAME_LEN:
            raise _Fail("Argument name is too long", 0)
        if eq == 0:
            raise _Fail("Argument name is not specified", 0)
        name, body, boff = tok[:eq], tok[eq + 1:], eq + 1
    else:
        name, body, boff = f"arg{index + 1}", tok, 0
    if not _is_good_name(name):
        raise _Fail("Argument name must follow the same rules as C identifiers", 0)
    if name in _RESERVED or name in used:
        raise _Fail("This argument name is already used", 0)
    try:
        fetch, tname, count, bf, explicit, code = _parse_body(body, flags, size)
    except _Fail as exc:
        exc.pos += boff
        raise
    if flags & _FL_UPROBE:
        code = tuple((_UPROBE_OPS.get(op[0], op[0]),) + op[1:] for op in code)
    return ProbeArg(name, fetch, tname, count, bf, eq >= 0, explicit, body, code)


_SPACE = re.compile(r"[^ \t\n\v\f\r]+")          # argv_split() splits on isspace()


@dataclass(frozen=True)
class KernelView:
    """What parsing a line needs to know of the kernel that will take it.

    ``rules`` are its series' (:mod:`harness.kernel.rules`); ``btf`` its BTF (None: not known,
    a BTF variable then parses into a placeholder each backend resolves for its kernel:
    ``lenient``); ``on_func_entry`` and ``count_symbol`` as :func:`parse` takes them;
    ``module_count(mod, sym)`` counts ``sym`` in a loaded module (None: not loaded), for
    6.12's ``validate_probe_symbol()``; ``dentry_offsets`` are ``offsetof(struct dentry,
    d_name.name)`` and ``offsetof(struct file, f_path.dentry)`` for ``%pd``/``%pD``.
    """

    rules: KernelRules
    btf: Any = None
    on_func_entry: Callable[[str, int], bool | None] | None = None
    count_symbol: Callable[[str], int] | None = None
    module_count: Callable[[str, str], int | None] | None = None
    dentry_offsets: tuple[int, int] | None = None

    @property
    def lenient(self) -> bool:
        return self.btf is None


def parse(text: str, *,
          on_func_entry: Callable[[str, int], bool | None] | None = None,
          count_symbol: Callable[[str], int] | None = None,
          kernel: KernelView | None = None, uprobe_symbols: bool = True) -> ProbeSpec:
    """Parse one ``kprobe_events`` line the way the kernel of ``kernel`` does (6.1 without
    one, the default image's).

    Errors come in the kernel's order (maxactive, target, event name, then each argument),
    with its ``error_log`` texts. Like ``trace_parse_run_command()``, everything from ``#`` on
    is a comment. Like 6.1's ``__trace_kprobe_create()``, arguments past
    :data:`MAX_TRACE_ARGS` are ignored (a warning is logged); 6.12 and 7.3 refuse them.

    :param on_func_entry: ``kprobe_on_func_entry()`` for ``(symbol_name, offset)``: True on a
        function entry, False when not (a return probe there is BAD_RETPROBE), None when the
        symbol is unknown (the kernel defers that to ENOENT at register time). By default
        ``offset == 0``, which holds for the default image (no IBT ``endbr64`` at entries).
    :param count_symbol: ``number_of_same_symbols()`` for an unqualified ``SYM``: the kernel
        refuses 0 (BAD_PROBE_ADDR, ENOENT) and more than 1 (NON_UNIQ_SYMBOL, EADDRNOTAVAIL)
        right after the return-probe check, before the event name and the arguments.
    :param kernel: the kernel's rules and facts; its callbacks replace the two above.
    :param uprobe_symbols: take the harness's ``PATH:SYMBOL[+OFFS]`` uprobe places; False
        parses as ``uprobe_events`` does, where only ``PATH:OFFSET`` is valid.
    :raise ProbeSpecError: when the kernel would refuse the line before looking anything up;
        ``column`` is the 0-based offset in ``text`` of the offending character, ``errno``
        the write's errno.
    :raise NotMirroredError: a kind that kernel takes and the host side does not mirror.
    """
    if kernel is not None:
        on_func_entry = kernel.on_func_entry or on_func_entry
        count_symbol = kernel.count_symbol or count_symbol
    line = text.split("#", 1)[0]
    if "\n" in line.rstrip("\n"):
        raise ProbeSpecError("One probe per line", text, line.index("\n"))
    toks = [(m.start(), m.group()) for m in _SPACE.finditer(line)]
    if not toks:
        raise ProbeSpecError("No probe definition", text, 0)
    try:
        if line[0] == "-":
            return _parse_delete(toks, text)
        return _parse_probe(toks, text, on_func_entry, count_symbol, kernel, uprobe_symbols)
    except _Fail as exc:
        # The kernel splits the line into words (argv_split()) and logs the error against
        # the words joined by single spaces (trace_probe_log_err(): the "Command:" of
        # error_log), so a caret after doubled spaces or tabs moves left (kph fuzz found it).
        if exc.words is not None:
            raise ProbeSpecError(str(exc), " ".join(exc.words), exc.pos, errno=exc.errno,
                                 logged=exc.logged) from None
        command = " ".join(t for _, t in toks)
        raise ProbeSpecError(str(exc), command, _argv_column(toks, exc.pos), errno=exc.errno,
                             logged=exc.logged) from None


def _argv_column(toks: list[tuple[int, str]], pos: int) -> int:
    """``pos`` in the typed text as a column of the words joined by single spaces."""
    col = 0
    for start, tok in toks:
        if pos < start:
            return col
        if pos <= start + len(tok):
            return col + pos - start
        col += len(tok) + 1
    return col                  # past the last word: where a next one would start


def _parse_delete(toks: list[tuple[int, str]], text: str) -> ProbeSpec:
    """``dyn_event_release()``: ``-:[GRP/]EVENT`` plus optional literal match tokens."""
    start, head = toks[0]
    if head[1:2] != ":":
        raise _Fail("A probe is deleted with -:[GRP/]EVENT", start + 1)
    name = head[2:]
    group, slash = "", name.find("/")
    if slash >= 0:
        group, name = name[:slash], name[slash + 1:]
    if slash < 0 and name == "":
        raise _Fail("Event name is not specified", start + 2)
    return ProbeSpec("-", group, name, explicit_group=slash >= 0, explicit_event=name != "",
                     match=tuple(t for _, t in toks[1:]), text=text)


_KIND_NAMES = {"f": "fprobe events (f:)", "t": "tracepoint probes (t:)",
               "e": "event probes (e:)", "s": "synthetic events (s:)"}


def _parse_probe(toks: list[tuple[int, str]], text: str,
                 on_func_entry: Callable[[str, int], bool | None] | None,
                 count_symbol: Callable[[str], int] | None = None,
                 kernel: KernelView | None = None, uprobe_symbols: bool = True) -> ProbeSpec:
    rules = kernel.rules if kernel is not None else rules_for(None)
    h0, head = toks[0]
    kind = head[0]
    if kind not in ("p", "r"):
        if kind in rules.dynevent_kinds or kind in ("e", "s") and rules.dynevent_kinds:
            raise NotMirroredError(f"not mirrored host-side: {_KIND_NAMES[kind]} on "
                                   f"{rules.series}", text, h0,
                                   hint="probe the function with a p: or r: line instead")
        raise _Fail("Unknown probe type; use p, r or -", h0, logged=False)   # -ECANCELED
    if len(toks) < 2:
        raise _Fail("No probe point (SYM[+OFFS] or ADDR) is given",
                    len(text.split("#", 1)[0].rstrip()) + 1, logged=False)
    if "/" in toks[1][1]:
        # A target with a '/' is a file: a uprobe_events line (__trace_uprobe_create()).
        from .uprobe import parse_uprobe
        return parse_uprobe(toks, text, kernel, symbols=uprobe_symbols)
    is_return = kind == "r"
    colon = head.find(":", 1)
    maxactive = 0
    if head[1:2].isascii() and head[1:2].isdigit():
        if not is_return:
            raise _Fail(rules.message(rules.maxact_on_kprobe), h0 + 1)
        digits = head[1:colon] if colon >= 0 else head[1:]
        n = kstrtoul(digits) if len(digits) <= MAX_EVENT_NAME_LEN - 1 else None
        if n is None or n == 0 or n > _UINT_MAX:
            raise _Fail("Invalid maxactive number", h0 + 1)
        if n > KRETPROBE_MAXACTIVE_MAX:
            raise _Fail("Maxactive is too big", h0 + 1)
        maxactive = n

    t0, target = toks[1]
    module = symbol = None
    offset, suffix, fentry = 0, False, False
    addr = kstrtoul(target)
    if addr is None:
        sym, suffix = _return_suffix(target, t0)
        is_return = is_return or suffix
        cut = next((i for i, ch in enumerate(sym) if ch in "+-"), len(sym))
        off = kstrtol(sym[cut:]) if cut < len(sym) else 0
        if off is None or off < 0 or off > _UINT_MAX:
            raise _Fail("Invalid probed address or symbol", t0)
        sym, offset = sym[:cut], off
        if ":" in sym:
            module, sym = sym.split(":", 1)
        if rules.symbol_check == "validate":
            _validate_probe_symbol(kernel, module, sym, count_symbol, t0)
        elif sym == "" or module == "":
            raise _Fail("Invalid probed address or symbol", t0)
        symbol = sym
        name = f"{module}:{sym}" if module is not None else sym
        entry = on_func_entry(name, offset) if on_func_entry else offset == 0
        fentry = entry is True and (rules.fentry_on_return or not is_return)
        if entry is False and is_return:
            raise _Fail("Retprobe address must be an function entry", t0)
        if rules.symbol_check == "after_retprobe" and module is None and \
                count_symbol is not None:
            n = count_symbol(sym)       # __trace_kprobe_create(): number_of_same_symbols()
            if n > 1:
                raise _Fail("The symbol is not unique", t0, 99)     # -EADDRNOTAVAIL
            if n == 0:
                raise _Fail("Invalid probed address or symbol", t0, 2)     # -ENOENT

    group, event, exp_group, exp_event = KPROBE_EVENT_SYSTEM, "", False, False
    if colon >= 0:
        group, event, exp_group, exp_event = _parse_event_name(head[colon + 1:], h0 + colon + 1)
    if not exp_event:
        event = default_event_name(is_return, None if symbol is None else name, offset, addr)

    if rules.arg_parser == "context":
        flags = FL_KERNEL | (FL_RETURN if is_return else 0) | (FL_FENTRY if fentry else 0)
        args = _context_args(toks, text, kernel, rules, flags,
                             None if symbol is None else name)
        return ProbeSpec(kind, group, event, module, symbol, offset, addr, maxactive,
                         tuple(args), suffix, exp_group, exp_event, fentry=fentry, text=text)
    flags = _flags(is_return, fentry)
    args = []
    size = [0]
    if len(toks) - 2 > MAX_TRACE_ARGS:
        log.warning("%s: only the first %d of %d fetch args count (MAX_TRACE_ARGS)",
                    event, MAX_TRACE_ARGS, len(toks) - 2)
    for i, (start, tok) in enumerate(toks[2:2 + MAX_TRACE_ARGS]):
        try:
            args.append(_parse_arg(tok, i, flags, tuple(a.name for a in args), size))
        except _Fail as exc:
            exc.pos += start
            raise
    return ProbeSpec(kind, group, event, module, symbol, offset, addr, maxactive, tuple(args),
                     suffix, exp_group, exp_event, fentry=fentry, text=text)


def _validate_probe_symbol(kernel: KernelView | None, module: str | None, sym: str,
                           count_symbol: Callable[[str], int] | None, t0: int) -> None:
    """6.12+ ``validate_probe_symbol()``, before the return-probe check: ``SYM`` counted in
    vmlinux and the modules (7.3: vmlinux alone when it has the name), ``MOD:SYM`` in MOD
    when MOD is loaded; none is BAD_PROBE_ADDR, several NON_UNIQ_SYMBOL, both -EINVAL."""
    if module is not None:
        n = kernel.module_count(module, sym) if kernel and kernel.module_count else None
    else:
        n = count_symbol(sym) if count_symbol is not None else None
    if n is None:
        return
    if n > 1:
        raise _Fail("The symbol is not unique", t0)
    if n == 0:
        raise _Fail("Invalid probed address or symbol", t0)


def _context_args(toks: list[tuple[int, str]], text: str, kernel: KernelView | None,
                  rules: KernelRules, flags: int, funcname: str | None,
                  uprobe: bool = False) -> list[ProbeArg]:
    """The arguments of a line as 6.12/7.3 parse them (:mod:`harness.kernel.grammar.common`):
    ``$arg*``/``$argN`` expanded from BTF, the argument count checked, ``%pd``/``%pD``
    rewritten, then each argument. Errors are placed as ``__trace_probe_log_err()`` places
    them: against the line as written, at the argument index the kernel logs."""
    lc = FP.LineContext(rules, flags, funcname, kernel.btf if kernel else None,
                        lenient=kernel is None or kernel.lenient)

    def column(index: int, pos: int) -> int:
        """Argument ``index`` of the line (0 the head), ``pos`` into it."""
        if index < len(toks):
            return toks[index][0] + pos
        return len(" ".join(t for _, t in toks)) + 1

    raw = [t for _, t in toks[2:]]
    try:
        if not uprobe:
            items = FP.expand_meta_args(lc, raw)
        else:
            items = list(enumerate(raw))
        if len(items) > MAX_TRACE_ARGS:
            if rules.too_many_args == "TOO_MANY_ARGS":
                raise FP.Fail(rules.message("TOO_MANY_ARGS"), 0, 7, index=0)
            if rules.too_many_args == "E2BIG":
                raise FP.Fail("Too many arguments (more than 128)", 0, 7, index=0, logged=False)
            items = items[:MAX_TRACE_ARGS]
        logged: list[str] | None = None
        if not uprobe:
            d = kernel.dentry_offsets if kernel is not None else None
            before = items
            items = FP.expand_dentry_args(lc, items, *(d or (0x28, 0x48)))
            if items != before and [t for _, t in before] == raw:
                # traceprobe_expand_dentry_args() rewrites argv in place; without a $arg
                # expansion (a new argv) that is the array trace_probe_log holds, so
                # error_log shows the rewritten words and places its caret in them
                # (6.12: "+0(%di):%pd" is logged as "+0x0(+0x28(+0(%di))):string").
                logged = [t for _, t in toks[:2]] + [t for _, t in items]
    except FP.Fail as exc:
        raise _Fail(str(exc) or "refused without an error_log entry", column(
            2 + (exc.index or 0), exc.pos), exc.errno, exc.logged) from None
    args: list[ProbeArg] = []
    size = [0]
    for j, (_orig, tok) in enumerate(items):
        try:
            name, body, written = FP.parse_arg(lc, tok, j, tuple(a.name for a in args), size)
        except FP.Fail as exc:
            msg = str(exc) or "refused without an error_log entry"
            if logged is not None:
                col = sum(len(w) + 1 for w in logged[:2 + j]) + exc.pos
                raise _Fail(msg, col, exc.errno, exc.logged, words=logged) from None
            raise _Fail(msg, column(2 + j, exc.pos), exc.errno, exc.logged) from None
        fetch, tname, count, bf, explicit, code = body
        comm = tok[tok.find("=") + 1:] if written else tok
        args.append(ProbeArg(name, fetch, tname, count, bf, written, explicit, comm, code,
                             written=True))
    return args


def _return_suffix(target: str, pos: int) -> tuple[str, bool]:
    """Split a ``%return`` suffix off ``target`` (``pos`` its column): (rest, had it)."""
    pct = target.find("%")
    if pct < 0:
        return target, False
    if target[pct:] != "%return":
        raise _Fail("Invalid probed address suffix", pos + pct)
    return target[:pct], True


def _parse_event_name(s: str, pos: int) -> tuple[str, str, bool, bool]:
    """``traceprobe_parse_event_name()``: ``[GRP/]EVENT`` (``.`` also separates)."""
    group = KPROBE_EVENT_SYSTEM
    slash = s.find("/")
    if slash < 0:
        slash = s.find(".")
    if slash >= 0:
        if slash == 0:
            raise _Fail("Group name is not specified", pos)
        if slash + 1 > MAX_EVENT_NAME_LEN:
            raise _Fail("Group name is too long", pos)
        if not _is_good_name(s[:slash], hash_ok=True):
            raise _Fail("Group name must follow the same rules as C identifiers", pos)
        group, s, pos = s[:slash], s[slash + 1:], pos + slash + 1
    if s == "":
        if slash >= 0:
            return group, "", True, False
        raise _Fail("Event name is not specified", pos)
    if len(s) >= MAX_EVENT_NAME_LEN:
        raise _Fail("Event name is too long", pos)
    if not _is_good_name(s):
        raise _Fail("Event name must follow the same rules as C identifiers", pos)
    return group, s, slash >= 0, True


def default_event_name(is_return: bool, symbol_name: str | None, offset: int = 0,
                       addr: int | None = None) -> str:
    """The name ``__trace_kprobe_create()`` makes when none is given.

    ``"%c_%s_%ld"`` then ``sanitize_event_name()`` (``:`` and ``.`` become ``_``), cut to
    ``MAX_EVENT_NAME_LEN - 1``. For a raw address the kernel writes ``"%c_0x%p"``; ``%p`` is
    *hashed* unless the guest boots with ``no_hash_pointers``, so this returns the unhashed
    form and a harness comparing events by name must name address probes itself.
    """
    c = "r" if is_return else "p"
    if symbol_name is not None:
        name = f"{c}_{symbol_name}_{offset}"
    else:
        name = f"{c}_0x{(addr or 0):016x}"
    name = name[0] + name[1:].replace(":", "_").replace(".", "_")
    return name[:MAX_EVENT_NAME_LEN - 1]


# ---------------------------------------------------------------- formatting

def render_body(arg: ProbeArg) -> str:
    """The canonical ``FETCHARG[:TYPE]`` text of an argument built in Python."""
    body = render_fetch(arg.fetch)
    if arg.explicit_type:
        body += ":" + (str(arg.bitfield) if arg.bitfield else arg.type)
        body += f"[{arg.count}]" if arg.count else ""
    return body


def _arg_text(arg: ProbeArg, is_return: bool, uprobe: bool = False) -> str:
    """``arg.comm`` while it still says what the fields say, else the canonical rendering."""
    if arg.written and arg.comm:
        return arg.comm
    if arg.comm:
        try:
            flags = _FL_UPROBE | (_FL_RETURN if is_return else 0) if uprobe else \
                _flags(is_return, True)
            again = _parse_body(arg.comm, flags, [0])[:5]
        except _Fail:
            again = None
        if again == (arg.fetch, arg.type, arg.count, arg.bitfield, arg.explicit_type):
            return arg.comm
    return render_body(arg)


def format(spec: ProbeSpec) -> str:  # noqa: A001 - the module's verb, as in the guide
    """Write ``spec`` back as a ``kprobe_events`` line (``format(parse(s)) == s``)."""
    if spec.is_uprobe:
        from .uprobe import format_uprobe
        return format_uprobe(spec)
    if spec.kind == "-":
        name = (f"{spec.group}/" if spec.explicit_group else "") + spec.event
        return " ".join((f"-:{name}",) + spec.match)
    head = spec.kind + (str(spec.maxactive) if spec.maxactive else "")
    if spec.explicit_group or spec.explicit_event:
        head += ":" + (f"{spec.group}/" if spec.explicit_group else "")
        head += spec.event if spec.explicit_event else ""
    if spec.symbol is None:
        target = f"0x{(spec.addr or 0):x}"
    else:
        target = f"{spec.symbol_name}" + (f"+0x{spec.offset:x}" if spec.offset else "")
        target += "%return" if spec.return_suffix else ""
    args = [(f"{a.name}=" if a.explicit_name else "") + _arg_text(a, spec.is_return)
            for a in spec.args]
    return " ".join([head, target] + args)


def kernel_format(spec: ProbeSpec) -> str:
    """The line ``cat kprobe_events`` shows for ``spec`` (``trace_kprobe_show()``).

    Always ``r`` for return probes, the group and event spelled out, ``SYM+%u`` in decimal
    and every argument as ``NAME=COMM``. Raw addresses print through ``%p``, which the guest
    hashes unless booted with ``no_hash_pointers``; this shows the unhashed value.
    """
    if spec.kind == "-":
        return format(spec)
    if spec.is_uprobe:
        from .uprobe import kernel_format_uprobe
        return kernel_format_uprobe(spec)
    head = "r" if spec.is_return else "p"
    head += str(spec.maxactive) if spec.is_return and spec.maxactive else ""
    if spec.symbol is None:
        target = f"0x{(spec.addr or 0):016x}"
    else:
        target = f"{spec.symbol_name}" + (f"+{spec.offset}" if spec.offset else "")
    args = "".join(f" {a.name}={_arg_text(a, spec.is_return)}" for a in spec.args)
    return f"{head}:{spec.group}/{spec.event} {target}{args}"


def guest_line(spec: ProbeSpec) -> str:
    """The line written to a guest's ``kprobe_events``: a kprobe line as written (its
    arguments untouched, so the kernel expands ``$arg*``, ``$argN`` and ``%pd`` and types
    BTF arguments itself) under the explicit ``GROUP/EVENT`` the harness expects; uprobe
    lines and lines built in Python as :func:`kernel_format` writes them."""
    if spec.is_uprobe or spec.kind == "-" or not spec.text:
        return kernel_format(spec)
    toks = _SPACE.findall(spec.text.split("#", 1)[0])
    head = "r" if spec.kind == "r" else "p"
    head += str(spec.maxactive) if spec.kind == "r" and spec.maxactive else ""
    return " ".join([f"{head}:{spec.group}/{spec.event}"] + toks[1:])


def format_error(err: ProbeSpecError, subsystem: str = "trace_kprobe") -> str:
    """Render ``err`` as ``tracing/error_log`` does (``tracing_err_log_seq_show()``), caret
    under ``err.column``, without the timestamp."""
    cmd = err.text.rstrip("\n")
    return (f"{subsystem}: error: {err}\n  Command: {cmd}\n"
            f"{' ' * (len('  Command: ') + err.column)}^")
