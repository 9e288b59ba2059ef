"""The shared part of the dynamic-event grammar, as ``kernel/trace/trace_probe.c`` is for
``trace_kprobe.c`` and ``trace_uprobe.c``: the line types, fetch arguments, event names, the
error log.

Pure text in, frozen records out, no I/O (like pygdbmi's ``gdbmiparser.py``); evaluating
fetch args against a stopped vCPU lives in :mod:`harness.kernel.grammar.fetch`. The 6.1 rules
are read from Debian's ``linux-source-6.1`` (6.1.192), the kernel family the default image
boots: ``traceprobe_parse_probe_arg()``, ``traceprobe_parse_probe_arg_body()``,
``parse_probe_arg()``, ``parse_probe_vars()`` and ``traceprobe_parse_event_name()`` in
kernel/trace/trace_probe.c. That 6.1 stable tree has the ``symstr`` type (backported from
6.2) and immediates (``\\IMM``, ``\\"str"``, from 5.14). 6.4 rewrote the argument parser
around a ``struct traceprobe_parse_context``: 6.12's and 7.3's is :mod:`harness.kernel.grammar.args`,
which :func:`context_args` runs for a whole line.

Fetch args keep their spelling, because the kernel keeps it too (``probe_arg.comm``, printed
back by ``trace_kprobe_show()``).

Why this module runs past 600 lines: it follows those kernel functions check by check, so
that every refusal comes with the kernel's wording and a column; the fetch-arg tree, the
evaluation and the trace-file side already live in :mod:`harness.kernel.grammar.fetch`.
"""
from __future__ import annotations

import functools
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import ProbeSpecError
from ..rules import KernelRules, rules_for
from . import args as argp
from .fetch import (FETCH_TYPES, REGISTERS, THREAD_SIZE, Bitfield, Comm, Deref, FetchArg, FetchType,
                    FileOffset, FuncArg, Imm, ImmString, Insn, MemAddr, MemSymbol, Reg, RetVal,
                    StackEntry, StackPointer, register_plan, render_fetch)

log = logging.getLogger(__name__)

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
UINT_MAX = 0xFFFFFFFF
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
                code = _parse_body(render_body(self), FLAG_ANY, [0])[5]
            except ParseFail as exc:
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
    #: an ``f`` line made an exit probe by a ``$retval`` argument, without ``%return``
    #: (trace_fprobe.c: ``parse_symbol_and_return()``)
    implicit_return: bool = field(default=False, compare=False)
    #: an ``e`` line (kernel/trace/trace_eprobe.c): the attached event (system, event),
    #: and its ``if`` filter (``harness.kernel.evfilter.EventFilter``)
    attach: tuple[str, str] | None = None
    filter: Any = None

    def __post_init__(self) -> None:
        if not self.event and self.kind != "-":
            if self.path is not None:
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
        return self.kind == "r" or self.return_suffix or self.implicit_return

    @property
    def is_fprobe(self) -> bool:
        """An ``f`` or ``t`` line (fprobe event or tracepoint probe,
        ``kernel/trace/trace_fprobe.c``): ``symbol`` is then an ftrace filter, probed at each
        matching function's ftrace location, or a tracepoint, probed at its stub's."""
        return self.kind in ("f", "t")

    @property
    def is_eprobe(self) -> bool:
        """An ``e`` line: an event probe on the trace event ``attach``."""
        return self.kind == "e"

    @property
    def is_tprobe(self) -> bool:
        """A ``t`` line: ``symbol`` is a tracepoint."""
        return self.kind == "t"

    @property
    def symbol_name(self) -> str | None:
        if self.symbol is None:
            return None
        return f"{self.module}:{self.symbol}" if self.module is not None else self.symbol

    @functools.cached_property
    def ret_ip_args(self) -> tuple[str, ...]:
        """A return probe's arguments whose value starts from ``%ip``: the return address
        (``__kretprobe_trampoline_handler()`` / ``handle_trampoline()`` set ``regs->ip``
        to the saved one before the handlers run). Where a host-side return probe
        hijacked the same call first, the guest's saved one is the host trampoline, and so
        is every value it fetches from there (``harness.diff.verdict``'s ``trampoline`` rule)."""
        if not self.is_return:
            return ()
        return tuple(a.name for a in self.args if a.code and a.code[0] == ("reg", "ip"))

    @functools.cached_property
    def slot_args(self) -> tuple[str, ...]:
        """An entry probe's arguments that read the word at the probed sp: ``$stack0``,
        ``+0($stack)``, ``+0(%sp)``. At a function's entry that word is the return-address
        slot, which a return probe on the same call may have hijacked before this probe's
        handler read it (``harness.diff.rules``' ``trampoline`` rule)."""
        if self.is_return:
            return ()
        return tuple(a.name for a in self.args if len(a.code) >= 2 and (
            a.code[0] == ("stack", 0)
            or (a.code[0] in (("stackp",), ("reg", "sp")) and a.code[1][:2] == ("st_mem", 0))))

    @functools.cached_property
    def mem_args(self) -> tuple[str, ...]:
        """The arguments whose value comes from memory, read at the hit: a dereference,
        a store from memory or a string, ``$stackN``, ``$argN`` past the sixth, ``$comm``.
        Memory another context writes can change between the host's read (at its
        breakpoint) and the guest's (in its handler, later): ``harness.diff.rules``'
        ``raced`` rule looks at these only, never at a register."""
        mem = {"stack", "ustack", "comm", "deref", "uderef", "cpu_ptr", "st_mem", "st_umem",
               "st_string", "st_ustring", "st_string_uprobe"}
        return tuple(a.name for a in self.args if any(
            op[0] in mem or (op[0] == "arg" and op[1] >= 6) for op in a.code))

    @functools.cached_property
    def flags_args(self) -> frozenset[int]:
        """The indexes of the arguments that fetch ``%flags`` (the plugin engine cannot
        know them: ``harness.backends.plugin``)."""
        return frozenset(i for i, a in enumerate(self.args)
                         if isinstance(a.fetch, Reg) and a.fetch.name == "flags")

    @functools.cached_property
    def register_plan(self) -> Any:
        """``harness.kernel.grammar.fetch.register_plan`` of the arguments (None: one of
        them reads memory or is not a plain register fetch), worked out once a spec
        (these properties are computed at the first hit and kept: the spec is frozen)."""
        return register_plan(self.args)



