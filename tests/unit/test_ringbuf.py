"""harness.kernel.ringbuf against pages laid out as 6.1's ring buffer lays them out, and the
format file of a kprobe event as the 6.1 guest printed it."""
import struct

from harness.kernel.grammar.fetch import FAULT, escape_bytes, format_value
from harness.kernel.grammar import parse
from harness.kernel.ringbuf import decode_args, parse_format, parse_page

FORMAT = """name: b
ID: 1392
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long __probe_ip;\toffset:8;\tsize:8;\tsigned:0;
\tfield:__data_loc char[] s;\toffset:16;\tsize:4;\tsigned:1;
\tfield:u64 x;\toffset:20;\tsize:8;\tsigned:0;
\tfield:__data_loc char[] c;\toffset:28;\tsize:4;\tsigned:1;

print fmt: "(%lx) s=\\"%s\\" x=%Lu c=\\"%s\\"", REC->__probe_ip, __get_str(s), REC->x, __get_str(c)
"""
SPEC = parse("p:kprobes/b kernel_clone s=@linux_proc_banner:string x=+0(%di):u64 c=$comm")
BANNER = b"%s version %s (debian-kernel@lists.debian.org) %s\n"


def record(pid, ip, s, x, c, etype=1392):
    head = struct.pack("<HBBiQ", etype, 0, 0, pid, ip)
    fixed = 8 + 8 + 4 + 8 + 4
    s_loc = (len(s) + 1) << 16 | fixed
    c_loc = (len(c) + 1) << 16 | (fixed + len(s) + 1)
    body = head + struct.pack("<IQI", s_loc, x, c_loc) + s + b"\0" + c + b"\0"
    return body + b"\0" * (-len(body) % 4)


