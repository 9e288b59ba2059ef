"""Issue 14's six divergence classes and honest verdicts, on the booted 6.1 kernel.

Each test draws its probes from the 6.1 selftests (tools/testing/selftests/ftrace/test.d)
or samples/kprobes, and shows host and guest agreeing, or refusing alike with the kernel's
errno and error_log text. The selftests' definitions themselves are all in
``test_selftests.py``; these tests look at what each class needs beyond a diff.
"""
from __future__ import annotations

import errno
import logging
import subprocess
import sys

import pytest

from harness.errors import ProbeRejectedError
from harness.kernel.kprobes import Kprobe
from harness.kernel.grammar import parse

pytestmark = pytest.mark.vm

FORK = "ls / >/dev/null; ls / >/dev/null"
KPROBES_LIST = "/sys/kernel/debug/kprobes/list"


def kph(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


# -- 1. existing event names (EEXIST), and return probes that never return -------------------

def test_eexist_texts_on_both_sides(probe_diff):
    """kprobe_syntax_errors.tc's multiprobe errors, in one run: the first line makes the
    event, the others are refused with the kernel's three texts, on both sides."""
    res = probe_diff(["p:kprobes/testevent kernel_clone abcd=\\1",
                      "r:kprobes/testevent do_exit",
                      "p:kprobes/testevent kernel_clone bcd=\\1",
                      "p:kprobes/testevent kernel_clone abcd=\\1"], FORK)
    res.assert_equivalent()
    for side in res.runs:
        assert [(o.accepted, o.errno, o.message) for o in side.outcomes] == [
            (True, 0, ""),
            (False, errno.EEXIST, "Probe type is different from existing probe"),
            (False, errno.EEXIST, "Argument type or name is different from existing probe"),
            (False, errno.EEXIST, "There is already the exact same probe event")], side.side
    assert res.both_refused == ["kprobes/testevent#2", "kprobes/testevent#3",
                                "kprobes/testevent#4"]


def test_the_issues_eexist_case_records_nothing_for_the_refused_line(probe_diff):
    res = probe_diff(["p:kprobes/testevent kernel_clone", "p:kprobes/testevent do_exit $stack"],
                     FORK)
    res.assert_equivalent()
    host, guest = res.runs
    # every hit is kernel_clone's: the refused do_exit line placed nothing on either side
    assert {h.ip.split("+")[0] for h in host.hits + guest.hits} == {"kernel_clone"}


def test_a_return_probe_on_do_exit_keeps_its_pool_and_tears_down(probe_diff, caplog):
    """The issue's case: r on do_exit. Its instances never return; 6.1 recycles them when
    the task is freed (rethook_flush_task() from delayed_put_task_struct()), so the default
    pool (10 here) never drains over 25 exits and nothing is missed on either side; the
    host used to keep them and miss every exit past the tenth. Closing must not read the
    dead tasks' stacks ("could not shut down cleanly")."""
    caplog.set_level(logging.WARNING)
    work = "; ".join(["ls / >/dev/null"] * 25) + "; true"
    res = probe_diff(["r:kprobes/ex do_exit", "p:kprobes/en do_exit"], work)
    res.assert_equivalent(min_events=0)     # nmissed is compared exactly; the return
    assert res.silent == ["kprobes/ex"]     # probe never fires: do_exit does not return
    assert res.matched["kprobes/en"] >= 25
    host, guest = res.runs
    assert host.counters["kprobes/ex"].nmissed == guest.counters["kprobes/ex"].nmissed == 0
    assert len([h for h in guest.hits if h.probe == "kprobes/en"]) >= 25
    assert probe_diff.vm.host.stats["kretprobe_flushed"] >= 15
    assert not [r for r in caplog.records if "could not shut down" in r.getMessage()]


# -- 2. @SYM fetch arguments ----------------------------------------------------------------

def test_fetch_symbols_resolve_at_registration(probe_diff):
    """kprobe_args_syntax.tc: good @SYM forms record values; bad ones are ENOENT at
    registration on both sides, and no handler ever runs for them."""
    res = probe_diff(["p:good vfs_read a=@_sdata b=@_sdata+10 c=@_sdata-10 d=+10(@_sdata-10)",
                      "p:bad1 vfs_read x=@deaqswdefr", "p:bad2 vfs_read x=@_sdata*10",
                      "p:bad3 vfs_read x=@", "p:bad4 vfs_read x=@_sdata+zz"],
                     "head -c 20 /proc/version >/dev/null")
    res.assert_equivalent()
    for side in res.runs:
        assert [(o.accepted, o.errno) for o in side.outcomes] == [
            (True, 0), (False, errno.ENOENT), (False, errno.ENOENT), (False, errno.ENOENT),
            (False, errno.EINVAL)]
    assert not probe_diff.vm.host.handler_errors


def test_kph_probe_refuses_an_unknown_fetch_symbol():
    r = kph("probe", "p:a vfs_read x=@bogus", "--run", "head -c 5 /proc/version")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "refused: ENOENT (Invalid probed address or symbol)" in r.stderr


# -- 3. unqualified module symbols ------------------------------------------------------------

def test_unqualified_module_symbol_with_stale_image_addresses(probe_diff):
    """port_fops_open is virtio_console's. Module addresses differ from boot to boot; the
    image's kallsyms holds one boot's. Make this machine's table stale on purpose: the host
    must still take the address from the running guest, as kallsyms_lookup_name() does."""
    vm = probe_diff.vm
    vm.refresh_module_symbols()     # this boot's: the image's lines are another boot's
    real = vm.symbols.lookup("port_fops_open")
    assert real.module == "virtio_console"
    listed = vm.run("grep -w port_fops_open /proc/kallsyms", timeout=30).stdout.split()
    assert int(listed[0], 16) == real.addr, listed
    lines = [f"{s.addr + 0x1000:016x} {s.type} {s.name}\t[virtio_console]" for s in vm.symbols
             if s.module == "virtio_console"]
    vm.symbols.add_module("virtio_console", "\n".join(lines))
    assert vm.symbols.lookup("port_fops_open").addr != real.addr
    res = probe_diff(["p:event0 port_fops_open", "p:event1 virtio_console:port_fops_open"],
                     "cat /dev/vport*p1 </dev/null >/dev/null 2>&1 & sleep 0.3; kill %1; wait")
    res.assert_equivalent()
    assert res.matched == {"kprobes/event0": 1, "kprobes/event1": 1}
    assert vm.symbols.lookup("port_fops_open").addr == real.addr


def test_unqualified_module_symbol_through_the_api(kph_fresh_machine):
    vm = kph_fresh_machine
    hits = []
    kp = vm.host.register_kprobe(Kprobe(symbol_name="port_fops_open",
                                        pre_handler=lambda p, r: hits.append(r.ip) or 0))
    vm.run("cat /dev/vport*p1 </dev/null >/dev/null 2>&1 & sleep 0.3; kill %1; wait")
    vm.host.unregister_kprobe(kp)
    assert hits == [kp.addr + 1]
    assert vm.symbols.symbolize(kp.addr)[0].module == "virtio_console"


# -- 4. strings as the kernel stored them -----------------------------------------------------

def test_strings_keep_newlines_and_bytes_that_are_not_utf8(probe_diff):
    """kprobe_args_symbol.tc's @linux_proc_banner:string holds a newline; file names and a
    comm with bytes that are not UTF-8. Both sides show the same escaped bytes."""
    bad = "$(printf '\\377\\303')"
    work = (f"cp /bin/busybox /tmp/{bad}x; /tmp/{bad}x ls / >/dev/null; "
            f"touch \"/tmp/a$(printf '\\n\\001\\351')b\"; ls / >/dev/null")
    res = probe_diff(["p:str kernel_clone s=@linux_proc_banner:string",
                      "p:open do_sys_openat2 path=+0(%si):ustring c=$comm",
                      "p:exit do_exit c=$comm"], work)
    res.assert_equivalent()
    host, guest = res.runs
    banner = [h.arg("s") for h in guest.hits if h.probe == "kprobes/str"]
    assert banner and all(v.endswith('%s\\n"') for v in banner)       # the newline, kept
    paths = {h.arg("path") for h in guest.hits if h.probe == "kprobes/open"}
    assert '"/tmp/a\\n\\001\\351b"' in paths and '"/tmp/\\377\\303x"' in paths
    comms = {h.arg("c") for h in guest.hits if h.probe == "kprobes/exit"}
    assert '"\\377\\303x"' in comms


# -- 5. a pre_handler's regs.ip -----------------------------------------------------------------

@pytest.mark.parametrize("where,post,mode", [
    ("do_sys_openat2", False, "ftrace"),
    ("do_sys_openat2+5", True, "int3"),
    ("do_sys_openat2+5", False, "optimized"),
], ids=["ftrace", "int3", "optimized"])
def test_pre_handler_ip_is_addr_plus_one_on_every_path(kph_fresh_machine, where, post, mode):
    """kprobe_example.c prints regs->ip in its pre_handler: the kernel's module sees
    addr + 1 through kprobe_ftrace_handler(), kprobe_int3_handler() and
    optimized_callback(), and so does the host's pre_handler on the same calls. The
    post_handler sees the next instruction."""
    from harness.backends.module import ModuleBackend

    vm = kph_fresh_machine
    host_pre, host_post = [], []
    kp = vm.host.register_kprobe(Kprobe(
        symbol_name="do_sys_openat2", offset=5 if "+" in where else 0,
        pre_handler=lambda p, r: host_pre.append(r.ip) or 0,
        post_handler=(lambda p, r, f: host_post.append(r.ip)) if post else None))
    be = ModuleBackend(vm, post_handler=post)
    try:
        (out,) = be.register([parse(f"p:kph/ip {where}")])
        assert out.accepted
        vm.host.invalidate_code()
        if mode == "optimized":             # the optimizer works after a delay
            vm.run(f"for i in 1 2 3 4 5 6 7 8 9 10; do grep -q OPTIMIZED {KPROBES_LIST} && break;"
                   " sleep 0.2; done")
        be.enable()
        vm.run("cat /proc/version >/dev/null", check=True)
        be.disable()
        recs = be.records()
        listing = vm.run(f"cat {KPROBES_LIST}").stdout
    finally:
        be.close()
        vm.host.unregister_kprobe(kp)
    pre = [r for r in recs if r.kind == "pre"]
    assert pre and host_pre
    seen_mode = pre[0].mode
    if mode == "optimized":
        assert seen_mode == "optimized", listing
    else:
        assert seen_mode == mode
    assert all(r.ip == r.addr + 1 for r in pre), [(hex(r.addr), hex(r.ip)) for r in pre]
    assert set(host_pre) == {kp.addr + 1}
    if post:
        posts = [r for r in recs if r.kind == "post"]
        assert posts and all(r.ip == r.addr + 2 for r in posts)    # after push %r12
        assert set(host_post) == {kp.addr + 2}


def test_a_nonzero_pre_handler_resumes_where_it_left_regs_ip(kph_fresh_machine):
    """Returning non-zero skips the instruction: the guest resumes at regs.ip as the
    handler left it. Here it skips the entry's 5-byte nop itself (addr + 5, not
    regs.ip + 4 from addr + 1), and do_sys_openat2 carries on."""
    vm = kph_fresh_machine
    seen = []

    def skip_nop(p, regs):
        seen.append(regs.ip)
        regs.ip = p.addr + 5
        return 1
    kp = vm.host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=skip_nop))
    r = vm.run("cat /proc/version")
    vm.host.unregister_kprobe(kp)
    assert r.status == 0 and r.stdout.startswith("Linux version")
    assert seen and set(seen) == {kp.addr + 1}