# ---------------------------------------------------------------- numbers (lib/kstrtox.c)

# lib/kstrtox.c, as harness.kernel.grammar.common holds it (one copy for every kernel's parser)
kstrtoul = argp.kstrtoul
kstrtol = argp.kstrtol


def _simple_strtoul(s: str, start: int) -> tuple[int, int]:
    """``simple_strtoul(s + start, &end, 0)``: (value mod 2**64, index of ``end``)."""
    return argp.simple_strtoul(s, start)


def split_symbol_offset(data: str) -> tuple[str, int | None]:
    """``traceprobe_split_symbol_offset()`` (kernel/trace/trace_probe.c): the text before
    the first ``+`` or ``-`` and ``kstrtol()`` of the rest from that sign on (0 without
    one); the offset is None where the kernel returns -EINVAL."""
    cut = next((i for i, ch in enumerate(data) if ch in "+-"), len(data))
    return data[:cut], (kstrtol(data[cut:]) if cut < len(data) else 0)


def is_good_name(name: str, hash_ok: bool = False) -> bool:
    """``__is_good_name()`` in kernel/trace/trace.h: a C identifier (``-`` too for groups)."""
    extra = "_-" if hash_ok else "_"
    return (name != "" and (name[0].isascii() and name[0].isalpha() or name[0] in extra)
            and all(c.isascii() and c.isalnum() or c in extra for c in name[1:]))



# ---------------------------------------------------------------- the error log

#: The ``trace_probe_log_init()`` name of each parser (kernel/trace/trace_kprobe.c,
#: trace_uprobe.c, trace_fprobe.c, trace_eprobe.c; 6.1, 6.12 and 7.3), by line family
#: (``k`` p/r, ``u`` uprobe, ``f`` f/t, ``e``): what its ``error_log`` entries start with.
SUBSYSTEM = {"k": "trace_kprobe", "u": "trace_uprobe", "f": "trace_fprobe",
             "e": "event_probe"}
#: kernel/trace/trace_events_filter.c: ``append_filter_err()`` (an ``e`` line's filter;
#: its command is the filter alone)
FILTER_SUBSYSTEM = "event filter parse error"
#: kernel/trace/trace_dynevent.c: ``create_dyn_event()`` (7.3: no kind took the line)
DYNEVENT_SUBSYSTEM = "dynevent"


