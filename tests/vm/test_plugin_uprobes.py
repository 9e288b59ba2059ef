"""uprobe_events lines in the plugin engine, diffed with the guest's own uprobes.

The cases of tests/vm/test_uprobes.py that compare with uprobe_events, on the plugin,
plus the inode rule (a copy of the program, same code at the same address, is not
probed) and the three worlds: for spec lines (``kph diff --host both``) and for Python
handlers (the gdbstub engine's and the plugin engine's ``register_uprobe``, and the
guest's uprobe_events, on one execution). The Python API's own cases run on both engines
in tests/vm/test_uprobes.py.
"""
from __future__ import annotations

import pytest

from harness import Machine
from harness.backends import make_backend
from harness.diff.verdict import compare
from harness.engines.gdbstub_engine import HostEngine
from harness.engines.uprobes import Uprobe
from harness.kernel.grammar import parse
from harness.diff.runner import resolve_uprobes, run_differential, trampoline_text

pytestmark = pytest.mark.vm


@pytest.fixture
def pvm(default_image):
    with Machine.boot(default_image, host="plugin") as m:
        yield m


def diff(vm, specs, workload):
    runs = run_differential(vm, [parse(s) for s in specs], workload)
    assert runs[0].side == "plugin"
    return runs, compare(*runs, trampoline=trampoline_text(vm))


def test_loop_entry_and_return_agree_with_uprobe_events(pvm):
    runs, res = diff(pvm, ["p:u/add /usr/bin/kph-loop:kph_add a=%di b=%si w=+0(%dx):string "
                           "c=$comm sp1=$stack1 ip=%ip",
                           "r:u/addr /usr/bin/kph-loop:kph_add ret=$retval:s64"],
                     "/usr/bin/kph-loop 6 hello")
    assert res.equivalent, res.first
    assert res.counts["u/add"] == (6, 6) and res.counts["u/addr"] == (6, 6)
    plug = [h for h in runs[0].hits if h.probe == "u/add"]
    assert [h.arg("a") for h in plug] == [hex(i) for i in range(6)]
    assert {h.arg("w") for h in plug} == {'"hello"'}
    rets = [h.arg("ret") for h in runs[0].hits if h.probe == "u/addr"]
    assert rets == [str(4 * i + 5) for i in range(6)]
    assert res.applied.get("trampoline", 0) >= 6    # the guest returned through ours


def test_recursion_matches_instances_innermost_first(pvm):
    runs, res = diff(pvm, ["p:u/fact /usr/bin/kph-recurse:kph_fact n=%di:s64",
                           "r:u/factr /usr/bin/kph-recurse:kph_fact v=$retval:s64"],
                     "/usr/bin/kph-recurse 7")
    assert res.equivalent, res.first
    assert [h.arg("n") for h in runs[0].hits if h.probe == "u/fact"] == \
        [str(n) for n in range(7, 0, -1)]
    assert [h.arg("v") for h in runs[0].hits if h.probe == "u/factr"] == \
        ["1", "2", "6", "24", "120", "720", "5040"]


def test_multithreaded_agrees_per_thread(pvm):
    runs, res = diff(pvm, ["p:u/work /usr/bin/kph-threads:kph_work t=%di i=%si",
                           "r:u/workr /usr/bin/kph-threads:kph_work v=$retval:s64"],
                     "/usr/bin/kph-threads 4 8")
    assert res.equivalent, res.first
    assert res.counts["u/work"] == (32, 32) and res.counts["u/workr"] == (32, 32)
    assert len({h.pid for h in runs[0].hits}) == 4
    vals = sorted(int(h.arg("v")) for h in runs[0].hits if h.probe == "u/workr")
    assert vals == sorted(t * 1000 + i for t in range(4) for i in range(8))


def test_a_copy_of_the_program_is_another_inode(pvm):
    """The kernel puts a uprobe on an inode (kernel/events/uprobes.c): a copy of
    kph-loop runs the same code at the same address and is not probed; the plugin sees
    its hits and drops them by current->mm->exe_file->f_inode->i_ino."""
    pvm.run("cp /usr/bin/kph-loop /tmp/kph-copy", check=True)
    runs, res = diff(pvm, ["p:u/add /usr/bin/kph-loop:kph_add a=%di"],
                     "/tmp/kph-copy 3 x; /usr/bin/kph-loop 2 y")
    assert res.equivalent, res.first
    assert [h.comm for h in runs[0].hits] == ["kph-loop", "kph-loop"]
    assert pvm.host.global_stats()["uprobe_filtered"] >= 3


