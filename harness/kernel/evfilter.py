"""Event filters (``if FILTER`` of an event probe), as ``kernel/trace/trace_events_filter.c``
of Linux 6.12 and 7.3 parses and applies them.

An event probe's filter is tested on the attached event's record before the probe runs
(``event_triggers_call()``: ``filter_match_preds(data->filter, rec)``). The language:
predicates ``FIELD[.ustring] OP VALUE`` joined by ``&&`` and ``||`` (``&&`` binds tighter),
``!`` and parentheses (``process_preds()``); ``OP`` one of ``== != < <= > >= & ~``
(``parse_pred()``). A string field takes a quoted value (``'...'`` or ``"..."``) with
``==``, ``!=`` or ``~`` (a glob: ``filter_parse_regex()``'s front, middle, end or full
``glob_match()``); a numeric field a number (``kstrtoll()``/``kstrtoull()``, base 0),
compared at the field's size and signedness (``select_comparison_fn()``); ``&`` is a bit
test. Fields are the event's own, its ``common_*`` ones, and the generic ``cpu``/``CPU``/
``common_cpu`` (the CPU) and ``comm``/``COMM`` (``current->comm``).

Not mirrored (:class:`NotMirroredError`): cpumask values (``{...}``), ``.function`` and
``.ustring`` fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import NotMirroredError

__all__ = ["EventFilter", "FilterError", "parse_filter", "field_kind"]

_OPS = ("==", "!=", "<=", ">=", "<", ">", "&", "~")     # longest first, as ops[] is tried
_GENERIC = {"cpu": "cpu", "CPU": "cpu", "common_cpu": "cpu", "comm": "comm", "COMM": "comm"}
MAX_FILTER_STR_VAL = 256


class FilterError(Exception):
    """``create_event_filter()`` refusing a filter: the text of ``filter_parse_error``
    (``err_text[]``) and the position in the filter."""

    def __init__(self, msg: str, pos: int) -> None:
        super().__init__(msg)
        self.pos = pos


@dataclass(frozen=True)
class _Pred:
    field: str          # a field of the event, or "cpu"/"comm" (generic)
    op: str
    value: Any          # int, or the pattern (str)
    kind: str = "int"   # "int", "static", "dyn", "rdyn", "ptr", "cpu", "comm"
    offset: int = 0
    size: int = 8
    signed: bool = False


@dataclass(frozen=True)
class EventFilter:
    """A parsed filter: ``text`` as the kernel keeps it (the words joined by single
    spaces), ``tree`` its predicates (None until the attached event's fields are known)."""

    text: str
    tree: Any = None

    def __str__(self) -> str:
        return self.text

    def predicates(self) -> list[Any]:
        """Every predicate, in the filter's order (each field a matcher must read)."""
        out: list[Any] = []

        def walk(node: Any) -> None:
            if node[0] == "pred":
                out.append(node[1])
            else:
                for n in node[1:]:
                    walk(n)
        if self.tree is not None:
            walk(self.tree)
        return out

    def match(self, field_value: Callable[[_Pred], Any]) -> bool:
        """``filter_match_preds()``: ``field_value(pred)`` gives a predicate's field as an
        int (numeric) or bytes (strings, up to the NUL), or None for a string the kernel
        could not read (the predicate is then false, ``!=`` too)."""
        return _eval(self.tree, field_value)


def _eval(node: Any, value: Callable[[_Pred], Any]) -> bool:
    if node[0] == "and":
        return _eval(node[1], value) and _eval(node[2], value)
    if node[0] == "or":
        return _eval(node[1], value) or _eval(node[2], value)
    if node[0] == "not":
        return not _eval(node[1], value)
    return _test(node[1], value(node[1]))


def _glob(pattern: str) -> tuple[str, str, bool]:
    """``filter_parse_regex()``: (type, search, not)."""
    neg = pattern.startswith("!")
    buf = pattern[1:] if neg else pattern
    kind = "full"
    if buf[:1].isdigit():
        return "full", buf, neg
    for i, c in enumerate(buf):
        if c == "*":
            if i == 0:
                kind = "end"
            elif i == len(buf) - 1:
                kind = "middle" if kind == "end" else "front"
                buf = buf[:i]
                break
            else:
                return "glob", buf, neg
        elif c in "[?\\":
            return "glob", buf, neg
    if buf[:1] == "*":
        buf = buf[1:]
    return kind, buf, neg


def _strncmp(a: bytes, b: bytes, n: int | None) -> bool:
    """``strncmp(a, b, n) == 0`` (``strcmp`` for None), bytes past either's end as NUL."""
    i = 0
    while n is None or i < n:
        ca = a[i] if i < len(a) else 0
        cb = b[i] if i < len(b) else 0
        if ca != cb:
            return False
        if ca == 0:
            return True
        i += 1
    return True


def _cstring(buf: bytes) -> bytes:
    z = buf.find(b"\0")
    return buf if z < 0 else buf[:z]


def glob_match_len(pat: bytes, buf: bytes, end: int | None) -> bool:
    """lib/glob.c: ``glob_match_str()`` (6.12's Debian tree and 7.3), ``buf`` read up to
    ``end`` bytes (None: up to its NUL), a NUL within them ending it."""
    def at(i: int) -> int:
        return 0 if (end is not None and i >= end) or i >= len(buf) else buf[i]

    def p(i: int) -> int:       # the pattern's byte, NUL past its end
        return pat[i] if i < len(pat) else 0
    back_pat = back_str = -1
    pi = si = 0
    while True:
        c, d = at(si), p(pi)
        pi += 1
        si += 1
        if d == ord("?"):                       # anything but nul
            if c == 0:
                return False
            continue
        if d == ord("*"):                       # any-length wildcard
            if p(pi) == 0:
                return True
            back_pat, si = pi, si - 1
            back_str = si
            continue
        literal = True
        if d == ord("["):                       # a class; malformed: '[' literal
            if c == 0:
                return False
            inverted = p(pi) == ord("!")
            ci = pi + inverted
            a, ci = p(ci), ci + 1
            match = malformed = False
            while True:
                b = a
                if a == 0:
                    malformed = True
                    break
                if p(ci) == ord("-") and p(ci + 1) != ord("]"):
                    b = p(ci + 1)
                    if b == 0:
                        malformed = True
                        break
                    ci += 2
                match |= a <= c <= b
                a, ci = p(ci), ci + 1
                if a == ord("]"):
                    break
            if not malformed:
                literal = False
                if match != inverted:
                    pi = ci
                    continue
        elif d == ord("\\"):
            d, pi = p(pi), pi + 1
        if literal and c == d:
            if d == 0:
                return True
            continue
        # backtrack
        if c == 0 or back_pat < 0:
            return False
        pi = back_pat
        back_str += 1
        si = back_str


def regex_match(kind: str, pat: bytes, buf: bytes, length: int) -> bool:
    """kernel/trace/trace_events_filter.c: ``regex_match_full/front/middle/end/glob()``
    (6.12's Debian tree and 7.3) on the ``length`` the field's predicate passes: a static
    ``char[N]`` its size N, the generic ``comm`` TASK_COMM_LEN (16), a ``__data_loc``
    string the length in its u32, a ``char *`` strlen + 1; 0 means NUL-terminated.
    ``buf`` holds those bytes (the string and what follows it in the field)."""
    r = len(pat)
    buf = buf + b"\0" * max(0, length - len(buf))
    if kind == "full":
        if not length:
            return _strncmp(buf, pat, None)
        return length >= r and _strncmp(buf, pat, length)
    if kind == "front":
        return not (length and length < r) and _strncmp(buf, pat, r)
    if kind == "middle":
        if not length:
            return pat in _cstring(buf)
        return r == 0 or pat in buf[:length]            # strnstr(): memcmp, NULs too
    if kind == "end":
        n = length - 1
        return n >= r and buf[n - r:n] == pat
    return glob_match_len(pat, buf, length)


def _test(p: _Pred, v: Any) -> bool:
    if v is None:       # a string the kernel could not read: the predicate is false
        return False
    if isinstance(p.value, str):                 # a string predicate: a regex
        # v: (the bytes the predicate passes, its length), or a C string (filter_pchar())
        if isinstance(v, tuple):
            buf, length = bytes(v[0]), int(v[1])
        else:
            raw = v if isinstance(v, (bytes, bytearray)) else str(v).encode("utf-8",
                                                                              "surrogateescape")
            buf = _cstring(bytes(raw))
            buf, length = buf + b"\0", len(buf) + 1
        if p.op == "~":
            kind, pat, neg = _glob(p.value)
        else:
            kind, pat, neg = "full", p.value, p.op == "!="
        hit = regex_match(kind, pat.encode("utf-8", "surrogateescape"), buf, length)
        return hit ^ neg
    bits = 8 * (p.size if p.kind != "cpu" else 4)
    mask = (1 << bits) - 1
    a, b = v & mask, p.value & mask
    if p.signed:
        a = a - (1 << bits) if a >> (bits - 1) else a
        b = b - (1 << bits) if b >> (bits - 1) else b
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b,
            ">=": a >= b, "&": bool(a & b)}[p.op]


