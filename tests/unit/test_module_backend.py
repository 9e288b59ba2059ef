"""harness/backends/module.py without a VM: the fetch-program compiler, the events-line
parser and the records decoder, and decoding records into the trace file's text."""
from __future__ import annotations

import errno

import pytest

from harness.backends.module import (FLAG_POST, REG_OFFSET, Item, ModuleBackend, ModuleError,
                                     UnsupportedFetchArgError, _Placed, add_line,
                                     compile_arg, decode_arg, parse_events_line,
                                     parse_records)
from harness.errors import SymbolNotFoundError
from harness.kernel.grammar.fetch import FAULT, UNKNOWN, FaultError, evaluate, format_value
from harness.kernel.grammar import parse, parse_arg
from harness.kernel.symbols import SymbolTable, remembered_symbolizer

KALLSYMS = """\
ffffffff81000000 T _stext
ffffffff8134a350 T do_sys_openat2
ffffffff8134a4c0 T do_sys_open
ffffffff8134a520 T __x64_sys_openat
ffffffff8134a5c0 t next_fn
ffffffff8134cc50 T vfs_read
ffffffff8134cd50 T vfs_write
ffffffff82000000 D jiffies
ffffffff82000040 D other_data
ffffffff82e00000 T _etext
"""


def arg(text, **kw):
    return parse_arg(text, **kw)


@pytest.mark.parametrize("text,program", [
    ("dfd=%di:s32", "reg:112,val"),
    ("%ax", "reg:80,val"),
    ("path=+0(%si):ustring", "reg:104,ustr:0:4096"),
    ("p=+u8(%si):string", "reg:104,ustr:8:4096"),
    ("p=+0(+u8(%si)):string", "reg:104,uld:8,str:0:4096"),
    ("k=+8(%di):string", "reg:112,str:8:4096"),
    ("n=+8(+0(%di)):u32", "reg:112,ld:0,mem:8:4"),
    ("n=-8(%sp):x16", "reg:152,mem:-8:2"),
    ("u=+u4(%si):u8", "reg:104,umem:4:1"),
    ("a=+0(%si):u8[3]", "reg:104,dup,mem:0:1,dup,mem:1:1,mem:2:1"),
    ("a=+16(%di):x64[2]", "reg:112,dup,mem:16:8,mem:24:8"),
    ("s=+0(%si):string[2]", "reg:104,dup,ld:0,str:0:4096,ld:8,str:0:4096"),
    ("s=+u0(%si):ustring[2]", "reg:104,dup,uld:0,ustr:0:4096,uld:8,ustr:0:4096"),
    ("c=$comm", "comm"),
    ("c=$COMM:string", "comm"),
    ('d=\\"ab c"', "data:616220 63".replace(" ", "")),
    ("s=$stack2", "stack:2,val"),
    ("s=$stack", "sp,val"),
    ("a=$arg2:s16", "arg:1,val"),
    ("a=$arg8", "arg:7,val"),
    ("i=\\-1", "imm:0xffffffffffffffff,val"),
    ("i=\\0x10:string", "imm:0x10,str:0:4096"),
    ("m=@0xffffffff82000040:u16", "imm:0xffffffff82000040,mem:0:2"),
    ("m=@0xffffffff82000040:string", "imm:0xffffffff82000040,str:0:4096"),
    ("m=@0xffffffff82000040", "imm:0xffffffff82000040,mem:0:8"),
    ("m=+0(@0xffffffff82000040):u32", "imm:0xffffffff82000040,ld:0,mem:0:4"),
    ("y=%ax:symstr", "reg:80,val"),
    ("y=+8(%di):symstr", "reg:112,ld:8,val"),
    ("y=+8(%di):symbol", "reg:112,mem:8:8"),
    ("b=%dx:b4@4/32", "reg:96,val"),
    ("b=+2(%di):b3@1/8", "reg:112,mem:2:1"),
])
def test_compile(text, program):
    assert compile_arg(arg(text)) == program


