"""Events as the kernel stored them: ``trace_pipe_raw`` pages and event ``format`` files.

Why not the ``trace`` text: ``print_type_string()`` prints a string's bytes raw with
``%s``, so a ``:string`` holding a newline (``@linux_proc_banner:string``) splits its record
over two lines, and bytes that are not UTF-8 come out as whatever the reader makes of them.
The binary ring buffer keeps every record whole: its length, each ``__data_loc`` string's
exact bytes. The layout is Linux 6.1's (kernel/trace/ring_buffer.c, as the guest's
``events/header_page`` and ``events/header_event`` describe it):

- a page: ``u64 timestamp``, ``local_t commit`` (bytes of data; bit 31 RB_MISSED_EVENTS,
  bit 30 RB_MISSED_STORED), then the events;
- an event: a ``u32`` header, ``type_len:5`` and ``time_delta:27``; type_len 1..28 is a data
  event of ``4 * type_len`` bytes after the header, 0 a data event whose length is in the
  next ``u32`` (``array[0]``, counting itself), 29 padding (null when ``time_delta`` is 0:
  the rest of the page), 30 a time extend (``array[0] << 27 | time_delta``), 31 an
  absolute time stamp;
- a record (``struct trace_entry`` first): ``u16 common_type`` (the event's ``id``), ``u8
  common_flags``, ``u8 common_preempt_count``, ``int common_pid``, then the fields at the
  offsets its ``format`` file gives (``__probe_ip``; or ``__probe_func`` and
  ``__probe_ret_ip`` for return probes; then the arguments; a string is a ``u32``
  ``__data_loc``: length << 16 | offset from the record's start).

Pure: bytes and text in, records out, no I/O.
"""
from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from .grammar.fetch import FAULT, FETCH_TYPES

log = logging.getLogger(__name__)

__all__ = ["Field", "EventFormat", "RawRecord", "parse_format", "parse_page", "decode_args",
           "PAGE_SIZE", "GuestArg", "format_args", "page_missed", "parse_stats",
           "RingLoss", "ring_loss", "STATS_LOSSES", "page_events", "TYPE_PID"]

PAGE_SIZE = 4096
_PAGE_HEADER = 16
_MISSED = (1 << 31) | (1 << 30)
_MISSED_EVENTS, _MISSED_STORED = 1 << 31, 1 << 30
_PADDING, _TIME_EXTEND, _TIME_STAMP = 29, 30, 31
#: RINGBUF_TYPE_DATA_TYPE_LEN_MAX (include/linux/ring_buffer.h): type_len 1-28 is a data
#: event of that many 4-byte words, 0 one with its length in the next word
_DATA_MAX = 28
_U32, _PAGE_HEAD = struct.Struct("<I"), struct.Struct("<QQ")
_FIELD = re.compile(r"\s*field:(?P<decl>[^;]*);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);"
                    r"\s*signed:(?P<signed>-?\d+);")


@dataclass(frozen=True)
class Field:
    """One ``field:TYPE NAME; offset:N; size:N; signed:N;`` line."""

    name: str
    decl: str
    offset: int
    size: int
    signed: bool


@dataclass(frozen=True)
class EventFormat:
    """An event's ``format`` file: its ``ID``, fields by name in order, ``print fmt``."""

    name: str
    id: int
    fields: dict[str, Field]
    print_fmt: str = ""


@dataclass(frozen=True)
class GuestArg:
    """An argument as the guest kernel defined it: what ``harness.kernel.grammar.fetch.format_value``
    and :func:`decode_args` need of a ``ProbeArg`` (name, type, array count)."""

    name: str
    type: str
    count: int = 0


# __set_print_fmt() (kernel/trace/trace_probe.c): each argument's " NAME=FMT" (or
# "{FMT,FMT,...}" for an array) with FMT a fetch type's print format.
_PRINT_ARG = re.compile(r' (?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<fmt>\{[^}]*\}|'
                        r"'%c'|\\\"%s\\\"|0x%L?x|%L?[ud]|%pS)")
_BY_FMT = {("%u", 1): "u8", ("%u", 2): "u16", ("%u", 4): "u32", ("%Lu", 8): "u64",
           ("%d", 1): "s8", ("%d", 2): "s16", ("%d", 4): "s32", ("%Ld", 8): "s64",
           ("0x%x", 1): "x8", ("0x%x", 2): "x16", ("0x%x", 4): "x32", ("0x%Lx", 8): "x64",
           ("%pS", 8): "symbol", ("'%c'", 1): "char", ('\\"%s\\"', 4): "string"}


