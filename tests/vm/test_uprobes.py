"""Host-side uprobes and uretprobes on a booted kernel, and the diff with uprobe_events
(the acceptance of issue 9)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.diff.verdict import compare
from harness.errors import ProbeRejectedError
from harness.kernel.kprobes import ProbeFlags
from harness.kernel.grammar import parse
from harness.diff.runner import run_differential, trampoline_text
from harness.engines.uprobes import Uprobe

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module", params=["gdbstub", "plugin"])
def evm(request, default_image):
    """A machine per host engine: the Python uprobe API's tests run on both."""
    from harness import Machine

    with Machine.boot(default_image, host=request.param) as m:
        yield m


@pytest.fixture
def host_vm(evm):
    """conftest's ``host`` on ``evm``: the API's tests run on each engine."""
    return evm


def kph(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def bg(cmd, out):
    """A guest process that outlives the agent's shell (all three std fds redirected)."""
    return f"({cmd} > {out} 2>&1 < /dev/null &)"


def until(cond, tries=150):
    """Shell: wait (0.1 s a try) until ``cond`` holds. Fixed sleeps are not enough: under
    TCG the guest runs slower while the host is loaded, its clock does not."""
    return f"i=0; until {cond}; do [ $i -ge {tries} ] && break; sleep 0.1; i=$((i+1)); done"


def wait_hits(vm, probe, n=1):
    """Wait (in guest time, at most ~15 s) until ``probe`` was hit ``n`` times."""
    for _ in range(150):
        if probe.nhit >= n:
            return
        vm.run("sleep 0.1", check=True)


def diff(vm, specs, workload):
    runs = run_differential(vm, [parse(s) for s in specs], workload)
    return runs, compare(*runs, trampoline=trampoline_text(vm))


def test_loop_entry_and_return_agree_with_uprobe_events(vm):
    runs, res = diff(vm, ["p:u/add /usr/bin/kph-loop:kph_add a=%di b=%si w=+0(%dx):string "
                          "c=$comm sp1=$stack1 ip=%ip",
                          "r:u/addr /usr/bin/kph-loop:kph_add ret=$retval:s64"],
                     "/usr/bin/kph-loop 6 hello")
    assert res.equivalent, res.first
    assert res.counts["u/add"] == (6, 6) and res.counts["u/addr"] == (6, 6)
    host = [h for h in runs[0].hits if h.probe == "u/add"]
    assert [h.arg("a") for h in host] == [hex(i) for i in range(6)]
    assert {h.arg("w") for h in host} == {'"hello"'}
    rets = [h.arg("ret") for h in runs[0].hits if h.probe == "u/addr"]
    assert rets == [str(4 * i + 5) for i in range(6)]       # a + b + strlen("hello")


def test_recursion_matches_uretprobe_instances_innermost_first(vm):
    runs, res = diff(vm, ["p:u/fact /usr/bin/kph-recurse:kph_fact n=%di:s64",
                          "r:u/factr /usr/bin/kph-recurse:kph_fact v=$retval:s64"],
                     "/usr/bin/kph-recurse 7")
    assert res.equivalent, res.first
    assert [h.arg("n") for h in runs[0].hits if h.probe == "u/fact"] == \
        [str(n) for n in range(7, 0, -1)]
    assert [h.arg("v") for h in runs[0].hits if h.probe == "u/factr"] == \
        ["1", "2", "6", "24", "120", "720", "5040"]
    assert res.applied.get("trampoline", 0) >= 7      # the guest saw our trampoline


def test_multithreaded_agrees_per_thread(vm):
    runs, res = diff(vm, ["p:u/work /usr/bin/kph-threads:kph_work t=%di i=%si",
                          "r:u/workr /usr/bin/kph-threads:kph_work v=$retval:s64"],
                     "/usr/bin/kph-threads 4 8")
    assert res.equivalent, res.first
    assert res.counts["u/work"] == (32, 32) and res.counts["u/workr"] == (32, 32)
    assert len({h.pid for h in runs[0].hits}) == 4
    vals = sorted(int(h.arg("v")) for h in runs[0].hits if h.probe == "u/workr")
    assert vals == sorted(t * 1000 + i for t in range(4) for i in range(8))


def test_a_process_not_targeted_does_not_fire(evm, host):
    """Two kph-loop processes run the same code at the same address; pid targets one."""
    r = evm.run("rm -f /tmp/goA /tmp/goB; "
               f"{bg('/usr/bin/kph-loop 5 aa /tmp/goA', '/tmp/a.out')}; "
               f"{bg('/usr/bin/kph-loop 5 bbb /tmp/goB', '/tmp/b.out')}; "
               f"{until('[ -s /tmp/a.out ] && [ -s /tmp/b.out ]')}; "
               "head -n1 /tmp/a.out; head -n1 /tmp/b.out", check=True)
    pid_a, pid_b = (int(x) for x in r.stdout.split())
    seen, everyone = [], []
    up = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add", pid=pid_a,
                                     handler=lambda u, regs: seen.append(regs.di)))
    host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                handler=lambda u, regs: everyone.append(regs.di)))
    evm.run(f"touch /tmp/goA /tmp/goB; "
           f"{until(f'! kill -0 {pid_a} 2>/dev/null && ! kill -0 {pid_b} 2>/dev/null')}; "
           "cat /tmp/a.out /tmp/b.out", check=True)
    assert seen == [0, 1, 2, 3, 4] and up.nhit == 5    # only process A
    assert sorted(everyone) == sorted([0, 1, 2, 3, 4] * 2)
    assert pid_a != pid_b


