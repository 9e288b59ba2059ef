"""Fetch arguments as Linux 6.12 and 7.3 parse them (``traceprobe_parse_probe_arg()`` with a
``struct traceprobe_parse_context``), BTF arguments included.

Why a module apart from :mod:`harness.kernel.grammar.common`: 6.4 rewrote the argument parser around a
parse context (kernel/trace/trace_probe.c), and with ``CONFIG_PROBE_EVENTS_BTF_ARGS`` an
argument may name a function parameter (``file``), follow fields (``file->f_pos``,
``$retval->name``), and untyped ``$retval``/``$argN`` take their type from the function's
BTF prototype. 7.3 rewrote it again as a loop with a nesting stack (``$current``,
``this_cpu_read()``/``this_cpu_ptr()``, ``(struct[,field])`` casts, at most
``TRACEPROBE_MAX_NESTED_LEVEL`` levels). 6.1's parser stays in :mod:`harness.kernel.grammar.common`,
checked against 6.1; this one follows 6.12.117's and 7.3.4's sources function by function,
the differences between the two gated by :class:`harness.kernel.rules.KernelRules`, with
their error codes, errnos and caret offsets (``ctx->offset``, including where the kernel
leaves it after a dereference).

It produces what :mod:`harness.kernel.grammar.common` does: a fetch tree (for the module and plugin
backends) and the kernel's ``fetch_insn`` program as tuples (for
:func:`harness.kernel.grammar.fetch.evaluate`), with the new ops ``("edata", n)`` (an entry argument
a return probe's entry handler saved), ``("current",)`` and ``("cpu_ptr",)``.

Without a kernel's BTF (``lenient``: a line parsed before any kernel is chosen) a BTF
variable parses into a placeholder the backends resolve again for the booted kernel.
"""
from __future__ import annotations

import errno as E
from dataclasses import dataclass, field
from typing import Any

from ..btf import (BTF, INT_SIGNED, KIND_ARRAY, KIND_ENUM, KIND_ENUM64, KIND_INT, KIND_PTR,
                  KIND_STRUCT, KIND_UNION, BtfType)
from .fetch import (FETCH_TYPES, REGISTERS, THREAD_SIZE, BtfVar, Comm, Current, Deref, EntryArg,
                        FetchArg, FileOffset, FuncArg, Imm, ImmString, MemAddr, MemSymbol,
                        PerCpu, Reg, RetVal, StackEntry, StackPointer, Bitfield, EventField,
                        field_kind)
from ..rules import KernelRules

__all__ = ["LineContext", "Fail", "parse_arg", "expand_meta_args", "expand_dentry_args",
           "FL_RETURN", "FL_KERNEL", "FL_FENTRY", "FL_USER", "FL_FPROBE", "FL_TPOINT", "FL_ANY"]

FL_RETURN, FL_KERNEL, FL_FENTRY, FL_USER = 1, 2, 4, 16      # TPARG_FL_* (trace_probe.h)
FL_TEVENT, FL_FPROBE, FL_TPOINT = 8, 32, 64
FL_ANY = 1 << 10                        # ours: compile a Python-built arg, any variable
_LOC_MASK = 0x1F                        # TPARG_FL_LOC_MASK
FETCH_INSN_MAX = 16
PARAM_MAX_STACK = THREAD_SIZE // 8
MAX_ARG_NAME_LEN = 32
MAX_ARRAY_LEN = 64
MAX_PROBE_EVENT_SIZE = 3072
MAX_BTF_ARGS_LEN = 128
MAX_DENTRY_ARGS_LEN = 256
_UINT_MAX = 0xFFFFFFFF
_M = (1 << 64) - 1
_RESERVED = ("common_type", "common_flags", "common_preempt_count", "common_pid",
             "common_tgid", "__probe_ip", "__probe_ret_ip", "__probe_func")
_THIS_CPU_PTR, _THIS_CPU_READ = "this_cpu_ptr(", "this_cpu_read("
_UPROBE_OPS = {"deref": "uderef", "st_mem": "st_umem", "stack": "ustack",
               "st_string": "st_string_uprobe", "st_ustring": "st_string_uprobe"}


class Fail(Exception):
    """The kernel refusing an argument: an ``error_log`` text at ``pos`` in the argument
    (``index``: the line's argument it is logged against, when not the one parsed), and the
    errno the write fails with."""

    def __init__(self, msg: str, pos: int, errno: int = E.EINVAL, index: int | None = None,
                 logged: bool = True) -> None:
        super().__init__(msg)
        self.pos, self.errno, self.index, self.logged = pos, errno, index, logged