def event(data, delta=0):
    if len(data) <= 28 * 4:
        return struct.pack("<I", (delta << 5) | (len(data) // 4)) + data
    return struct.pack("<II", delta << 5, len(data) + 4) + data      # type_len 0


def page(events, ts=1000, flags=0):
    body = b"".join(events)
    return (struct.pack("<QQ", ts, len(body) | flags) + body).ljust(4096, b"\0")


def test_format_file():
    fmt = parse_format(FORMAT)
    assert (fmt.name, fmt.id) == ("b", 1392)
    assert list(fmt.fields)[4:] == ["__probe_ip", "s", "x", "c"]
    assert (fmt.fields["x"].offset, fmt.fields["x"].size) == (20, 8)
    assert fmt.fields["s"].decl == "__data_loc char[] s"


def test_records_keep_the_bytes_the_kernel_stored():
    fmt = parse_format(FORMAT)
    big = record(110, 0xFFFFFFFF810941A0, BANNER, 0x1200000, b"sh")
    small = record(111, 0xFFFFFFFF810941A0, b"a\xff\xc3\n", 7, b"\xe9x")
    recs, missed = parse_page(page([event(big), event(small, delta=5)]), cpu=0)
    assert not missed and [r.pid for r in recs] == [110, 111]
    assert [r.ts for r in recs] == [1000, 1005] and recs[0].type == 1392
    assert recs[0].u64(fmt.fields["__probe_ip"]) == 0xFFFFFFFF810941A0
    vals = decode_args(recs[0], fmt, SPEC.args)
    assert vals == [BANNER, 0x1200000, b"sh"]           # the newline is kept
    vals = decode_args(recs[1], fmt, SPEC.args)
    assert vals == [b"a\xff\xc3\n", 7, b"\xe9x"]
    shown = [format_value(a, v) for a, v in zip(SPEC.args, vals)]
    assert shown == ['"a\\377\\303\\n"', "7", '"\\351x"']


def test_padding_time_extends_and_lost_events():
    fmt = parse_format(FORMAT)
    rec = record(5, 1, b"", 0, b"")
    ext = struct.pack("<II", (3 << 5) | 30, 1)                 # time extend: 1 << 27 | 3
    pad = struct.pack("<II", (9 << 5) | 29, 8) + b"\0" * 4     # a discarded event
    recs, missed = parse_page(page([event(rec), ext, pad, event(rec, delta=2)], flags=1 << 31),
                              cpu=1)
    assert missed and [r.ts for r in recs] == [1000, 1000 + (1 << 27) + 3 + 2]
    assert all(r.cpu == 1 for r in recs)
    null = struct.pack("<I", 29)                               # rb_null_event(): page end
    recs, _ = parse_page(page([event(rec), null, event(rec)]), cpu=0)
    assert len(recs) == 1
    assert decode_args(recs[0], fmt, SPEC.args)[0] == b""


def test_a_zero_length_string_is_a_fault_and_arrays_decode_per_element():
    spec = parse("p:kprobes/a f s=+0(%si):string v=+0(%di):s16[3]")
    fmt_text = FORMAT.replace("field:__data_loc char[] s;\toffset:16;\tsize:4;\tsigned:1;",
                              "field:__data_loc char[] s;\toffset:16;\tsize:4;\tsigned:1;\n"
                              "\tfield:s16 v[3];\toffset:20;\tsize:6;\tsigned:1;")
    fmt = parse_format(fmt_text)
    data = struct.pack("<HBBiQI", 1392, 0, 0, 9, 0, 0) + struct.pack("<hhh", -1, 2, -3) + b"\0\0"
    recs, _ = parse_page(page([event(data)]), cpu=0)
    assert decode_args(recs[0], fmt, spec.args) == [FAULT, [-1, 2, -3]]


def test_escape_bytes_is_printable_ascii_and_exact():
    assert escape_bytes(b"plain text /x-y_z") == "plain text /x-y_z"
    assert escape_bytes(b'"q"\\') == '\\"q\\"\\\\'
    assert escape_bytes(b"\n\t\r\x0b\x0c\x07\x1b\0") == "\\n\\t\\r\\v\\f\\a\\e\\0"
    assert escape_bytes(b"\x01\x7f\x80\xa0\xff") == "\\001\\177\\200\\240\\377"
    assert escape_bytes("é".encode()) == "\\303\\251"


# a 6.1 guest's format for "p:kprobes/t1 do_sys_openat2 %r15 @linux_proc_banner:ustring[2]
# x=%dx:u32" (a string array prints as {\"%s\",\"%s\"}: a `",` inside the literal)
STRING_ARRAY = r'''name: t1
ID: 1392
format:
	field:unsigned short common_type;	offset:0;	size:2;	signed:0;
	field:unsigned char common_flags;	offset:2;	size:1;	signed:0;
	field:unsigned char common_preempt_count;	offset:3;	size:1;	signed:0;
	field:int common_pid;	offset:4;	size:4;	signed:1;

	field:unsigned long __probe_ip;	offset:8;	size:8;	signed:0;
	field:u64 arg1;	offset:16;	size:8;	signed:0;
	field:__data_loc char[][2] arg2;	offset:24;	size:8;	signed:1;
	field:u32 x;	offset:32;	size:4;	signed:0;

print fmt: "(%lx) arg1=0x%Lx arg2={\"%s\",\"%s\"} x=%u", REC->__probe_ip, REC->arg1, __get_str(arg2[0]), __get_str(arg2[1]), REC->x
'''


def test_arguments_after_a_string_array_are_read():
    from harness.kernel.ringbuf import format_args

    got = [(a.name, a.type, a.count) for a in format_args(parse_format(STRING_ARRAY))]
    assert got == [("arg1", "x64", 0), ("arg2", "string", 2), ("x", "u32", 0)]


def test_record_excess_is_what_the_record_holds_beyond_its_fields_and_strings():
    """A record is its fixed fields, then the strings its data_locs describe, rounded up
    to 4 bytes (rb_calculate_event_length()); anything else is an excess."""
    from harness.kernel.ringbuf import RawRecord, record_excess
    fmt = parse_format(FORMAT)
    args = parse("p:b do_sys_openat2 s=+0(%si):string x=%di:u64 c=$comm").args
    fixed = 32                                      # c's data_loc ends the fixed part
    s, c = b"/etc\0", b"cat\0"
    head = struct.pack("<HBBiQ", 1392, 0, 0, 7, 0)
    body = struct.pack("<IQI", (len(s) << 16) | fixed, 5, (len(c) << 16) | (fixed + len(s)))
    data = head + body + s + c
    pad = (-len(data)) % 4
    assert record_excess(RawRecord(0, 0, data + bytes(pad)), fmt, args) == (0, len(data))
    assert record_excess(RawRecord(0, 0, data + bytes(pad + 8)), fmt, args) == (8, len(data))
    # a fetch that failed before its store keeps the preset data_loc, the rest of the
    # area, and the next string is stored inside it: the data still reaches the end
    preset = head + struct.pack("<IQI", ((len(s) + len(c)) << 16) | fixed, 5,
                                (len(c) << 16) | fixed)
    assert record_excess(RawRecord(0, 0, preset + c + bytes(len(s)) + bytes(pad)), fmt,
                         args)[0] == 0
    # a data_loc never written (its bytes point past the record) is not counted
    stale = head + struct.pack("<IQI", (len(s) << 16) | fixed, 5, (400 << 16) | 900)
    assert record_excess(RawRecord(0, 0, stale + s + bytes(4) + bytes(pad)), fmt, args)[0] == 4


def test_an_eight_byte_record_reads_back_as_twelve():
    """rb_calculate_event_length(): a whole event of 12 bytes is made 16, so an event probe
    with no argument (its 8-byte trace_entry alone) holds 12 bytes of data (7.3's guest,
    kph fuzz, 2026-11-29), and is no excess."""
    from harness.kernel.ringbuf import RawRecord, rb_data_len, record_excess
    assert [rb_data_len(n) for n in (8, 16, 17, 112, 113)] == [12, 16, 20, 112, 116]
    fmt = parse_format(FORMAT.split("\n\n")[0] + "\n\nprint fmt: \"\"\n")
    assert record_excess(RawRecord(0, 0, struct.pack("<HBBi", 1392, 0, 0, 7) + bytes(4)),
                         fmt, ())[0] == 0


CLONE = 0xFFFFFFFF810941A0


def events_backend(cpus):
    """An EventsBackend of ``cpus`` whose one event is SPEC's (FORMAT), no guest."""
    from harness.backends.events import EventsBackend
    from harness.kernel.symbols import SymbolTable

    be = object.__new__(EventsBackend)
    be.side, be.outcomes, be._args = "events", [], {}
    be.vm = type("VM", (), {"symbols": SymbolTable.from_kallsyms(
        f"ffffffff81000000 T _stext\n{CLONE:x} T kernel_clone\nffffffff81094500 T next\n")})()
    be._formats = {1392: ("kprobes/b", SPEC, parse_format(FORMAT))}
    be._cpus, be._stack_fmt, be._rename_fmt = cpus, None, None
    return be


def test_events_collect_decodes_a_repeated_payload_once_and_places_it_at_each_record():
    """The events side keeps each distinct record payload (the bytes after struct
    trace_entry) decoded once: each hit's pid, comm, CPU and context are its own record's,
    its ip and arguments its own payload's."""
    be = events_backend([0])

    def rec(pid, flags=0, x=7, ip=CLONE):
        data = bytearray(record(pid, ip, b"v", x, b"sh"))
        data[2] = flags                                   # common_flags
        return event(bytes(data))
    pg = page([rec(7), rec(8, flags=0x10), rec(0), rec(7, x=8), rec(9, ip=CLONE + 5)])
    be._raw_pages = lambda cpu: ([pg], True)
    be._read_after = lambda cpus: {"stats0": b"entries: 0\noverrun: 0\n",
                                   "saved_cmdlines": b"7 cat\n8 ls\n"}
    hits = be.collect()
    args = (("s", '"v"'), ("x", "7"), ("c", '"sh"'))
    assert [(h.seq, h.pid, h.comm, h.irq, h.ip, h.args) for h in hits] == [
        (0, 7, "cat", "task", "kernel_clone+0x0/0x360", args),
        (1, 8, "ls", "irq", "kernel_clone+0x0/0x360", args),
        (2, 0, "<idle>", "task", "kernel_clone+0x0/0x360", args),
        (3, 7, "cat", "task", "kernel_clone+0x0/0x360", (("s", '"v"'), ("x", "8"), ("c", '"sh"'))),
        (4, 9, "<...>", "task", "kernel_clone+0x5/0x360", args)]


def test_events_collect_merges_cpus_by_time_stamp_keeping_each_cpus_order():
    """Two CPUs' records in time-stamp order, a tie taken CPU 0 first, another event's
    record left out, and a CPU's record stamped earlier than the one before it (an
    interrupt's event nested in another's write) kept after it, as its buffer holds
    them (kernel/trace/ring_buffer.c commits in order)."""
    be = events_backend([0, 1])

    def ev(x, delta, pid=7, etype=1392):
        return event(record(pid, CLONE, b"v", x, b"sh", etype=etype), delta=delta)
    stamp = struct.pack("<II", (1001 & ((1 << 27) - 1)) << 5 | 31, 1001 >> 27)  # TIME_STAMP
    pages = {0: [page([ev(1, 0), ev(2, 10), ev(3, 10), ev(4, 10)], ts=1000)],
             1: [page([ev(11, 0, 8), ev(99, 5, 8, etype=7), ev(12, 5, 8), ev(13, 5, 8),
                       stamp, ev(14, 0, 8)], ts=1005)]}
    be._raw_pages = lambda cpu: (pages[cpu], True)
    be._read_after = lambda cpus: {**{f"stats{c}": b"entries: 0\noverrun: 0\n" for c in cpus},
                                   "saved_cmdlines": b"7 cat\n8 ls\n"}
    hits = be.collect()
    assert [(h.arg("x"), h.cpu, h.comm, h.seq) for h in hits] == [
        ("1", 0, "cat", 0), ("11", 1, "ls", 1), ("2", 0, "cat", 2), ("12", 1, "ls", 3),
        ("3", 0, "cat", 4), ("13", 1, "ls", 5), ("14", 1, "ls", 6), ("4", 0, "cat", 7)]


def test_events_collect_gives_each_hit_the_renames_of_its_pid_recorded_after_it():
    """``task:task_rename`` records (``_rename_fmt``): each hit carries the comms its pid
    took in renames recorded after it, in their order (``comm_alts``, for the diff's
    ``comm-change`` rule), the last hit too when a rename follows it; another pid's
    renames none."""
    from types import SimpleNamespace as NS
    be = events_backend([0])
    be._rename_fmt = (300, NS(offset=8, size=4), NS(offset=12, size=16))

    def ren(pid, comm):
        return event(struct.pack("<HBBii16s", 300, 0, 0, pid, pid, comm.encode()))

    def hit(pid, x):
        return event(record(pid, CLONE, b"v", x, b"sh"))
    pg = page([hit(7, 1), ren(7, "ls"), hit(7, 2), ren(7, "dd"), hit(7, 3), hit(8, 4),
               ren(8, "sh"), hit(7, 5), ren(7, "cat")])
    be._raw_pages = lambda cpu: ([pg], True)
    be._read_after = lambda cpus: {"stats0": b"entries: 0\noverrun: 0\n",
                                   "saved_cmdlines": b"7 dd\n8 sh\n"}
    assert [(h.arg("x"), h.comm_alts) for h in be.collect()] == [
        ("1", ("ls", "dd", "cat")), ("2", ("dd", "cat")), ("3", ("cat",)), ("4", ("sh",)),
        ("5", ("cat",))]
