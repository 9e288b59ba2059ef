"""The uprobe_events grammar (harness/kernel/grammar/uprobe.py) and the uprobe fetch rules."""
from __future__ import annotations

import pytest

from harness.errors import ProbeSpecError
from harness.kernel.grammar.fetch import FAULT, FaultError, evaluate
from harness.kernel.grammar import format, kernel_format, parse
from harness.engines.uprobes import _maps_base
from harness.kernel.elf import ElfImage


@pytest.mark.parametrize("line", [
    "p:u /usr/bin/kph-loop:0x1139 %di",
    "r:g/e /usr/bin/kph-loop:0x1139 ret=$retval",
    "p /bin/x:0x10%return $retval",
    "p /bin/x:0x10(0x20) a=%ax b=@+4096:u8 c=$stack2 d=+0(%si):string e=$comm",
    "p /bin/x:kph_add+0x4 %di",
])
def test_round_trip(line):
    assert format(parse(line)) == line


def test_kernel_format_and_default_names():
    s = parse("p /usr/bin/kph-loop:0x16b0 %di")
    assert s.is_uprobe and s.group == "uprobes" and s.event == "p_kph_0x16b0"
    assert kernel_format(s) == "p:uprobes/p_kph_0x16b0 /usr/bin/kph-loop:0x00000000000016b0 arg1=%di"
    r = parse("r /usr/bin/kph-loop:0x16b0")
    assert r.is_return and r.event == "p_kph_0x16b0"      # the kernel writes a literal 'p'
    assert kernel_format(parse("p:a/b /x/y:16(0x8)")) == "p:a/b /x/y:0x0000000000000010(0x8)"
    with pytest.raises(ValueError):
        kernel_format(parse("p /x/y:main"))              # a symbol must be resolved first


@pytest.mark.parametrize("line,msg,col", [
    ("p /usr/bin/kph-loop:0x10 $arg1", "Invalid $-variable specified", 25),
    ("p /usr/bin/kph-loop:0x10 @sym", "Symbol is not available with uprobe", 25),
    ("p /usr/bin/kph-loop:0x1z %di", "Invalid uprobe offset", 20),
    ("p /bin/x:12(0x20", "Reference counter brace is not closed", 16),
    ("p /bin/x:12(0x20)z", "Reference counter has wrong suffix", 17),
    ("p /bin/x:12(zz)", "Invalid reference counter offset", 12),
    ("p /bin/x:12%ret", "Invalid probed address suffix", 11),
    ("p /bin/x", "Invalid uprobe target", 8),
    ("p /bin/x:0x10 $retval", "$retval is not available on probe", 14),
    ("p /bin/x:0x10 @+zz", "Invalid file offset value", 14),
    ("p do_sys_open @+4", "File offset is not available with kprobe", 14),
])
def test_errors_name_the_column(line, msg, col):
    with pytest.raises(ProbeSpecError) as e:
        parse(line)
    assert str(e.value).startswith(msg) and e.value.column == col


class Ctx:
    """A user process: stack at 0x7ff0, a string at 0x5000, code at 0x401000."""

    def __init__(self):
        self.pages = {0x5000: bytearray(4096), 0x7000: bytearray(4096)}
        self.pages[0x7000][0xFF0:0x1000] = (0x401234).to_bytes(8, "little") + (7).to_bytes(8, "little")
        self.pages[0x5000][0:3] = b"hi\0"

    def reg(self, name):
        return {"sp": 0x7FF0, "si": 0x5000, "di": 0x5100, "ax": 3, "ip": 0x401000}[name]

    def read(self, addr, size):
        raise AssertionError("uprobes never read kernel memory")

    def read_user(self, addr, size):
        page = self.pages.get(addr & ~0xFFF)
        if page is None or (addr & 0xFFF) + size > 4096:
            raise FaultError(addr, size)
        return bytes(page[addr & 0xFFF:(addr & 0xFFF) + size])

    def comm(self):
        return "kph-loop"

    def retval(self):
        return 3

    def file_offset_vaddr(self, off):
        return 0x5000 - 0x1000 + off