def test_fork_child_does_not_inherit_and_exec_drops_the_probe(evm, host):
    r = evm.run("rm -f /tmp/go2; " + bg("/usr/bin/kph-forkexec /tmp/go2", "/tmp/fe2.out") +
               f"; {until('[ -s /tmp/fe2.out ]')}; head -n1 /tmp/fe2.out", check=True)
    pid = int(r.stdout.split()[0])
    seen = []
    up = host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="kph_tick", pid=pid,
                                     handler=lambda u, regs: seen.append(regs.di)))
    rets = []
    rp = host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="kph_tick", pid=pid,
                                     ret_handler=lambda ri, regs: rets.append(regs.ax)))
    done = until("grep -q 'after 201' /tmp/fe2.out")
    out = evm.run(f"touch /tmp/go2; {done}; cat /tmp/fe2.out", check=True).stdout
    assert "after 201" in out                          # the exec'd image ran kph_tick(200)
    assert seen == [1, 2]                              # not the child's 100, not 200 after exec
    assert rets == [2, 3]
    assert up.gone and rp.gone and up.flags & ProbeFlags.GONE
    host.unregister_uprobe(up)                         # a GONE probe unregisters quietly
    host.unregister_uprobe(rp)
    assert not up.registered and not host.uprobes.tramps
    # with pid=None (what uprobe_events does) the child fires too
    everyone = []
    host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="kph_tick",
                                handler=lambda u, regs: everyone.append(regs.di)))
    evm.run("/usr/bin/kph-forkexec > /dev/null", check=True)
    assert sorted(everyone) == [1, 2, 100, 200]


def test_refusals(evm, host):
    with pytest.raises(ProbeRejectedError) as e:
        host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="no_such_function"))
    assert e.value.errno == 2
    with pytest.raises(ProbeRejectedError) as e:
        host.register_uprobe(Uprobe("/usr/bin/nope", offset=0x1000))
    assert e.value.errno == 2
    with pytest.raises(ProbeRejectedError):
        host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add", pid=99999))