# -- 6. uprobe targets that are not regular files ---------------------------------------------

def test_uprobe_targets_that_are_not_regular_files(probe_diff):
    """uprobe_syntax_errors.tc: /sys is EINVAL "Not a regular file", a missing file ENOENT
    "Failed to find the given file", on both sides and through the API."""
    from harness.engines.uprobes import Uprobe

    res = probe_diff(["p /sys:100", "p /non_exist_file:100", "p:u/dev /dev/null:0"], "true")
    res.assert_equivalent(min_events=0, refusals_ok=True)
    for side in res.runs:
        assert [(o.errno, o.message) for o in side.outcomes] == [
            (errno.EINVAL, "Not a regular file"),
            (errno.ENOENT, "Failed to find the given file"),
            (errno.EINVAL, "Not a regular file")], side.side
    vm = probe_diff.vm
    with pytest.raises(ProbeRejectedError) as info:
        vm.host.register_uprobe(Uprobe("/sys", 100, handler=lambda u, r: 0))
    assert info.value.errno == errno.EINVAL and "Not a regular file" in str(info.value)
    with pytest.raises(ProbeRejectedError) as info:
        vm.host.register_uprobe(Uprobe("/non_exist_file", 100, handler=lambda u, r: 0))
    assert info.value.errno == errno.ENOENT


