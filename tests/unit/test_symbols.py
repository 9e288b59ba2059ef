"""harness/kernel/symbols.py: kallsyms, vmlinux, the blacklist and register_kprobe()'s address
rules, on inline fixtures and hand-assembled x86-64 bytes (no VM)."""
import errno
import os
import subprocess
import textwrap

import pytest

from harness.errors import ProbeRejectedError, ProbeSpecError, SetupError, SymbolNotFoundError
from harness.kernel.symbols import (ARCH, Blacklist, Insn, SymbolTable, X86_64, check_probe_address,
                             instruction_at, kprobe_addr, load_kallsyms_cached)

KALLSYMS = textwrap.dedent("""\
    0000000000000000 A fixed_percpu_data
    0000000000006000 A cpu_tss_rw
    ffffffff80f00000 r dup_static
    ffffffff81000000 T startup_64
    ffffffff81000000 T _stext
    ffffffff81000000 T _text
    ffffffff81000100 t probe_me
    ffffffff81000140 T do_sys_open
    ffffffff81000180 t dup_static
    ffffffff810001a0 t asm_exc_page_fault
    ffffffff810001c0 t helper.cold
    ffffffff810001d0 t helper
    ffffffff810001f0 t dup_static
    ffffffff81000200 t ibt_func
    ffffffff81000240 t odd_insns
    ffffffff81000280 T _etext
    ffffffff82000000 D jiffies
    ffffffff82000008 d dup_static
    ffffffff82000010 B __bss_stop
    ffffffffc0002000 t foo_fn\t[mymod]
    ffffffffc0002020 T foo_exported\t[mymod]
    ffffffffc0002040 t do_sys_open\t[mymod]
    ffffffffc0003000 d foo_data\t[mymod]
    ffffffffc0010000 t bpf_prog_6deef7357e7b4530\t[bpf]
    ffffffffc0010100 t bpf_prog_end\t[bpf]
    """)

BLACKLIST = textwrap.dedent("""\
    0xffffffff810001a0-0xffffffff810001c0\tasm_exc_page_fault
    0xffffffff810001a0-0xffffffff810001c0\tasm_exc_page_fault
    0xffffffff810001d0-0xffffffff810001f0\thelper
    0xffffffffc0002020-0xffffffffc0002040\tfoo_exported [mymod]
    """)

PROBE_ME = 0xffffffff81000100
# probe_me: (offset, bytes, instruction)
PROBE_ME_CODE = [
    (0x00, "0f 1f 44 00 00", "nop5: the __fentry__ site"),
    (0x05, "55", "push rbp"),
    (0x06, "48 89 e5", "mov rbp, rsp"),
    (0x09, "41 57", "push r15"),
    (0x0b, "e8 10 00 00 00", "call"),
    (0x10, "5d", "pop rbp"),
    (0x11, "c3", "ret"),
    (0x12, "cc", "int3: straight-line-speculation padding"),
]
BOUNDARIES = [off for off, _, _ in PROBE_ME_CODE]


class FakeMemory:
    """Guest memory: a few byte strings at addresses, INT3 padding elsewhere."""

    def __init__(self, regions):
        self.regions = {a: bytes.fromhex(h.replace(" ", "")) for a, h in regions.items()}
        self.reads = []

    def __call__(self, addr, n):
        self.reads.append((addr, n))
        out = bytearray(b"\xcc" * n)
        for base, data in self.regions.items():
            for i in range(n):
                if 0 <= addr + i - base < len(data):
                    out[i] = data[addr + i - base]
        return bytes(out)

    def poke(self, addr, data):
        for base, old in self.regions.items():
            if 0 <= addr - base < len(old):
                i = addr - base
                self.regions[base] = old[:i] + data + old[i + len(data):]


@pytest.fixture
def table():
    return SymbolTable.from_kallsyms(KALLSYMS)


@pytest.fixture
def blacklist():
    return Blacklist(BLACKLIST)


@pytest.fixture
def mem():
    return FakeMemory({
        PROBE_ME: " ".join(h for _, h, _ in PROBE_ME_CODE),
        0xffffffff81000200: "f3 0f 1e fa 55 48 89 e5 5d c3",              # ibt_func
        # odd_insns: mov ss,eax | ud2 "xen" cpuid | push rbp | 06 (invalid in 64-bit)
        0xffffffff81000240: "8e d0 0f 0b 78 65 6e 0f a2 55 06",
        0xffffffffc0002000: "0f 1f 44 00 00 41 57 c3",                    # foo_fn
        0xffffffff81000140: "0f 1f 44 00 00 c3",                          # do_sys_open
        0xffffffff810001c0: "55 5d c3",                                   # helper.cold
    })


def check(table, blacklist, mem, addr, **kw):
    check_probe_address(addr, symbols=table, blacklist=blacklist, read=mem, **kw)