def _fmt_literal(print_fmt: str) -> str:
    """The C string literal that opens a ``print fmt``, up to its first unescaped quote
    (a string array prints as ``{\\"%s\\",\\"%s\\"}``: its ``",`` is not the end)."""
    m = re.match(r'"((?:[^"\\]|\\.)*)"', print_fmt)
    return m[1] if m else print_fmt


def format_args(fmt: EventFormat) -> list[GuestArg]:
    """The arguments of a probe event as its kernel typed and named them, read from its
    ``format``: names and element types from ``print fmt`` (each fetch type prints its
    own way: ``%u`` for ``u32``, ``0x%x`` for ``x32``, ``'%c'`` for ``char`` ...), sizes from
    the fields. What a kernel did with BTF (``$retval`` typed ``s32``, ``file`` named after
    the parameter) is then taken from the guest, not predicted.

    :raise ValueError: when the print format names an argument this cannot read.
    """
    head = _fmt_literal(fmt.print_fmt)
    out = []
    for m in _PRINT_ARG.finditer(head):
        name, pf = m["name"], m["fmt"]
        f = fmt.fields.get(name)
        if f is None:
            raise ValueError(f"{fmt.name}: print fmt names {name}, the format has no field")
        count = 0
        if pf.startswith("{"):
            items = pf[1:-1].split(",")
            count, pf = len(items), items[0]
        size = f.size // (count or 1)
        t = _BY_FMT.get((pf, size))
        if t is None:
            raise ValueError(f"{fmt.name}: argument {name} prints {pf} over {size} byte(s)")
        out.append(GuestArg(name, t, count))
    return out


def parse_format(text: str) -> EventFormat:
    """Read ``/sys/kernel/tracing/events/GROUP/EVENT/format``.

    :raise ValueError: when it has no ``name:`` or ``ID:`` line.
    """
    name, ident, fields, pfmt = None, None, {}, ""
    for line in text.splitlines():
        if line.startswith("print fmt:"):
            pfmt = line[len("print fmt:"):].strip()
        elif line.startswith("name:"):
            name = line[5:].strip()
        elif line.startswith("ID:"):
            ident = int(line[3:].strip())
        else:
            m = _FIELD.match(line)
            if m:
                decl = m["decl"].strip()
                fname = re.sub(r"\[.*\]$", "", decl.split()[-1])
                fields[fname] = Field(fname, decl, int(m["off"]), int(m["size"]),
                                      m["signed"] not in ("0",))
    if name is None or ident is None:
        raise ValueError("not an event format file (no name: or ID: line)")
    return EventFormat(name, ident, fields, pfmt)


class RawRecord:
    """One data event: the CPU whose buffer held it, its time stamp, the record bytes;
    its ``common_type`` and ``common_pid`` read once (a run reads 100,000 of these, and
    looks at each one's type several times)."""

    __slots__ = ("cpu", "ts", "data", "type", "pid")

    def __init__(self, cpu: int, ts: int, data: bytes) -> None:
        self.cpu, self.ts, self.data = cpu, ts, data
        self.type, self.pid = TYPE_PID.unpack_from(data) if len(data) >= 8 else \
            (struct.unpack_from("<H", data)[0], None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawRecord) and (self.cpu, self.ts, self.data) == \
            (other.cpu, other.ts, other.data)

    __hash__ = None     # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RawRecord(cpu={self.cpu}, ts={self.ts}, data={self.data!r})"

    def u64(self, f: Field) -> int:
        return int.from_bytes(self.data[f.offset:f.offset + 8], "little")


#: ``struct trace_entry``: type, flags and preempt_count left out, pid
TYPE_PID = struct.Struct("<H2xi")


def parse_page(page: bytes, cpu: int) -> tuple[list[RawRecord], bool]:
    """The data events of one ``trace_pipe_raw`` page, and whether events were missed
    before it (the ring buffer overwrote them)."""
    got, missed = page_events(page)
    return [RawRecord(cpu, ts, data) for ts, data in got], missed