@dataclass
class LineContext:
    """``struct traceprobe_parse_context`` for one line: flags, the probed function, its
    BTF, and what parsing the line's arguments has found so far."""

    rules: KernelRules
    flags: int
    funcname: str | None = None
    btf: BTF | None = None
    lenient: bool = False
    offset: int = 0
    # the function prototype (query_btf_context())
    queried: bool = False
    proto: tuple[int, list[Any]] | None = None
    # what the last BTF access left
    last_type: BtfType | None = None
    last_bitoffs: int = 0
    last_bitsize: int = 0
    struct_type: BtfType | None = None        # 7.3 typecast target (struct_btf)
    prefix_byteoffs: int = 0
    entry_args: list[int] = field(default_factory=list)   # __store_entry_arg()
    #: an event probe's attached event: its fields by name (``trace_get_fields()``: the
    #: event's own, no ``common_*``), None when not known yet (lenient)
    event_fields: Any = None

    def err(self, code: str, pos: int | None = None, errno: int = E.EINVAL) -> Fail:
        return Fail(self.rules.message(code), self.offset if pos is None else pos, errno)

    @property
    def is_entry(self) -> bool:              # tparg_is_function_entry()
        return self.flags & FL_ANY != 0 or (self.flags & _LOC_MASK) == FL_KERNEL | FL_FENTRY

    @property
    def is_return(self) -> bool:             # tparg_is_function_return()
        return self.flags & FL_ANY != 0 or (self.flags & _LOC_MASK) == FL_KERNEL | FL_RETURN

    def query_btf(self) -> int:
        """``query_btf_context()``: 0, or -errno when the function has no BTF prototype."""
        if self.queried:
            return 0 if self.proto is not None else -E.ENOENT
        if not self.funcname:
            return -E.EINVAL
        self.queried = True
        self.proto = self.btf.func_proto(self.funcname) if self.btf is not None else None
        return 0 if self.proto is not None else -E.ENOENT

    @property
    def params(self) -> list[Any]:
        """The prototype's parameters; a tracepoint probe's stub hides its first, the
        tracepoint's ``void *__data`` (``query_btf_context()``: TPARG_FL_TPOINT)."""
        params = self.proto[1] if self.proto is not None else []
        return params[1:] if self.flags & FL_TPOINT else params

    @property
    def arg_shift(self) -> int:
        """Where argument 0 of the line is in the registers: 1 on a tracepoint probe,
        whose stub's first argument is the hidden ``__data`` (``code->param++``)."""
        return 1 if self.flags & FL_TPOINT else 0


# ---------------------------------------------------------------- lib/kstrtox.c

def _digits(s: str, base: int) -> tuple[int, int]:
    start = 0
    if base == 0:
        base = 16 if s[:1] == "0" and s[1:2] in ("x", "X") and s[2:3] != "" and \
            s[2:3] in "0123456789abcdefABCDEF" else (8 if s[:1] == "0" else 10)
    if base == 16 and s[:1] == "0" and s[1:2] in ("x", "X"):
        start = 2
    i, val = start, 0
    while i < len(s):
        c = s[i].lower()
        d = ord(c) - 48 if "0" <= c <= "9" else (ord(c) - 87 if "a" <= c <= "f" else 99)
        if d >= base:
            break
        val, i = val * base + d, i + 1
    return val, (i if i > start else 0)


def kstrtoul(s: str, base: int = 0) -> int | None:
    """The kernel's ``kstrtoul()``: one leading ``+``, ``0x``/``0`` prefixes with base 0.

    :return: the value, or None where the kernel returns -EINVAL or -ERANGE.
    """
    s = s[1:] if s[:1] == "+" else s
    val, used = _digits(s, base)
    if used == 0 or val > _M or s[used:] not in ("", "\n"):
        return None
    return val


def kstrtol(s: str, base: int = 0) -> int | None:
    """The kernel's ``kstrtol()`` (``kstrtoll()`` on 64-bit); None on -EINVAL/-ERANGE."""
    if s[:1] == "-":
        v = kstrtoul(s[1:], base) if s[1:2] != "+" else None
        return None if v is None or v > 1 << 63 else -v
    v = kstrtoul(s, base)
    return None if v is None or v >= 1 << 63 else v


def simple_strtoul(s: str, start: int, base: int = 0) -> tuple[int, int]:
    val, used = _digits(s[start:], base)
    return val & _M, start + used


def is_good_name(name: str) -> bool:
    return (name != "" and (name[0].isascii() and name[0].isalpha() or name[0] == "_")
            and all(c.isascii() and c.isalnum() or c == "_" for c in name[1:]))


# ---------------------------------------------------------------- types

def find_fetch_type(t: str | None, lc: LineContext) -> str | None:
    """``find_fetch_type()``: uprobes refuse ``symbol``/``symstr`` (6.12+)."""
    if t is not None and lc.flags & FL_USER and lc.rules.uprobe_no_symbol_types and \
            t in ("symbol", "symstr"):
        return None
    if t is None:
        return "x64"
    if t.startswith("b"):
        slash = t.find("/")
        bs = kstrtoul(t[slash + 1:]) if slash >= 0 else None
        return f"u{bs}" if bs in (8, 16, 32, 64) else None
    return t if lc.rules.has_type(t) else None


def _type_from_btf(lc: LineContext) -> str | None:
    """``fetch_type_from_btf_type()`` for ``ctx->last_type``."""
    t = lc.last_type
    if t is None:
        return None
    if t.kind == KIND_ENUM:
        return "s32"
    if t.kind == KIND_ENUM64:
        return "s64"
    if t.kind == KIND_PTR:
        return "x64"
    if t.kind == KIND_INT:
        enc, ioff, bits = t.extra
        if enc & INT_SIGNED:
            return {8: "s8", 16: "s16", 32: "s32", 64: "s64"}.get(bits)
        if bits in (8, 16, 32, 64):
            return f"u{bits}"
        lc.last_bitsize = bits          # a bitfield, its size encoded in the type
        lc.last_bitoffs += ioff
        return "u64"
    return None


def _is_char(btf: BTF, tid: int) -> bool:
    _, real = btf.skip_modifiers(tid)
    return (real is not None and real.kind == KIND_INT and not real.extra[0] & INT_SIGNED
            and real.extra[2] == 8)


# ---------------------------------------------------------------- the parsed argument

@dataclass
class _Arg:
    """What parsing one body builds: the fetch tree and the instruction list."""
    ops: list[tuple] = field(default_factory=list)

    def push(self, lc: LineContext, insn: tuple, pos: int | None = None,
             code: str = "TOO_MANY_OPS") -> None:
        # code[FETCH_INSN_MAX - 1] is FETCH_OP_END: a 16th instruction does not fit
        if len(self.ops) >= FETCH_INSN_MAX - 1:
            raise lc.err(code, pos)
        self.ops.append(insn)