def test_kph_diff_host_both_with_uprobes(capsys):
    from harness.cli import main

    rc = main(["diff", "--host", "both", "p:u/add /usr/bin/kph-loop:kph_add a=%di",
               "r:u/addr /usr/bin/kph-loop:kph_add ret=$retval:s64",
               "--run", "/usr/bin/kph-loop 3 hi"])
    cap = capsys.readouterr()
    out = cap.err                      # text for people: stderr
    assert cap.out == ""
    assert rc == 0, out
    assert out.rstrip().endswith("three worlds: EQUIVALENT")


def three_worlds(vm, lines, workload, *, pid=None, guest_filter=None):
    """One execution: the same uprobe and uretprobe as Python handlers in the gdbstub
    engine and in the plugin engine (``pid``: per process), and as uprobe_events
    ``lines`` in the guest (``guest_filter`` on its events). Each world's hits as
    (event, value) in order, and the handlers' (ip, func) as seen."""
    specs = resolve_uprobes(vm, [parse(s) for s in lines])
    entry = specs[0]
    name_p, name_r = (line.split()[0].split(":", 1)[1] for line in lines)
    stub = HostEngine(vm, emulate=False)       # the gdbstub engine, beside the plugin's vm.host
    g = make_backend("events", vm)
    seen = {"gdbstub": [], "plugin": []}
    where = {"gdbstub": set(), "plugin": set()}
    try:
        for world, eng in (("gdbstub", stub), ("plugin", vm.host)):
            log, at = seen[world], where[world]
            eng.register_uprobe(Uprobe(
                entry.path, symbol=lines[0].split(":")[2].split()[0], pid=pid,
                handler=lambda up, r, log=log, at=at: (log.append((name_p, r.di)),
                                                       at.add(("ip", r.ip - up.vaddr))),
                ret_handler=lambda ri, r, log=log, at=at: (log.append((name_r, r.ax)),
                                                           at.add(("func", ri.func)))))
        outs = g.register(specs)
        assert all(o.accepted for o in outs), outs
        for ev in (name_p, name_r):
            if guest_filter:
                vm.run(f"echo '{guest_filter}' > /sys/kernel/tracing/events/{ev}/filter",
                       check=True)
        stub.invalidate_code()
        g.enable()
        vm.run(workload, check=True, timeout=120)
        g.disable()
        guest = [(h.probe, int(h.args[0][1], 0)) for h in g.collect()]
        errors = stub.take_handler_errors() + vm.host.take_handler_errors()
        assert not errors, errors
    finally:
        g.close()
        stub.close()
    return seen, guest, where


def test_python_handlers_in_three_worlds(pvm):
    """kph_fact recursing: the handlers of both engines see what uprobe_events records,
    call for call (innermost return first), and the probed address at each entry."""
    seen, guest, where = three_worlds(
        pvm, ["p:u/fact /usr/bin/kph-recurse:kph_fact n=%di:s64",
              "r:u/factr /usr/bin/kph-recurse:kph_fact v=$retval:s64"],
        "/usr/bin/kph-recurse 5")
    want = [("u/fact", n) for n in range(5, 0, -1)] + \
        [("u/factr", v) for v in (1, 2, 6, 24, 120)]
    assert guest == want
    assert seen["gdbstub"] == want and seen["plugin"] == want
    assert where["gdbstub"] == where["plugin"] and ("ip", 0) in where["plugin"]


def test_per_process_handlers_in_three_worlds(pvm):
    """Two kph-loop processes at the same address; both engines' uprobes target one
    (``pid``), the guest's events filter on it (``common_pid``, one thread)."""
    r = pvm.run("rm -f /tmp/g3A /tmp/g3B; "
                "(/usr/bin/kph-loop 4 aa /tmp/g3A > /tmp/3a.out 2>&1 < /dev/null &); "
                "(/usr/bin/kph-loop 3 bbb /tmp/g3B > /tmp/3b.out 2>&1 < /dev/null &); "
                "i=0; until [ -s /tmp/3a.out ] && [ -s /tmp/3b.out ]; do "
                "[ $i -ge 150 ] && break; sleep 0.1; i=$((i+1)); done; "
                "head -n1 /tmp/3a.out; head -n1 /tmp/3b.out", check=True)
    pid_a, pid_b = (int(x) for x in r.stdout.split())
    go = (f"touch /tmp/g3A /tmp/g3B; i=0; while kill -0 {pid_a} 2>/dev/null || "
          f"kill -0 {pid_b} 2>/dev/null; do [ $i -ge 300 ] && break; sleep 0.1; "
          "i=$((i+1)); done; cat /tmp/3a.out /tmp/3b.out")
    seen, guest, _ = three_worlds(
        pvm, ["p:u/add /usr/bin/kph-loop:kph_add a=%di",
              "r:u/addr /usr/bin/kph-loop:kph_add v=$retval:s64"],
        go, pid=pid_a, guest_filter=f"common_pid == {pid_a}")
    want = [x for i in range(4) for x in (("u/add", i), ("u/addr", 4 * i + 2))]
    assert guest == want
    assert seen["gdbstub"] == want and seen["plugin"] == want