def page_events(page: bytes) -> tuple[list[tuple[int, bytes]], bool]:
    """:func:`parse_page` without its records: each data event's time stamp and bytes
    (those of 8 bytes or more: a ``struct trace_entry`` at least), for a reader that
    makes a :class:`RawRecord` only of the events it decodes."""
    if len(page) < _PAGE_HEADER:
        return [], False
    ts, commit = _PAGE_HEAD.unpack_from(page, 0)
    missed = bool(commit & _MISSED)
    end = min(_PAGE_HEADER + (commit & ~_MISSED & 0xFFFFFFFF), len(page))
    pos, out = _PAGE_HEADER, []
    u32, add = _U32.unpack_from, out.append      # bound once: a page holds ~150 events
    while pos + 4 <= end:
        (head,) = u32(page, pos)
        type_len, delta = head & 0x1F, head >> 5
        if type_len > _DATA_MAX:
            if type_len == _PADDING:
                if delta == 0:                   # rb_null_event(): the rest is padding
                    break
                (length,) = u32(page, pos + 4)
                pos += 4 + length                # rb_update_read_stamp(): no time
                continue
            (hi,) = u32(page, pos + 4)
            if type_len == _TIME_EXTEND:
                ts += (hi << 27) | delta
            else:                                # _TIME_STAMP
                ts = (hi << 27) | delta
            pos += 8
            continue
        ts += delta
        if type_len == 0:
            (length,) = u32(page, pos + 4)
            data, pos = page[pos + 8:pos + 4 + length], pos + 4 + length
        else:
            data, pos = page[pos + 4:pos + 4 + 4 * type_len], pos + 4 + 4 * type_len
        if len(data) >= 8:
            add((ts, data))
    return out, missed


def page_missed(page: bytes) -> int | None:
    """Events the ring buffer lost before this page, as the page header says: None when
    it says none; the count when it stored one; 0 when it flagged a loss without room to
    store the count. ``ring_buffer_read_page()`` (kernel/trace/ring_buffer.c, 6.1, 6.12,
    7.3): with ``missed_events`` it adds RB_MISSED_EVENTS (bit 31) to the page's
    ``commit``, and when the page has room after its data, copies the ``unsigned long``
    count there (at ``data[commit]``) and adds RB_MISSED_STORED (bit 30)."""
    if len(page) < _PAGE_HEADER:
        return None
    (commit,) = struct.unpack_from("<Q", page, 8)
    if not commit & _MISSED_EVENTS:
        return None
    if not commit & _MISSED_STORED:
        return 0
    at = _PAGE_HEADER + (commit & ~_MISSED & 0xFFFFFFFF)
    if at + 8 > len(page):
        return 0
    return struct.unpack_from("<Q", page, at)[0]


#: The lines of ``per_cpu/cpuN/stats`` that count events lost (``tracing_stats_read()``,
#: kernel/trace/trace.c, the same lines in 6.1, 6.12 and 7.3): ``overrun`` (events the
#: writer overwrote before they were read, overwrite mode: ``rb_handle_head_page()``),
#: ``commit overrun`` (events dropped when the writer ran into its own commit:
#: ``rb_move_tail()``), ``dropped events`` (events dropped on a full buffer, overwrite off).
#: ``rb_reset_cpu()`` sets each to 0 (``echo > trace``).
STATS_LOSSES = ("overrun", "commit overrun", "dropped events")


def parse_stats(text: str) -> dict[str, int]:
    """``per_cpu/cpuN/stats``: each ``NAME: NUMBER`` line (time stamps left out)."""
    out = {}
    for line in text.splitlines():
        name, sep, value = line.rpartition(":")
        if sep and value.strip().lstrip("-").isdigit():
            out[name.strip()] = int(value)
    return out


@dataclass(frozen=True)
class RingLoss:
    """What one CPU's buffer lost over a run: the stats counters (:data:`STATS_LOSSES`),
    the pages whose header flagged lost events, and the counts those pages stored."""

    cpu: int
    counters: dict[str, int]
    flagged_pages: int = 0
    stored: int = 0
    unstored: int = 0        # flagged pages with no room for the count: one event at least

    @property
    def count(self) -> int:
        """Events lost: the stats' sum, or what the pages say if that is more."""
        return max(sum(self.counters.values()), self.stored + self.unstored)

    def describe(self) -> str:
        parts = [f"per_cpu/cpu{self.cpu}/stats {k} {n}" for k, n in self.counters.items() if n]
        if self.flagged_pages:
            parts.append(f"cpu{self.cpu}: {self.flagged_pages} trace_pipe_raw page(s) flagged "
                         f"RB_MISSED_EVENTS (stored counts {self.stored})")
        return ", ".join(parts)


def ring_loss(cpu: int, stats: dict[str, int], pages: Sequence[bytes]) -> RingLoss:
    """One CPU's losses from its stats and its pages (both sources the kernel gives)."""
    flagged = stored = unstored = 0
    for page in pages:
        m = page_missed(page)
        if m is not None:
            flagged += 1
            stored += m
            unstored += m == 0
    return RingLoss(cpu, {k: stats.get(k, 0) for k in STATS_LOSSES}, flagged, stored, unstored)