def rejected(table, blacklist, mem, addr, **kw):
    with pytest.raises(ProbeRejectedError) as ei:
        check(table, blacklist, mem, addr, **kw)
    assert ei.value.addr == addr
    return ei.value


# -- kallsyms ---------------------------------------------------------------------------

def test_parse_counts_and_fields(table):
    assert len(table) == len(KALLSYMS.splitlines())
    s = table.lookup("probe_me")
    assert (s.name, s.addr, s.type, s.module, s.size) == ("probe_me", PROBE_ME, "t", None, 0x40)
    assert s.is_text and str(s) == "probe_me"
    m = table.lookup("mymod:foo_fn")
    assert (m.module, m.type, m.size, str(m)) == ("mymod", "t", 0x20, "foo_fn [mymod]")


def test_counts_scanned_and_counted_at_once_agree():
    """count() and count_in() answer their first asks by scanning the names, then count
    every name at once: the same answers either way (number_of_same_symbols())."""
    from harness.kernel import symbols
    asks = [("dup_static", None), ("do_sys_open", None), ("do_sys_open", "mymod"),
            ("foo_fn", "mymod"), ("foo_fn", None), ("nothing", None), ("nothing", "mymod"),
            ("jiffies", "bpf")]
    t = SymbolTable.from_kallsyms(KALLSYMS)
    first = [(t.count(n), t.count_in(n, m)) for n, m in asks]
    assert first[:4] == [(4, 4), (2, 1), (2, 1), (1, 1)]
    assert first[4:] == [(1, 0), (0, 0), (0, 0), (1, 0)]
    for _ in range(symbols._SCANS):
        t.count("x")
        t.count_in("x", None)
    assert t._counts is not None and t._counts_by is not None     # counted at once now
    assert [(t.count(n), t.count_in(n, m)) for n, m in asks] == first


def test_size_is_distance_to_next_distinct_address(table):
    assert table.lookup("startup_64").size == 0x100      # aliases share the next address
    assert table.lookup("_stext").size == 0x100
    assert table.lookup("mymod:do_sys_open").size == 0x3000 - 0x2040
    # the last symbol of an owner has no next symbol to measure against
    assert table.lookup("mymod:foo_data").size == 0
    assert table.lookup("__bss_stop").size == 0


def test_lookup_prefers_text_then_lowest_address(table):
    assert table.lookup("dup_static").addr == 0xffffffff81000180
    # the core kernel before a module, as kallsyms_lookup_name()
    assert table.lookup("do_sys_open").addr == 0xffffffff81000140
    assert table.lookup("mymod:do_sys_open").addr == 0xffffffffc0002040
    # a module-only name needs no MOD: prefix
    assert table.lookup("foo_exported").module == "mymod"
    assert table.lookup("cpu_tss_rw").addr == 0x6000


def test_unknown_symbol_suggests_close_names(table):
    with pytest.raises(SymbolNotFoundError) as ei:
        table.lookup("do_sys_opn")
    err = ei.value
    assert isinstance(err, KeyError) and err.name == "do_sys_opn"
    assert "do_sys_open" in err.hint and "do_sys_open" in str(err)
    with pytest.raises(SymbolNotFoundError, match="probe_me"):
        table.lookup("probe")                          # substring match
    with pytest.raises(SymbolNotFoundError, match="mymod:foo_fn"):
        table.lookup("mymod:foo_fm")
    with pytest.raises(SymbolNotFoundError, match="add_module"):
        table.lookup("othermod:foo_fn")
    with pytest.raises(SymbolNotFoundError) as ei:
        table.lookup("qqqqqqqqqqqqqqqqqq")
    assert "no similar names" in ei.value.hint


def test_a_miss_caught_costs_no_close_matches(table, monkeypatch):
    """The close matches (difflib over every name, ~1 s on a Debian kernel) are worked out
    when the hint is read: a registration of 1,000 lines spent 8.8 s on nine misses it
    caught. A pickled error carries its hint."""
    import pickle

    calls = []
    real = type(table)._suggest
    monkeypatch.setattr(type(table), "_suggest",
                        lambda self, *a: calls.append(a) or real(self, *a))
    with pytest.raises(SymbolNotFoundError) as ei:
        table.lookup("do_sys_opn")
    assert calls == []
    back = pickle.loads(pickle.dumps(ei.value))
    assert len(calls) == 1 and "do_sys_open" in back.hint and back.name == "do_sys_opn"
    assert "do_sys_open" in str(ei.value) and len(calls) == 1     # worked out once


@pytest.mark.parametrize("spec, want", [
    ("probe_me", PROBE_ME),
    ("probe_me+0x10", PROBE_ME + 0x10),
    ("probe_me+16", PROBE_ME + 16),
    ("probe_me+010", PROBE_ME + 8),                    # kstrtoul(s, 0): octal
    ("probe_me+0", PROBE_ME),
    ("mymod:foo_fn+0x5", 0xffffffffc0002005),
    ("helper.cold+2", 0xffffffff810001c2),
    ("0xffffffff81000000", 0xffffffff81000000),
    (" 0xFFFFFFFF81000000 ", 0xffffffff81000000),
])
def test_resolve(table, spec, want):
    assert table.resolve(spec) == want


