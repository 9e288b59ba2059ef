"""Python handlers in the plugin engine: the kprobes API of harness.engines.gdbstub_engine, same semantics.

Mirrors tests/vm/test_engine.py case by case (where the gdbstub engine emulates or
single-steps, the plugin lets QEMU run the instruction), plus what only this engine
shows: the post_handler after a call, a conditional branch and a ret, a vCPU waiting in
a handler while the other runs, nmissed of a maxactive=1 kretprobe across two vCPUs.
"""
from __future__ import annotations

import errno
import threading

import pytest

from harness.errors import HandlerError

from harness import Machine
from harness.errors import ProbeRejectedError
from harness.kernel.kprobes import Jprobe, Kprobe, Kretprobe

pytestmark = pytest.mark.vm

OPEN = "cat /proc/version"


@pytest.fixture(scope="module")
def pvm(default_image):
    with Machine.boot(default_image, host="plugin") as m:
        yield m


@pytest.fixture
def host(pvm):
    h = pvm.host
    assert h.kind == "plugin"
    yield h
    errors = h.take_handler_errors()
    h.close()
    assert pvm.run("echo alive").stdout == "alive\n"
    assert not errors, f"handler raised: {errors[0]!r}"


def user_string(host, addr):
    return (host.read_string(addr) or b"").decode()


def at(vm, off):
    return vm.symbols.lookup("do_sys_openat2").addr + off


def test_pre_and_post_around_the_entry_nop(pvm, host):
    seen = []
    kp = host.register_kprobe(Kprobe(
        symbol_name="do_sys_openat2",
        pre_handler=lambda p, r: seen.append(("pre", r.ip, r.signed("di", 32), user_string(host, r.si))),
        post_handler=lambda p, r, f: seen.append(("post", r.ip, f))))
    pvm.run(OPEN, check=True)
    assert seen and kp.nhit == len(seen) // 2
    assert ("pre", kp.addr + 1, -100, "/proc/version") in seen   # regs->ip = addr + 1
    assert seen[1] == ("post", kp.addr + 5, 0)
    assert host.stats["round_trips"] == len(seen)


def test_a_one_vcpu_guest_s_channel_polls_for_events_while_hits_are_dense(pvm, host):
    """With a core the vCPU leaves free, the channel's thread polls for the next event
    (probes/plugin/waiter.c) before sleeping, and the vCPU as long for each answer; the
    hits are served all the same. The plugin takes the vCPU's poll from CMD_CHANNEL: one
    it refuses (over a second) leaves the channel as it was."""
    import os

    from harness.machine.pluginlink import (ANSWER_SPIN_DENSE_US, ANSWER_SPIN_US, Channel,
                                            PluginError)

    hits = []
    host.register_kprobe(Kprobe(symbol_name="vfs_read", pre_handler=lambda p, r: hits.append(r.dx)))
    pvm.run("dd if=/dev/zero of=/dev/null bs=1 count=300 2>/dev/null", check=True)
    chans = host._channels
    assert len(chans) == host.link.nvcpus == 1
    assert (chans[0]._waiter is not None) == ((os.cpu_count() or 1) > 1)
    assert chans[0].answer_spin_us == (ANSWER_SPIN_DENSE_US if chans[0]._waiter is not None
                                       else ANSWER_SPIN_US)
    assert hits.count(1) >= 300
    with pytest.raises(PluginError) as err:
        Channel(host.link, 0, answer_spin_us=1_000_001)
    assert err.value.errno == errno.EINVAL
    hits.clear()
    pvm.run("dd if=/dev/zero of=/dev/null bs=1 count=30 2>/dev/null", check=True)
    assert hits.count(1) >= 30          # the refused channel replaced nothing


def test_mid_function_push_and_mov_effects(pvm, host):
    """do_sys_openat2+5 is push %r12, +7 is mov %rsi,%r12 (checked, not assumed)."""
    code = host.read(at(pvm, 0), 16)
    assert code[5:7] == bytes.fromhex("4154") and code[7:10] == bytes.fromhex("4989f4")
    push, mov = [], []
    host.register_kprobes([
        Kprobe(symbol_name="do_sys_openat2", offset=5,
               pre_handler=lambda p, r: push.append({"sp": r.sp, "r12": r.r12}),
               post_handler=lambda p, r, f: push.append(
                   {"sp": r.sp, "top": int.from_bytes(host.read(r.sp, 8), "little"), "ip": r.ip})),
        Kprobe(symbol_name="do_sys_openat2", offset=7,
               pre_handler=lambda p, r: mov.append({"si": r.si}),
               post_handler=lambda p, r, f: mov.append({"r12": r.r12, "ip": r.ip})),
    ])
    pvm.run(OPEN, check=True)
    before, after = push[0], push[1]
    assert after["sp"] == before["sp"] - 8 and after["top"] == before["r12"]
    assert after["ip"] == at(pvm, 7)
    assert mov[1]["r12"] == mov[0]["si"] and mov[1]["ip"] == at(pvm, 10)