def _kstrto(s: str, signed: bool) -> int | None:
    """``kstrtoll()``/``kstrtoull()`` with base 0."""
    neg = s.startswith("-")
    if neg and not signed:
        return None
    t = s[1:] if neg else s
    try:
        v = int(t, 16) if t[:2].lower() == "0x" and len(t) > 2 else \
            int(t, 8) if t[:1] == "0" and len(t) > 1 else int(t, 10)
    except ValueError:
        return None
    if not t or not t.isascii() or t[:1] in "+-" and not t[:2].lower() == "0x":
        return None
    if signed and (v > (1 << 63) - (0 if neg else 1)):
        return None
    if v >> 64:
        return None
    return -v if neg else v


def field_kind(decl: str) -> str:
    """How ``get_event_field()`` reads a field of this declaration: its ``filter_type``
    (kernel/trace/trace_events_filter.c: ``filter_assign_type()``, 6.12 and 7.3) as "dyn"
    (``__data_loc char[]``: the record plus the low 16 bits of the u32 there), "rdyn"
    (``__rel_loc char[]``: the field's own address plus them), "static" (``char[N]``: the
    field's address), "ptr" (``char *``/``const char *``: the pointer stored) or "int"
    (anything else: the value, sign-extended when the field is signed)."""
    if "__data_loc" in decl and "char" in decl:
        return "dyn"
    if "__rel_loc" in decl and "char" in decl:
        return "rdyn"
    if "[" in decl and "char" in decl:
        return "static"
    typ = decl.rsplit(" ", 1)[0].strip() if " " in decl else decl
    return "ptr" if typ in ("char *", "const char *") else "int"


