"""harness/backends/module.py against the booted default image: kph_kprobes.ko registers
real kprobes and kretprobes, and what it records agrees with the guest's own tracefs."""
from __future__ import annotations

import errno

import pytest

from harness.backends.module import KPH_DIR, Item, ModuleBackend
from harness.kernel.grammar.fetch import parse_trace_line
from harness.kernel.grammar import parse

pytestmark = pytest.mark.vm

TRACING = "/sys/kernel/tracing"
KPROBES_LIST = "/sys/kernel/debug/kprobes/list"
OPEN = "p:kph/open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32"
OPEN_RET = "r:kph/open_ret do_sys_openat2 ret=$retval:s64"


def assert_nothing_left(vm):
    assert vm.run(f"cat {KPROBES_LIST}", check=True).stdout == ""
    lsmod = vm.run("lsmod", check=True).stdout
    assert "kph_kprobes" not in [line.split(" ", 1)[0] for line in lsmod.splitlines()]


@pytest.fixture
def backend(vm):
    made = []

    def make(**kw):
        made.append(ModuleBackend(vm, **kw))
        return made[-1]
    yield make
    for be in made:
        be.close()
    assert_nothing_left(vm)


def run(vm, be, specs, workload):
    outcomes = be.register([parse(s) for s in specs])
    be.enable()
    vm.run(workload, check=True, timeout=60)
    be.disable()
    return outcomes, be.collect()


def workload_pid(hits, path='"/proc/version"'):
    pids = {h.pid for h in hits if h.kind == "p" and dict(h.args).get("path") == path}
    assert len(pids) == 1, f"expected one process opening {path}: {pids}"
    return pids.pop()


def test_open_entry_and_return(vm, backend):
    be = backend()
    outcomes, hits = run(vm, be, [OPEN, OPEN_RET], "cat /proc/version")
    assert [(o.probe, o.accepted, o.mode) for o in outcomes] == \
        [("kph/open", True, "ftrace"), ("kph/open_ret", True, "ftrace")]
    entry = [h for h in hits if h.kind == "p"]
    ret = [h for h in hits if h.kind == "r"]
    assert entry and all(h.probe == "kph/open" and h.side == "module" for h in entry)
    pid = workload_pid(hits)
    mine = [h for h in entry if h.pid == pid]
    assert all(h.arg("dfd") == "-100" for h in mine)            # AT_FDCWD
    assert all(h.ip == vm.symbols.format(vm.symbols.lookup("do_sys_openat2").addr)
               for h in entry)
    assert all(h.mode == "ftrace" for h in hits)
    assert ret and all(h.ret_from == "do_sys_openat2" for h in ret)
    for h in ret:
        value = int(h.arg("ret"))
        assert value >= 0 or -4095 <= value <= -1, h.line()
    mine_ret = [h for h in ret if h.pid == pid]
    assert len(mine_ret) == len(mine)
    opened = [int(r.arg("ret")) for e, r in zip(mine, mine_ret)
              if e.arg("path") == '"/proc/version"']
    assert opened and opened[0] >= 0
    seqs = [h.seq for h in hits]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    counters = be.counters()
    assert counters["kph/open"].nhit == len(entry)
    assert counters["kph/open_ret"].nhit == len(ret)


def _list_line(vm, addr):
    lines = [ln for ln in vm.run(f"cat {KPROBES_LIST}", check=True).stdout.splitlines()
             if ln.startswith(f"{addr:016x}")]
    assert lines, f"{addr:#x} not in {KPROBES_LIST}"
    return lines


def test_recording_flag_address_is_its_kallsyms_address(vm, backend):
    """The flag's address from the module's section base and the .ko's symbol table (a
    few ms) is the one /proc/kallsyms lists (seconds under TCG)."""
    be = backend()
    be.load()
    at = be._recording_from_sections()
    line = vm.run("grep -E ' recording\\s+\\[kph_kprobes\\]$' /proc/kallsyms",
                  check=True).stdout
    assert at is not None and at == int(line.split()[0], 16), (hex(at or 0), line)


def test_a_module_reloaded_where_it_was_reuses_its_kallsyms_lines(vm, backend, monkeypatch):
    """refresh_module_symbols() reads the modules' kallsyms lines once per state of the
    modules (sizes, addresses, sections, build IDs): kph_kprobes.ko loaded again where it
    was is not read again, and its symbols are the ones read the first time."""
    reads = []
    real = vm.run

    def run(cmd, *a, **kw):
        if "/proc/kallsyms" in cmd:
            reads.append(cmd)
        return real(cmd, *a, **kw)
    monkeypatch.setattr(vm, "run", run)
    be = backend()
    be.load()
    assert "kph_kprobes" in vm.refresh_module_symbols()
    first = vm.symbols.lookup("kph_kprobes:kph_ctl_write").addr
    n = len(reads)
    assert n <= 1
    be.close()
    assert "kph_kprobes" not in vm.refresh_module_symbols()
    be = backend()
    be.load()
    assert "kph_kprobes" in vm.refresh_module_symbols()
    lines = real("grep kph_ctl_write /proc/kallsyms", check=True).stdout
    assert vm.symbols.lookup("kph_kprobes:kph_ctl_write").addr == first == \
        int(lines.split()[0], 16), lines
    # the state without the module may be new (read once); the one with it is not
    assert len(reads) <= n + 1, reads