def test_cli_diff_on_a_uprobe_and_a_malformed_spec_exits_2():
    r = kph("diff", "p:u /usr/bin/kph-recurse:kph_fact n=%di", "--run", "/usr/bin/kph-recurse 4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equivalent" in r.stderr
    bad = kph("diff", "p:u /usr/bin/kph-loop:0x1z %di", "--run", "true")
    assert bad.returncode == 2
    assert "Invalid uprobe offset" in bad.stderr and "^" in bad.stderr
    assert "Traceback" not in bad.stderr
    nosym = kph("diff", "p:u /usr/bin/kph-loop:no_such_fn %di", "--run", "true")
    assert nosym.returncode == 2 and "trace_uprobe: error: no symbol no_such_fn" in nosym.stderr


def test_close_puts_back_a_hijacked_return_address(evm):
    """kph-loop waits inside main for its go-file; a uretprobe on main hijacked the return
    address. After the engine closes, main must still return where it was called from:
    the gdbstub engine puts the address back; the plugin, which stays loaded, keeps
    servicing returns in flight (docs/plugin.md)."""
    host = evm.host
    up = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="main",
                                     ret_handler=lambda ri, regs: None))
    evm.run("rm -f /tmp/goM; (/usr/bin/kph-loop 2 x /tmp/goM > /tmp/m.out 2>&1 < /dev/null; "
            "echo $? > /tmp/m.rc) > /dev/null 2>&1 < /dev/null &", check=True)
    wait_hits(evm, up)
    assert up.nhit == 1
    host.close()
    if getattr(host, "kind", "gdbstub") == "gdbstub":
        assert host.stats["uretprobe_restored"] == 1
    out = evm.run(f"touch /tmp/goM; {until('[ -s /tmp/m.rc ]')}; cat /tmp/m.rc /tmp/m.out",
                  check=True).stdout
    assert out.split()[0] == "0" and out.split()[2] == "6"   # exit 0; (0+0+1) + (1+3+1)

def test_unregistering_a_uretprobe_keeps_its_trampoline_for_calls_in_flight(evm, host):
    # the engine's counters live as long as the module's machine: this test's own returns
    returns0 = host.stats["uretprobe_returns"]
    calls = []
    up = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="main",
                                     ret_handler=lambda ri, regs: calls.append(regs.ax)))
    evm.run("rm -f /tmp/goF; (/usr/bin/kph-loop 1 x /tmp/goF > /dev/null 2>&1 < /dev/null; "
           "echo $? > /tmp/f.rc) > /dev/null 2>&1 < /dev/null &", check=True)
    wait_hits(evm, up)
    assert up.nhit == 1
    host.unregister_uprobe(up)
    assert host.uprobes.tramps                          # main is still running
    assert evm.run(f"touch /tmp/goF; {until('[ -s /tmp/f.rc ]')}; cat /tmp/f.rc",
                  check=True).stdout == "0\n"
    assert calls == [] and not host.uprobes.tramps      # no handler; trampoline gone after
    assert host.stats["uretprobe_returns"] - returns0 == 1


def test_consumers_run_newest_first_and_register_writes_reach_the_program(evm, host):
    """Two consumers of kph_add: handler_chain() runs the newest registered first, and
    so does handle_uretprobe_chain() at the return. A handler's register writes reach
    the program: the entry's rsi (b) and the return's rax (the value main adds up)."""
    order = []

    def entry(tag, b=None):
        def fn(up, regs):
            order.append(("entry", tag, regs.ip == up.vaddr))
            if b is not None:
                regs.si = b
        return fn

    def ret(tag, ax=None):
        def fn(ri, regs):
            order.append(("ret", tag, regs.ax))
            if ax is not None:
                regs.ax = ax
        return fn

    old = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                       handler=entry("old"), ret_handler=ret("old", 100)))
    new = host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                       handler=entry("new", 0), ret_handler=ret("new")))
    out = evm.run("/usr/bin/kph-loop 3 ab", check=True).stdout
    assert order[:4] == [("entry", "new", True), ("entry", "old", True),
                         ("ret", "new", 2), ("ret", "old", 2)]    # a + 0 + strlen("ab")
    assert len(order) == 12 and old.nhit == new.nhit == 3
    assert out == "300\n"                   # every call returned what the old consumer set