def parse_filter(text: str, fields: Mapping[str, Any] | None) -> EventFilter:
    """Parse ``text`` for an event with ``fields`` (``harness.kernel.ringbuf.Field`` by
    name, ``common_*`` included); None parses the shape only (no kernel known yet).

    :raise FilterError: where ``create_event_filter()`` fails.
    :raise NotMirroredError: a form the host does not evaluate.
    """
    _calc_stack(text)
    p = _Parser(text, fields)
    tree = p.expr()
    p.skip()
    if p.i < len(text):     # predicate_parse() #5: after a predicate only ), &&, || or the end
        raise _placed(FilterError(_TOO_MANY_PREDS, p.i))
    return EventFilter(text, tree if fields is not None else None)


def _calc_stack(s: str) -> None:
    """``calc_stack()``: quotes and parentheses checked before any predicate."""
    preds, opened, quote, last_quote, is_pred = 0, 1, "", 0, False
    i = 0
    for i, c in enumerate(s):
        if c.isspace():
            continue
        if quote:
            if c == quote:
                quote = ""
            continue
        if c in "'\"":
            quote, last_quote = c, i
        elif c in "|&" and s[i + 1:i + 2] == c:
            is_pred = False
            continue
        elif c == "(":
            is_pred, opened = False, opened + 1
            continue
        elif c == ")":
            is_pred = False
            if opened == 1:
                raise _placed(FilterError("Too few '('", i))
            opened -= 1
            continue
        if not is_pred:
            preds, is_pred = preds + 1, True
    if quote:
        raise _placed(FilterError("Missing matching quote", last_quote))
    if opened != 1:
        # the kernel's forward loop ends with i at the NUL, so "for (i--; i; i--)" starts
        # at the last character (kph fuzz on 6.12: a closing quote there, 2026-11-29)
        level, q = opened, ""
        for j in range(len(s) - 1, 0, -1):
            c = s[j]
            if q:
                if c == q:
                    q = ""
                continue
            if c == "(":
                if level == opened:
                    raise _placed(FilterError("Too many '('", j))
                level -= 1
            elif c == ")":
                level += 1
            elif c in "'\"":
                q = c
        raise _placed(FilterError("Too many '('", 0))
    if not preds:
        raise _placed(FilterError("Error", 0))


_TOO_MANY_PREDS = "Too many terms in predicate expression"


def _placed(exc: FilterError) -> FilterError:
    exc.placed = True       # a position of the whole filter, not one past a predicate's
    return exc


