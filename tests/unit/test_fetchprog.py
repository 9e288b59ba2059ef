"""harness.kernel.grammar.program: the plugin's captures answer exactly what evaluate() reads.

For each spec, ``evaluate`` runs twice over one memory model: once reading the model
directly (what the gdbstub engine does at a stop), once from what ``simulate`` (the C
interpreter's reference) captured. The values must be identical and no read may miss.
Then ``probes/plugin/fetch.c`` itself, compiled into a small driver, must capture
byte for byte what ``simulate`` captures.
"""
from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from harness.kernel.grammar import program as fetchprog
from harness.kernel.grammar.fetch import FaultError, evaluate
from harness.kernel.grammar import parse

PAGE = 4096
USER = 0x7ffd_1000_0000
KSTACK = 0xffffc900_0040_8000          # sp sits near the top of a 16 KiB stack
KDATA = 0xffff8880_0123_4000
UNMAPPED = 0xffff8880_0999_0000

SPECS = [
    "p:e1 do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32",
    "p:e2 do_sys_openat2 a1=$arg1:s32 a2=$arg2:x64 a3=$arg3:x64 a7=$arg7:x64",
    "r:r1 do_sys_openat2 ret=$retval:s64",
    "p:ip do_sys_openat2 ip=%ip:x64 sp=$stack:x64",
    "p:c do_sys_openat2 comm=$comm c2=$comm:string",
    "p:s do_sys_openat2 s0=$stack0:x64 s1=$stack1:x64 s9=$stack9:u32",
    "p:sym do_sys_openat2 caller=$stack0:symbol",
    "p:k do_sys_openat2 how_flags=+0(%dx):x64 how_mode=+8(%dx):x64",
    "p:ks do_sys_openat2 s=+0(%si):string",
    "p:ua do_sys_openat2 head=+0(%si):u8[4]",
    "p:bf do_sys_openat2 lo=%dx:b4@0/32 mid=%dx:b8@4/32 mem=+0(%dx):b3@5/16",
    "p:g do_sys_openat2 node=@init_uts_ns+65:string",
    "p:imm do_sys_openat2 n=\\42 s=\\\"kph\\\"",
    "p:dd do_sys_openat2 x=+8(+0(%dx)):x64 y=+0(+0(+0(%dx))):u16",
    "p:strs do_sys_openat2 a=+0(%r8):string[3] b=+0(%r9):string[2]",
    "p:arr do_sys_openat2 v=+0(%dx):x32[5] w=+16(%dx):s8[3]",
    "p:fault do_sys_openat2 bad=+0(%cx):x64 bads=+0(%cx):string badu=+0(%cx):ustring",
    "p:crosspage do_sys_openat2 long=+0(%bx):string",
    "p:symstr do_sys_openat2 f=$stack0:symstr after=+0(%si):ustring",
    "p:many do_sys_openat2 a=+0(%si):ustring b=+0(%bx):string c=+0(%si):string",
    "p:emptyu do_sys_openat2 e=+0(%r10):ustring k=+0(%r10):string",
]


class Memory:
    """A sparse guest memory: mapped pages with contents; everything else faults."""

    def __init__(self, seed: int) -> None:
        rnd = random.Random(seed)
        self.pages: dict[int, bytearray] = {}
        for base in (USER, USER + PAGE, KSTACK - PAGE, KSTACK, KDATA, KDATA + PAGE,
                     0xffffffff82000000 & ~(PAGE - 1)):
            self.pages[base] = bytearray(rnd.randrange(256) for _ in range(PAGE))
        # a user path, a kernel string, pointers to them, a string running into a hole
        self.put(USER + 0x10, b"/proc/version\0")
        self.put(USER + 0x100, b"\0")
        self.put(KDATA + 0x20, b"kernel-string\0")
        self.put(KDATA + PAGE - 6, b"crosses-a-page\0")
        self.put(USER + 2 * PAGE - 40, b"A" * 40)          # then an unmapped page
        self.put(KDATA + 0x200, struct.pack("<QQQ", KDATA + 0x20, USER + 0x10, UNMAPPED))
        self.put(KDATA + 0x300, struct.pack("<QQ", USER + 0x10, KDATA + 0x20))
        self.put(KDATA + 0x400, struct.pack("<QQ", KDATA + 0x200, 0x1234))
        self.put(0xffffffff82000000 + 65, b"(none)\0")
        self.put(KSTACK + 0x40, struct.pack("<Q", 0xffffffff8134a3a0))

    def put(self, addr: int, data: bytes) -> None:
        for i, byte in enumerate(data):
            a = addr + i
            self.pages[a & ~(PAGE - 1)][a & (PAGE - 1)] = byte

    def read(self, addr: int, size: int) -> bytes | None:
        out = bytearray()
        for a in range(addr, addr + size):
            page = self.pages.get(a & ~(PAGE - 1))
            if page is None:
                return None
            out.append(page[a & (PAGE - 1)])
        return bytes(out)