def test_post_handler_after_call_branch_and_ret(pvm, host):
    """The instruction runs in QEMU; the post_handler sees the registers after it, at the
    next instruction the vCPU executes: a call's target with the return address pushed,
    the branch taken or not as the flags said, a ret's return address."""
    code = host.read(at(pvm, 0x47), 1) + host.read(at(pvm, 0x4e), 1) + host.read(at(pvm, 0x6e), 1)
    assert code == b"\xe8\x74\xc3", code.hex()      # call rel32, je rel8, ret
    call_target = at(pvm, 0x4c) + int.from_bytes(host.read(at(pvm, 0x48), 4), "little", signed=True)
    log = {"call": [], "je": [], "ret": []}

    def pair(name):
        return dict(pre_handler=lambda p, r: log[name].append(("pre", r.ip, r.sp, r.ax,
                                                               int.from_bytes(host.read(r.sp, 8), "little"))),
                    post_handler=lambda p, r, f: log[name].append(("post", r.ip, r.sp, r.ax,
                                                                   int.from_bytes(host.read(r.sp, 8), "little"))))
    host.register_kprobes([Kprobe(symbol_name="do_sys_openat2", offset=0x47, **pair("call")),
                           Kprobe(symbol_name="do_sys_openat2", offset=0x4e, **pair("je")),
                           Kprobe(symbol_name="do_sys_openat2", offset=0x6e, **pair("ret"))])
    pvm.run(OPEN, check=True)
    pre, post = log["call"][0], log["call"][1]
    assert post[0] == "post" and post[1] == call_target
    assert post[2] == pre[2] - 8 and post[4] == at(pvm, 0x4c)
    for pre, post in zip(log["je"][::2], log["je"][1::2]):
        taken = pre[3] & 0xFFFFFFFF == 0                  # test eax,eax; je
        assert post[1] == (at(pvm, 0x73) if taken else at(pvm, 0x50))
    pre, post = log["ret"][0], log["ret"][1]
    assert post[1] == pre[4] and post[2] == pre[2] + 8
    assert pvm.symbols.format(post[1]).startswith("__x64_sys_openat")


def test_pre_handler_changing_the_path_is_visible(pvm, host):
    """Return -EACCES from do_sys_openat2 for one path: set ax, ip and sp, return 1."""
    def deny(p, r):
        if user_string(host, r.si) != "/proc/version":
            return 0
        r.ax = -errno.EACCES
        r.ip = int.from_bytes(host.read(r.sp, 8), "little")  # the caller
        r.sp = r.sp + 8
        return 1
    posts = []
    host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=deny,
                                post_handler=lambda p, r, f: posts.append(r.ip)))
    r = pvm.run("cat /proc/version; echo status=$?; head -c 5 /proc/cmdline")
    assert "Permission denied" in r.stderr
    assert "status=1" in r.stdout and r.stdout.endswith("conso")
    assert posts  # other opens still ran the post_handler


def test_pre_handler_register_write_carries_over_but_ip_does_not(pvm, host):
    """With 0 the ip change is dropped (setup_singlestep() overwrites it), other registers
    stay: rdi (dfd) made AT_FDCWD for a relative path changes nothing visible, while a
    bogus dfd makes the open fail with EBADF."""
    def pre(p, r):
        if user_string(host, r.si) == "version":
            r.di = 12345         # a bad dfd
            r.ip = r.ip + 1      # dropped
        return 0
    host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=pre))
    r = pvm.run("cd /proc && cat version; echo status=$?")
    assert "status=1" in r.stdout and "Bad file descriptor" in r.stderr


def test_fault_handler_sees_page_fault_and_cr2(pvm, host):
    f = pvm.symbols.lookup("strncpy_from_user")
    sites = [insn for insn, _ in host.exception_table() if f.addr <= insn < f.addr + f.size]
    assert sites, "strncpy_from_user has no user-access instruction in __ex_table"
    faults = []

    def on_fault(p, r, trapnr):
        faults.append((p.addr, trapnr, r.read_sys("cr2"), r.ip))
        return 0  # not handled: the kernel's exception table turns it into -EFAULT
    host.register_kprobes([Kprobe(addr=a, fault_handler=on_fault) for a in sites])
    r = pvm.run("kph-efault 0x1000")
    assert r.stdout.strip() == "open(0x1000) = -1 errno 14", r.stdout
    ours = [f for f in faults if f[2] == 0x1000]
    assert ours, f"no fault on 0x1000 among {[hex(f[2]) for f in faults]}"
    addr, trapnr, cr2, ip = ours[0]
    assert trapnr == 14 and ip == addr
    assert host.stats["faults"] >= 1