def test_compile_retval_and_maxlen():
    spec = parse("r:g/e do_sys_openat2 ret=$retval:s64 s=+0(%ax):string")
    assert [compile_arg(a, maxlen=64) for a in spec.args] == ["retval,val", "reg:80,str:0:64"]


def test_compile_every_register():
    for name, off in REG_OFFSET.items():
        assert compile_arg(arg(f"r=%{name}")) == f"reg:{off},val"
    assert REG_OFFSET["ss"] == 160                 # MAX_REG_OFFSET, sizeof(pt_regs) - 8


def test_compile_symbol_resolution():
    table = SymbolTable.from_kallsyms(KALLSYMS)
    resolve = lambda n: table.lookup(n).addr       # noqa: E731
    assert compile_arg(arg("j=@jiffies+8:u32"), resolve=resolve) == \
        "imm:0xffffffff82000008,mem:0:4"
    assert compile_arg(arg("j=@jiffies-8"), resolve=resolve) == "imm:0xffffffff81fffff8,mem:0:8"
    with pytest.raises(SymbolNotFoundError):
        compile_arg(arg("j=@no_such_sym"), resolve=resolve)
    with pytest.raises(UnsupportedFetchArgError, match="'j'.*needs a symbol table"):
        compile_arg(arg("j=@jiffies"))


def test_unsupported_names_the_arg():
    # The kernel parses this (string[N] stores after an immediate) but its loop returns
    # -EILSEQ after the first element; the module refuses it up front.
    with pytest.raises(UnsupportedFetchArgError, match="fetch arg 'weird'") as ei:
        compile_arg(arg("weird=\\0x10:string[2]"))
    assert ei.value.arg == "weird"


def test_add_line():
    spec = parse("p:g/e do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring")
    line = add_line(7, "p", 0xffffffff8134a350, [compile_arg(a) for a in spec.args],
                    flags=FLAG_POST)
    assert line == "add 7 p ffffffff8134a350 0 1 reg:112,val reg:104,ustr:0:4096"
    assert add_line(1, "r", 0x10, [], maxactive=4) == "add 1 r 10 4 0"


# ---------------------------------------------------------------- events lines

LINE_PRE = ("5 1 pre ftrace 0 113 636174 ffffffff8134a350 ffffffff8134a351 0 4 "
            "iffffff9c s14:2f70726f632f76657273696f6e i80000 s4:636174")
LINE_RET = ("6 2 ret ftrace 1 113 636174 ffffffff8134a350 ffffffff8134a56a ffffffff8134a56a 1 i3")


def test_parse_events_line():
    rec = parse_events_line(LINE_PRE)
    assert (rec.seq, rec.id, rec.kind, rec.mode, rec.cpu, rec.pid, rec.comm) == \
        (5, 1, "pre", "ftrace", 0, 113, "cat")
    assert (rec.addr, rec.ip, rec.ret_addr) == (0xffffffff8134a350, 0xffffffff8134a351, 0)
    assert rec.args[0] == (Item("i", value=0xffffff9c),)
    assert rec.args[1] == (Item("s", ret=14, data=b"/proc/version"),)
    rec = parse_events_line("1 3 post int3 0 1 - ffffffff8134a355 ffffffff8134a357 0 2 - "
                            "e-14,s0:,f-34")
    assert rec.comm == "" and rec.args == ((), (Item("e", -14), Item("s", 0), Item("f", -34)))


@pytest.mark.parametrize("bad", [
    "", "1 2 pre", "1 1 pre ftrace 0 1 63 10 11 0 2 i1",          # NARGS says 2, one given
    "1 1 jump ftrace 0 1 63 10 11 0 0", "1 1 pre warp 0 1 63 10 11 0 0",
    "1 1 pre int3 0 1 63 10 11 0 1 q5", "1 1 pre int3 0 1 zz 10 11 0 0",
])
def test_parse_events_line_rejects(bad):
    with pytest.raises(ModuleError, match="unreadable"):
        parse_events_line(bad)