def test_a_fork_inside_a_uretprobed_call_in_three_worlds(pvm):
    """``r:`` on ``_Fork`` (static glibc's fork): the guest records the return in the
    parent and in the child (``dup_utask()``), and so do both engines: the gdbstub engine
    copies its instances at ``uprobe_copy_process()``, the plugin in C (``PK_FORK``)."""
    from harness.diff.worlds import run_three

    tw = run_three(pvm, [parse("r:u/f /usr/bin/kph-forkexec:_Fork ret=$retval:s64"),
                         parse("p:u/t /usr/bin/kph-forkexec:kph_tick v=%di")],
                   "/usr/bin/kph-forkexec")
    assert tw.equivalent, tw.first_divergence().first
    for run in tw.runs:
        rets = sorted(int(h.arg("ret")) for h in run.hits if h.probe == "u/f")
        assert len(rets) == 2 and rets[0] == 0 and rets[1] > 0, (run.side, rets)
        assert sorted(int(h.arg("v"), 0) for h in run.hits if h.probe == "u/t") == \
            [1, 2, 100, 200], run.side
    assert pvm.host.global_stats()["uretprobe_forked"] >= 1


@pytest.mark.parametrize("copied, direct_map", [
    (False, None), (True, None),
    (False, 0),                         # the kernel's direct map unknown
    (False, 0xffff800000000000)],       # a direct map that does not map (x86's guard hole)
    ids=["the page cache's page", "a copy the guest's uprobe made",
         "no direct map: every translation flushed",
         "a direct map that does not map: every translation flushed"])
def test_a_uprobe_added_while_the_program_runs_reaches_its_translated_code(pvm, copied,
                                                                           direct_map):
    """A program already looping through kph_add (its code translated) gets the plugin's
    uprobe at once, without a flush of every translation: the plugin invalidates the
    physical pages its user blocks were translated from (kph_plugin.c user_invalidate),
    the page cache's, or the private copy the guest's own uprobe made of that page
    (``__replace_page()``, kernel/events/uprobes.c) when one is armed there. Where the
    kernel's direct map is unknown or does not map, everything is flushed instead."""
    vm = pvm
    if direct_map is not None:
        vm.host._direct_map = direct_map
    if copied:
        vm.run(f"cd /sys/kernel/tracing && echo 'p:g/add /usr/bin/kph-loop:{_offset(vm, 'kph_add'):#x}'"
               " >> uprobe_events && echo 1 > events/g/add/enable", check=True)
    pid = int(vm.run("(/usr/bin/kph-loop 400000000 x > /dev/null 2>&1 < /dev/null & echo $!)",
                     check=True).stdout.split()[0])
    try:
        # the loop has run (translated) before the probe: its guest time, not a host sleep
        vm.run("sleep 0.3", check=True)
        assert vm.run(f"kill -0 {pid}").status == 0, "kph-loop ended before the probe"
        flushes = vm.host.global_stats()["flushes"]
        hits: list[int] = []
        up = vm.host.register_uprobe(Uprobe("/usr/bin/kph-loop", symbol="kph_add",
                                            handler=lambda u, regs: hits.append(regs.di)))
        for _ in range(100):
            if len(hits) >= 20:
                break
            vm.run("sleep 0.05")
        vm.host.unregister_uprobe(up)
        assert len(hits) >= 20, f"{len(hits)} hits of the running loop after the probe"
        assert hits[:20] == list(range(hits[0], hits[0] + 20))    # its own i, in order
        # a full flush only where the direct map cannot serve
        assert vm.host.global_stats()["flushes"] == flushes + (direct_map is not None)
    finally:
        vm.run(f"kill {pid}")
        if copied:
            vm.run("cd /sys/kernel/tracing && echo 0 > events/g/add/enable && "
                   "echo '-:g/add' >> uprobe_events")


def _offset(vm, symbol):
    """``symbol``'s file offset in kph-loop (what a uprobe_events line takes)."""
    from harness.engines.uprobes import file_stat, cached_elf
    img = cached_elf(vm, file_stat(vm, "/usr/bin/kph-loop"), "/usr/bin/kph-loop")
    return img.file_offset(img.symbol(symbol))