def test_fault_handler_that_handles_redirects(pvm, host):
    f = pvm.symbols.lookup("strncpy_from_user")
    table = [(i, x) for i, x in host.exception_table() if f.addr <= i < f.addr + f.size]
    fixups = dict(table)

    def handle(p, r, trapnr):
        if r.read_sys("cr2") != 0x1000:
            return 0
        r.ip = fixups[p.addr]
        return 1
    host.register_kprobes([Kprobe(addr=i, fault_handler=handle) for i, _ in table])
    r = pvm.run("kph-efault 0x1000")
    assert "errno 14" in r.stdout
    assert host.stats["faults_handled"] >= 1


def test_kretprobe_sees_the_return_values_the_guest_gets(pvm, host):
    got = []

    def entry(ri, regs):
        ri.data[:8] = regs.si.to_bytes(8, "little")
        return 0

    def ret(ri, regs):
        path = user_string(host, int.from_bytes(ri.data[:8], "little"))
        if path.startswith(("/proc/version", "/nope", "/etc/kph")):
            got.append((path, regs.signed("ax"), regs.ip, ri.ret_addr))
    rp = host.register_kretprobe(Kretprobe(symbol_name="do_sys_openat2", handler=ret,
                                           entry_handler=entry, maxactive=4, data_size=8))
    out = pvm.run("kph-open /proc/version /nope /etc/kph/modules.load /proc/version", check=True)
    truth = [(ln.split()[0], int(ln.split()[1])) for ln in out.stdout.splitlines()]
    assert [(p, v) for p, v, _, _ in got] == truth
    assert all(ip == ret for _, _, ip, ret in got)
    assert all(pvm.symbols.format(ret).startswith("__x64_sys_openat") for *_, ret in got)
    assert rp.nmissed == 0 and rp.nhit >= 4


def test_entry_handler_nonzero_suppresses_the_return_handler(pvm, host):
    calls = []
    rp = host.register_kretprobe(Kretprobe(symbol_name="do_sys_openat2",
                                           entry_handler=lambda ri, r: 1,
                                           handler=lambda ri, r: calls.append(1)))
    pvm.run(OPEN, check=True)
    assert calls == [] and rp.nmissed == 0


def test_three_probes_at_one_address_in_order_and_disable(pvm, host):
    order = []
    a, b, c = (Kprobe(symbol_name="do_sys_openat2", pre_handler=lambda p, r, n=n: order.append(n))
               for n in "abc")
    host.register_kprobes([a, b, c])
    pvm.run(OPEN, check=True)
    assert order[:3] == ["c", "b", "a"]
    order.clear()
    host.disable_kprobe(b)
    assert "[DISABLED]" in host.list()
    pvm.run(OPEN, check=True)
    assert order[:2] == ["c", "a"] and "b" not in order
    order.clear()
    host.unregister_kprobe(c)
    host.enable_kprobe(b)
    pvm.run(OPEN, check=True)
    assert order[:2] == ["b", "a"] and "c" not in order


def test_pre_handler_nonzero_stops_the_chain(pvm, host):
    order = []

    def first(p, r):
        order.append(1)
        r.ip = r.ip + 5  # skip the entry nop ourselves
        return 1
    host.register_kprobes([Kprobe(symbol_name="do_sys_openat2",
                                  pre_handler=lambda p, r: order.append(2)),
                           Kprobe(symbol_name="do_sys_openat2", pre_handler=first)])
    pvm.run(OPEN, check=True)
    assert order and set(order) == {1}


def test_list_prints_like_debugfs(pvm, host):
    host.register_kprobe(Kprobe(symbol_name="do_sys_openat2"))
    host.register_kretprobe(Kretprobe(symbol_name="do_sys_openat2", handler=lambda ri, r: 0))
    addr = at(pvm, 0)
    assert host.list().splitlines() == [f"{addr:016x}  r  do_sys_openat2+0x0    ",
                                        f"{addr:016x}  k  do_sys_openat2+0x0    "]