@pytest.mark.parametrize("text,items,shown", [
    ("x=%di:s32", [Item("i", value=0xffffff9c)], "-100"),
    ("x=%di:x32", [Item("i", value=0xdeadbeef12345678)], "0x12345678"),
    ("x=%di:u8", [Item("i", value=0x1ff)], "255"),
    ("x=+0(%di):u32", [Item("f", ret=-14)], "(unknown)"),
    ("x=+0(+0(%di)):u32", [Item("e", ret=-14)], "(unknown)"),
    ("x=+0(%si):string", [Item("s", ret=4, data=b"abc")], '"abc"'),
    ("x=+0(%si):string", [Item("s", ret=1)], '""'),
    ("x=+0(%si):ustring", [Item("s", ret=0)], "(fault)"),          # empty ustring
    ("x=+0(%si):string", [Item("s", ret=-14)], "(fault)"),
    ("x=+0(+0(%si)):string", [Item("e", ret=-14)], "(fault)"),
    ("x=$comm", [Item("s", ret=4, data=b"cat")], '"cat"'),
    ("x=%dx:b4@4/32", [Item("i", value=0xabcd)], str(0xc)),
    ("x=+0(%di):b3@5/8", [Item("i", value=0b11100000)], "7"),
    ("x=+0(%di):u8[3]", [Item("i", value=1), Item("f", ret=-14), Item("i", value=3)],
     "{1,(unknown),3}"),
    ("x=+0(%di):u8[3]", [Item("i", value=1), Item("e", ret=-14)], "{1,(unknown),(unknown)}"),
    ("x=+0(%di):string[2]", [Item("s", ret=2, data=b"a"), Item("s", ret=2, data=b"b")],
     '{"a","b"}'),
    ("x=+0(%di):string[3]", [Item("s", ret=2, data=b"a"), Item("s", ret=2, data=b"b"),
                             Item("e", ret=-14)], '{(fault),"b",(unknown)}'),
    ("x=%ax:symstr", [Item("i", value=0xffffffff8134a355)], '"do_sys_openat2+0x5/0x170"'),
    ("x=%ax:symstr", [Item("i", value=0x1234)], '"0x1234"'),
    ("x=%ax:symbol", [Item("i", value=0xffffffff8134a4c0)], "do_sys_open+0x0/0x60"),
])
def test_decode_and_format(text, items, shown):
    table = SymbolTable.from_kallsyms(KALLSYMS)
    sym = remembered_symbolizer(table)
    a = arg(text)
    assert format_value(a, decode_arg(a, items, sym), sym) == shown


# ---------------------------------------------------------------- hits, as the trace prints

class FakeVM:
    """Symbols, and a guest whose commands print nothing (no other trace events, no
    module loaded)."""

    def __init__(self):
        self.symbols = SymbolTable.from_kallsyms(KALLSYMS)

    def run(self, cmd, stdin=None, **kw):
        import types
        # available_filter_functions: every function of the table has an ftrace location
        out = ("".join(f"{s.name}\n" for s in self.symbols)
               if "available_filter_functions" in cmd else "")
        return types.SimpleNamespace(stdout=out, out=out.encode(), status=0)

    def pull(self, path, **kw):
        return b""

    def pull_many(self, paths, **kw):
        # available_filter_functions: every function of the table has an ftrace location
        return ["".join(f"{s.name}\n" for s in self.symbols).encode()
                if p.endswith("available_filter_functions") else b"" for p in paths]

    def refresh_module_symbols(self):
        return []