def line_subsystem(words: list[str]) -> str:
    """The parser a line's words go to (``create_dyn_event()`` tries each kind;
    ``kprobe_events`` and ``uprobe_events`` take their own), by the name it logs under."""
    kind = words[0][:1] if words else ""
    if kind in ("f", "t"):
        return SUBSYSTEM["f"]
    if kind == "e":
        return SUBSYSTEM["e"]
    if kind in ("p", "r") and len(words) > 1 and "/" in words[1]:
        return SUBSYSTEM["u"]
    return SUBSYSTEM["k"]


# ---------------------------------------------------------------- parsing

class ParseFail(Exception):
    """A parse error at ``pos`` in the token being parsed, worded as the kernel's ``ERRORS``
    list in trace_probe.h words it (or, where the kernel logs nothing, as ours)."""

    def __init__(self, msg: str, pos: int, errno: int = 22, logged: bool = True,
                 words: list[str] | None = None, subsystem: str = "") -> None:
        super().__init__(msg)
        self.pos = pos
        self.errno = errno
        self.logged = logged
        #: who logs it when not the parser of the line's kind (:func:`line_subsystem`):
        #: an event filter, 7.3's ``dynevent``
        self.subsystem = subsystem
        #: the words the kernel's log holds when they are not the line's own (then ``pos``
        #: is a column of those words joined by single spaces)
        self.words = words


FLAG_RETURN, FLAG_FENTRY = 1, 4          # TPARG_FL_RETURN, TPARG_FL_FENTRY (KERNEL always set)
FLAG_ANY = 8                             # ours: accept $retval and $argN (compiling only)
FLAG_UPROBE = 16                         # ours: a uprobe_events line (TPARG_FL_KERNEL clear)
#: How trace_uprobe.c's process_fetch_insn() differs: every memory access is
#: copy_from_user(), $stackN is get_user_stack_nth(), strings strncpy_from_user().
_UPROBE_OPS = {"deref": "uderef", "st_mem": "st_umem", "stack": "ustack",
               "st_string": "st_string_uprobe", "st_ustring": "st_string_uprobe"}


def _push(ops: list[Insn], insn: Insn, pos: int,
          msg: str = "Dereference is too much nested") -> None:
    # Slot FETCH_INSN_MAX - 1 holds FETCH_OP_END, so a 16th instruction cannot be added.
    if len(ops) >= FETCH_INSN_MAX - 1:
        raise ParseFail(msg, pos)
    ops.append(insn)


def _parse_var(s: str, pos: int, flags: int) -> tuple[FetchArg, Insn]:
    """``parse_probe_vars()``: ``s`` is the text after ``$``, ``pos`` where ``$`` is."""
    if s == "retval":
        if not flags & (FLAG_RETURN | FLAG_ANY):
            raise ParseFail("$retval is not available on probe", pos)
        return RetVal(), ("retval",)
    if s.startswith("stack"):
        rest = s[5:]
        if rest == "":
            return StackPointer(), ("stackp",)
        n = kstrtoul(rest, 10) if rest[0].isascii() and rest[0].isdigit() else None
        if n is None:
            raise ParseFail("Invalid $-variable specified", pos)
        if n > PARAM_MAX_STACK:
            raise ParseFail("Invalid stack number", pos)
        return StackEntry(n), ("stack", n)
    if s in ("comm", "COMM"):
        return Comm(), ("comm",)
    if flags in (FLAG_FENTRY, FLAG_ANY) and s.startswith("arg"):  # flags == KERNEL|FENTRY
        n = kstrtoul(s[3:], 10)
        if n is None:
            raise ParseFail("Invalid $-variable specified", pos)
        if n == 0 or n > PARAM_MAX_STACK:
            raise ParseFail("Invalid argument number", pos)
        return FuncArg(n), ("arg", n - 1)
    raise ParseFail("Invalid $-variable specified", pos)