def test_uprobe_fetches_read_user_memory_only():
    s = parse("p /x/y:0x10 a=$stack1 b=+0(%si):string c=+0(%di):string d=@+0x1000:u8 "
              "e=$stack9 f=$comm g=+8($stack):u64")
    assert evaluate(s, Ctx()) == (7, b"hi", b"", ord("h"), 0, b"kph-loop", 7)
    assert evaluate(parse("p /x/y:0x10 a=+0(\\1):string"), Ctx())[0] is FAULT


def test_maps_base_and_elf_offsets():
    maps = ("00400000-00401000 r--p 00000000 00:02 309 /usr/bin/kph-loop\n"
            "00401000-00478000 r-xp 00001000 00:02 309 /usr/bin/kph-loop\n")
    assert _maps_base(maps, "/usr/bin/kph-loop", 0x16b0) == 0x4016b0
    assert _maps_base(maps, "/usr/bin/other", 0x16b0) is None
    with pytest.raises(Exception):
        ElfImage(b"not an elf")


@pytest.mark.parametrize("series", [None, "6.12", "7.3"])
@pytest.mark.parametrize("target", ["/usr/bin/kph-loop:=ph_add", "/usr/bin/kph-loop:zz",
                                    "/usr/bin/kph-loop:%return", "/usr/bin/kph-loop:(1)"])
def test_no_digit_after_the_colon_is_no_uprobe_and_logs_nothing(series, target):
    """__trace_uprobe_create(): `if (!arg || !isdigit(arg[1])) return -ECANCELED;` before
    trace_probe_log_init() (measured on 6.1: EINVAL, error_log empty), in the kernel's
    PATH:OFFSET form; the harness's PATH:SYMBOL form still takes a name."""
    from harness.kernel.grammar.common import KernelView
    from harness.kernel.rules import rules_for

    kw = {"kernel": KernelView(rules_for(series))} if series else {}
    with pytest.raises(ProbeSpecError) as exc:
        parse(f"p {target}", uprobe_symbols=False, **kw)
    assert not exc.value.logged and exc.value.errno == 22
    # a digit first and not a number: kstrtoul() fails after the log is set up
    with pytest.raises(ProbeSpecError) as exc:
        parse("p /usr/bin/kph-loop:1zz", uprobe_symbols=False, **kw)
    assert exc.value.logged and str(exc.value).startswith("Invalid uprobe offset")


def test_elf_function_symbols_read_in_bulk_are_pyelftools_own(tmp_path):
    """ElfImage reads a 64-bit .symtab in bulk (struct); the functions and their addresses
    are what pyelftools' symbol iteration gives, the first of a name kept, two files
    (two `static int twin`) included."""
    import io
    import shutil
    import subprocess

    from elftools.elf.elffile import ELFFile

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler on this machine: ./setup.sh installs gcc")
    a, b = tmp_path / "a.c", tmp_path / "b.c"
    a.write_text("".join(f"int f{i}(int x) {{ return x + {i}; }}\n" for i in range(200))
                 + "static int twin(void) { return 1; } int ta(void) { return twin(); }\n"
                 + "int main(void) { return f1(0); }\n")
    b.write_text("static int twin(void) { return 2; } int tb(void) { return twin(); }\n")
    out = tmp_path / "prog"
    subprocess.run([cc, "-O0", "-o", str(out), str(a), str(b)], check=True, timeout=120)
    data = out.read_bytes()
    want: dict[str, int] = {}
    for s in ELFFile(io.BytesIO(data)).get_section_by_name(".symtab").iter_symbols():
        if s.name and s["st_info"]["type"] == "STT_FUNC":
            want.setdefault(s.name, s["st_value"])
    img = ElfImage(data)
    assert img._syms == want and len(want) > 200 and "twin" in want
    assert img.symbol("f7") == want["f7"]