def test_hits_from_records():
    be = ModuleBackend(FakeVM())
    pre = parse("p:kph/open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32 "
                "c=$comm")
    ret = parse("r:kph/ret do_sys_openat2 ret=$retval:s64")
    sym = remembered_symbolizer(be.vm.symbols)
    h = be._hit(parse_events_line(LINE_PRE), _Placed(1, "kph/open", pre, 0xffffffff8134a350, "p"),
                sym)
    assert (h.side, h.probe, h.kind, h.seq, h.cpu, h.pid, h.comm, h.mode) == \
        ("module", "kph/open", "p", 5, 0, 113, "cat", "ftrace")
    assert h.ip == "do_sys_openat2+0x0/0x170" and h.ret_from is None
    assert h.args == (("dfd", "-100"), ("path", '"/proc/version"'), ("flags", "0x80000"),
                      ("c", '"cat"'))
    r = be._hit(parse_events_line(LINE_RET), _Placed(2, "kph/ret", ret, 0xffffffff8134a350, "r"),
                sym)
    assert (r.kind, r.ip, r.ret_from, r.args) == \
        ("r", "__x64_sys_openat+0x4a/0xa0", "do_sys_openat2", (("ret", "3"),))
    assert r.line() == "cat-113 [001] kph/ret: (__x64_sys_openat+0x4a/0xa0 <- do_sys_openat2) ret=3"


def encode(rec, *, pad=b"\0"):
    """``rec`` as kph_record() lays it in the module's buffer (``struct kph_rec``, then
    ``struct kph_item``s, a string's bytes padded to 8 with ``pad``): this test's own
    writer of the layout probes/kmod/kph_kprobes.c documents, not the decoder's."""
    import struct

    items = b""
    for i, arg_items in enumerate(rec.args):
        for it in arg_items:
            val = it.value if it.type == "i" else len(it.data) if it.type == "s" else 0xdead
            items += struct.pack("<HBBiQ", i, ord(it.type), 0, it.ret, val)
            if it.type == "s":
                items += it.data + pad * (-len(it.data) % 8)
    kind = {"pre": b"p", "post": b"s", "ret": b"r"}[rec.kind]
    head = struct.pack("<IIQQQQII", 72 + len(items), rec.id, rec.seq, rec.addr, rec.ip,
                       rec.ret_addr, rec.pid, rec.cpu)
    head += kind + rec.mode[:1].encode() + struct.pack("<H", len(rec.args))
    head += bytes([rec.irq == "irq"]) + b"\0" * 3 + rec.comm.encode().ljust(16, b"\0")
    assert len(head) == 72
    return head + items


LINES = [LINE_PRE.replace(" ftrace ", " ftrace:task "),
         LINE_RET.replace(" ftrace ", " ftrace:irq "),
         "1 3 post int3:task 0 1 - ffffffff8134a355 ffffffff8134a357 246 2 - e-14,s0:,f-34",
         "2 3 pre optimized:task 1 7 6b776f726b65722f303a3130 10 11 0 1 s9:6162636465666768"]


def test_a_records_drain_reads_as_its_events_lines():
    """The binary drain decodes to what the same records' text lines parse to (each kind,
    mode, context, a 15-byte comm, a string whose length is a multiple of 8, an empty
    string, failed and aborted reads, a post record's flags)."""
    want = [parse_events_line(ln) for ln in LINES]
    data = b"".join(encode(r, pad=b"\xaa") for r in want)
    assert parse_records(data) == want
    assert parse_records(b"") == []


@pytest.mark.parametrize("cut", [
    lambda d: d[:-1],                               # the last item cut short
    lambda d: d[:40],                               # a header cut short
    lambda d: d[:48] + b"x" + d[49:],               # a kind that is none
    lambda d: d[:49] + b"q" + d[50:],               # a mode that is none
    lambda d: b"\x10" + d[1:],                      # a length shorter than a header
    lambda d: d[:72] + b"\x09" + d[73:],            # an item of an arg past NARGS
    lambda d: d[:74] + b"z" + d[75:],               # an item type that is none
])
def test_records_that_are_not_the_layout_are_refused(cut):
    data = encode(parse_events_line(LINES[0]))
    with pytest.raises(ModuleError, match="unreadable .*/records"):
        parse_records(cut(data))