def test_jprobe_gets_the_arguments(pvm, host):
    seen = []
    host.register_jprobe(Jprobe(symbol_name="do_sys_openat2",
                                entry=lambda dfd, filename, how: seen.append((dfd, filename))))
    pvm.run(OPEN, check=True)
    dfd, filename = seen[0]
    assert dfd & 0xFFFFFFFF == 0xFFFFFF9C
    assert user_string(host, filename).startswith("/")


def test_registration_errors_use_the_kernels_errnos(pvm, host):
    cases = [
        (Kprobe(symbol_name="do_sys_openat2", addr=0xffffffff81000000), errno.EINVAL),
        (Kprobe(symbol_name="no_such_function_kph"), errno.ENOENT),
        (Kprobe(symbol_name="kprobe_int3_handler"), errno.EINVAL),
        (Kprobe(symbol_name="do_sys_openat2", offset=1), errno.EILSEQ),
        (Kprobe(addr=host.trampoline), errno.EINVAL),
    ]
    for kp, want in cases:
        with pytest.raises(ProbeRejectedError) as ei:
            host.register_kprobe(kp)
        assert ei.value.errno == want, (kp, ei.value)
        assert not kp.registered
    with pytest.raises(ProbeRejectedError) as ei:
        host.register_kretprobe(Kretprobe(symbol_name="do_sys_openat2", offset=5,
                                          handler=lambda ri, r: 0))
    assert ei.value.errno == errno.EINVAL


def test_batch_that_fails_part_way_unregisters_what_it_did(pvm, host):
    good = Kprobe(symbol_name="do_sys_openat2")
    bad = Kprobe(symbol_name="no_such_function_kph")
    with pytest.raises(ProbeRejectedError):
        host.register_kprobes([good, bad])
    assert not good.registered and host.list() == ""
    pvm.run(OPEN, check=True)
    assert good.nhit == 0


def test_close_with_a_hijacked_return_address(pvm, host):
    entered = threading.Event()
    host.register_kretprobe(Kretprobe(symbol_name="do_nanosleep",
                                      entry_handler=lambda ri, r: entered.set() or 0,
                                      handler=lambda ri, r: 0))
    t = threading.Thread(target=lambda: pvm.run("sleep 2", timeout=30))
    t.start()
    assert entered.wait(20)
    host.close()  # the sleeper is inside do_nanosleep with the trampoline as its return
    t.join(30)
    assert not t.is_alive()
    assert pvm.run("echo ok").stdout == "ok\n"


def test_unregister_with_live_instances_keeps_the_trampoline(pvm, host):
    entered = threading.Event()
    calls = []
    rp = host.register_kretprobe(Kretprobe(symbol_name="do_nanosleep",
                                           entry_handler=lambda ri, r: entered.set() or 0,
                                           handler=lambda ri, r: calls.append(1)))
    t = threading.Thread(target=lambda: pvm.run("sleep 1", timeout=30))
    t.start()
    assert entered.wait(20)
    host.unregister_kretprobe(rp)
    t.join(30)
    assert not t.is_alive() and calls == []  # returned through the trampoline, no handler
    assert host.stats["returns"] == 1


def test_handler_exception_is_logged_and_the_guest_goes_on(pvm, host):
    def boom(p, r):
        raise RuntimeError("boom")
    host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=boom))
    assert pvm.run(OPEN).ok
    assert host.stats["handler_errors"] >= 1
    with pytest.raises(HandlerError, match="boom"):   # not silent: the next call raises
        host.register_kprobe(Kprobe(symbol_name="vfs_read"))


# ---------------------------------------------------------------- two vCPUs

@pytest.fixture(scope="module")
def smp2(default_image):
    with Machine.boot(default_image, host="plugin", smp=2) as m:
        yield m


def test_a_handler_stops_its_vcpu_only(smp2):
    """While vCPU 0 waits in a handler, vCPU 1 goes on: its timer ticks (a busy loop
    pinned there keeps them coming) reach a probe on update_process_times(), whose handler
    releases the first. With every vCPU stopped at a hit, as the gdbstub engine does,
    the second could never fire and the first would time out. (The loop forks nothing
    while the first waits: the guest kernel on CPU 1 must not need CPU 0.)"""
    host = smp2.host
    other_ran = threading.Event()
    seen = {}

    def blocking(p, r):
        if user_string(host, r.si) == "/proc/version":
            seen["blocked_cpu"] = r.cpu
            seen["released"] = other_ran.wait(20)
        return 0

    def tick(p, r):
        if "blocked_cpu" in seen and r.cpu != seen["blocked_cpu"] and not other_ran.is_set():
            seen["other_cpu"] = r.cpu
            other_ran.set()
        return 0
    try:
        host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=blocking))
        host.register_kprobe(Kprobe(symbol_name="update_process_times", pre_handler=tick))
        smp2.run("taskset 2 sh -c 'i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done' & "
                 "sleep 0.3; taskset 1 cat /proc/version >/dev/null; kill %1; wait",
                 timeout=60)
        assert seen.get("released") is True, seen
        assert seen["blocked_cpu"] == 0 and seen["other_cpu"] == 1
    finally:
        other_ran.set()
        host.close()