def test_mid_function_mode_follows_the_flags(vm, backend):
    """+5 is past the ftrace nop: int3 unless the kprobe optimizer takes it; a post_handler
    forbids optimizing, and the kernel then single-steps the instruction."""
    addr = vm.symbols.lookup("do_sys_openat2").addr + 5
    spec = "p:kph/mid do_sys_openat2+5 si=%si"
    be = backend()
    (out,), hits = run(vm, be, [spec], "cat /proc/version")
    optimized = all("[OPTIMIZED]" in ln for ln in _list_line(vm, addr))
    assert out.accepted and out.mode == ("optimized" if optimized else "int3")
    assert hits and all(h.mode == out.mode and h.ip.startswith("do_sys_openat2+0x5/")
                        for h in hits)
    be.close()

    be = backend(post_handler=True)
    (out,), hits = run(vm, be, [spec], "cat /proc/version")
    assert out.accepted and out.mode == "int3"
    assert not any("[OPTIMIZED]" in ln for ln in _list_line(vm, addr))
    assert hits and all(h.mode == "int3" for h in hits)
    # The post_handler sees regs->ip after the single-stepped push %r12 (2 bytes).
    posts = be.post_records
    assert len(posts) == len(hits) and all(p.ip == addr + 2 and p.addr == addr for p in posts)


def test_blacklisted_and_unknown_symbols_are_refused(vm, backend):
    assert vm.blacklist.find(vm.symbols.lookup("do_int3").addr)
    be = backend()
    out = be.register([parse("p:kph/bl do_int3"), parse("p:kph/none no_such_function_kph"),
                       parse("p:kph/mid do_sys_openat2+1"), parse(OPEN)])
    assert [(o.accepted, o.errno) for o in out] == \
        [(False, errno.EINVAL), (False, errno.ENOENT), (False, errno.EILSEQ), (True, 0)]
    assert out[0].message == "Failed to register probe event"        # what error_log says
    assert out[0].reason == "register_kprobe() returned -EINVAL"
    listing = be.list()
    assert [state for state, _, _ in listing.values()] == ["rejected", "rejected", "registered"]


def test_nmissed_when_maxactive_is_exhausted(vm, backend):
    be = backend()
    (out,), hits = run(vm, be, ["r1:kph/sleep do_nanosleep"], "sleep 1 & sleep 1 & wait")
    assert out.accepted
    c = be.counters()["kph/sleep"]
    assert c.nmissed > 0 and c.nhit >= 1 and c.nhit == len(hits)
    stats = be.stats()
    assert int(next(iter(stats.values()))["nentry"]) == c.nhit


def test_agrees_with_tracefs(vm, backend):
    """The same specs through kprobe_events at the same time: every hit of the workload
    prints the same ip and args on both sides. Handlers at one address run newest-first,
    so the module's kretprobe (registered first) saves the return address the tracefs one
    already replaced with the rethook trampoline."""
    entry = ("p:kphcmp/open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring "
             "kpath=+0(%si):string flags=%dx:x32 how=+0(%dx):x64 bits=+0(%dx):b4@1/32 "
             "mode=+8(%dx):u16[2] c=$comm a2=$arg2 ret=$stack0:symbol f=+0(+0(%dx)):string "
             'imm=\\7 lit=\\"lit"')
    ret = "r:kphcmp/ret do_sys_openat2 ret=$retval:s64 ax=%ax:x8"
    be = backend()
    assert all(o.accepted for o in be.register([parse(entry), parse(ret)]))
    for spec in (entry, ret):
        vm.run(f"echo '{spec}' >> {TRACING}/kprobe_events", check=True)
    try:
        vm.run(f"echo > {TRACING}/trace; echo 1 > {TRACING}/events/kphcmp/enable", check=True)
        be.enable()
        vm.run("cat /proc/version", check=True)
        be.disable()
        vm.run(f"echo 0 > {TRACING}/events/kphcmp/enable", check=True)
        trace = vm.run(f"cat {TRACING}/trace", check=True).stdout
    finally:
        vm.run(f"echo 0 > {TRACING}/events/kphcmp/enable; "
               f"echo '-:kphcmp/open' >> {TRACING}/kprobe_events; "
               f"echo '-:kphcmp/ret' >> {TRACING}/kprobe_events")
    hits = be.collect()
    pid = workload_pid(hits)
    names = {"open": [a.name for a in parse(entry).args], "ret": ["ret", "ax"]}
    events = []
    for line in trace.splitlines():
        head = parse_trace_line(line)
        if head is not None and head.pid == pid:
            events.append(parse_trace_line(line, names[head.event]))
    mine = [h for h in hits if h.pid == pid]
    assert len(events) == len(mine) >= 2
    for h, e in zip(mine, events, strict=True):
        assert h.probe == f"kphcmp/{e.event}"
        assert dict(h.args) == e.raw_fields, h.line()
        if h.kind == "p":
            assert h.ip == e.ip_text
        else:
            assert h.ret_from == e.ret_from == "do_sys_openat2"
            # the saved address is the rethook trampoline, which the trace prints as
            # kretprobed() does (kernel/trace/trace_output.c)
            assert h.ip == "[unknown/kretprobe'd]"
            assert e.ip_text.startswith("__x64_sys_openat+")
    opened = [h for h in mine if h.kind == "p" and h.arg("path") == '"/proc/version"']
    assert opened[0].arg("kpath") == '"/proc/version"'      # kernel-typed read of a user
    assert opened[0].arg("f") == "(fault)"                   # address reads user memory
    assert opened[0].arg("lit") == '"lit"' and opened[0].arg("imm") == "0x7"