def test_collect_decodes_a_repeated_payload_once_and_places_it_at_each_record(monkeypatch):
    """collect() keeps each distinct record payload (all but SEQ, CPU, PID and COMM)
    decoded once: every hit is what _hit() makes of its own record, alone; a record that
    repeats a payload with a cut-short place is still the module's unreadable drain; the
    drain and the stats after it are one request."""
    from harness.backends.module import ModuleError
    be = ModuleBackend(FakeVM())
    pre = parse("p:kph/open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32 "
                "c=$comm")
    ret = parse("r:kph/ret do_sys_openat2 ret=$retval:s64")
    be._placed = {1: _Placed(1, "kph/open", pre, 0xffffffff8134a350, "p"),
                  2: _Placed(2, "kph/ret", ret, 0xffffffff8134a350, "r")}
    rest_pre, rest_ret = LINES[0].split(" ", 7)[7], LINES[1].split(" ", 7)[7]
    lines = [LINES[0], LINES[1],
             f"7 1 pre ftrace:task 1 200 6c73 {rest_pre}",         # same payload, ls-200
             f"8 2 ret ftrace:irq 0 200 6c73 {rest_ret}",
             f"9 1 pre ftrace:irq 1 0 - {rest_pre}",               # another context
             f"10 1 pre ftrace:task 0 113 636174 {rest_pre.replace('i80000', 'i8000')}",
             f"11 1 pre int3:task 0 113 636174 {rest_pre}"]        # another mode
    recs = [parse_events_line(ln) for ln in lines]
    stats = b"buffer size 4194304 used 1 records 7 dropped 0 seq 12\n"
    asked = []

    def pull_many(paths, **kw):
        asked.append(paths)
        return [b"".join(map(encode, recs)), stats]
    monkeypatch.setattr(be.vm, "pull_many", pull_many, raising=False)
    sym = remembered_symbolizer(be.vm.symbols)
    got = be.collect()
    assert asked == [["/sys/kernel/debug/kph/records", "/sys/kernel/debug/kph/stats"]]
    want = [be._hit(r, be._placed[r.id], sym) for r in recs]
    assert got == want
    assert [(h.seq, h.cpu, h.pid, h.comm, h.irq) for h in got[2:5]] == \
        [(7, 1, 200, "ls", "task"), (8, 0, 200, "ls", "irq"), (9, 1, 0, "", "irq")]
    assert got[5].arg("flags") == "0x8000" and got[0].arg("flags") == "0x80000"
    assert got[6].mode == "int3" and got[0].mode == "ftrace"
    be2 = ModuleBackend(FakeVM())
    be2._placed = be._placed
    data = encode(recs[0]) + encode(recs[2])[:60]
    monkeypatch.setattr(be2.vm, "pull_many", lambda paths, **kw: [data, stats], raising=False)
    with pytest.raises(ModuleError, match="unreadable"):
        be2.collect()


def test_collect_fails_on_records_the_module_dropped(monkeypatch):
    from harness.errors import GuestLossError
    be = ModuleBackend(FakeVM())
    be._dropped0 = 3
    monkeypatch.setattr(be.vm, "pull_many", lambda paths, **kw: [
        b"", b"buffer size 4096 used 0 records 0 dropped 5 seq 9\n"], raising=False)
    with pytest.raises(GuestLossError, match="dropped 2 record") as ei:
        be.collect()
    assert ei.value.needed_mib == 0         # no record kept to scale from
    monkeypatch.setattr(be.vm, "pull_many", lambda paths, **kw: [
        b"", b"buffer size 4194304 used 4194300 records 40000 dropped 40003 seq 9\n"],
        raising=False)
    with pytest.raises(GuestLossError, match=r"dropped 40000 record.*--guest-buffer 10\)$"):
        be.collect()


def test_symbol_lookup_failure_is_enoent(monkeypatch):
    be = ModuleBackend(FakeVM())
    monkeypatch.setattr(be, "load", lambda: None)
    monkeypatch.setattr(be, "list", lambda: {})
    out = be.register([parse("p:kph/x no_such_function"), parse("p:kph/y vfs_read j=@nope")])
    assert [(o.probe, o.accepted, o.errno) for o in out] == \
        [("kph/x", False, errno.ENOENT), ("kph/y", False, errno.ENOENT)]