def test_uprobe_offsets_the_kernel_takes_and_never_installs(probe_diff):
    """/bin/sh:10 is uprobe_syntax_errors.tc's base line: a regular file, an offset in its
    ELF header. 6.1 takes it (uprobe_register() only refuses offsets past the file's end)
    and never installs it (valid_vma(): no executable mapping holds it)."""
    res = probe_diff(["p /bin/sh:10", "p:u/past /bin/sh:0x10000000"], "ls / >/dev/null")
    res.assert_equivalent(min_events=0, refusals_ok=True)     # accepted, never installed
    host, guest = res.runs
    assert host.outcomes[0].accepted and guest.outcomes[0].accepted
    assert "valid_vma" in host.outcomes[0].pending
    assert (host.outcomes[1].errno, guest.outcomes[1].errno) == (errno.EINVAL, errno.EINVAL)
    assert not host.hits and not [h for h in guest.hits if h.comm != "qemu-ga"]


# -- honest verdicts --------------------------------------------------------------------------

def test_a_refusal_is_shown_as_a_refusal():
    r = kph("diff", "p:x do_int3", "--run", "true")
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("result: both refused: EINVAL (blacklisted: do_int3"), r.stderr
    r = kph("diff", "p vfs_read+0x2", "--run", "true")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 0 and last.startswith("result: both refused: EILSEQ ("), r.stderr
    assert "Probe point is not an instruction boundary" in last


def test_a_workload_that_did_not_run_is_a_usage_error():
    r = kph("diff", "p:x do_sys_openat2", "--run", "no_such_cmd")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "did not run (exit 127: /bin/sh: no_such_cmd: not found)" in r.stderr, r.stderr
    r = kph("diff", "p:x do_sys_openat2", "--run", "cat /nope")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(exit 1: cat: can't open '/nope': No such file or directory)" in r.stderr
