"""GdbStub against the real default image: hits, registers, memory, stepping, vCPUs."""
from __future__ import annotations

import os
import threading
import time

import pytest

from harness.errors import ProbeRejectedError
from harness.gdbstub import GdbStub
from harness.kernel.symbols import Blacklist, check_probe_address, load_kallsyms_cached
from harness.vmctl import Machine

pytestmark = pytest.mark.vm

AT_FDCWD = -100


@pytest.fixture(scope="module")
def syms(default_image):
    return load_kallsyms_cached(default_image.kallsyms)


@pytest.fixture
def stub(vm):
    g = vm.gdbstub(resume=False)
    if g.running:
        g.interrupt()
    yield g
    if g.running:
        g.interrupt()
    for n in list(g_bps(g)):
        g.delete_breakpoint(n)
    if not g.running:
        g.cont()


def g_bps(g: GdbStub) -> list[int]:
    r = g.command("-break-list")
    body = r.get("BreakpointTable", {}).get("body", [])
    return [int(b["number"]) for b in body]


def run_in_thread(vm, cmd):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", vm.run(cmd, timeout=60)))
    t.start()
    return t, out


def collect_hits(g, thread, *, handler, limit=200):
    hits = []
    while thread.is_alive() and len(hits) < limit:
        try:
            s = g.wait_stop(timeout=0.2)
        except TimeoutError:
            continue
        hits.append(handler(s))
    thread.join(60)
    return hits


def s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def test_breakpoint_hits_with_rip_at_symbol_and_at_fdcwd(vm, stub, syms):
    addr = syms.lookup("do_sys_openat2").addr
    stub.insert_breakpoint(addr)
    stub.cont()
    t, out = run_in_thread(vm, "cat /proc/version")

    def on_hit(s):
        regs = stub.read_registers(("rip", "rdi"))
        stub.resume(s.addr + 5)  # past the 5-byte ftrace nop at the entry
        return s, regs

    hits = collect_hits(stub, t, handler=on_hit)
    assert "Linux version" in out["r"].stdout
    assert hits, "no breakpoint hit while cat opened files"
    for s, regs in hits:
        assert s.reason == "breakpoint-hit"
        assert s.addr == addr and regs["rip"] == addr
    assert any(s32(regs["rdi"]) == AT_FDCWD for _, regs in hits)


def test_register_write_round_trips(stub):
    stub.interrupt()
    before = stub.read_registers()
    assert {"rip", "rsp", "eflags", "cs", "cr3", "gs_base", "efer"} <= set(before)
    assert before["cs"] == 0x10 or before["cs"] & 3 == 3  # kernel or user code segment
    stub.write_register("r15", 0x1122334455667788)
    assert stub.read_registers(("r15",))["r15"] == 0x1122334455667788
    stub.write_register("r15", before["r15"])
    assert stub.read_registers(("r15",))["r15"] == before["r15"]
    stub.cont()


def test_memory_write_is_seen_by_the_guest(vm, stub, syms):
    # init_uts_ns.name.nodename (struct new_utsname: sysname[65], nodename[65], ...)
    nodename = syms.lookup("init_uts_ns").addr + 65
    stub.interrupt()
    old = stub.read_memory(nodename, 16)
    assert old.startswith(b"kph\0")
    stub.write_memory(nodename, b"gdbwrite\0")
    assert stub.read_memory(nodename, 9) == b"gdbwrite\0"
    stub.cont()
    assert vm.run("uname -n").stdout.strip() == "gdbwrite"
    stub.interrupt()
    stub.write_memory(nodename, old)
    stub.cont()
    assert vm.run("uname -n").stdout.strip() == "kph"


def test_single_step_from_entry_nop_lands_at_entry_plus_5(vm, stub, syms):
    addr = syms.lookup("do_sys_openat2").addr
    assert stub.read_memory(addr, 5) == bytes.fromhex("0f1f440000")  # shadowed: no 0xcc
    stub.insert_breakpoint(addr)
    stub.cont()
    t, _ = run_in_thread(vm, "cat /proc/version")
    s = stub.wait_stop(timeout=30)
    assert s.addr == addr
    after = stub.step(thread=s.thread)
    assert after.addr == addr + 5
    assert stub.read_registers(("rip",))["rip"] == addr + 5
    for n in g_bps(stub):
        stub.delete_breakpoint(n)
    stub.cont()
    t.join(60)


def test_interrupt_stops_a_running_guest(stub):
    stub.cont()
    s = stub.interrupt()
    assert not stub.running
    assert s.addr != 0
    stub.cont()