# ------------------------------------- the module's op language against fetchargs.evaluate

KSTART, TASK_SIZE_MAX = 0xFFFF800000000000, (1 << 47) - 4096


class Ctx:
    """One stopped CPU: registers and a sparse memory, for evaluate() and for _run()."""

    def __init__(self, regs, mem, comm="cat"):
        self.regs, self.mem, self._comm = regs, mem, comm

    def _get(self, addr, size):
        for base, data in self.mem.items():
            if base <= addr and addr + size <= base + len(data):
                return data[addr - base:addr - base + size]
        raise FaultError(addr, size)

    def reg(self, name):
        return self.regs.get(name, 0)

    def read(self, addr, size):
        if addr < KSTART:
            raise FaultError(addr, size)
        return self._get(addr, size)

    def read_user(self, addr, size):
        if addr + size > TASK_SIZE_MAX:
            raise FaultError(addr, size)
        return self._get(addr, size)

    def comm(self):
        return self._comm

    def retval(self):
        return self.regs.get("ax", 0)

    def symbol_addr(self, name):
        return {"jiffies": 0xFFFFFFFF82000000}[name]

    def symbolize(self, addr):
        return None


def _cstr(ctx, addr, maxlen, user):
    out = b""
    while len(out) < maxlen:
        try:
            b = (ctx.read_user if user else ctx.read)(addr + len(out), 1)
        except FaultError:
            return -14, b""
        if b == b"\0":
            return len(out) + 1, out
        out += b
    return maxlen, out[:-1]


def _user(addr, user):
    # kph_user_addr(): CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE, as probe_mem_read()
    return user or addr < TASK_SIZE_MAX


def run_program(program, ctx):
    """What kph_run() in probes/kmod/kph_kprobes.c records, in Python."""
    names = {v: k for k, v in REG_OFFSET.items()}
    stack, items = [], []
    for op in program.split(","):
        name, *ops = op.split(":")
        if name == "reg":
            stack.append(ctx.reg(names[int(ops[0])]))
        elif name == "imm":
            stack.append(int(ops[0], 0))
        elif name == "sp":
            stack.append(ctx.reg("sp"))
        elif name == "retval":
            stack.append(ctx.retval())
        elif name == "dup":
            stack.append(stack[-1])
        elif name in ("ld", "uld"):
            try:
                a = (stack[-1] + int(ops[0])) & (1 << 64) - 1
                read = ctx.read_user if _user(a, name == "uld") else ctx.read
                stack[-1] = int.from_bytes(read(a, 8), "little")
            except FaultError:
                items.append(Item("e", -14))
                return items
        elif name == "val":
            items.append(Item("i", value=stack.pop()))
        elif name in ("mem", "umem"):
            a = stack.pop() + int(ops[0])
            try:
                read = ctx.read_user if _user(a, name == "umem") else ctx.read
                data = read(a, int(ops[1]))
                items.append(Item("i", value=int.from_bytes(data, "little")))
            except FaultError:
                items.append(Item("f", -14))
        elif name in ("str", "ustr"):
            a = stack.pop() + int(ops[0])
            user = _user(a, name == "ustr")
            ret, data = _cstr(ctx, a, int(ops[1]), user)
            if user and ret == 1:
                ret = 0                     # strncpy_from_user_nofault(): "" gives 0
            items.append(Item("s", ret, data=data))
        elif name == "comm":
            items.append(Item("s", len(ctx.comm()) + 1, data=ctx.comm().encode()))
        elif name == "data":
            data = bytes.fromhex(ops[0])
            items.append(Item("s", len(data) + 1, data=data))
        else:
            raise AssertionError(f"op {name} not modelled")
    return items


KDATA, UDATA = 0xFFFF888000100000, 0x7FFF00001000