REGS = {"di": (-100) & ((1 << 64) - 1), "si": USER + 0x10, "dx": KDATA + 0x400, "cx": UNMAPPED,
        "bx": KDATA + PAGE - 6, "r8": KDATA + 0x1f8, "r9": KDATA + 0x300, "r10": USER + 0x100,
        "sp": KSTACK + 0x40, "ax": 3, "ip": 0xffffffff8134a350, "cs": 0x10, "flags": 0x246,
        "r11": 7, "r12": 8, "r13": 9, "r14": 10, "r15": 11, "bp": KSTACK + 0x80}
SYMBOLS = {"init_uts_ns": 0xffffffff82000000}


class _Ctx:
    def __init__(self, read) -> None:
        self._read = read

    def reg(self, name: str) -> int:
        return REGS.get(name, 0) if name != "orig_ax" else (1 << 64) - 1

    def read(self, addr: int, size: int) -> bytes:
        return self._read(addr, size)

    read_user = read

    def comm(self) -> str:
        return "cat"

    def retval(self) -> int:
        return REGS["ax"]

    def symbol_addr(self, name: str) -> int:
        return SYMBOLS[name]

    def symbolize(self, addr: int) -> str | None:
        return f"sym+{addr & 0xff:#x}/0x100"


def _direct(mem: Memory):
    def read(addr: int, size: int) -> bytes:
        data = mem.read(addr, size)
        if data is None:
            raise FaultError(addr, size)
        return data
    return read


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("text", SPECS)
def test_capture_answers_every_read(text, seed):
    spec = parse(text)
    mem = Memory(seed)
    want = evaluate(spec, _Ctx(_direct(mem)))
    blocks = []
    for a in spec.args:
        blocks += fetchprog.simulate(a.code, REGS, mem.read, resolve=SYMBOLS.__getitem__)
    cap = fetchprog.CaptureContext(blocks)
    got = evaluate(spec, _Ctx(cap.read))
    assert cap.misses == 0
    assert got == want


def test_compile_resolves_symbols_and_ends_each_arg():
    spec = parse("p:g do_sys_openat2 node=@init_uts_ns+65:string x=%di:u8")
    prog = fetchprog.compile_spec(spec.args, resolve=SYMBOLS.__getitem__)
    insns = [struct.unpack_from("<BBHIQ", prog, i) for i in range(0, len(prog), 16)]
    ops = [i[0] for i in insns]
    assert ops.count(fetchprog.KOP["end"]) == 2
    assert insns[0][0] == fetchprog.KOP["imm"] and insns[0][4] == SYMBOLS["init_uts_ns"] + 65


def test_capture_refuses_what_it_did_not_see():
    cap = fetchprog.CaptureContext([fetchprog.Block(0x1000, fetchprog.DATA, b"12345678", 8)])
    assert cap.read(0x1000, 4) == b"1234"
    with pytest.raises(fetchprog.CaptureMiss):
        cap.read(0x2000, 8)
    assert cap.misses == 1


# ---------------------------------------------------------------- the C interpreter

PLUGIN = Path(__file__).resolve().parents[2] / "probes" / "plugin"
DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "fetch.h"
/* stdin: u32 npages, pages {u64 base, u8[4096]}, u64 regs[21], u32 nprog, kph_insn[nprog],
 * then (optional) u64 task, u64 percpu, u32 has_percpu, u32 nedata, {u64 idx, u64 val}[] */