def _parse_fetch(s: str, pos: int, flags: int, ops: list[Insn]) -> FetchArg:
    """``parse_probe_arg()``: build the tree and the kernel's instruction list together."""
    c = s[:1]
    if c == "$":
        var, insn = _parse_var(s[1:], pos, flags)
        ops.append(insn)
        return var
    if c == "%":
        if s[1:] not in REGISTERS:
            raise ParseFail("Invalid register name", pos)
        ops.append(("reg", s[1:]))
        return Reg(s[1:])
    if c == "@":
        if s[1:2].isascii() and s[1:2].isdigit():
            addr = kstrtoul(s[1:])
            if addr is None:
                raise ParseFail("Invalid memory address", pos)
            node: FetchArg = MemAddr(addr)
            ops.append(("imm", addr))
        elif s[1:2] == "+":
            if not flags & FLAG_UPROBE:
                raise ParseFail("File offset is not available with kprobe", pos)
            foff = kstrtol(s[2:])
            if foff is None:
                raise ParseFail("Invalid file offset value", pos)
            node = FileOffset(foff)
            ops.append(("foffs", foff & _MASK64))
        elif flags & FLAG_UPROBE:
            raise ParseFail("Symbol is not available with uprobe", pos)
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
            raise ParseFail("Dereference needs a brace", pos)
        off = kstrtol(rest[:lp] if c == "+" else "-" + rest[:lp])
        if off is None:
            raise ParseFail("Invalid dereference offset", pos)
        # parse_probe_arg() (6.1): for "+u"/"-u" it overwrites the 'u' with the sign and
        # steps over it, then adds (tmp + 1 - arg) + (arg[0] != '-') to the offset: the
        # 'u' is never counted, so every caret inside a user deref is one column left of
        # the text (found by kph fuzz: "p do_sys_openat2 +u0($retval)", caret 20, not 21).
        ipos = pos + 1 + lp + 1
        inner = rest[lp + 1:]
        rp = inner.rfind(")")
        if rp < 0:
            raise ParseFail("Dereference brace is not closed", ipos + len(inner))
        if inner[rp + 1:]:
            log.debug("ignoring %r after ')' in %r, as the kernel does", inner[rp + 1:], s)
        base = _parse_fetch(inner[:rp], ipos, flags, ops)
        if ops[-1][0] in ("comm", "data"):
            raise ParseFail("$comm can not be dereferenced", ipos)
        _push(ops, ("uderef" if user else "deref", off), ipos)
        return Deref(off, base, user)
    if c == "\\":
        if s[1:2] == '"':
            body = s[2:]
            if not body.endswith('"'):
                raise ParseFail("String is not closed with '\"'", pos + 2 + len(body))
            ops.append(("data", body[:-1]))
            return ImmString(body[:-1])
        t = s[1:]
        v = (kstrtoul(t) if t[:1].isascii() and t[:1].isdigit() else
             kstrtol(t) if t[:1] == "-" else kstrtol(t[1:]) if t[:1] == "+" else None)
        if v is None:
            raise ParseFail("Invalid immediate value", pos + 1)
        ops.append(("imm", v & _MASK64))
        return Imm(v)
    raise ParseFail("Invalid fetch argument", pos)