def _ctx():
    kmem = bytearray(4096)                  # whole pages: evaluate() reads rest-of-page
    kmem[0:8] = (KDATA + 32).to_bytes(8, "little")
    kmem[8:16] = (0x1234).to_bytes(8, "little")
    kmem[16:32] = (KDATA + 32).to_bytes(8, "little") + (KDATA + 40).to_bytes(8, "little")
    kmem[32:48] = b"hello\0\0\0world\0\0\0"
    umem = bytearray(4096)
    umem[0:14] = b"/proc/version\0"
    mem = {KDATA: bytes(kmem), UDATA: bytes(umem),
           0xFFFFFFFF82000000: (123456).to_bytes(8, "little")}
    return Ctx({"di": KDATA, "si": UDATA, "bx": 0xFFFF888000900000, "r8": UDATA + 14,
                "ax": 0xFFFFFFFFFFFF8001, "sp": KDATA}, mem)


@pytest.mark.parametrize("text", [
    "a=%di:s32", "a=%si", "p=+0(%si):ustring", "p=+u0(%si):string", "k=+0(%di):string",
    "k=+8(%di):string", "n=+8(+0(%di)):u32", "n=+0(%di):u8[4]", "n=+0(%di):b4@4/8",
    "s=+16(%di):string[2]", "s=+0(%si):string", "c=$comm", 'd=\\"xy"', "f=+0(%bx):u64",
    "e=+0(%r8):ustring", "m=@0xffff888000100000:u16", "j=@jiffies:u32", "i=\\-2:s8",
    "r=$retval:x16", "y=+8(%di):x8[3]", "z=+0(%si):string", "u=+0(%si):u8[4]",
    "w=+0(%r8):string", "v=+8(+0(%si)):string",
])
def test_program_matches_evaluate(text):
    ctx = _ctx()
    a = parse_arg(text, is_return=True)
    items = run_program(compile_arg(a, resolve=ctx.symbol_addr), ctx)
    assert format_value(a, decode_arg(a, items)) == format_value(a, evaluate(a, ctx))


def test_failed_inner_deref_of_a_string_is_a_fault():
    """store_trace_args() makes the data_loc of a failed dynamic fetch (fault); a 6.1 guest
    prints ``f=(fault)`` for ``f=+0(+0(%dx)):string`` at do_sys_openat2 (how->flags is no
    pointer). fetchargs.evaluate() leaves it (unknown)."""
    ctx = _ctx()
    a = parse_arg("f=+0(+0(%bx)):string")
    items = run_program(compile_arg(a), ctx)
    assert items == [Item("e", -14)]
    assert format_value(a, decode_arg(a, items)) == "(fault)"


def test_an_aborted_string_fetch_shows_what_the_event_stores_after_it():
    """The same rule as fetchargs.evaluate (store_trace_args() keeps the aborted arg's
    data_loc): the module's items of one event, decoded together, give what the 6.1
    guest's trace printed for the two kph fuzz findings of seed 8128."""
    from harness.backends.module import decode_args

    spec = parse("p:e do_sys_openat2 a=+0(%di):symstr c=$comm")
    items = [[Item("e", -14)], [Item("s", ret=8, data=b"qemu-ga")]]
    assert decode_args(spec.args, items) == [b"qemu-ga", b"qemu-ga"]
    spec = parse("p:e do_sys_openat2 s=%r15:symstr t=+0(%r15):symstr")
    items = [[Item("i", value=0)], [Item("e", -14)]]
    assert decode_args(spec.args, items) == [b"0x0", b""]
    spec = parse("p:e do_sys_openat2 t=+0(%r15):symstr n=%di")
    assert decode_args(spec.args, [[Item("e", -14)], [Item("i", value=1)]]) == [FAULT, 1]


def test_decode_pads_missing_elements():
    a = arg("x=+0(%di):u16[3]")
    assert decode_arg(a, [Item("i", value=5)]) == [5, UNKNOWN, UNKNOWN]
    assert decode_arg(arg("x=+0(%si):string"), []) is UNKNOWN
    assert decode_arg(arg("x=%ax:symstr"), [Item("e", -14)]) is FAULT


# ---------------------------------------------------------------- the image step