static uint64_t base[64]; static unsigned char page[64][4096]; static unsigned npages;
static int rd(void *c, uint64_t a, void *buf, size_t n) {
    (void)c;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = a + i; unsigned k;
        for (k = 0; k < npages && base[k] != (x & ~4095ull); k++) ;
        if (k == npages) return -1;
        ((unsigned char *)buf)[i] = page[k][x & 4095];
    }
    return 0;
}
int main(void) {
    uint64_t regs[KREG_NUM]; uint32_t n; static kph_insn prog[1024]; static uint8_t out[1 << 20];
    if (fread(&npages, 4, 1, stdin) != 1) return 2;
    for (unsigned k = 0; k < npages; k++) { fread(&base[k], 8, 1, stdin); fread(page[k], 4096, 1, stdin); }
    fread(regs, 8, KREG_NUM, stdin); fread(&n, 4, 1, stdin); fread(prog, 16, n, stdin);
    kph_capture c = {.buf = out, .cap = sizeof(out), .read = rd};
    static uint64_t edata[8]; static uint32_t idx[8]; uint32_t hp = 0, ne = 0;
    if (fread(&c.task, 8, 1, stdin) == 1 && fread(&c.percpu, 8, 1, stdin) == 1 &&
        fread(&hp, 4, 1, stdin) == 1 && fread(&ne, 4, 1, stdin) == 1) {
        c.has_percpu = (int)hp;
        for (uint32_t i = 0; i < ne && i < 8; i++) {
            uint64_t k; fread(&k, 8, 1, stdin); fread(&edata[i], 8, 1, stdin); idx[i] = (uint32_t)k;
        }
        c.edata = edata; c.edata_idx = idx; c.nedata = ne;
    }
    int r = kph_capture_args(&c, prog, n, regs);
    fwrite(&r, 4, 1, stdout); fwrite(&c.nblocks, 4, 1, stdout); fwrite(out, 1, c.len, stdout);
    return 0;
}
"""


def _build(tmp_path_factory, name: str, source: str) -> Path:
    """``source`` compiled with ``fetch.c`` into a program of its own."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: apt-get install gcc (./setup.sh installs it)")
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.c").write_text(source)
    exe = d / name
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-I", str(PLUGIN), "-o", str(exe),
                    str(d / f"{name}.c"), str(PLUGIN / "fetch.c")], check=True, timeout=60)
    return exe


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return _build(tmp_path_factory, "driver", DRIVER)