def _split_field(lc: LineContext, name: str) -> tuple[str, str | None, bool]:
    """``split_next_field()``: (this name, the rest after ``.`` or ``->``, whether ``->``)."""
    cut = next((i for i, c in enumerate(name) if c in ".-"), -1)
    if cut < 0:
        return name, None, False
    if name[cut] == "-":
        if name[cut + 1:cut + 2] != ">":
            raise lc.err("BAD_HYPHEN", lc.offset + cut)
        return name[:cut], name[cut + 2:], True
    return name[:cut], name[cut + 1:], False


def _field_bits(lc: LineContext, fieldname: str, tid: int) -> tuple[int, str | None, int]:
    """The inner loop over ``.``-joined fields (7.3: ``get_bitoffset_of_field()``): (bit
    offset, what follows an ``->``, the type id reached)."""
    btf = lc.btf
    assert btf is not None
    bits = 0
    name: str | None = fieldname
    while True:
        assert name is not None
        this, nxt, arrow = _split_field(lc, name)
        t = btf.type(tid)
        if t is None or t.kind not in (KIND_STRUCT, KIND_UNION):
            raise lc.err("BAD_BTF_TID")
        found = btf.find_member(tid, this)
        if found is None:
            raise lc.err("NO_BTF_FIELD", errno=E.ENOENT)
        m, anon, _holder = found
        bits += anon + m.bit_offset
        lc.last_bitsize = m.bitfield_size
        tid, t = btf.skip_modifiers(m.type)
        if t is None:
            raise lc.err("BAD_BTF_TID")
        if nxt is not None:
            lc.offset += len(this) + (2 if arrow else 1)
        name = nxt
        if arrow or name is None:
            return bits, name, tid


def _btf_field(lc: LineContext, fieldname: str, tid: int, a: _Arg, node: FetchArg
               ) -> FetchArg:
    """``parse_btf_field()``: ``tid`` is a pointer to the struct (or, for the first field
    of a 7.3 cast, the struct itself); each ``->`` adds a dereference."""
    btf = lc.btf
    assert btf is not None
    first = True
    name: str | None = fieldname
    while name is not None:
        if not (first and lc.struct_type is not None):
            t = btf.type(tid)
            if t is None or t.kind != KIND_PTR:
                raise lc.err("NO_PTR_STRCT")
            tid, t = btf.skip_modifiers(t.ref)
            if t is None:
                raise lc.err("BAD_BTF_TID")
        bits, name, ftid = _field_bits(lc, name, tid)
        off = bits // 8
        if first and lc.struct_type is not None:
            off -= lc.prefix_byteoffs
        a.push(lc, ("deref", off))
        node = Deref(off, node)
        lc.last_bitoffs = bits % 8
        lc.last_type = btf.type(ftid)
        tid = ftid
        first = False
    return node


def _btf_arg(lc: LineContext, varname: str, a: _Arg) -> FetchArg:
    """``parse_btf_arg()``: a parameter name, ``$retval`` or ``$current``, then fields."""
    if not varname.startswith("$current") and not lc.funcname:
        raise Fail("", lc.offset, logged=False)          # -EINVAL, nothing logged
    this, rest, arrow = _split_field(lc, varname)
    if not arrow and rest is not None:
        raise lc.err("NOSUP_DAT_ARG", lc.offset + len(this) + 1, E.EOPNOTSUPP)
    if lc.lenient:          # no BTF known yet: a placeholder the booted kernel resolves
        a.ops.append(("btf", varname))
        return BtfVar(varname)
    btf = lc.btf
    tid = 0
    node: FetchArg
    if this == "$current":
        a.ops.append(("current",))
        tid = btf.find("task_struct", KIND_STRUCT) if btf is not None else None
        if tid is None:
            raise lc.err("NO_BTF_ENTRY", errno=E.ENOENT)
        lc.struct_type = btf.type(tid)
        lc.last_type, lc.last_bitoffs, lc.last_bitsize = lc.struct_type, 0, 0
        node = Current()
    elif lc.flags & FL_RETURN and this == "$retval":
        a.ops.append(("retval",))
        node = RetVal()
        if lc.query_btf() == 0:
            assert lc.proto is not None
            if lc.proto[0] == 0:
                raise lc.err("NO_RETVAL", errno=E.ENOENT)
            tid = lc.proto[0]
        else:
            if rest is not None:
                raise lc.err("NO_BTF_ENTRY", lc.offset + len(this) + 2, E.ENOENT)
            return node
    else:
        if lc.query_btf() < 0 or not lc.params:
            raise lc.err("NO_BTF_ENTRY", errno=E.ENOENT)
        for i, p in enumerate(lc.params):
            if p.name == this:
                if lc.is_entry:
                    a.ops.append(("arg", i + lc.arg_shift))
                    node = FuncArg(i + 1)
                else:
                    a.ops.append(("edata", i))
                    if i not in lc.entry_args:
                        lc.entry_args.append(i)
                    node = EntryArg(i + 1)
                tid = p.type
                break
        else:
            raise lc.err("NO_BTFARG", errno=E.ENOENT)
    if this != "$current":
        assert btf is not None
        tid, t = btf.skip_modifiers(tid)
        if t is None:
            raise lc.err("BAD_BTF_TID")
        lc.last_type, lc.last_bitoffs, lc.last_bitsize = t, 0, 0
    if rest is not None:
        lc.offset += len(this) + 2
        node = _btf_field(lc, rest, tid, a, node)
    return node


# ---------------------------------------------------------------- $variables