def test_recipe_hash_covers_the_module_sources_only(tmp_path, monkeypatch):
    from harness.machine.image import store as images

    names = [p.name for p in images.kmod_sources()]
    assert "kph_kprobes.c" in names and "Makefile" in names
    kmod = tmp_path / "kmod"
    kmod.mkdir()
    for p in images.kmod_sources():
        (kmod / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(images, "KMOD_DIR", kmod)
    base = images.recipe_hash()
    (kmod / "kph_kprobes.o").write_bytes(b"build output")       # a local make
    (kmod / ".kph_kprobes.o.cmd").write_text("cmd")
    assert images.recipe_hash() == base
    (kmod / "kph_kprobes.c").write_text((kmod / "kph_kprobes.c").read_text() + "\n")
    assert images.recipe_hash() != base


def test_missing_headers_name_the_package(tmp_path):
    from harness.errors import SetupError
    from harness.machine.image.store import _build_kmod

    with pytest.raises(SetupError, match="apt-get install linux-headers-0.0.0-kph-none"):
        _build_kmod(tmp_path, "0.0.0-kph-none")


def test_parse_events_line_reads_the_context_of_the_probed_call():
    rec = parse_events_line(LINE_PRE.replace(" ftrace ", " ftrace:irq ", 1))
    assert (rec.mode, rec.irq) == ("ftrace", "irq")
    assert parse_events_line(LINE_PRE.replace(" ftrace ", " int3:task ", 1)).irq == "task"
    assert parse_events_line(LINE_PRE).irq == ""
    with pytest.raises(ModuleError):
        parse_events_line(LINE_PRE.replace(" ftrace ", " ftrace:nmi ", 1))


def test_symbol_in_section_reads_a_relocatable_objects_symtab(tmp_path):
    """The flag's (section, offset) as a .ko holds it: st_value is the offset in its
    section (a relocatable object), st_shndx names the section."""
    import shutil
    import subprocess

    from harness.backends.module import symbol_in_section

    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler (build-essential) is part of the test setup"
    src = tmp_path / "m.c"
    src.write_text("int pad[3] = {1, 2, 3};\nstatic _Bool recording;\n"
                   "int get(void) { return pad[0] + recording; }\n"
                   "void set(_Bool v) { recording = v; }\n")
    obj = tmp_path / "m.o"
    subprocess.run([cc, "-c", "-O2", "-o", str(obj), str(src)], check=True)
    section, offset = symbol_in_section(obj.read_bytes(), "recording")
    assert section == ".bss" and offset == 0
    assert symbol_in_section(obj.read_bytes(), "pad") == (".data", 0)
    assert symbol_in_section(obj.read_bytes(), "get") is None       # a function
    assert symbol_in_section(obj.read_bytes(), "missing") is None
    assert symbol_in_section(b"not an ELF file", "recording") is None


def test_regs_masked_as_the_probed_path_saved_them():
    """PtRegs.mask_loaded(): an ftrace-based kprobe's flags are pushfq's image (RF and VM
    cleared: ftrace_regs_caller); read now or later, and not a value a handler sets."""
    from harness.kernel.kprobes import MASK64, X86_EFLAGS_RF, X86_EFLAGS_VM, PtRegs
    mask = ~(X86_EFLAGS_RF | X86_EFLAGS_VM) & MASK64
    later = PtRegs(loader=lambda names: {n: 0x10206 if n == "flags" else 1 for n in names})
    later.mask_loaded("flags", mask)
    assert later.flags == 0x206 and later.di == 1
    now = PtRegs({"flags": 0x30246})
    now.mask_loaded("flags", mask)
    assert now.flags == 0x246 and now.snapshot()["flags"] == 0x246
    now.flags = 0x10202                                 # a handler's write stands
    assert now.flags == 0x10202 and now.dirty == {"flags": 0x10202}
    whole = PtRegs(loader=lambda names: {n: 0x10206 for n in names})
    whole.mask_loaded("flags", mask)
    assert whole.snapshot()["flags"] == 0x206 and whole.snapshot()["ip"] == 0x10206