@pytest.mark.parametrize("spec", ["probe_me+0xzz", "probe_me+", "probe me", "probe_me+08", ""])
def test_resolve_rejects_malformed_specs(table, spec):
    with pytest.raises(ProbeSpecError) as ei:
        table.resolve(spec)
    assert ei.value.text == spec


def test_resolve_unknown_symbol(table):
    with pytest.raises(SymbolNotFoundError):
        table.resolve("nope+0x10")


def test_symbolize_and_format(table):
    assert table.symbolize(PROBE_ME + 5)[1] == 5
    assert table.format(PROBE_ME + 5) == "probe_me+0x5/0x40"
    assert table.format(PROBE_ME) == "probe_me+0x0/0x40"
    assert table.format(0xffffffffc0002003) == "foo_fn+0x3/0x20 [mymod]"
    # aliases: the first in kallsyms order, as the kernel prints it
    assert table.format(0xffffffff81000000) == "startup_64+0x0/0x100"
    # outside every symbol: per-cpu offsets, below the kernel, past an owner's last symbol
    for addr in (0x6000, 0x1000, 0xffffffff00000000, 0xffffffff82000011, 0xffffffffc0003008):
        assert table.symbolize(addr) is None
        assert table.format(addr) == f"0x{addr:x}"
    assert table.symbolize(0xffffffffc0003000)[0].name == "foo_data"


