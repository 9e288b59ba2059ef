"""uprobe_events lines in the plugin engine, diffed with the guest's own uprobes.

The cases of tests/vm/test_uprobes.py that compare with uprobe_events, on the plugin,
plus the inode rule (a copy of the program, same code at the same address, is not
probed) and the three worlds.
"""
from __future__ import annotations

import pytest

from harness import Machine
from harness.diff.verdict import compare
from harness.kernel.grammar import parse
from harness.diff.runner import run_differential, trampoline_text

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