def test_events_drain_and_record_switch(vm, backend):
    be = backend()
    be.register([parse(OPEN)])
    vm.run("cat /proc/version", check=True)
    assert be.records() == []                                 # not recording yet
    be.enable()
    vm.run("cat /proc/version", check=True)
    first, second = be.records(), be.records()
    paths = lambda recs: [r.args[1][0].data for r in recs]   # noqa: E731
    # A read drains: the second holds only the opens made since (kph-reader opening
    # stats after the first drain, then records again).
    assert b"/proc/version" in paths(first) and b"/proc/version" not in paths(second)
    assert min(r.seq for r in second) > max(r.seq for r in first)
    stats = vm.run(f"cat {KPH_DIR}/stats", check=True).stdout.splitlines()
    assert stats[0] == "recording 1" and "dropped 0" in stats[1]


def test_the_records_drain_and_the_events_text_agree(vm, backend):
    """The module's two drains of its buffer, ``events`` (text, formatted in the guest:
    kph_format()) and ``records`` (the bytes: kph_copy(), what ``collect()`` decodes), give
    the same records for the same workload run twice: every field but the record's place
    (SEQ, PID, CPU), for each open, return and read of ``dd``: values, strings, a comm."""
    from harness.backends.module import parse_events_line
    be = backend()
    be.register([parse("p:kph/open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring"),
                 parse(OPEN_RET), parse("p:kph/rd vfs_read count=%dx:u64 comm=$comm")])
    be.enable()
    mine = lambda recs: [r._replace(seq=0, pid=0, cpu=0) for r in recs  # noqa: E731
                         if r.comm == "dd"]
    workload = "dd if=/proc/version of=/dev/null bs=16 count=3"
    vm.run(workload, check=True)
    text = vm.pull(f"{KPH_DIR}/events").decode()
    as_text = mine(parse_events_line(ln) for ln in text.splitlines())
    vm.run(workload, check=True)
    as_records = mine(be.records())
    assert {r.kind for r in as_text} == {"pre", "ret"}, text
    assert any(r.args[1:2] == ((Item("s", ret=14, data=b"/proc/version"),),) for r in as_text), \
        text
    assert sum(r.args[0] == (Item("i", value=16),) for r in as_text) >= 3, text
    assert as_records == as_text


def test_close_unregisters_everything(vm, backend):
    be = backend()
    be.register([parse(OPEN), parse(OPEN_RET), parse("p:kph/mid do_sys_openat2+5")])
    assert len(vm.run(f"cat {KPROBES_LIST}", check=True).stdout.splitlines()) == 3
    be.close()
    assert_nothing_left(vm)
    be.close()                                                 # idempotent


#: Threads pwrite() "add" lines into one open file: pwrite(2) takes no f_pos_lock (write(2)
#: on a shared regular file does, fdget_pos()), so nothing above the module serialises them.
PWRITER = r"""
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int fd, n;
static long fails;
static void *run(void *arg) {
    char line[64];
    for (int i = 1; i <= n; i++) {
        int len = snprintf(line, sizeof(line), "add %ld p 1 0 0\n", (long)arg * 1000 + i);
        if (pwrite(fd, line, len, 0) != len) __atomic_add_fetch(&fails, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}
int main(int argc, char **argv) {
    pthread_t th[8];
    int t = atoi(argv[2]);
    n = atoi(argv[3]);
    fd = open(argv[1], O_WRONLY);
    if (fd < 0 || t > 8) return 2;
    for (long w = 0; w < t; w++) pthread_create(&th[w], NULL, run, (void *)(w + 1));
    for (int w = 0; w < t; w++) pthread_join(th[w], NULL);
    printf("failed %ld\n", fails);
    return close(fd) != 0;
}
"""