def run_driver(driver, mem: Memory, prog: bytes, regs: dict[str, int] = REGS, *,
               task: int = 0, percpu: int | None = None, edata: dict[int, int] | None = None
               ) -> tuple[int, int, bytes]:
    """fetch.c over ``mem`` and ``regs`` (and the hit's current, per-cpu offset and
    entry-saved arguments): (its return value, blocks, the output)."""
    inp = struct.pack("<I", len(mem.pages))
    for b, data in sorted(mem.pages.items()):
        inp += struct.pack("<Q", b) + bytes(data)
    inp += b"".join(struct.pack("<Q", regs.get(n, 0) if n != "orig_ax" else (1 << 64) - 1)
                    for n in fetchprog.REGS)
    inp += struct.pack("<I", len(prog) // 16) + prog
    ed = sorted((edata or {}).items())
    inp += struct.pack("<QQII", task, percpu or 0, percpu is not None, len(ed))
    inp += b"".join(struct.pack("<QQ", k, v & ((1 << 64) - 1)) for k, v in ed)
    out = subprocess.run([str(driver)], input=inp, capture_output=True, check=True,
                         timeout=30).stdout
    nargs, nblocks = struct.unpack_from("<iI", out)
    return nargs, nblocks, out


@pytest.mark.parametrize("text", SPECS)
def test_c_interpreter_captures_what_the_reference_does(driver, text):
    spec = parse(text)
    mem = Memory(7)
    prog = fetchprog.compile_spec(spec.args, resolve=SYMBOLS.__getitem__)
    nargs, nblocks, out = run_driver(driver, mem, prog)
    assert nargs == len(spec.args)
    c_blocks = fetchprog.parse_blocks(out, nblocks, 8)
    ref = []
    for a in spec.args:
        ref += fetchprog.simulate(a.code, REGS, mem.read, resolve=SYMBOLS.__getitem__)
    assert c_blocks == ref


@pytest.mark.parametrize("count,ok", [(64, True), (65, False), (0, False), (1 << 31, False)])
def test_c_interpreter_refuses_array_counts_the_kernel_refuses(driver, count, ok):
    """MAX_ARRAY_LEN is 64 (kernel/trace/trace_probe.h) and 0 is "Invalid array size": a
    program with another count is malformed (-1), never a loop of 2^31 reads."""
    prog = bytearray(fetchprog.compile_spec(parse("p:a do_sys_openat2 v=+0(%dx):x32[2]").args))
    at = next(i for i in range(0, len(prog), 16) if prog[i] == fetchprog.KOP["lp_array"])
    prog[at + 4:at + 8] = count.to_bytes(4, "little")
    nargs = run_driver(driver, Memory(7), bytes(prog))[0]
    assert nargs == (1 if ok else -1)


def _event_mem() -> tuple[Memory, dict[str, int]]:
    """A trace_event_buffer_commit(fbuffer) stop: fbuffer at %di, its entry (offset 24)
    a record with each kind of field get_event_field() reads."""
    mem = Memory(11)
    fbuf, rec = KDATA + 0x600, KDATA + 0x700
    mem.put(fbuf + 24, struct.pack("<Q", rec))
    mem.put(rec + 8, struct.pack("<i", -2))                     # int, signed
    mem.put(rec + 12, b"sh\0")                                  # char[16]
    mem.put(rec + 28, struct.pack("<H", 0xfffe))                # u16
    mem.put(rec + 32, struct.pack("<I", 8 << 16 | 96))          # __data_loc char[]
    mem.put(rec + 40, struct.pack("<Q", KDATA + 0x20))          # const char *
    mem.put(rec + 48, struct.pack("<I", 6 << 16 | 12))          # __rel_loc char[]
    mem.put(rec + 96, b"dyn-str\0")
    mem.put(rec + 48 + 12, b"ra\0")                             # get_event_field()'s base
    mem.put(rec + 52 + 12, b"rb\0")                             # the filter's (after the u32)
    return mem, dict(REGS, di=fbuf)


EVENT_FIELDS = [("i", 8, 4, True, "int", "x64"), ("u", 28, 2, False, "int", "x64"),
                ("c", 12, 16, False, "static", "string"), ("d", 32, 4, True, "dyn", "string"),
                ("p", 40, 8, False, "ptr", "string"), ("r", 48, 4, True, "rdyn", "string"),
                ("r4", 48, 4, True, "rdyn4", "string"), ("cx", 12, 16, False, "static", "x64")]


@pytest.mark.parametrize("field", EVENT_FIELDS, ids=[f[0] for f in EVENT_FIELDS])
def test_c_reads_event_fields_as_the_reference_does(driver, field):
    """KOP_TP_ARG (an event probe's $FIELD): fetch.c and simulate() capture the same reads,
    and evaluate() over them gives get_event_field()'s value."""
    from harness.kernel.grammar import ProbeArg
    from harness.kernel.grammar.fetch import EventField, evaluate

    name, off, size, signed, kind, t = field
    store = ("st_string", 0) if t == "string" else ("st_raw", 0, 8)
    arg = ProbeArg(name, EventField(name), t,
                   code=(("tp_arg", name, off, size, signed, kind), store, ("end",)))
    mem, regs = _event_mem()
    prog = fetchprog.compile_spec([arg], event_entry=24)
    nargs, nblocks, out = run_driver(driver, mem, prog, regs)
    assert nargs == 1
    blocks = fetchprog.parse_blocks(out, nblocks, 8)
    assert blocks == fetchprog.simulate(arg.code, regs, mem.read, event_entry=24)

    class Ctx:
        def __init__(self):
            self.cap = fetchprog.CaptureContext(blocks)

        def reg(self, n):
            return regs[n]

        def read(self, a, n):
            return self.cap.read(a, n)

        def event_record(self):
            return int.from_bytes(self.cap.read(regs["di"] + 24, 8), "little")
    want = {"i": (1 << 64) - 2, "u": 0xfffe, "c": b"sh", "d": b"dyn-str", "p": b"kernel-string",
            "r": b"ra", "r4": b"rb", "cx": KDATA + 0x70c}[name]
    assert evaluate(arg, Ctx()) == want


CONTEXT_CODES = [
    ("current", (("current",), ("st_raw", 0, 8))),
    ("current->comm", (("current",), ("st_string", 0x28))),
    ("this_cpu_read", (("imm", KDATA - 0x800), ("cpu_ptr",), ("deref", 0), ("st_raw", 0, 8))),
    ("this_cpu_ptr", (("imm", KDATA - 0x800), ("cpu_ptr",), ("st_raw", 0, 8))),
    ("edata", (("edata", 0), ("st_raw", 0, 8))),
    ("edata deref", (("edata", 7), ("deref", 0), ("st_mem", 8, 4))),
]


@pytest.mark.parametrize("name,code", CONTEXT_CODES, ids=[c[0] for c in CONTEXT_CODES])
def test_c_takes_the_hit_context_as_the_reference_does(driver, name, code):
    """KOP_CURRENT, KOP_CPU_PTR and KOP_EDATA ($current, this_cpu_*() and a return line's
    $argN): fetch.c and simulate() capture the same, the per-cpu offset and the saved
    argument as blocks of their own."""
    code = tuple(code) + (("end",),)
    mem = Memory(5)
    mem.put(KDATA + 0x28, b"kph-task\0")
    ctx = {"task": KDATA, "percpu": 0x800 + 0x10, "edata": {0: 0x1234, 7: KDATA + 0x200}}
    prog = fetchprog.compile_code(code)
    nargs, nblocks, out = run_driver(driver, mem, prog, **ctx)
    assert nargs == 1
    blocks = fetchprog.parse_blocks(out, nblocks, 8)
    assert blocks == fetchprog.simulate(code, REGS, mem.read, **ctx)
    if name.startswith("edata"):
        assert blocks[0].kind == fetchprog.EDATA
    if name.startswith("this_cpu"):
        assert blocks[0].kind == fetchprog.PERCPU


def test_a_registers_only_spec_evaluates_as_the_interpreter_does():
    """evaluate()'s registers-only path (a spec whose every argument is one register-like
    fetch and its st_raw store) gives what process_fetch_insn()'s interpreter gives for
    each argument alone, for every non-string type and random register values; a spec
    with one memory or string argument takes the interpreter whole."""
    from harness.kernel.grammar.fetch import FETCH_TYPES

    class Regs(_Ctx):
        def __init__(self, regs):
            super().__init__(_direct(Memory(1)))
            self.regs = regs

        def reg(self, name):
            return self.regs[name]

        def retval(self):
            return self.regs["ax"]

    rng = random.Random(36)
    types = [t for t, ft in FETCH_TYPES.items() if not ft.is_string and t != "char"]  # 6.12+
    fetches = ["%di", "%si", "%dx", "%cx", "%ax", "%sp", "%r9", "$stack", "$arg1", "$arg6",
               "%flags"]
    for i in range(200):
        line = f"p:g/e{i} vfs_read " + " ".join(
            f"a{j}={rng.choice(fetches)}:{rng.choice(types)}" for j in range(rng.randint(1, 5)))
        r = "r:g/ret vfs_read v=$retval:" + rng.choice(types)
        for spec in (parse(line), parse(r)):
            ctx = Regs({n: rng.getrandbits(64) for n in REGS})
            got = evaluate(spec, ctx)
            assert spec.register_plan is not None, line             # took the fast path
            assert got == tuple(evaluate(a, ctx) for a in spec.args), line
    mixed = parse("p:g/m vfs_read a=%di:u32 b=+0(%si):u8")
    evaluate(mixed, _Ctx(_direct(Memory(1))))
    assert mixed.register_plan is None


def test_a_plain_user_read_is_refused_where_nmi_uaccess_okay_is_false():
    """probe_mem_read_user() is copy_from_user_nofault(), which refuses when current->mm
    is not the loaded mm (mm/maccess.c: nmi_uaccess_okay()): a plain read of a user
    address fails (unknown, its address the evidence), a kernel one and a string do not
    (strncpy_from_user_nofault() has no such check); a context without the check (a
    uprobe's) reads as before."""
    mem = Memory(1)
    spec = parse("p:u do_sys_openat2 w=+0(%si):u64 uw=+u0(%si):u64 k=+0(%dx):u64 "
                 "s=+0(%si):ustring")

    class Gone(_Ctx):
        failed_at = None

        def uaccess_okay(self) -> bool:
            return False

    plain = evaluate(spec, _Ctx(_direct(mem)))
    why: dict[int, str] = {}
    failed: dict[int, int] = {}
    gone = evaluate(spec, Gone(_direct(mem)), why, failed)
    assert plain[0] == int.from_bytes(mem.read(USER + 0x10, 8), "little") and plain[1] == plain[0]
    assert gone[0] != plain[0] and gone[1] != plain[1]
    assert failed.get(0) == USER + 0x10 and failed.get(1) == USER + 0x10, (why, failed)
    assert gone[2] == plain[2] and gone[3] == plain[3] == b"/proc/version", gone

    class Here(Gone):               # measured equal: the read is made and compared
        def uaccess_okay(self) -> bool:
            return True
    why.clear()
    failed.clear()
    assert evaluate(spec, Here(_direct(mem)), why, failed) == plain and not failed, why


REGS_DRIVER = r"""
#include <stdio.h>
#include "fetch.h"
/* stdin: kph_insn[] to the end; stdout: kph_prog_regs() of them, decimal */
int main(void) {
    static kph_insn prog[1024];
    size_t n = fread(prog, sizeof(kph_insn), 1024, stdin);
    printf("%u\n", kph_prog_regs(prog, n));
    return 0;
}
"""


@pytest.fixture(scope="module")
def regs_driver(tmp_path_factory):
    return _build(tmp_path_factory, "regs", REGS_DRIVER)


REG_SPECS = SPECS + [
    "r:rr vfs_read ret=$retval:s64 a=%ax:x64",
    "p:all vfs_read " + " ".join(f"r{n}=%{n}:x64" for n in fetchprog.REGS if n != "orig_ax"),
    "p:args vfs_read a6=$arg6:x64 a8=$arg8:x64",
    "p:none vfs_read",
]


@pytest.mark.parametrize("text", REG_SPECS)
def test_a_spec_hit_reads_every_register_its_programs_and_evaluate_read(regs_driver, driver, text):
    """A spec probe's hit reads only the registers ``kph_prog_regs()`` names (the plugin's
    read_context_regs(), the others 0 in the record): every register evaluate() reads (and
    %sp, which the backend's reads check the stack against) is among them, and fetch.c
    captures exactly the same with the others zeroed as with all of them."""
    spec = parse(text)
    prog = fetchprog.compile_spec(spec.args, resolve=SYMBOLS.__getitem__)
    mask = int(subprocess.run([str(regs_driver)], input=prog, capture_output=True, check=True,
                              timeout=30).stdout)
    kept = {n for i, n in enumerate(fetchprog.REGS) if mask >> i & 1}
    assert {"sp", "cs", "ip"} <= kept, kept

    read: set[str] = set()

    class Recording(_Ctx):
        def reg(self, name: str) -> int:
            read.add(name)
            return super().reg(name)

        def retval(self) -> int:
            read.add("ax")
            return super().retval()

    evaluate(spec, Recording(_direct(Memory(7))))
    assert read <= kept, f"evaluate() reads {sorted(read - kept)}, which the hit does not"
    full = run_driver(driver, Memory(7), prog)
    zeroed = {n: v for n, v in REGS.items() if n in kept}
    assert run_driver(driver, Memory(7), prog, zeroed) == full
    if text.startswith("p:all"):
        assert set(fetchprog.REGS) - {"orig_ax"} <= kept, kept