def test_symbolize_round_trips_every_symbol(table):
    for sym in table:
        if sym.type in "aA":
            continue
        first, off = table.symbolize(sym.addr)
        assert off == 0 and first.addr == sym.addr
        for delta in sorted({d for d in (0, 1, sym.size // 2, sym.size - 1) if 0 <= d < sym.size}):
            got, off = table.symbolize(sym.addr + delta)
            assert (got, off) == (first, delta)
            text = table.format(sym.addr + delta)
            assert text == f"{first.name}+0x{delta:x}/0x{sym.size:x}" + (
                f" [{sym.module}]" if sym.module else "")
            # and back: "name+off" resolves to the address (for the name lookup() picks)
            spec = f"{first.module}:{first.name}" if first.module else first.name
            if table.lookup(spec) == first:
                assert table.resolve(text.split("/")[0].replace(first.name, spec, 1)) == \
                    sym.addr + delta


def test_is_text(table):
    assert table.is_text(PROBE_ME)
    assert table.is_text(0xffffffff81000000)
    assert table.is_text(0xffffffff8100027f)
    assert not table.is_text(0xffffffff81000280)        # _etext is exclusive
    assert not table.is_text(0xffffffff82000000)        # jiffies
    assert not table.is_text(0xffffffff80f00000)        # rodata before _stext
    assert table.is_text(0xffffffffc0002010)            # module text
    assert not table.is_text(0xffffffffc0003000)        # module data
    assert not table.is_text(0xffffffffc0010010)        # BPF program
    assert not table.is_text(0x6000)


def test_is_text_without_stext_uses_symbol_types():
    t = SymbolTable.from_kallsyms("ffffffff81000000 t a\nffffffff81000010 d b\n"
                                  "ffffffff81000020 t c\n")
    assert t.is_text(0xffffffff81000005) and not t.is_text(0xffffffff81000015)


def test_add_module_and_reload(table):
    table.add_module("late", "ffffffffc0020000 t late_fn\nffffffffc0020040 t late_end\t[late]\n")
    assert table.lookup("late:late_fn").size == 0x40
    assert table.format(0xffffffffc0020001) == "late_fn+0x1/0x40 [late]"
    assert table.is_text(0xffffffffc0020001)
    # a reload moves the module: the old addresses are gone
    table.add_module("late", "ffffffffc0030000 t late_fn\nffffffffc0030020 t late_end\n")
    assert table.lookup("late:late_fn").addr == 0xffffffffc0030000
    assert table.symbolize(0xffffffffc0020001) is None
    assert table.lookup("probe_me").addr == PROBE_ME        # the rest is untouched


def test_module_sections_cap_symbol_size(table):
    assert table.format(0xffffffffc0002050) == "do_sys_open+0x10/0xfc0 [mymod]"
    table.add_module_sections("mymod", {".text": 0xffffffffc0002000,
                                        ".rodata": 0xffffffffc0002800,
                                        ".data": 0xffffffffc0003000})
    assert table.format(0xffffffffc0002050) == "do_sys_open+0x10/0x7c0 [mymod]"
    assert table.symbolize(0xffffffffc0002900) is None
    # no section starts above foo_data, so its size stays unknown
    assert table.lookup("mymod:foo_data").size == 0


def test_set_modules_is_add_module_and_add_module_sections_at_once(table):
    """vmctl.refresh_module_symbols merges every loaded module with one index rebuild; the
    result is the table the one-at-a-time calls make, and a changed module clears the key."""
    texts = {"late": "ffffffffc0020000 t late_fn\nffffffffc0020040 t late_end\n",
             "mymod": "ffffffffc0002040 t do_sys_open\nffffffffc0003000 d foo_data\n"}
    secs = {"mymod": {".text": 0xffffffffc0002000, ".rodata": 0xffffffffc0002800}}
    one = table.copy()
    for name, text in texts.items():
        one.add_module(name, text)
    one.add_module_sections("mymod", secs["mymod"])
    table.set_modules(texts, secs, key="k1")
    assert table.modules_key == "k1" and one.modules_key is None
    for addr in (0xffffffffc0020001, 0xffffffffc0002050, 0xffffffffc0002900, PROBE_ME + 1):
        assert table.format(addr) == one.format(addr), hex(addr)
    assert table.modules() == one.modules()
    assert table.lookup("late:late_fn").size == 0x40
    table.drop_module("late")
    assert table.modules_key is None and "late" not in table.modules()


def test_a_table_read_back_merges_modules_as_the_table_it_was_written_from(table):
    """SymbolTable.to_bytes leaves the rows out (60 of ~95 ms of reading a Debian kernel's
    table back): from_bytes makes them again from the columns when a merge needs them.
    The table read back, merged, is the table merged; and a copy of an older layout (the
    rows in it, no columns to make them from) is not read back."""
    import marshal

    texts = {"late": "ffffffffc0020000 t late_fn\nffffffffc0020040 t late_end\n",
             "mymod": "ffffffffc0002040 t do_sys_open\nffffffffc0003000 d foo_data\n"}
    secs = {"mymod": {".text": 0xffffffffc0002000, ".rodata": 0xffffffffc0002800}}
    table.add_module("early", "ffffffffc0010000 t early_fn\n")
    back = SymbolTable.from_bytes(table.to_bytes())
    assert back is not None and "_row_list" not in back.__dict__
    assert sorted(back._rows) == sorted(table._rows)
    for t in (table, back):
        t.set_modules(texts, secs)
        t.drop_module("early")
    assert back.__dict__.keys() == table.__dict__.keys()
    for k in table.__dict__:
        a, b = table.__dict__[k], back.__dict__[k]
        assert (sorted(a) if k == "_row_list" else a) == (sorted(b) if k == "_row_list" else b), k
    assert back.format(0xffffffffc0002050) == "do_sys_open+0x10/0x7c0 [mymod]"
    state = dict(table.__dict__, _rows=table._rows)
    for k in ("_row_list", "_orders", "_size0"):
        state.pop(k)
    assert SymbolTable.from_bytes(marshal.dumps((1, state))) is None
    assert SymbolTable.from_bytes(marshal.dumps((SymbolTable.STATE_FORMAT, state))) is None


def test_kallsyms_all_zero_addresses_is_a_setup_error():
    with pytest.raises(SetupError, match="kptr_restrict"):
        SymbolTable.from_kallsyms("0000000000000000 T _stext\n0000000000000000 t foo\n")


def test_kallsyms_malformed_line(tmp_path):
    with pytest.raises(SetupError, match=":2: not a kallsyms line"):
        SymbolTable.from_kallsyms("ffffffff81000000 T _stext\nnot an address here\n")
    with pytest.raises(SetupError, match="cannot read kallsyms"):
        SymbolTable.from_kallsyms(tmp_path / "missing")


def test_kallsyms_from_path_and_cache(tmp_path):
    p = tmp_path / "kallsyms"
    p.write_text(KALLSYMS)
    assert len(SymbolTable.from_kallsyms(p)) == len(SymbolTable.from_kallsyms(str(p)))
    a = load_kallsyms_cached(p)
    b = load_kallsyms_cached(str(p))
    assert a is not b and a.lookup("probe_me") == b.lookup("probe_me")
    a.add_module("late", "ffffffffc0020000 t late_fn\n")   # a's copy only
    with pytest.raises(SymbolNotFoundError):
        b.lookup("late:late_fn")
    with pytest.raises(SymbolNotFoundError):
        load_kallsyms_cached(p).lookup("late_fn")
    # a new mtime means a new parse
    p.write_text(KALLSYMS + "ffffffff82000020 b new_bss\n")
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_kallsyms_cached(p).lookup("new_bss").type == "b"


# -- vmlinux ----------------------------------------------------------------------------

def test_from_vmlinux_reads_elf_symtab(tmp_path):
    src = tmp_path / "tiny.c"
    src.write_text(textwrap.dedent("""\
        int data_var = 3;
        static int bss_var;
        __attribute__((noinline, used)) static int local_fn(int x) { bss_var += x; return bss_var; }
        int global_fn(int x) { return local_fn(x) + data_var; }
        __attribute__((weak)) int weak_fn(void) { return 1; }
        """))
    obj = tmp_path / "tiny.o"
    cc = ["gcc", "-O1", "-fno-asynchronous-unwind-tables", str(src)]
    subprocess.run(cc + ["-c", "-o", str(obj)], check=True)
    t = SymbolTable.from_vmlinux(obj)
    g, loc, w = t.lookup("global_fn"), t.lookup("local_fn"), t.lookup("weak_fn")
    assert (g.type, loc.type, w.type) == ("T", "t", "W")
    assert (t.lookup("data_var").type, t.lookup("bss_var").type) == ("D", "b")
    assert all(s.size > 0 for s in (g, loc, w))
    nm = subprocess.run(["nm", "-S", str(obj)], capture_output=True, text=True, check=True)
    sizes = {f[3]: int(f[1], 16) for f in (l.split() for l in nm.stdout.splitlines())
             if len(f) == 4}
    assert g.size == sizes["global_fn"] and loc.size == sizes["local_fn"]
    assert "tiny.c" not in {s.name for s in t}          # STT_FILE is not a symbol
    # linked, like a vmlinux: absolute addresses, so symbolize() works inside functions
    exe = tmp_path / "tiny"
    subprocess.run(cc + ["-nostdlib", "-static", "-Wl,-e,global_fn", "-o", str(exe)],
                   check=True)
    t = SymbolTable.from_vmlinux(exe)
    g = t.lookup("global_fn")
    assert g.addr > 0x1000 and t.is_text(g.addr)
    for delta in range(g.size):
        assert t.symbolize(g.addr + delta) == (g, delta)
    assert t.format(g.addr + 1).startswith("global_fn+0x1/0x")
    assert not t.is_text(t.lookup("data_var").addr)


def test_from_vmlinux_rejects_non_elf(tmp_path):
    p = tmp_path / "vmlinux"
    p.write_bytes(b"not an elf file at all")
    with pytest.raises(SetupError, match="vmlinux"):
        SymbolTable.from_vmlinux(p)


# -- blacklist --------------------------------------------------------------------------

def test_blacklist_find_half_open(blacklist):
    assert len(blacklist) == 4
    assert blacklist.find(0xffffffff810001a0) == "asm_exc_page_fault"
    assert blacklist.find(0xffffffff810001bf) == "asm_exc_page_fault"
    assert blacklist.find(0xffffffff810001c0) is None      # end is exclusive
    assert blacklist.find(0xffffffff8100019f) is None
    assert blacklist.find(0xffffffffc0002030) == "foo_exported"
    assert blacklist.find(0) is None and Blacklist("").find(PROBE_ME) is None


def test_blacklist_overlapping_ranges():
    bl = Blacklist("0xffffffff81000000-0xffffffff81001000\tbig_section_fn\n"
                   "0xffffffff81000100-0xffffffff81000110\tinner\n")
    assert bl.find(0xffffffff81000105) in ("big_section_fn", "inner")
    assert bl.find(0xffffffff81000800) == "big_section_fn"   # behind a later, shorter range
    assert bl.find(0xffffffff81001000) is None


def test_blacklist_real_format_and_errors(tmp_path):
    p = tmp_path / "blacklist"
    p.write_text("0xffffffff81c00990-0xffffffff81c009b0\tasm_exc_divide_error\n")
    assert Blacklist.from_file(p).find(0xffffffff81c009a0) == "asm_exc_divide_error"
    with pytest.raises(SetupError, match="as root"):
        Blacklist("0x0000000000000000-0x0000000000000000\tfoo\n")
    with pytest.raises(SetupError, match="line 1"):
        Blacklist("garbage\n")


# -- instructions -----------------------------------------------------------------------

def test_instruction_at():
    i = instruction_at(ARCH.nop5 + b"\x55", 0x1000)
    assert isinstance(i, Insn) and (i.addr, i.size, i.mnemonic, i.bytes) == (
        0x1000, 5, "nop", ARCH.nop5)
    call = instruction_at(bytes.fromhex("e810000000"), 0xffffffff81000000)
    assert (call.mnemonic, call.op_str, str(call)) == (
        "call", "0xffffffff81000015", "call 0xffffffff81000015")
    assert instruction_at(b"\x06", 0) is None                # push es: invalid in 64-bit
    assert instruction_at(b"", 0) is None
    xen = instruction_at(bytes.fromhex("0f0b78656e0fa2"), 0)
    assert (xen.size, xen.mnemonic) == (7, "cpuid")


@pytest.mark.parametrize("hexbytes, size", [
    ("0f01e8", 3),            # serialize (in sync_core(), so in finish_task_switch)
    ("f20f01ff", 4),          # pvalidate
    ("f30f01fe", 4),          # rmpadjust
    ("c4e27849c0", 5),        # tilerelease (AMX)
    ("c4e2794904250000000041", 10),   # AMX, SIB + disp32
])
def test_instructions_capstone_lacks_still_have_a_length(hexbytes, size):
    i = instruction_at(bytes.fromhex(hexbytes) + b"\x90" * 8, 0x1000)
    assert (i.size, i.mnemonic) == (size, ".byte")
    assert i.bytes == bytes.fromhex(hexbytes)[:size]


def test_probe_after_an_instruction_capstone_lacks(table, blacklist):
    # push rbp | serialize | pop rbp | ret
    mem = FakeMemory({PROBE_ME: "55 0f 01 e8 5d c3"})
    check(table, blacklist, mem, PROBE_ME + 1)
    check(table, blacklist, mem, PROBE_ME + 4)
    assert rejected(table, blacklist, mem, PROBE_ME + 2).errno == errno.EILSEQ


def test_arch_facts():
    assert isinstance(ARCH, X86_64)
    assert (ARCH.breakpoint, ARCH.max_insn_len) == (b"\xcc", 15)
    assert ARCH.nop5 == bytes.fromhex("0f1f440000")
    assert ARCH.endbr64 == bytes.fromhex("f30f1efa")


# -- check_probe_address ----------------------------------------------------------------

@pytest.mark.parametrize("off", BOUNDARIES[:-1])
def test_instruction_boundaries_are_accepted(table, blacklist, mem, off):
    check(table, blacklist, mem, PROBE_ME + off)
    assert mem.reads == [(PROBE_ME, off + 15)]              # one read, prefix + one insn


@pytest.mark.parametrize("off, inside, before, after", [
    (1, "nop", 0x0, 0x5), (2, "nop", 0x0, 0x5), (4, "nop", 0x0, 0x5),
    (7, "mov rbp, rsp", 0x6, 0x9), (8, "mov", 0x6, 0x9), (0xa, "push r15", 0x9, 0xb),
    (0xc, "call", 0xb, 0x10),
])
def test_mid_instruction_is_eilseq(table, blacklist, mem, off, inside, before, after):
    err = rejected(table, blacklist, mem, PROBE_ME + off)
    assert err.errno == errno.EILSEQ
    msg = str(err)
    assert f"probe_me+{off:#x} is not an instruction boundary" in msg
    assert inside in msg
    assert f"probe_me+{before:#x} and probe_me+{after:#x}" in msg


def test_int3_instruction_is_einval(table, blacklist, mem):
    err = rejected(table, blacklist, mem, PROBE_ME + 0x12)
    assert err.errno == errno.EINVAL and "INT3" in str(err)


def test_int_and_ud_are_eilseq_where_can_probe_refuses_them(table, blacklist, mem):
    """6.12 and 7.3's can_probe() refuses INT and UD first (is_exception_insn()); a raw
    kprobe on __softirqentry_text_end, an INT3 of padding, showed it (6.1: EINVAL)."""
    err = rejected(table, blacklist, mem, PROBE_ME + 0x12, exception_insns=True)
    assert err.errno == errno.EILSEQ and "is_exception_insn" in str(err)
    # UD2 (0f 0b), with a REX prefix too: 6.1 takes it, 6.12 refuses it
    for code in (b"\x0f\x0b", b"\x48\x0f\x0b"):
        mem.poke(PROBE_ME + 6, code)
        check(table, blacklist, mem, PROBE_ME + 6)
        assert rejected(table, blacklist, mem, PROBE_ME + 6,
                        exception_insns=True).errno == errno.EILSEQ
    # any other instruction passes as before
    check(table, blacklist, mem, PROBE_ME, exception_insns=True)


def test_armed_kprobe_bytes_are_recovered(table, blacklist, mem):
    mem.poke(PROBE_ME + 6, b"\xcc")                        # a kprobe on "mov rbp, rsp"
    # unrecovered, the INT3 shifts the decode: +7 looks like a boundary (cc | 89 e5)
    check(table, blacklist, mem, PROBE_ME + 7)
    original = {PROBE_ME + 6: b"\x48"}
    calls = []

    def recover(addr):
        calls.append(addr)
        return original.get(addr)

    err = rejected(table, blacklist, mem, PROBE_ME + 7, recover=recover)
    assert err.errno == errno.EILSEQ and "mov rbp, rsp" in str(err)
    assert calls == [PROBE_ME + 6]
    # a second probe on the same address is aggregated by the kernel, so it is fine
    check(table, blacklist, mem, PROBE_ME + 6, recover=recover)
    with pytest.raises(ProbeRejectedError, match="INT3"):
        check(table, blacklist, mem, PROBE_ME + 6)


def test_module_function(table, blacklist, mem):
    check(table, blacklist, mem, 0xffffffffc0002000)
    check(table, blacklist, mem, 0xffffffffc0002005)
    assert rejected(table, blacklist, mem, 0xffffffffc0002006).errno == errno.EILSEQ


def test_blacklisted_is_einval_and_says_what_to_do(table, blacklist, mem):
    err = rejected(table, blacklist, mem, 0xffffffff810001a4)
    assert err.errno == errno.EINVAL
    msg = str(err)
    assert "asm_exc_page_fault" in msg and "blacklist" in msg and "caller" in msg
    # module functions too
    assert rejected(table, blacklist, mem, 0xffffffffc0002020).errno == errno.EINVAL


def test_suffixed_symbol_of_blacklisted_function_is_einval(table, blacklist, mem):
    # helper.cold's own range is not listed, but helper is (within_kprobe_blacklist)
    assert blacklist.find(0xffffffff810001c0) is None
    err = rejected(table, blacklist, mem, 0xffffffff810001c0)
    assert err.errno == errno.EINVAL and "helper" in str(err) and "helper.cold" in str(err)


@pytest.mark.parametrize("addr", [0xffffffff82000000, 0xffffffff80f00000, 0xffffffffc0003000,
                                  0xffffffffc0010000])
def test_not_text_is_einval(table, blacklist, mem, addr):
    err = rejected(table, blacklist, mem, addr)
    assert err.errno == errno.EINVAL and "kprobes go only in core kernel text" in str(err)
    assert mem.reads == []                                   # refused before reading


@pytest.mark.parametrize("addr", [0x1234, 0x6000, 0xffffffffc0003008])
def test_outside_every_symbol_is_enoent(table, blacklist, mem, addr):
    assert rejected(table, blacklist, mem, addr).errno == errno.ENOENT


def test_kretprobe_needs_function_entry(table, blacklist, mem):
    check(table, blacklist, mem, PROBE_ME, kretprobe=True)
    err = rejected(table, blacklist, mem, PROBE_ME + 5, kretprobe=True, symbol_offset=5)
    assert err.errno == errno.EINVAL and "kprobe_on_func_entry" in str(err)
    # the kernel re-derives the offset: do_sys_open+0 given as probe_me+0x40 is an entry
    check(table, blacklist, mem, PROBE_ME + 0x40, kretprobe=True, symbol_offset=0x40)


def test_ibt_entry(table, blacklist, mem):
    ibt = 0xffffffff81000200
    check(table, blacklist, mem, ibt + 4, kretprobe=True)   # after ENDBR is still the entry
    check(table, blacklist, mem, ibt, kretprobe=True)
    assert rejected(table, blacklist, mem, ibt + 5, kretprobe=True).errno == errno.EINVAL
    assert rejected(table, blacklist, mem, ibt + 2).errno == errno.EILSEQ
    # without ENDBR, +4 is no entry (and mid-nop)
    assert rejected(table, blacklist, mem, PROBE_ME + 4, kretprobe=True).errno == errno.EINVAL


def test_kprobe_addr(table, mem):
    ibt = 0xffffffff81000200
    assert kprobe_addr(ibt, symbols=table, read=mem) == (ibt + 4, True)
    assert kprobe_addr(ibt + 4, symbols=table, read=mem) == (ibt + 4, True)
    assert kprobe_addr(ibt + 5, symbols=table, read=mem) == (ibt + 5, False)
    assert kprobe_addr(PROBE_ME, symbols=table, read=mem) == (PROBE_ME, True)
    assert kprobe_addr(PROBE_ME + 4, symbols=table, read=mem) == (PROBE_ME + 4, False)
    with pytest.raises(ProbeRejectedError) as ei:
        kprobe_addr(0x1234, symbols=table, read=mem)
    assert ei.value.errno == errno.ENOENT


def test_copy_instruction_refusals(table, blacklist, mem):
    odd = 0xffffffff81000240
    err = rejected(table, blacklist, mem, odd)              # mov ss, eax
    assert err.errno == errno.EINVAL and "mov ss" in str(err)
    err = rejected(table, blacklist, mem, odd + 2)          # ud2 "xen" cpuid
    assert err.errno == errno.EINVAL and "emulate prefix" in str(err)
    # the prefixed cpuid is one 7-byte instruction for the kernel's decoder
    assert rejected(table, blacklist, mem, odd + 4).errno == errno.EILSEQ
    check(table, blacklist, mem, odd + 9)                   # push rbp
    err = rejected(table, blacklist, mem, odd + 10)         # 06: undecodable
    assert err.errno == errno.EINVAL and "decoded" in str(err)


def test_undecodable_prefix_is_eilseq(table, blacklist, mem):
    err = rejected(table, blacklist, mem, 0xffffffff81000240 + 11)
    assert err.errno == errno.EILSEQ and "cannot decode 06" in str(err)


def test_cfi_preamble_is_einval(mem):
    t = SymbolTable.from_kallsyms("ffffffff81000000 T _stext\nffffffff81000100 t __pfx_f\n"
                                  "ffffffff81000110 t f\nffffffff81000200 T _etext\n")
    with pytest.raises(ProbeRejectedError, match="preamble") as ei:
        check_probe_address(0xffffffff81000100, symbols=t, blacklist=Blacklist(), read=mem)
    assert ei.value.errno == errno.EINVAL


def test_too_far_into_a_symbol(table, blacklist, mem):
    err = rejected(table, blacklist, mem, PROBE_ME + 0x11, max_prefix=0x10)
    assert err.errno == errno.EILSEQ and mem.reads == []


def test_reserved_text_reads_self_relative_tables():
    """jump_label_text_reserved(), static_call_text_reserved() and find_bug() on tables laid
    out as vmlinux's: self-relative s32 entries of 16, 8 and 12 bytes."""
    from harness.kernel.symbols import ReservedText, SymbolTable

    text = 0xFFFFFFFF81000000
    tables = {0xFFFFFFFF82000000: (16, [text + 0x10]),           # a 2-byte nop, jump label
              0xFFFFFFFF82001000: (8, [text + 0x40]),            # a static call site
              0xFFFFFFFF82002000: (12, [text + 0x80])}           # ud2
    mem = {}
    rows = [f"{text:016x} T f"]
    for (start, stop), (base, (size, sites)) in zip(
            [("__start___jump_table", "__stop___jump_table"),
             ("__start_static_call_sites", "__stop_static_call_sites"),
             ("__start___bug_table", "__stop___bug_table")], tables.items()):
        data = b"".join(((site - (base + i * size)) & 0xFFFFFFFF).to_bytes(4, "little")
                        + bytes(size - 4) for i, site in enumerate(sites))
        mem[base] = data
        rows += [f"{base:016x} D {start}", f"{base + len(data):016x} D {stop}"]
    code = bytearray(b"\x90" * 0x100)
    code[0x10:0x12] = b"\x66\x90"

    def read(addr, n):
        for base, data in {**mem, text: bytes(code)}.items():
            if base <= addr < base + len(data):
                return data[addr - base:addr - base + n]
        raise AssertionError(hex(addr))
    rt = ReservedText.from_memory(SymbolTable.from_kallsyms("\n".join(rows)), read)
    assert (rt.jump, rt.static_calls, rt.bugs) == ([text + 0x10], [text + 0x40], {text + 0x80})
    assert "jump label" in rt.find(text + 0x10, read) and "jump label" in rt.find(text + 0x11, read)
    assert rt.find(text + 0x12, read) is None                    # past the 2-byte nop
    assert all("static call" in rt.find(text + 0x40 + i, read) for i in range(5))
    assert rt.find(text + 0x45, read) is None
    assert "BUG()" in rt.find(text + 0x80, read) and rt.find(text + 0x81, read) is None
    # kept per snapshot (harness.engines.base): the same sites back, a torn file refused
    back = ReservedText.from_bytes(rt.to_bytes())
    assert (back.jump, back.static_calls, back.bugs) == (rt.jump, rt.static_calls, rt.bugs)
    for torn in (rt.to_bytes()[:-8], b"", rt.to_bytes() + b"\0"):
        with pytest.raises(ValueError):
            ReservedText.from_bytes(torn)
    table = SymbolTable.from_kallsyms("\n".join(rows))
    assert ReservedText.state(table) == tuple(
        (base, base + len(mem[base])) for base in tables)


def test_a_frame_in_no_function_has_no_name(table):
    """A stack frame's return address is named after the function holding it; past a
    module's last (data) symbol, where ftrace puts an ops' trampoline, the table's
    next-symbol span would name it after that data: a trace prints the raw address
    (seen in CI: 6.1's ftrace trampoline named ``pvpanic_pci_driver``)."""
    assert table.frame_name(0xFFFFFFFFC0002044) == "do_sys_open"
    assert table.symbolize(0xFFFFFFFFC0003000)[0].name == "foo_data"
    assert table.frame_name(0xFFFFFFFFC0003000) == "0xffffffffc0003000"
    assert table.frame_name(0xFFFFFFFFC0F00000) == "0xffffffffc0f00000"


@pytest.mark.parametrize("code,size", [
    ("67480fb93a", 5),      # 7.3's WARN(): ud1 (%edx),%rdi behind an address-size prefix
    ("480fb93a", 4), ("0fb9c8", 3), ("0fb94c2408", 5), ("0fb98800010000", 7),
    ("0f0b", 2), ("0fff", 2),          # ud2 and ud0 take no ModRM (x86-opcode-map.txt)
    ("f20f00f7", 4), ("f20f003f", 4),  # 7.3's LKGS (Grp6 /6 behind F2), unknown to capstone
    ("0f00d8", 3),
])
def test_ud1_takes_a_modrm_as_the_kernels_decoder_does(code, size):
    """arch/x86/lib/x86-opcode-map.txt: 0f b9 Grp10 (1A); capstone 5 gives it none, and a
    walk to a probe point past a 7.3 WARN() refused a boundary can_probe() accepts."""
    insn = instruction_at(bytes.fromhex(code) + b"\x90" * 16, 0x1000)
    assert insn is not None and insn.size == size