def test_writers_sharing_one_control_file_are_serialised(default_image, tmp_path):
    """kph_ctl_write() holds ctl_mutex for the whole command: on two vCPUs, four threads
    share one open control file (one line buffer) and pwrite() 500 ``add`` lines each
    (address 1: register_kprobe() refuses it at once, the line is still listed). Every
    line runs exactly once and no write fails (unserialised, about 10% were lost)."""
    import shutil
    import subprocess

    from harness import Machine

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: apt-get install gcc libc6-dev (./setup.sh installs them)")
    (tmp_path / "pw.c").write_text(PWRITER)
    subprocess.run([cc, "-static", "-O2", "-pthread", "-o", str(tmp_path / "pw"),
                    str(tmp_path / "pw.c")], check=True, timeout=60)
    with Machine.boot(default_image, smp=2) as m:
        be = ModuleBackend(m)
        be.load()
        try:
            m.push(tmp_path / "pw", "/tmp/kph-pwrite", mode=0o755)
            r = m.run(f"/tmp/kph-pwrite {KPH_DIR}/control 4 500", timeout=120)
            assert (r.status, r.stdout) == (0, "failed 0\n"), r.stderr
            listed = sorted(int(ln.split()[0]) for ln in
                            m.run(f"cat {KPH_DIR}/list", check=True).stdout.splitlines())
            assert listed == [w * 1000 + i for w in range(1, 5) for i in range(1, 501)]
        finally:
            be.close()


def test_the_kernel_names_the_instructions_and_every_post_handler_ip_is_checked(vm, backend):
    """ModuleBackend.instructions asks register_kprobe() where the instructions of a
    function are (it refuses a byte inside one: -EILSEQ); with post_handlers, the
    post-ip check runs on each post record whose instruction's next address its bytes and
    flags tell, and a sound kernel agrees with it at every one (docs/diff.md)."""
    import random

    from harness.apps.hunt import insn_lines
    from harness.kernel.emulate import next_ip

    sym = vm.symbols.lookup("do_sys_openat2")
    sweep = backend()
    sites = sweep.instructions(sym.addr, sym.size)
    sweep.close()                   # one module: the next backend loads it again
    offs = [off for off, _ in sites]
    assert offs == sorted(offs) and len(offs) >= 20 and 0 not in offs   # 0: ftrace, no slot
    assert all(1 <= len(code) <= 15 for _, code in sites)
    assert all(b - a >= len(dict(sites)[a]) for a, b in zip(offs, offs[1:]))
    kinds = {(next_ip(code, sym.addr + off, 0) or ("-",))[0] for off, code in sites}
    assert "call" in kinds and kinds & {"je", "jne", "js", "jns", "jnbe", "jbe"}, kinds
    lines = insn_lines("do_sys_openat2", sym.addr, sites, random.Random(0))
    be = backend(post_handler=True)
    outs, hits = run(vm, be, list(lines), "cat /proc/version; ls / >/dev/null")
    assert all(o.accepted and o.mode == "int3" for o in outs), outs
    assert hits and be.posts_checked >= len(hits) // 2, (len(hits), be.posts_checked)
    assert not [h.post_ip for h in hits if h.post_ip]


def test_raw_kprobes_reach_register_kprobe_without_trace_kprobe_s_checks(vm):
    """``--raw-kprobes``: a function kprobe_events refuses for having no ftrace location
    (kernel/trace/ is built without -pg: within_notrace_func()) is one a module may
    probe; the host, told the same, agrees on each line, and register_kprobe()'s own
    refusal (the blacklist) stays. Registrations only: no workload, nothing armed."""
    from harness.diff.runner import run_differential
    from harness.diff.verdict import compare

    lines = ["p:kph/t tracing_is_on", "p:kph/b do_int3"]
    specs = [parse(ln) for ln in lines]
    by_mode = {}
    for raw in (False, True):
        host, mod = run_differential(vm, specs, "true", guest="module", raw_kprobes=raw,
                                     registrations_only=True)
        res = compare(host, mod)
        assert not [d for d in res.divergences if d.field == "registration"], res.divergences
        by_mode[raw] = [(o.accepted, o.errno) for o in mod.outcomes]
    assert by_mode[False] == [(False, errno.EINVAL), (False, errno.EINVAL)]
    assert by_mode[True] == [(True, 0), (False, errno.EINVAL)], by_mode
    assert vm.run(f"cat {KPROBES_LIST}", check=True).stdout == ""