def _event_field(lc: LineContext, name: str, a: _Arg, bare: bool = False) -> FetchArg | None:
    """``parse_trace_event_arg()``: ``name`` among the attached event's fields
    (``FETCH_OP_TP_ARG``), or None. Before the kernel is known any name is taken."""
    if lc.event_fields is None:
        a.ops.append(("tp_arg", name, None, 8, False, "int"))
        return EventField(name, bare)
    f = lc.event_fields.get(name)
    if f is None:
        return None
    a.ops.append(("tp_arg", name, f.offset, f.size, bool(f.signed), field_kind(f.decl)))
    return EventField(name, bare)


def _vars(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    """``parse_probe_vars()`` (6.12) / 7.3's split of it; ``arg`` starts at ``$``."""
    v = arg[1:]
    r = lc.rules
    if lc.flags & FL_TEVENT:
        # parse_probe_vars() (6.12) / 7.3's: an event field first, then $comm, nothing else
        node = _event_field(lc, v, a)
        if node is not None:
            return node
        if v in ("comm", "COMM"):
            a.ops.append(("comm",))
            return Comm()
        raise lc.err("BAD_VAR")
    if r.current_var and v in ("comm", "COMM"):         # 7.3 checks $comm first
        a.ops.append(("comm",))
        return Comm()
    if v.startswith("retval"):
        if not lc.flags & FL_RETURN:
            raise lc.err("RETVAL_ON_PROBE")
        if lc.flags & FL_USER or not r.btf_args:
            a.ops.append(("retval",))
            return RetVal()
        return _btf_arg(lc, arg, a)
    if v.startswith("stack"):
        rest = v[5:]
        if rest == "":
            a.ops.append(("stackp",))
            return StackPointer()
        if rest[:1].isascii() and rest[:1].isdigit():
            n = kstrtoul(rest, 10)
            if n is None:
                raise lc.err("BAD_VAR")
            if lc.flags & FL_KERNEL and n > PARAM_MAX_STACK:
                raise lc.err("BAD_STACK_NUM")
            a.ops.append(("stack", n))
            return StackEntry(n)
        raise lc.err("BAD_VAR")
    if v in ("comm", "COMM"):
        a.ops.append(("comm",))
        return Comm()
    if r.current_var and v.startswith("current"):
        if not lc.flags & FL_KERNEL:
            raise lc.err("BAD_VAR")
        tail = v[7:]
        if tail[:1] == "-" and r.btf_args:
            return _btf_arg(lc, arg, a)
        if tail != "":
            raise lc.err("BAD_VAR")
        a.ops.append(("current",))
        return Current()
    if v.startswith("arg"):
        n = kstrtoul(v[3:], 10)
        if n is None and lc.lenient and v == "arg*":
            a.ops.append(("btf", arg))          # $arg* before a kernel's BTF is known
            return BtfVar(arg)
        if n is None:
            raise lc.err("BAD_VAR")
        if n == 0 or n > PARAM_MAX_STACK:
            raise lc.err("BAD_ARG_NUM")
        if lc.is_entry:
            a.ops.append(("arg", n - 1 + lc.arg_shift))
            return FuncArg(n)
        if lc.is_return and r.entry_args_on_return:
            a.ops.append(("edata", n - 1))
            if n - 1 not in lc.entry_args:
                lc.entry_args.append(n - 1)
            return EntryArg(n)
        raise lc.err("NOFENTRY_ARGS")
    raise lc.err("BAD_VAR")


# ---------------------------------------------------------------- the leaf and nesting

def _imm(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    if arg[1:2] == '"':
        body = arg[2:]
        if body == "" or not body.endswith('"'):
            raise lc.err("IMMSTR_NO_CLOSE", lc.offset + 2 + len(body))
        a.ops.append(("data", body[:-1]))
        return ImmString(body[:-1])
    t = arg[1:]
    v = (kstrtoul(t) if t[:1].isascii() and t[:1].isdigit() else
         kstrtol(t) if t[:1] == "-" else kstrtol(t[1:]) if t[:1] == "+" else None)
    if v is None:
        raise lc.err("BAD_IMM", lc.offset + 1)
    a.ops.append(("imm", v & _M))
    return Imm(v)


def _mem(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    """``@ADDR``, ``@+OFFS`` (uprobes), ``@SYM[+|-OFFS]``."""
    node: FetchArg
    if arg[1:2].isascii() and arg[1:2].isdigit():
        addr = kstrtoul(arg[1:])
        if addr is None:
            raise lc.err("BAD_MEM_ADDR")
        a.ops.append(("imm", addr))
        node = MemAddr(addr)
    elif arg[1:2] == "+":
        if lc.flags & FL_KERNEL:
            raise lc.err("FILE_ON_KPROBE")
        off = kstrtol(arg[2:])
        if off is None:
            raise lc.err("BAD_FILE_OFFS")
        a.ops.append(("foffs", off & _M))
        node = FileOffset(off)
    else:
        if not lc.flags & FL_KERNEL:
            raise lc.err("SYM_ON_UPROBE")
        data = arg[1:]
        cut = next((i for i, c in enumerate(data) if c in "+-"), len(data))
        off = kstrtol(data[cut:]) if cut < len(data) else 0
        node = MemSymbol(data[:cut], off) if off is not None else MemSymbol(data)
        a.ops.append(("nop_symbol", data))
        a.push(lc, ("imm", None))
    a.push(lc, ("deref", 0))
    return node


def _leaf(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    n = len(a.ops)
    c = arg[:1]
    node: FetchArg | None = None
    if c == "$":
        node = _vars(lc, arg, a)
    elif c == "%" and lc.flags & (FL_TEVENT | FL_FPROBE):
        # parse_probe_arg(): "eprobe and fprobe do not handle registers". 7.3 returns
        # BAD_VAR; 6.12 logs BAD_VAR, breaks out with ret 0, and the empty fetch logs
        # BAD_FETCH_ARG after it (error_log's last entry, as the guest shows it).
        raise lc.err(lc.rules.fprobe_reg_error)
    elif c == "%":
        if arg[1:] not in REGISTERS:
            raise lc.err("BAD_REG_NAME")
        a.ops.append(("reg", arg[1:]))
        node = Reg(arg[1:])
    elif c == "@":
        node = _mem(lc, arg, a)
    elif c == "\\":
        node = _imm(lc, arg, a)
    elif c.isascii() and (c.isalpha() or c == "_") and lc.flags & FL_TEVENT and \
            lc.rules.eprobe == "bare":
        # 7.3's parse_probe_arg_default(): a bare name is an event field
        node = _event_field(lc, arg, a, bare=True)
        if node is None:
            raise lc.err("NO_EVENT_FIELD")
    elif c.isascii() and (c.isalpha() or c == "_"):
        if not lc.is_entry and not lc.is_return:
            raise lc.err("NOSUP_BTFARG")
        if not lc.rules.btf_args:
            raise lc.err("NOSUP_BTFARG", errno=E.EOPNOTSUPP)
        node = _btf_arg(lc, arg, a)
    if node is None or len(a.ops) == n:
        raise lc.err("BAD_FETCH_ARG")
    return node


def _deref_head(lc: LineContext, arg: str) -> tuple[str, int, bool, int]:
    """``+|-[u]OFFS(`` of a dereference: (the inner text, offset, user, inner's
    ``ctx->offset``). The kernel's offset arithmetic is kept as it is: for ``+u``/``-u``
    the inner offset comes out one short (the ``u`` is not counted)."""
    user = arg[1:2] == "u"
    s = arg[0] + arg[2:] if user else arg
    if s[:1] == "+":
        s = s[1:]
    lp = s.find("(")
    if lp < 0:
        raise lc.err("DEREF_NEED_BRACE")
    off = kstrtol(s[:lp])
    if off is None:
        raise lc.err("BAD_DEREF_OFFS")
    ioff = lc.offset + lp + 1 + (1 if s[:1] != "-" else 0)
    inner = s[lp + 1:]
    rp = inner.rfind(")")
    if rp < 0:
        raise lc.err("DEREF_OPEN_BRACE", ioff + len(inner))
    return inner[:rp], off, user, ioff


def _parse_6_12(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    """6.12's recursive ``parse_probe_arg()``."""
    if arg[:1] in ("+", "-"):
        inner, off, user, ioff = _deref_head(lc, arg)
        lc.offset = ioff
        base = _parse_6_12(lc, inner, a)
        lc.offset = ioff
        if a.ops[-1][0] in ("comm", "data"):
            raise lc.err("COMM_CANT_DEREF")
        a.push(lc, ("uderef" if user else "deref", off))
        lc.last_type = None
        return Deref(off, base, user)
    return _leaf(lc, arg, a)


def _match_paren(s: str, start: int) -> int:
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "(":
            depth += 1
        elif s[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _parse_7_3(lc: LineContext, arg: str, a: _Arg) -> FetchArg:
    """7.3's loop: ``parse_probe_arg_nested()``, ``parse_probe_arg_leaf()``,
    ``unwind_parse_states()``."""
    stack: list[tuple] = []
    while arg[:1] in ("+", "-", "(") or arg.startswith((_THIS_CPU_PTR, _THIS_CPU_READ)):
        if len(stack) >= (lc.rules.max_nested or 8):
            raise lc.err("TOO_MANY_NESTED", errno=E.E2BIG)
        if arg[:1] in ("+", "-"):
            inner, off, user, ioff = _deref_head(lc, arg)
            lc.offset = ioff
            stack.append(("deref", "uderef" if user else "deref", off, ioff, inner, False))
            arg = inner
        elif arg[:1] == "(":
            st, arg = _typecast_head(lc, arg)
            stack.append(st)
        else:
            # parse_this_cpu(): kernel probes only, and not event probes ("event data
            # pointer should not be recorded by events")
            if not lc.flags & FL_KERNEL or lc.flags & FL_TEVENT:
                raise lc.err("NOSUP_PERCPU")
            read = arg.startswith(_THIS_CPU_READ)
            n = len(_THIS_CPU_READ if read else _THIS_CPU_PTR)
            arg, lc.offset = arg[n:], lc.offset + n
            rp = arg.rfind(")")
            if rp < 0:
                raise lc.err("DEREF_OPEN_BRACE", lc.offset + len(arg))
            arg = arg[:rp]
            stack.append(("deref", "cpu_ptr", 0, lc.offset, arg, read))
    node = _leaf(lc, arg, a)
    while stack:
        st = stack.pop()
        if st[0] == "deref":
            _, op, off, cur, inner, read = st
            lc.offset = cur
            if a.ops[-1][0] in ("comm", "data"):
                raise lc.err("COMM_CANT_DEREF")
            if op == "cpu_ptr" and inner[:1] == "@":
                a.ops[-1] = ("cpu_ptr",)            # replaces @SYM's FETCH_OP_DEREF
            else:
                a.push(lc, ("cpu_ptr",) if op == "cpu_ptr" else (op, off))
            lc.last_type = None
            if read:
                a.push(lc, ("deref", 0))
            node = PerCpu(node, read) if op == "cpu_ptr" else Deref(off, node, op == "uderef")
        else:
            _, casttype, fieldname, orig, diff = st
            if lc.lenient:      # no BTF known yet: the booted kernel resolves the cast
                a.ops.append(("btf", f"({casttype})...->{fieldname}"))
                node = BtfVar(f"({casttype})->{fieldname}")
                continue
            lc.struct_type = None
            lc.offset = orig + 1
            _casttype(lc, casttype)
            lc.offset = orig + diff
            assert lc.struct_type is not None
            node = _btf_field(lc, fieldname, lc.struct_type.id, a, node)
            lc.prefix_byteoffs = 0
    return node


def _typecast_head(lc: LineContext, arg: str) -> tuple[tuple, str]:
    """``handle_typecast()``: ``(STRUCT[,FIELD])VAR->...``; returns the state and the
    inner argument."""
    orig = lc.offset
    # 7.3: tparg_is_event_probe() || tparg_is_function_entry() || ..._return()
    if not (lc.is_entry or lc.is_return or lc.flags & FL_TEVENT and lc.rules.eprobe == "bare"):
        raise lc.err("NOSUP_BTFARG", errno=E.EOPNOTSUPP)
    rp = arg.find(")")
    if rp < 0:
        raise lc.err("DEREF_OPEN_BRACE", lc.offset + len(arg))
    casttype, tmp = arg[1:rp], arg[rp + 1:]
    lc.offset += rp + 1
    tstart = rp + 1                           # tmp's index in arg
    if tmp[:1] == "(":
        close = _match_paren(tmp, 0)
        if close < 0:
            raise lc.err("DEREF_OPEN_BRACE")
        if tmp[close + 1:close + 3] != "->":
            raise lc.err("TYPECAST_REQ_FIELD", lc.offset + close + 1)
        lc.offset += 1
        inner, fstart = tmp[1:close], tstart + close + 3
    elif tmp[:1] in ("+", "-") or tmp.startswith((_THIS_CPU_PTR, _THIS_CPU_READ)):
        op = tmp.find("(", 1)
        if op < 0:
            raise lc.err("DEREF_NEED_BRACE")
        close = _match_paren(tmp, op)
        if close < 0:
            raise lc.err("DEREF_OPEN_BRACE", lc.offset + len(tmp))
        close += 1
        if tmp[close:close + 2] != "->":
            raise lc.err("TYPECAST_REQ_FIELD", lc.offset + close)
        inner, fstart = tmp[:close], tstart + close + 2
    else:
        if tmp[:1] == "@":
            c = next((i for i, ch in enumerate(tmp) if ch in "+-"), -1)
            if c >= 0 and tmp[c + 1:c + 2].isdigit():
                raise lc.err("TYPECAST_SYM_OFFSET")
        close = tmp.find("-")
        if close < 0 or tmp[close + 1:close + 2] != ">":
            raise lc.err("TYPECAST_REQ_FIELD", lc.offset + len(tmp))
        inner, fstart = tmp[:close], tstart + close + 2
    return ("cast", casttype, arg[fstart:], orig, fstart), inner


def _casttype(lc: LineContext, casttype: str) -> None:
    """``parse_btf_casttype()``: the struct, and a ``,FIELD`` option (container_of)."""
    name, comma, fld = casttype.partition(",")
    btf = lc.btf
    tid = btf.find(name, KIND_STRUCT) if btf is not None else None
    if tid is None:
        raise lc.err("NO_PTR_STRCT")
    lc.struct_type = btf.type(tid)
    if comma:
        lc.offset += len(name) + 1
        bits, rest, _ = _field_bits(lc, fld, tid)
        if bits % 8:
            raise lc.err("TYPECAST_NOT_ALIGNED")
        if rest is not None:
            raise lc.err("TYPECAST_BAD_ARROW", lc.offset - 2)
        lc.prefix_byteoffs = bits // 8
        lc.struct_type = btf.type(tid)


# ---------------------------------------------------------------- one argument

def _arg_type(lc: LineContext, body: str) -> tuple[str, str | None, int, int, str]:
    """``parse_probe_arg_type()``: (the fetch part, the type text, array count, the type's
    offset in the body, the resolved type name)."""
    arg, tstr, count, toff = body, None, 0, 0
    colon = body.find(":")
    if colon >= 0:
        arg, tstr = body[:colon], body[colon + 1:]
        toff = colon
        lb = tstr.find("[")
        if lb >= 0:
            inside, npos = tstr[lb + 1:], colon + 1 + lb + 1
            tstr = tstr[:lb]
            rb = inside.find("]")
            if rb < 0:
                raise lc.err("ARRAY_NO_CLOSE", lc.offset + len(body))
            if inside[rb + 1:]:
                raise lc.err("BAD_ARRAY_SUFFIX", lc.offset + npos + rb + 1)
            n = kstrtoul(inside[:rb])
            if n is None or n == 0 or n > _UINT_MAX:
                raise lc.err("BAD_ARRAY_NUM", lc.offset + npos)
            if n > MAX_ARRAY_LEN:
                raise lc.err("ARRAY_TOO_BIG", lc.offset + npos)
            count = n
    if not lc.flags & FL_TEVENT and (arg in ("$comm", "$COMM") or arg.startswith('\\"')):
        if count or (tstr is not None and tstr != "string"):
            if lc.rules.comm_type_logged:
                raise lc.err("NEED_STRING_TYPE", lc.offset + (colon + 1 if colon >= 0 else 0))
            raise Fail("", 0, logged=False)
        tname: str | None = "string"
    else:
        tname = find_fetch_type(tstr, lc)
    if tname is None:
        raise lc.err("BAD_TYPE", lc.offset + (colon + 1 if colon >= 0 else 0))
    return arg, tstr, count, toff, tname


def _bitfield(t: str, size: int) -> Bitfield | None:
    """``__parse_bitfield_probe_arg()``."""
    bw, i = simple_strtoul(t, 1)
    if bw == 0 or t[i:i + 1] != "@":
        return None
    bo, j = simple_strtoul(t, i + 1)
    if j == i + 1 or t[j:j + 1] != "/":
        return None
    return Bitfield(bw, bo, size * 8)


def parse_body(lc: LineContext, body: str, size: list[int]
               ) -> tuple[FetchArg, str, int, Bitfield | None, bool, tuple]:
    """``traceprobe_parse_probe_arg_body()``: (fetch, type, count, bitfield, explicit type,
    code). ``lc.offset`` is the body's offset in the argument on entry."""
    r = lc.rules
    if len(body) > r.max_argstr_len:
        raise lc.err("ARG_TOO_LONG", errno=E.E2BIG)
    if body == "":
        raise lc.err("NO_ARG_BODY")
    arg, tstr, count, toff, tname = _arg_type(lc, body)
    if tstr is not None:
        toff += 1           # type - arg: the type text starts after ':'
    lc.last_type, lc.struct_type = None, None
    a = _Arg()
    fetch = (_parse_7_3 if r.max_nested else _parse_6_12)(lc, arg, a)
    if r.btf_args and lc.last_type is not None and not lc.lenient:
        if tstr is None:
            tname = _type_from_btf(lc) or "x64"
        elif "string" in tstr and _string_from_btf(lc, tstr, a):
            # the tree says what the code does: the char * is read once more (the
            # module backend compiles the tree)
            fetch = Deref(0, fetch, tstr.startswith("u"))
    ftype = FETCH_TYPES[tname]
    size[0] += ftype.size * (count or 1)
    if size[0] > MAX_PROBE_EVENT_SIZE:
        raise lc.err("EVENT_TOO_BIG", errno=E.E2BIG)
    if lc.lenient and any(op[0] == "btf" for op in a.ops):
        # Its type and store depend on BTF not known yet: the booted kernel decides.
        return fetch, tname, count, None, tstr is not None, tuple(a.ops) + (("end",),)
    bitfield = _finalize(lc, a, tname, count, tstr, toff if tstr is not None else 0)
    ops = [(_UPROBE_OPS.get(op[0], op[0]),) + op[1:] for op in a.ops] \
        if lc.flags & FL_USER else a.ops
    return fetch, tname, count, bitfield, tstr is not None, tuple(ops) + (("end",),)


def _string_from_btf(lc: LineContext, tstr: str, a: _Arg) -> bool:
    """``check_prepare_btf_string_fetch()``: a ``char *`` is dereferenced once more (True),
    a ``char []`` is taken as it is, anything else is refused."""
    btf, t = lc.btf, lc.last_type
    if btf is None or t is None:
        return False
    if t.kind == KIND_ARRAY and _is_char(btf, t.extra[0]):
        return False
    # btf_type_is_char_ptr() (kernel/trace/trace_probe.c, 6.12 and 7.3) reads
    # type->type without checking that the type is a pointer: for an INT, STRUCT, UNION
    # or ENUM that field is its size, taken as a type id. Where BTF id 8 is an unsigned
    # 8-bit int (both kernels' vmlinux), a string of something 8 bytes wide (`$retval`
    # of a function returning long) is accepted and the value dereferenced as a char *;
    # an int (id 4) is refused. Seen in the guests: `r vfs_read $retval:ustring` is taken
    # by 6.12 and 7.3, `r do_sys_openat2 ...` by 6.12 only (7.3's returns int).
    if _is_char(btf, t.ref):
        if len(a.ops) >= FETCH_INSN_MAX - 2:
            raise lc.err("TOO_MANY_OPS", errno=E.E2BIG)
        a.ops.append(("uderef" if tstr.startswith("u") else "deref", 0))
        return True
    raise lc.err("BAD_TYPE4STR")


def _finalize(lc: LineContext, a: _Arg, tname: str, count: int, tstr: str | None,
              toff: int) -> Bitfield | None:
    """``finalize_fetch_insn()``: the store, a bitfield, an array loop."""
    ops = a.ops
    last = ops[-1][0]
    ftype = FETCH_TYPES[tname]
    tpos = lc.offset + toff
    if ftype.is_string:
        symstr = tname == "symstr"
        allowed = (("reg", "stack", "retval", "arg", "deref", "tp_arg") if symstr else
                   ("deref", "uderef", "imm", "comm", "data", "tp_arg"))
        if last not in allowed:
            raise lc.err("BAD_SYMSTRING" if symstr else "BAD_STRING", tpos)
        if symstr or last in ("imm", "comm", "data", "tp_arg") or count:
            a.push(lc, ("nop",))
        cur = ops[-1]
        off = cur[1] if cur[0] in ("deref", "uderef") else 0
        op = ("st_ustring" if tname == "ustring" or cur[0] == "uderef" else
              "st_symstr" if symstr else "st_string")
        ops[-1] = (op, off)
    elif last in ("deref", "uderef"):
        ops[-1] = ("st_mem" if last == "deref" else "st_umem", ops[-1][1], ftype.size)
    else:
        if len(ops) >= FETCH_INSN_MAX - 1:
            raise lc.err("TOO_MANY_OPS", errno=E.E2BIG)
        ops.append(("st_raw", 0, ftype.size))
    store = ops[-1][0]
    bitfield = None
    if tstr is not None:
        if tstr.startswith("b"):
            bitfield = _bitfield(tstr, ftype.size)
            bits = ftype.size * 8
            if bitfield is None or len(ops) >= FETCH_INSN_MAX - 1:
                raise lc.err("BAD_BITFIELD", tpos)
            ops.append(("mod_bf", ftype.size, bits - (bitfield.width + bitfield.offset),
                        bits - bitfield.width))
            if bits < bitfield.width + bitfield.offset:
                raise lc.err("BAD_BITFIELD", tpos)
    elif lc.rules.btf_args and lc.last_type is not None and not lc.lenient:
        if not (lc.last_bitsize % 8 == 0 and lc.last_bitoffs == 0):   # parse_btf_bitfield()
            a.push(lc, ("mod_bf", 8, 64 - (lc.last_bitsize + lc.last_bitoffs),
                        64 - lc.last_bitsize))
            bitfield = Bitfield(lc.last_bitsize, lc.last_bitoffs, 64)
    if count:
        if store not in ("st_mem", "st_string", "st_ustring"):
            raise lc.err("BAD_STRING", tpos)
        a.push(lc, ("lp_array", count))
    return bitfield


def generate_name(lc: LineContext, tok: str, index: int) -> str:
    """``generate_probe_arg_name()``: with BTF arguments an unnamed ``file:x64`` is named
    ``file`` when that is a good name; else ``arg<N>``."""
    if lc.rules.btf_args:
        name = tok.split(":", 1)[0]
        if is_good_name(name):
            return name
    return f"arg{index + 1}"


def parse_arg(lc: LineContext, tok: str, index: int, used: tuple[str, ...],
              size: list[int]) -> tuple[str, tuple, bool]:
    """``traceprobe_parse_probe_arg()`` for the ``index``-th argument ``tok``: (name, the
    ``parse_body()`` tuple, whether the name was written)."""
    eq = tok.find("=")
    if eq >= 0:
        if eq > MAX_ARG_NAME_LEN:
            raise lc.err("ARG_NAME_TOO_LONG", 0)
        if eq == 0:
            raise lc.err("NO_ARG_NAME", 0)
        name, body, boff = tok[:eq], tok[eq + 1:], eq + 1
    else:
        name, body, boff = generate_name(lc, tok, index), tok, 0
    if not is_good_name(name):
        raise lc.err("BAD_ARG_NAME", 0)
    if name in _RESERVED or name in used:
        raise lc.err("USED_ARG_NAME", 0)
    lc.offset = boff
    return name, parse_body(lc, body, size), eq >= 0


# ---------------------------------------------------------------- whole-line expansions

def expand_meta_args(lc: LineContext, args: list[str]) -> list[tuple[int, str]]:
    """``traceprobe_expand_meta_args()``: ``$arg*`` becomes every parameter's name and a
    bare ``$argN[:TYPE]`` the N-th name, from the function's BTF. Returns (the index of the
    original argument the kernel logs against, text) per argument."""
    out = [(i, a) for i, a in enumerate(args)]
    if not lc.rules.btf_args:
        return out
    star, found, last = -1, False, 0
    for i, a in enumerate(args):           # argv_has_var_arg()
        if not a.startswith("$arg"):
            continue
        last = i
        if not lc.is_entry and not lc.is_return:
            raise Fail(lc.rules.message("NOFENTRY_ARGS"), 0, index=i)
        if a[4:5].isascii() and a[4:5].isdigit():
            found = True
            continue
        if a[4:5] != "*":
            raise Fail(lc.rules.message("BAD_VAR"), 0, index=i)
        if star >= 0:
            raise Fail(lc.rules.message("DOUBLE_ARGS"), 0, index=i)
        found, star = True, i
    if not found:
        return out
    if lc.lenient:
        return out
    if lc.query_btf() < 0 or not lc.params:
        if star != -1:
            raise Fail(lc.rules.message("NOSUP_BTFARG"), 0, E.EOPNOTSUPP, index=last)
        return out
    new: list[tuple[int, str]] = []
    used = 0

    def nth(i: int, n: int, suffix: str) -> str:
        nonlocal used
        if n >= len(lc.params):
            raise Fail(lc.rules.message("NO_BTFARG"), 0, E.ENOENT, index=i)
        text = lc.params[n].name + suffix
        if len(text) >= MAX_BTF_ARGS_LEN - used:
            raise Fail(lc.rules.message("ARGS_2LONG"), 0, E.E2BIG, index=i)
        used += len(text) + 1
        return text

    for i, a in enumerate(args):
        if i == star:
            new += [(i, nth(i, n, "")) for n in range(len(lc.params))]
        elif a.startswith("$arg"):
            n, end = simple_strtoul(a, 4, 10)
            suffix = a[end:]
            if suffix[:1] not in (":", ""):
                raise Fail(lc.rules.message("BAD_VAR"), 0, E.ENOENT, index=i)
            if n == 0:
                raise Fail(lc.rules.message("BAD_ARG_NUM"), 0, index=i)
            new.append((i, nth(i, n - 1, suffix)))
        else:
            new.append((i, a))
    return new


def expand_dentry_args(lc: LineContext, args: list[tuple[int, str]],
                       dentry_name: int, file_dentry: int) -> list[tuple[int, str]]:
    """``traceprobe_expand_dentry_args()``: ``X:%pd`` is ``+0x0(+0xN(X)):string`` (the
    dentry's name), ``X:%pD`` the same through ``struct file``'s ``f_path.dentry``. The
    offsets are that kernel's (``offsetof()``, read from its BTF)."""
    if not lc.rules.dentry_types:
        return args
    out, used = [], 0
    for i, a in args:
        if not (a.endswith(":%pd") or a.endswith(":%pD")):
            out.append((i, a))
            continue
        name, eq, body = a[:-4].partition("=")
        if not eq:
            name, body = "", name
        inner = f"+0x{dentry_name:x}({body})" if a[-1] == "d" else \
            f"+0x{dentry_name:x}(+0x{file_dentry:x}({body}))"
        text = (f"{name}=" if eq else "") + f"+0x0({inner}):string"
        if len(text) >= MAX_DENTRY_ARGS_LEN - used:
            raise Fail("", 0, E.ENOMEM, index=i, logged=False)
        used += len(text) + 1
        out.append((i, text))
    return out