@pytest.mark.parametrize("series", ["6.12", "7.3"])
@pytest.mark.parametrize("engine", ["gdbstub", "plugin"])
def test_newer_kernels_per_process_and_the_syscall_trampolines_frame(series, engine):
    """The Python API on 6.12 and 7.3, both engines: a per-process uprobe fires for the
    parent only and is GONE after its exec (``uprobe_clear_state()`` on these kernels
    too), and a ret_handler finds rax, rcx and r11 just below sp, as
    ``uretprobe_trampoline_entry`` pushed them for ``sys_uretprobe()`` (6.11+)."""
    from harness import Machine
    from harness.machine.image.store import default_image

    with Machine.boot(default_image(series), host=engine) as m:
        host = m.host
        r = m.run("rm -f /tmp/go5; " + bg("/usr/bin/kph-forkexec /tmp/go5", "/tmp/fe5.out") +
                  f"; {until('[ -s /tmp/fe5.out ]')}; head -n1 /tmp/fe5.out", check=True)
        pid = int(r.stdout.split()[0])
        seen, frames = [], []

        def ret(ri, regs):
            below = host.read(regs.sp - 24, 24)
            frames.append((tuple(int.from_bytes(below[i:i + 8], "little") for i in (16, 8, 0)),
                           (regs.ax, regs.cx, regs.r11)))

        up = host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="kph_tick", pid=pid,
                                         handler=lambda u, regs: seen.append(regs.di),
                                         ret_handler=ret))
        out = m.run(f"touch /tmp/go5; {until('grep -q after /tmp/fe5.out')}; cat /tmp/fe5.out",
                    check=True).stdout
        assert "after 201" in out
        assert seen == [1, 2] and up.gone, (seen, up)
        assert len(frames) == 2 and all(a == b for a, b in frames), frames
        host.unregister_uprobe(up)
        errors = host.take_handler_errors()
        host.close()
        assert not errors, errors


def test_a_fork_inside_a_uretprobed_call_returns_in_both_processes(evm, host):
    """``fork()`` probed at its return: the child's stack is a copy holding the
    trampoline, and the kernel gives the child copies of the parent's return instances
    (``uprobe_copy_process()``, ``dup_utask()``), so the call returns through the
    trampoline twice, and every-process consumers run in both (a per-process one in the
    parent only). Before, the host broke the child: it returned into the padding."""
    rets, mine = [], []
    every = host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="_Fork",
                                        ret_handler=lambda ri, regs: rets.append(regs.ax)))
    ticks = []
    host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="kph_tick",
                                handler=lambda u, regs: ticks.append(regs.di)))
    r = evm.run("rm -f /tmp/go6; " + bg("/usr/bin/kph-forkexec /tmp/go6", "/tmp/fe6.out") +
                f"; {until('[ -s /tmp/fe6.out ]')}; head -n1 /tmp/fe6.out", check=True)
    pid = int(r.stdout.split()[0])
    one = host.register_uprobe(Uprobe("/usr/bin/kph-forkexec", symbol="_Fork", pid=pid,
                                      ret_handler=lambda ri, regs: mine.append(regs.ax)))
    out = evm.run(f"touch /tmp/go6; {until('grep -q after /tmp/fe6.out')}; cat /tmp/fe6.out",
                  check=True).stdout
    assert "after 201" in out
    assert sorted(ticks) == [1, 2, 100, 200]           # the child ran kph_tick(100)
    assert len(rets) == 2 and 0 in rets and rets[0] + rets[1] > 0, rets
    assert len(mine) == 1 and mine[0] > 0, mine        # the parent's: the child's pid
    assert every.nhit == 1 and one.nhit == 1           # one call, two returns