def test_offset_inside_an_instruction_is_refused(stub, syms):
    stub.interrupt()
    addr = syms.resolve("do_sys_openat2+1")
    with pytest.raises(ProbeRejectedError) as ei:
        check_probe_address(addr, symbols=syms, blacklist=Blacklist(""), read=stub.read_memory)
    assert ei.value.errno == 84  # EILSEQ
    assert "do_sys_openat2+0x1" in str(ei.value)
    check_probe_address(syms.resolve("do_sys_openat2+5"), symbols=syms,
                        blacklist=Blacklist(""), read=stub.read_memory)
    stub.cont()


def test_blacklisted_symbol_is_refused(stub, syms, default_image):
    bl = Blacklist(default_image.blacklist.read_text())
    stub.interrupt()
    addr = syms.lookup("kprobe_int3_handler").addr
    with pytest.raises(ProbeRejectedError) as ei:
        check_probe_address(addr, symbols=syms, blacklist=bl, read=stub.read_memory)
    assert ei.value.errno == 22  # EINVAL
    assert "kprobe_int3_handler" in str(ei.value) and "blacklist" in str(ei.value)
    stub.cont()


def test_two_vcpus_are_two_threads(default_image):
    with Machine.boot(default_image, smp=2) as vm:
        g = vm.gdbstub(resume=False)
        assert g.threads() == [1, 2]
        r1 = g.read_registers(("rsp", "gs_base"), thread=1)
        r2 = g.read_registers(("rsp", "gs_base"), thread=2)
        assert r1["gs_base"] != r2["gs_base"]  # per-cpu areas differ
        g.cont()
        assert vm.run("nproc").stdout.strip() == "2"
        gdb_pid = g.proc.pid
    assert not os.path.exists(f"/proc/{gdb_pid}")


def test_gdb_is_reaped_when_a_test_fails_mid_stop(default_image):
    pid = None
    with pytest.raises(RuntimeError):
        with Machine.boot(default_image) as vm:
            g = vm.gdbstub(resume=False)
            pid = g.proc.pid
            raise RuntimeError("a test failing while the guest is halted")
    time.sleep(0.1)
    assert pid and not os.path.exists(f"/proc/{pid}")


def test_an_early_gdb_is_the_one_attached_and_is_reaped_when_never_attached(default_image):
    """Machine.boot(early_gdb=True) (kph diff --host gdbstub): gdb starts with QEMU, and the
    session gdbstub() attaches is that process, working; a machine that never attaches
    ends its early gdb by pid when it closes; one whose early gdb died starts another."""
    with Machine.boot(default_image, early_gdb=True) as vm:
        early = vm._early_gdb
        assert early is not None and early.poll() is None
        g = vm.gdbstub(resume=False)
        assert g.proc is early and vm._early_gdb is None
        assert g.read_registers(("rip",))["rip"] > 0
        g.cont()
        assert vm.run("echo alive").stdout == "alive\n"
    assert early.poll() is not None and not os.path.exists(f"/proc/{early.pid}")
    with Machine.boot(default_image, early_gdb=True) as vm:
        unused = vm._early_gdb
        assert unused is not None and unused.poll() is None
    assert unused.poll() is not None and not os.path.exists(f"/proc/{unused.pid}")
    with Machine.boot(default_image, early_gdb=True) as vm:
        dead = vm._early_gdb
        dead.kill()
        dead.wait(5)
        g = vm.gdbstub()
        assert g.proc is not dead and g.proc.poll() is None
        assert vm.run("echo alive").stdout == "alive\n"
    with Machine.boot(default_image) as vm:
        assert vm._early_gdb is None


def test_symbols_of_a_bare_kernel_are_harvested_from_the_guest(default_image, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path))
    from harness.machine.qemu import find_qemu

    with Machine.boot(kernel=default_image.kernel, initrd=default_image.initrd,
                      qemu=find_qemu()) as vm:
        assert vm.image is None
        syms = vm.symbols
        assert syms.lookup("do_sys_openat2").addr == \
            load_kallsyms_cached(default_image.kallsyms).lookup("do_sys_openat2").addr
        assert vm.blacklist.find(syms.lookup("kprobe_int3_handler").addr)
        mods = vm.refresh_module_symbols()
        assert "virtio_console" in mods
        sym = syms.lookup("virtio_console:init_port_console") if False else None
        text = syms.format(syms.lookup("virtio_console:virtcons_probe").addr)
        assert text.endswith("[virtio_console]")
    assert list((tmp_path / "kernels").glob("*/kallsyms"))