def test_maxactive_1_two_vcpus_concurrent_calls_miss(smp2):
    """Two sleepers on two vCPUs hold do_nanosleep at once: one instance, one nmissed,
    as the guest's own kretprobe counts it (pre_handler_kretprobe(), kernel/kprobes.c)."""
    host = smp2.host
    calls = []
    try:
        rp = host.register_kretprobe(Kretprobe(symbol_name="do_nanosleep", maxactive=1,
                                               handler=lambda ri, r: calls.append(ri.cpu)))
        smp2.run("taskset 1 sleep 1 & taskset 2 sleep 1 & wait", timeout=30)
        assert rp.nmissed >= 1
        assert len(calls) == rp.nhit
    finally:
        host.close()


def test_post_mode_comes_and_goes_with_post_handlers(pvm, host):
    """A post_handler makes every translation block test for a pending post (one flush
    to reach old blocks); when the last one goes, so does the test (one more flush)."""
    before = host.global_stats()["flushes"]
    kp = host.register_kprobe(Kprobe(symbol_name="do_sys_openat2",
                                     post_handler=lambda p, r, f: None))
    pvm.run(OPEN, check=True)
    assert host.global_stats()["flushes"] == before + 1
    host.register_kprobe(Kprobe(symbol_name="vfs_read", post_handler=lambda p, r, f: None))
    pvm.run(OPEN, check=True)
    assert host.global_stats()["flushes"] == before + 1      # already on
    host.unregister_kprobes([kp, *[p for ps in host._aggr.values() for p in ps]])
    pvm.run(OPEN, check=True)
    assert host.global_stats()["flushes"] == before + 2


def test_closing_the_engine_lets_a_vcpu_waiting_in_a_handler_go_on(pvm):
    """A dead harness must not hold a vCPU: closing the engine while a handler still
    waits shuts its channel, the vCPU goes on as if the handler returned 0."""
    host = pvm.host
    entered, release = threading.Event(), threading.Event()

    def stuck(p, r):
        if user_string(host, r.si) == "/proc/version":
            entered.set()
            release.wait(30)
        return 0
    host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=stuck))
    out = {}
    t = threading.Thread(target=lambda: out.update(r=pvm.run("cat /proc/version", timeout=60)))
    t.start()
    try:
        assert entered.wait(20)
        host.close()
        t.join(30)
        assert not t.is_alive() and out["r"].ok and not release.is_set()
    finally:
        release.set()
    assert pvm.run("echo alive").stdout == "alive\n"


def test_a_jump_label_site_is_refused_as_the_guest_refuses_it_from_sites_kept_per_snapshot(pvm, host):
    """check_kprobe_address_safe() (kernel/kprobes.c): a probe on a static branch's jmp/nop
    is -EINVAL, in the guest's own kprobe_events and host-side alike. The engine reads
    vmlinux's sites once per snapshot (Machine.kept): what it kept is what the guest's
    memory holds now, read afresh."""
    from harness.kernel.symbols import ReservedText

    fresh = ReservedText.from_memory(pvm.symbols, host.read)
    kept = pvm.kept("reserved-text", ReservedText.state(pvm.symbols))
    assert kept is not None, "the engine kept no sites for this snapshot"
    was = ReservedText.from_bytes(kept)
    assert (was.jump, was.static_calls, was.bugs) == (fresh.jump, fresh.static_calls, fresh.bugs)
    assert len(fresh.jump) > 1000 and fresh.bugs
    # a site inside a core text function the blacklist does not name
    text = range(pvm.symbols.lookup("_stext").addr, pvm.symbols.lookup("_etext").addr)
    site = next(a for a in fresh.jump
                if a in text and (s := pvm.symbols.symbolize(a)) and s[1] > 0
                and pvm.blacklist.find(a) is None)
    with pytest.raises(ProbeRejectedError) as ei:
        host.register_kprobe(Kprobe(addr=site))
    assert ei.value.errno == errno.EINVAL and "jump label" in str(ei.value)
    r = pvm.run(f"echo 'p:kph_jl {site:#x}' >> /sys/kernel/tracing/kprobe_events")
    assert r.status != 0 and "Invalid argument" in r.stderr, (hex(site), r)