def _loc_bytes(data: bytes, loc: int) -> Any:
    """``print_type_string()``: ``(fault)`` for a zero length, else the bytes up to a NUL."""
    length, off = loc >> 16, loc & 0xFFFF
    if length == 0:
        return FAULT
    raw = data[off:off + length]
    z = raw.find(b"\0")
    return raw if z < 0 else raw[:z]


def decode_args(rec: RawRecord, fmt: EventFormat, args: Sequence[Any]) -> list[Any]:
    """The values of ``args`` (``ProbeArg``s) in ``rec``, in the shapes
    :func:`harness.kernel.grammar.fetch.evaluate` gives: int (signed for ``s*``), bytes or ``FAULT``
    for strings, a list for arrays.

    :raise KeyError: when the format has no field of an argument's name.
    """
    out = []
    for a in args:
        f = fmt.fields[a.name]
        t = FETCH_TYPES[a.type]
        n = a.count or 1
        vals: list[Any] = []
        for i in range(n):
            off = f.offset + i * t.size
            raw = int.from_bytes(rec.data[off:off + t.size], "little")
            if t.is_string:
                vals.append(_loc_bytes(rec.data, raw))
            elif t.is_signed and raw >> (8 * t.size - 1):
                vals.append(raw - (1 << 8 * t.size))
            else:
                vals.append(raw)
        out.append(vals if a.count else vals[0])
    return out


def record_excess(rec: RawRecord, fmt: EventFormat, args: Sequence[Any],
                  fixed: int | None = None) -> tuple[int, int]:
    """Bytes ``rec`` holds beyond its fixed fields and the dynamic data its ``__data_loc``
    words reach, after the ring buffer's rounding: 0 on a kernel whose two passes agree.
    A probe handler reserves ``sizeof(head) + tp->size + __get_data_size()``
    (kernel/trace/trace_kprobe.c: __kprobe_trace_func(), and the uprobe, fprobe and eprobe
    ones alike), the first pass counting each string's length, and ``store_trace_args()``
    writes the strings and their data_locs in the second, each one after the last.
    kernel/trace/ring_buffer.c: rb_calculate_event_length() rounds the record up to 4
    bytes (RB_ALIGNMENT on x86_64), and a whole event of 12 bytes to 16 (an 8-byte record,
    an event probe with no argument, reads back as 12).

    The data reaches as far as its farthest data_loc (offset + length): a fetch that
    failed before its store keeps the data_loc store_trace_args() preset, the rest of the
    area (kernel/trace/trace_probe_tmpl.h: process_fetch_insn_bottom()), and the next
    strings are stored inside it. A data_loc outside the record (one never written) is not
    counted. More bytes than the data reaches is space reserved for data that was never
    written (a string length counted twice in the first pass). ``fixed``: the format's
    :func:`fixed_size`, when the caller has it. Returns ``(excess, reach)``: the bytes
    beyond, and where the data ends."""
    if fixed is None:
        fixed = fixed_size(fmt)
    reach = fixed
    for a in args:
        t = FETCH_TYPES[a.type]
        f = fmt.fields.get(a.name)
        if not t.is_string or f is None:
            continue
        for i in range(a.count or 1):
            off = f.offset + i * t.size
            loc = int.from_bytes(rec.data[off:off + 4], "little")
            start, end = loc & 0xFFFF, (loc & 0xFFFF) + (loc >> 16)
            if fixed <= start and end <= len(rec.data):
                reach = max(reach, end)
    return len(rec.data) - rb_data_len(reach), reach


def fixed_size(fmt: EventFormat) -> int:
    """Where an event's fixed fields end (the farthest field's offset + size)."""
    return max((f.offset + f.size for f in fmt.fields.values()), default=0)


def rb_data_len(size: int) -> int:
    """The data bytes a record of ``size`` reads back as (``rb_calculate_event_length()``
    and ``rb_update_event()``: the length rounded up to RB_ALIGNMENT, a whole event of
    RB_LEN_TIME_EXTEND + RB_ALIGNMENT made one RB_ALIGNMENT longer; a record over
    RB_MAX_SMALL_DATA keeps its length in array[0], which :func:`parse_page` leaves out)."""
    n = max(size, 1)
    big = n > 112                       # RB_MAX_SMALL_DATA: 4 * 28
    n = ((n + (4 if big else 0) + 4) + 3) & ~3
    if n == 12:                         # RB_LEN_TIME_EXTEND + RB_ALIGNMENT
        n += 4
    return n - (8 if big else 4)