def _parse_body(body: str, flags: int, size: list[int]) -> tuple[Any, ...]:
    """``traceprobe_parse_probe_arg_body()``: (fetch, type, count, bitfield, explicit, code).

    ``size`` is the running record size of the earlier arguments (``trace_probe.size``).
    ``code`` is the kernel's ``fetch_insn`` list as tuples, ending in ``("end",)``.
    """
    if len(body) > MAX_ARGSTR_LEN:
        raise ParseFail("Argument expression is too long", 0)
    if body == "":
        raise ParseFail("No argument expression", 0)
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
                raise ParseFail("Array is not closed", len(body))
            if inside[rb + 1:]:
                raise ParseFail("Array has wrong suffix", npos + rb + 1)
            n = kstrtoul(inside[:rb])
            if n is None or n == 0 or n > UINT_MAX:
                raise ParseFail("Invalid array size", npos)
            if n > MAX_ARRAY_LEN:
                raise ParseFail("Array number is too big", npos)
            count = n
    if arg in ("$comm", "$COMM") or arg.startswith('\\"'):
        if count or (tstr is not None and tstr != "string"):
            # The kernel fails with -EINVAL here without an error_log entry.
            raise ParseFail("$comm and immediate strings are of type string, never arrays", tpos,
                        logged=False)
        tname: str | None = "string"
    else:
        tname = _find_fetch_type(tstr)
    if tname is None:
        raise ParseFail("Unknown type is specified", tpos)
    ftype = FETCH_TYPES[tname]
    size[0] += ftype.size * (count or 1)
    if size[0] > MAX_PROBE_EVENT_SIZE:
        raise ParseFail("Event too big (too many fields?)", 0)

    ops: list[Insn] = []
    fetch = _parse_fetch(arg, 0, flags, ops)
    last = ops[-1]
    if ftype.is_string:
        symstr = tname == "symstr"
        allowed = (("reg", "stack", "retval", "arg", "deref") if symstr else
                   ("deref", "uderef", "imm", "comm", "data"))
        if last[0] not in allowed:
            raise ParseFail("Symbol String doesn't accept data/userdata" if symstr else
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
            raise ParseFail("Invalid bitfield", tpos)
    if count:
        if store not in ("st_mem", "st_string", "st_ustring"):
            raise ParseFail("String accepts only memory argument", tpos)
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
        raise ParseFail("Invalid bitfield", pos)
    bo, j = _simple_strtoul(t, i + 1)
    if j == i + 1 or t[j:j + 1] != "/":
        raise ParseFail("Invalid bitfield", pos)
    return Bitfield(bw, bo, size * 8)


def arg_flags(is_return: bool, fentry: bool) -> int:
    return (FLAG_RETURN if is_return else 0) | (FLAG_FENTRY if fentry else 0)


def parse_arg(text: str, *, index: int = 0, is_return: bool = False, fentry: bool = True,
              used: tuple[str, ...] = ()) -> ProbeArg:
    """Parse one ``[NAME=]FETCHARG[:TYPE]`` token, as ``traceprobe_parse_probe_arg()`` does.

    :param index: 0-based position in the line; an unnamed argument is called ``arg<index+1>``.
    :param used: names of the earlier arguments (a repeat is USED_ARG_NAME).
    :raise ProbeSpecError: with ``column`` relative to ``text``.
    """
    try:
        return parse_probe_arg(text, index, arg_flags(is_return, fentry), used, [0])
    except ParseFail as exc:
        raise ProbeSpecError(str(exc), text, exc.pos) from None


def parse_probe_arg(tok: str, index: int, flags: int, used: tuple[str, ...],
               size: list[int]) -> ProbeArg:
    eq = tok.find("=")
    if eq >= 0:
        if eq > MAX_ARG_NAME_LEN:
            raise ParseFail("Argument name is too long", 0)
        if eq == 0:
            raise ParseFail("Argument name is not specified", 0)
        name, body, boff = tok[:eq], tok[eq + 1:], eq + 1
    else:
        name, body, boff = f"arg{index + 1}", tok, 0
    if not is_good_name(name):
        raise ParseFail("Argument name must follow the same rules as C identifiers", 0)
    if name in _RESERVED or name in used:
        raise ParseFail("This argument name is already used", 0)
    try:
        fetch, tname, count, bf, explicit, code = _parse_body(body, flags, size)
    except ParseFail as exc:
        exc.pos += boff
        raise
    if flags & FLAG_UPROBE:
        code = tuple((_UPROBE_OPS.get(op[0], op[0]),) + op[1:] for op in code)
    return ProbeArg(name, fetch, tname, count, bf, eq >= 0, explicit, body, code)



@dataclass(frozen=True)
class KernelView:
    """What parsing a line needs to know of the kernel that will take it.

    ``rules`` are its series' (:mod:`harness.kernel.rules`); ``btf`` its BTF (None: not known,
    a BTF variable then parses into a placeholder each backend resolves for its kernel:
    ``lenient``); ``on_func_entry`` and ``count_symbol`` as :func:`parse` takes them;
    ``module_count(mod, sym)`` counts ``sym`` in a loaded module (None: not loaded), for
    6.12's ``validate_probe_symbol()``; ``dentry_offsets`` are ``offsetof(struct dentry,
    d_name.name)`` and ``offsetof(struct file, f_path.dentry)`` for ``%pd``/``%pD``, or a
    function that works them out when a line first has one (finding a type by name
    indexes the whole BTF: 0.2 s a process).
    """

    rules: KernelRules
    btf: Any = None
    on_func_entry: Callable[[str, int], bool | None] | None = None
    count_symbol: Callable[[str], int] | None = None
    module_count: Callable[[str, str], int | None] | None = None
    dentry_offsets: tuple[int, int] | Callable[[], tuple[int, int] | None] | None = None
    #: ``event_format(system, event)``: the ``format`` of a trace event of the running
    #: kernel (``harness.kernel.ringbuf.EventFormat``), None when it has none; unset, an
    #: event probe takes any attached event and field (the booted kernel decides)
    event_format: Callable[[str, str], Any] | None = None

    @property
    def lenient(self) -> bool:
        return self.btf is None


def context_args(toks: list[tuple[int, str]], text: str, kernel: KernelView | None,
                  rules: KernelRules, flags: int, funcname: str | None,
                  uprobe: bool = False, event_fields: Any = None,
                  eprobe: bool = False) -> list[ProbeArg]:
    """The arguments of a line as 6.12/7.3 parse them (:mod:`harness.kernel.grammar.common`):
    ``$arg*``/``$argN`` expanded from BTF, the argument count checked, ``%pd``/``%pD``
    rewritten, then each argument. Errors are placed as ``__trace_probe_log_err()`` places
    them: against the line as written, at the argument index the kernel logs."""
    lc = argp.LineContext(rules, flags, funcname, kernel.btf if kernel else None,
                        lenient=kernel is None or kernel.lenient)
    lc.event_fields = event_fields

    def column(index: int, pos: int) -> int:
        """Argument ``index`` of the line (0 the head), ``pos`` into it."""
        if index < len(toks):
            return toks[index][0] + pos
        return len(" ".join(t for _, t in toks)) + 1

    raw = [t for _, t in toks[2:]]
    if eprobe:      # trace_eprobe_tp_update_arg(): each word as it is, no expansion
        uprobe = True
    try:
        if not uprobe:
            items = argp.expand_meta_args(lc, raw)
        else:
            items = list(enumerate(raw))
        if len(items) > MAX_TRACE_ARGS:
            if rules.too_many_args == "TOO_MANY_ARGS":
                raise argp.Fail(rules.message("TOO_MANY_ARGS"), 0, 7, index=0)
            if rules.too_many_args == "E2BIG":
                raise argp.Fail("Too many arguments (more than 128)", 0, 7, index=0, logged=False)
            items = items[:MAX_TRACE_ARGS]
        logged: list[str] | None = None
        if not uprobe and any(t.endswith((":%pd", ":%pD")) for _, t in items):
            d = kernel.dentry_offsets if kernel is not None else None
            if callable(d):
                d = d()
            before = items
            items = argp.expand_dentry_args(lc, items, *(d or (0x28, 0x48)))
            if items != before and [t for _, t in before] == raw:
                # traceprobe_expand_dentry_args() rewrites argv in place; without a $arg
                # expansion (a new argv) that is the array trace_probe_log holds, so
                # error_log shows the rewritten words and places its caret in them
                # (6.12: "+0(%di):%pd" is logged as "+0x0(+0x28(+0(%di))):string").
                logged = [t for _, t in toks[:2]] + [t for _, t in items]
    except argp.Fail as exc:
        raise ParseFail(str(exc) or "refused without an error_log entry", column(
            2 + (exc.index or 0), exc.pos), exc.errno, exc.logged) from None
    args: list[ProbeArg] = []
    size = [0]
    for j, (_orig, tok) in enumerate(items):
        try:
            name, body, written = argp.parse_arg(lc, tok, j, tuple(a.name for a in args), size)
        except argp.Fail as exc:
            msg = str(exc) or "refused without an error_log entry"
            if logged is not None:
                col = sum(len(w) + 1 for w in logged[:2 + j]) + exc.pos
                raise ParseFail(msg, col, exc.errno, exc.logged, words=logged) from None
            raise ParseFail(msg, column(2 + j, exc.pos), exc.errno, exc.logged) from None
        fetch, tname, count, bf, explicit, code = body
        comm = tok[tok.find("=") + 1:] if written else tok
        args.append(ProbeArg(name, fetch, tname, count, bf, written, explicit, comm, code,
                             written=True))
    # trace_fprobe.c: trace_fprobe_create_internal() (7.3), after the arguments: the entry
    # handler's data, one unsigned long per argument saved at entry
    # (traceprobe_get_entry_data_size()), must fit MAX_FPROBE_DATA_SIZE
    limit = rules.fprobe_max_entry_data
    if limit is not None and flags & argp.FL_FPROBE and flags & argp.FL_RETURN \
            and 8 * len(lc.entry_args) > limit:
        raise ParseFail(rules.message("TOO_MANY_EARGS"), column(2, 0), 7)
    return args


def split_return_suffix(target: str, pos: int) -> tuple[str, bool]:
    """Split a ``%return`` suffix off ``target`` (``pos`` its column): (rest, had it)."""
    pct = target.find("%")
    if pct < 0:
        return target, False
    if target[pct:] != "%return":
        raise ParseFail("Invalid probed address suffix", pos + pct)
    return target[:pct], True


def parse_event_name(s: str, pos: int) -> tuple[str, str, bool, bool]:
    """``traceprobe_parse_event_name()``: ``[GRP/]EVENT`` (``.`` also separates)."""
    group = KPROBE_EVENT_SYSTEM
    slash = s.find("/")
    if slash < 0:
        slash = s.find(".")
    if slash >= 0:
        if slash == 0:
            raise ParseFail("Group name is not specified", pos)
        if slash + 1 > MAX_EVENT_NAME_LEN:
            raise ParseFail("Group name is too long", pos)
        if not is_good_name(s[:slash], hash_ok=True):
            raise ParseFail("Group name must follow the same rules as C identifiers", pos)
        group, s, pos = s[:slash], s[slash + 1:], pos + slash + 1
    if s == "":
        if slash >= 0:
            return group, "", True, False
        raise ParseFail("Event name is not specified", pos)
    if len(s) >= MAX_EVENT_NAME_LEN:
        raise ParseFail("Event name is too long", pos)
    if not is_good_name(s):
        raise ParseFail("Event name must follow the same rules as C identifiers", pos)
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


def default_uprobe_event_name(is_return: bool, path: str, offset: int) -> str:
    """The name ``__trace_uprobe_create()`` (kernel/trace/trace_uprobe.c) makes:
    ``p_<base>_0x<offset>`` where ``<base>`` is the file's basename cut at its first ``.``,
    ``-`` or ``_`` (``p`` for return probes too: the kernel's format has a literal 'p').
    Kept here, by :func:`default_event_name`, because :class:`ProbeSpec` names itself."""
    tail = posixpath.basename(path)
    for i, ch in enumerate(tail):
        if ch in ".-_":
            tail = tail[:i]
            break
    return f"p_{tail}_0x{offset:x}"[:MAX_EVENT_NAME_LEN - 1]


# ---------------------------------------------------------------- formatting

def render_body(arg: ProbeArg) -> str:
    """The canonical ``FETCHARG[:TYPE]`` text of an argument built in Python."""
    body = render_fetch(arg.fetch)
    if arg.explicit_type:
        body += ":" + (str(arg.bitfield) if arg.bitfield else arg.type)
        body += f"[{arg.count}]" if arg.count else ""
    return body


def arg_text(arg: ProbeArg, is_return: bool, uprobe: bool = False) -> str:
    """``arg.comm`` while it still says what the fields say, else the canonical rendering."""
    if arg.written and arg.comm:
        return arg.comm
    if arg.comm:
        try:
            flags = FLAG_UPROBE | (FLAG_RETURN if is_return else 0) if uprobe else \
                arg_flags(is_return, True)
            again = _parse_body(arg.comm, flags, [0])[:5]
        except ParseFail:
            again = None
        if again == (arg.fetch, arg.type, arg.count, arg.bitfield, arg.explicit_type):
            return arg.comm
    return render_body(arg)


def error_subsystem(err: ProbeSpecError) -> str:
    """Who the kernel logs ``err`` under: set by :func:`harness.kernel.grammar.parse`
    (``err.subsystem``: ``trace_kprobe``, ``trace_uprobe``, ``trace_fprobe``,
    ``event_probe``, ``event filter parse error``, ``dynevent``; "" when the kernel logs
    nothing), else the parser the words of ``err.text`` go to."""
    sub = getattr(err, "subsystem", None)
    if sub is not None:
        return sub
    return line_subsystem(err.text.split()) if err.logged else ""


def format_error(err: ProbeSpecError, subsystem: str | None = None) -> str:
    """Render ``err`` as ``tracing/error_log`` does (``tracing_err_log_seq_show()``), caret
    under ``err.column``, without the timestamp; under ``subsystem`` (default: the one
    the kernel logs it under, :func:`error_subsystem`; a refusal the kernel does not log
    is shown under the parser of its kind)."""
    if subsystem is None:
        subsystem = error_subsystem(err) or line_subsystem(err.text.split())
    cmd = err.text.rstrip("\n")
    return (f"{subsystem}: error: {err}\n  Command: {cmd}\n"
            f"{' ' * (len('  Command: ') + err.column)}^")