class _Parser:
    def __init__(self, text: str, fields: Mapping[str, Any] | None) -> None:
        self.s, self.i, self.fields, self.depth = text, 0, fields, 0
        self.n = 0      # predicate_parse()'s N: the predicates parsed so far

    def skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def expr(self) -> Any:
        node = self.term()
        while True:
            self.skip()
            if self.s.startswith("||", self.i):
                self.i += 2
                node = ("or", node, self.term())
            else:
                return node

    def term(self) -> Any:
        node = self.unary()
        while True:
            self.skip()
            if self.s.startswith("&&", self.i):
                self.i += 2
                node = ("and", node, self.unary())
            else:
                return node

    def unary(self) -> Any:
        self.skip()
        if self.s[self.i:self.i + 1] == "!":
            self.i += 1
            return ("not", self.unary())
        if self.s[self.i:self.i + 1] == "(":
            self.i += 1
            node = self.expr()
            self.skip()
            if self.s[self.i:self.i + 1] != ")":
                if self.i < len(self.s):        # predicate_parse() #5, as at the top
                    raise _placed(FilterError(_TOO_MANY_PREDS, self.i))
                raise FilterError("Too many '('", self.i)
            self.i += 1
            return node
        try:
            node = ("pred", self.pred())
            self.n += 1
            return node
        except FilterError as exc:
            # predicate_parse() hands parse_pred() the position one past the
            # predicate's first character (ptr - str after ptr++): its errors sit one right
            if not getattr(exc, "placed", False):
                exc.pos += 1
                exc.placed = True
            raise

    def pred(self) -> _Pred:
        """``parse_pred()``."""
        s, start = self.s, self.i
        i = start
        while i < len(s) and (s[i].isalnum() or s[i] == "_"):
            i += 1
        name = s[start:i]
        if not name and s[start:].strip():
            # a character no field name has: parse_pred() returns -1 without
            # parse_error(), and append_filter_err() logs FILT_ERR_ERRNO ("Error") at 0
            raise _placed(FilterError("Error", 0))
        if not name:
            # nothing left: predicate_parse()'s first pass ends with a predicate still
            # wanted, FILT_ERR_INVALID_FILTER at ptr - str (the end of the text), or with
            # none at all (N == 0: "!" alone), FILT_ERR_NO_FILTER there
            raise _placed(FilterError("Meaningless filter expression" if self.n else
                                      "No filter found", len(s)))
        f = self.fields.get(name) if self.fields is not None else None
        generic = _GENERIC.get(name) if f is None else None
        if self.fields is not None and f is None and generic is None:
            raise FilterError("Field not found", i)
        for suffix in (".ustring", ".function"):
            if s.startswith(suffix, i):
                raise NotMirroredError(f"not mirrored host-side: the event filter's "
                                       f"{suffix} fields", s, start,
                                       hint="filter on the field's value instead")
        while i < len(s) and s[i].isspace():
            i += 1
        op = next((o for o in _OPS if s.startswith(o, i)), None)
        if op is None:
            raise FilterError("Invalid operator", i)
        i += len(op)
        while i < len(s) and s[i].isspace():
            i += 1
        kind = generic or (field_kind(f.decl) if f is not None else "int")
        size = f.size if f is not None else 8
        # the generic cpu field is an int (trace_events.c: __generic_field(int, CPU,
        # FILTER_CPU)): kstrtoll() and a signed compare (filter_pred_cpu())
        signed = bool(f.signed) if f is not None else generic == "cpu"
        strfield = kind in ("static", "dyn", "rdyn", "ptr", "comm")
        off = f.offset if f is not None else 0
        if s[i:i + 1] == "{":
            raise NotMirroredError("not mirrored host-side: cpumask values in an event "
                                   "filter", s, i, hint="compare the cpu field with numbers")
        if s[i:i + 1] in ("'", '"'):
            if op not in ("==", "!=", "~"):
                raise FilterError("Illegal operation for field type", i)
            if self.fields is not None and not strfield:
                raise FilterError("Expecting numeric field", i)
            end = s.find(s[i], i + 1)
            if end < 0:
                raise FilterError("Missing matching quote", len(s))
            pat = s[i + 1:end]
            if len(pat) >= MAX_FILTER_STR_VAL:
                raise FilterError("Operand too long", end)
            self.i = end + 1
            return _Pred(name, op, pat, kind, off, size, signed)
        if s[i:i + 1].isdigit() or s[i:i + 1] == "-":
            if self.fields is not None and strfield:
                raise FilterError("Expecting string field", i)
            if op == "~":
                raise FilterError("Illegal operation for field type", i)
            j = i + 1 if s[i] == "-" else i
            while j < len(s) and s[j].isalnum():
                j += 1
            num = s[i:j]
            if len(num) >= 24:
                raise FilterError("Operand too long", j)
            v = _kstrto(num, signed or kind == "cpu")
            if v is None:
                raise FilterError("Illegal integer value", i)
            self.i = j
            return _Pred(name, "&" if op == "&" else op, v, kind, off, size, signed)
        raise FilterError("Invalid value (did you forget quotes)?", i)
