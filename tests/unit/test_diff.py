import dataclasses

import pytest

from harness.diff.verdict import compare
from harness.records import Counters, Hit, Outcome, SideResult


def hit(side, seq, probe="kprobes/open", comm="cat", **args):
    return Hit(side=side, probe=probe, kind="p", seq=seq, cpu=0, pid=7, comm=comm,
               ip="do_sys_openat2+0x0/0x170", args=tuple((k, str(v)) for k, v in args.items()))


def run(side, hits, outcomes=None, counters=None, preempt="lazy"):
    """One side's result; an in-guest side's kernel preempts on interrupt exit (7.3's
    lazy model) unless ``preempt`` says otherwise."""
    return SideResult(side, outcomes or [Outcome("kprobes/open", True)], hits, counters or {},
                      preempt=preempt if side in ("events", "module") else None)


def test_equal_streams_are_equivalent_and_agent_hits_are_left_out():
    a = run("host", [hit("host", 0, dfd=-100), hit("host", 1, comm="qemu-ga", dfd=1)])
    b = run("events", [hit("events", 0, dfd=-100)])
    res = compare(a, b)
    assert res.equivalent and res.matched == {"kprobes/open": 1}
    assert res.applied["agent"] == 1


def test_agent_hits_are_counted_as_left_out_on_their_side_whatever_is_in_flight():
    """``left_out`` counts each side's agent hits (and side b's renamed agent children),
    also when the other side has a hit in flight: an in-flight host hit once hid the
    guest side's agent hit from the count (the skip compared each side's hits with both
    sides' in-flight ones)."""
    tail = dataclasses.replace(hit("host", 2, comm="kthreadd"), in_flight=True)
    a = run("host", [hit("host", 0), hit("host", 1, comm="qemu-ga"), tail])
    b = run("events", [hit("events", 0), hit("events", 1, comm="qemu-ga")])
    res = compare(a, b)
    assert res.equivalent and res.applied["in-flight"] == 1
    assert res.left_out == {"kprobes/open": (1, 1)} and res.applied["agent"] == 2
    # and with nothing in flight, nothing of the agent's: nothing left out
    res = compare(run("host", [hit("host", 0)]), run("events", [hit("events", 0)]))
    assert res.left_out == {} and res.applied["agent"] == 0


def test_first_differing_field_is_named_with_context():
    a = run("host", [hit("host", i, dfd=-100, path='"/x"') for i in range(5)])
    bh = [hit("events", i, dfd=-100, path='"/x"') for i in range(5)]
    bh[2] = hit("events", 2, dfd=3, path='"/x"')
    res = compare(a, run("events", bh))
    d = res.first
    assert not res.equivalent and (d.probe, d.field, d.index) == ("kprobes/open", "arg:dfd", 2)
    assert (d.a_value, d.b_value) == ("-100", "3")
    assert len(d.a_context) >= 3


def test_extra_hits_are_a_count_divergence():
    a = run("host", [hit("host", 0, dfd=1)])
    b = run("events", [hit("events", 0, dfd=1), hit("events", 1, dfd=1)])
    d = compare(a, b).first
    assert d.field == "count" and (d.a_value, d.b_value) == ("1", "2")


def test_refusals_compare_by_errno():
    a = run("host", [], [Outcome.rejected("kprobes/bl", 22)])
    b = run("events", [], [Outcome.rejected("kprobes/bl", 22)])
    assert compare(a, b).equivalent and "refusal-text" not in compare(a, b).applied
    # other words: compared by errno only where a side names why it cannot know them
    a2 = run("host", [], [Outcome.rejected("kprobes/bl", 22, "Invalid argument",
                                           words="registration")])
    b2 = run("events", [], [Outcome.rejected("kprobes/bl", 22, "Failed to register probe event",
                                             subsystem="trace_kprobe")])
    res = compare(a2, b2)
    assert res.equivalent and res.applied["refusal-text"] == 1
    assert not compare(a2, b2, strict=True).equivalent
    # refused (defect 9): the host's own words against the kernel's, with no named case
    a3 = run("host", [], [Outcome.rejected("kprobes/bl", 22,
                                           "no ftrace location matches 'non_exist_func'",
                                           subsystem="trace_kprobe")])
    b3 = run("events", [], [Outcome.rejected("kprobes/bl", 22, "Invalid probed address or symbol",
                                             subsystem="trace_fprobe", column=2)])
    res = compare(a3, b3)
    assert not res.equivalent and res.first.field == "refusal"
    # the same message under another subsystem, or another caret, diverges too
    a4 = run("host", [], [Outcome.rejected("kprobes/bl", 22, "Invalid probed address or symbol",
                                           subsystem="trace_kprobe", column=2)])
    assert compare(a4, b3).first.field == "refusal"
    a5 = run("host", [], [Outcome.rejected("kprobes/bl", 22, "Invalid probed address or symbol",
                                           subsystem="trace_fprobe", column=0)])
    assert compare(a5, b3).first.field == "refusal"
    a6 = run("host", [], [Outcome.rejected("kprobes/bl", 22, "Invalid probed address or symbol",
                                           subsystem="trace_fprobe", column=2)])
    assert compare(a6, b3).equivalent
    b = run("events", [], [Outcome("kprobes/bl", True)])
    assert compare(a, b).first.field == "registration"


def test_nmissed_must_match():
    a = run("host", [], counters={"kprobes/r": Counters("kprobes/r", 5, 1)})
    b = run("events", [], counters={"kprobes/r": Counters("kprobes/r", 9, 0)})
    d = compare(a, b).first
    assert d.field == "nmissed"


def test_trampoline_return_address_normalization():
    ra = Hit("host", "kprobes/r", "r", 0, 0, 7, "cat", "__x64_sys_openat+0x6a/0xa0", "do_sys_openat2")
    rb = Hit("events", "kprobes/r", "r", 0, 0, 7, "cat", "_etext+0x0/0x0", "do_sys_openat2")
    o = [Outcome("kprobes/r", True)]
    assert not compare(run("host", [ra], o), run("events", [rb], o)).equivalent
    res = compare(run("host", [ra], o), run("events", [rb], o), trampoline="_etext+0x0")
    assert res.equivalent and res.applied["trampoline"] == 1


def test_host_unknown_matches_any_value_only_where_the_record_says_why():
    """Applied: a host (unknown) the record gives a kernel reason for matches any guest
    value, per element, that argument only, counted under the reason's rule."""
    h = dataclasses.replace(hit("host", 0, head="{(unknown),(unknown)}", n="(unknown)"),
                            unknown=(("head", "stale"), ("n", "below-sp")),
                            failed=(("head", 0xffff888000001000),))
    a = run("host", [h])
    b = run("events", [hit("events", 0, head="{20,0}", n="5")])
    res = compare(a, b)
    assert res.equivalent and res.applied["stale"] == 1 and res.applied["below-sp"] == 1
    assert {(n.field, n.rule) for n in res.normalized} >= {("arg:head", "stale"),
                                                           ("arg:n", "below-sp")}
    b = run("events", [hit("events", 0, head="{20,0,1}", n="5")])
    assert not compare(a, b).equivalent


def test_host_unknown_without_a_reason_is_a_divergence():
    """Refused: an (unknown) the record does not explain (an engine that failed to read)
    never matches: the field diverges."""
    a = run("host", [hit("host", 0, n="(unknown)", m="(unknown)")])
    b = run("events", [hit("events", 0, n="5", m="6")])
    res = compare(a, b)
    assert not res.equivalent and res.first.field == "arg:n"
    # a reason for another argument covers only that argument
    h = dataclasses.replace(hit("host", 0, n="(unknown)", m="(unknown)"), unknown=(("n", "stale"),),
                            failed=(("n", 0x10),))
    res = compare(run("host", [h]), b)
    assert not res.equivalent and res.first.field == "arg:m" and res.applied["stale"] == 1


def test_a_stale_reason_without_the_failed_read_it_stands_for_is_a_divergence():
    """``stale`` is the host's word that a fetch failed; without the address whose read
    failed (``Hit.failed``, filled by evaluate()) the rule has no evidence and the
    (unknown) diverges: the record mutant ``stale-spurious``'s case."""
    b = run("events", [hit("events", 0, n="5")])
    said = dataclasses.replace(hit("host", 0, n="(unknown)"), unknown=(("n", "stale"),))
    res = compare(run("host", [said]), b)
    assert not res.equivalent and res.first.field == "arg:n"
    other = dataclasses.replace(said, failed=(("m", 0x10),))      # another argument's read
    assert not compare(run("host", [other]), b).equivalent
    shown = dataclasses.replace(said, failed=(("n", 0x10),))
    assert compare(run("host", [shown]), b).equivalent


def test_kernel_data_unknown_matches_only_an_unknown_host_value_of_that_argument():
    """An event probe's untyped immediate string: the host's (unknown) with the kernel-data
    reason matches the guest's address; a host value that is not (unknown), or another
    argument's difference, still diverges."""
    b = run("events", [hit("events", 0, s="0xffff888005ad2b60", n="5")])
    h = dataclasses.replace(hit("host", 0, s="(unknown)", n="5"), unknown=(("s", "kernel-data"),))
    res = compare(run("host", [h]), b)
    assert res.equivalent and res.applied["kernel-data"] == 1
    h = dataclasses.replace(hit("host", 0, s="0xffff888005ad0000", n="5"),
                            unknown=(("s", "kernel-data"),))
    assert compare(run("host", [h]), b).first.field == "arg:s"
    h = dataclasses.replace(hit("host", 0, s="(unknown)", n="6"), unknown=(("s", "kernel-data"),))
    assert compare(run("host", [h]), b).first.field == "arg:n"


def test_plugin_flags_unknown_matches_on_either_side():
    """A three-way diff puts the plugin engine on side b: its %flags rule holds there too."""
    a = run("host", [hit("host", 0, fl="0x246")])
    h = dataclasses.replace(hit("plugin", 0, fl="(unknown)"), unknown=(("fl", "flags"),))
    res = compare(a, run("plugin", [h]))
    assert res.equivalent and res.applied["flags"] == 1


def uhit(side, seq, pid, probe="u/work", ip="0x401780", **args):
    return Hit(side=side, probe=probe, kind="p", seq=seq, cpu=0, pid=pid, comm="kph-threads",
               ip=ip, args=tuple((k, str(v)) for k, v in args.items()))


def test_uprobe_hits_compare_per_thread_only_for_uprobes():
    host = [uhit("host", 0, 10, i=0), uhit("host", 1, 11, i=0), uhit("host", 2, 10, i=1)]
    guest = [uhit("events", 0, 10, i=0), uhit("events", 1, 10, i=1), uhit("events", 2, 11, i=0)]
    o = [Outcome("u/work", True, mode="uprobe")]
    res = compare(SideResult("host", [Outcome("u/work", True, mode="host")], host, {}),
                  SideResult("events", o, guest, {}))
    assert res.equivalent and res.applied["thread-order"] == 1
    # as kprobe hits, streams are not compared per thread. Here the guest recorded
    # thread 11's hit before thread 10's two, the host after them: no preemption between
    # the host's breakpoint and the guest's handler makes that (preempt-order moves only
    # a guest hit back): they diverge
    host = [uhit("host", 0, 10, i=0), uhit("host", 1, 10, i=1), uhit("host", 2, 11, i=0)]
    guest = [uhit("events", 0, 11, i=0), uhit("events", 1, 10, i=0), uhit("events", 2, 10, i=1)]
    kp = compare(SideResult("host", [Outcome("u/work", True)], host, {}),
                 SideResult("events", [Outcome("u/work", True, mode="int3")], guest, {}))
    assert not kp.equivalent and "thread-order" not in kp.applied
    assert "preempt-order" not in kp.applied


def test_a_guest_value_that_is_the_uretprobe_trampoline_compares_equal():
    host = [dataclasses.replace(uhit("host", 0, 10, s0="0x401543"), slot_args=("s0",))]
    guest = [uhit("events", 0, 10, s0="0x478cb1")]
    o = [Outcome("u/work", True, mode="uprobe")]
    args = (SideResult("host", o, host, {}), SideResult("events", o, guest, {}))
    assert compare(*args, trampoline=("_etext+0x0", "0x478cb1")).equivalent
    assert not compare(*args, trampoline=("_etext+0x0", "0x478cb")).equivalent   # whole only


def test_values_fetched_from_a_hijacked_return_ip_follow_the_trampoline_rule():
    """A return hit whose guest ip is the host trampoline: what the guest fetched from %ip
    (here +0(%ip): the trampoline's bytes) is that trampoline's too; other arguments are
    still compared."""
    def ret(side, ip, v, other="1", ret_ip_args=("v",)):
        return Hit(side=side, probe="u/r", kind="r", seq=0, cpu=0, pid=7, comm="kph-loop",
                   ip=ip, ret_from="0x401700", args=(("v", v), ("o", other)),
                   ret_ip_args=ret_ip_args if side == "host" else ())
    o = [Outcome("u/r", True, mode="uprobe")]
    t = ("_etext+0x0", "0x478cb1")

    def cmp(h, g):
        return compare(SideResult("host", o, [h], {}), SideResult("events", o, [g], {}),
                       trampoline=t)
    assert cmp(ret("host", "0x401711", "0x8b48c389"), ret("events", "0x478cb1", "0x0")).equivalent
    # not hijacked in that hit: compared
    assert not cmp(ret("host", "0x401711", "0x8b48c389"),
                   ret("events", "0x401711", "0x0")).equivalent
    # an argument not fetched from %ip: compared
    assert not cmp(ret("host", "0x401711", "0x1", other="2"),
                   ret("events", "0x478cb1", "0x1", other="3")).equivalent
    # the host did not say the argument came from %ip: compared
    assert not cmp(ret("host", "0x401711", "0x8b48c389", ret_ip_args=()),
                   ret("events", "0x478cb1", "0x0")).equivalent


def test_an_agent_child_s_hit_under_its_later_comm_is_left_out_on_both_sides():
    """The agent's forked child opens /dev/null before it execs sh: the host saw comm
    qemu-ga (and, later, sh); the trace prints sh. Only as many of the guest's first hits
    of that pid as the host left out go; sh's own hits after the exec are compared."""
    def h(side, seq, comm, alts=()):
        return Hit(side=side, probe="kprobes/open", kind="p", seq=seq, cpu=0, pid=9, comm=comm,
                   ip="do_sys_openat2+0x0/0x170", args=(("dfd", "-100"),), comm_alts=alts)
    host = [h("host", 0, "qemu-ga", ("sh", "cat")), h("host", 1, "sh", ("cat",)), h("host", 2, "cat")]
    # the guest's own task_rename records give its hits the same later comms
    guest = [h("events", 0, "sh", ("sh", "cat")), h("events", 1, "sh", ("cat",)),
             h("events", 2, "cat")]
    res = compare(run("host", host), run("events", guest))
    assert res.equivalent and res.matched == {"kprobes/open": 2}
    assert res.applied["agent"] == 2
    # without the host's agent hit nothing is left out of the guest's side
    res = compare(run("host", host[1:]), run("events", guest))
    assert not res.equivalent
    # nor when the guest did not see the pid take that comm after its hit
    bare = [dataclasses.replace(g, comm_alts=()) for g in guest]
    assert not compare(run("host", host), run("events", bare)).equivalent


def _task_hit(side, seq, comm, pid, obj):
    return Hit(side=side, probe="kprobes/kpevent", kind="p", seq=seq, cpu=0, pid=pid, comm=comm,
               ip="kfree+0x4/0x3c0", args=(("object", obj),))


def _kfree_run(side, order):
    o = [Outcome("kprobes/kpevent", True)]
    return run(side, [_task_hit(side, i, c, p, v) for i, (c, p, v) in enumerate(order)], o)


LS = ("ls", 127, "0x0")
KD1, KD2 = ("kdamond.0", 44, "0xffff888005930200"), ("kdamond.0", 44, "0xffff888005930300")


def test_a_hit_recorded_after_a_preempting_task_s_run_is_moved_back():
    """7.3, ``p:kpevent kfree $arg*`` during ``ls``: the host recorded ls's kfree at its
    breakpoint, an interrupt preempted ls before the guest's handler ran, kdamond.0 freed
    twice (both sides recorded those), then ls's guest record came."""
    host = _kfree_run("host", [LS, LS, KD1, KD2, LS])
    guest = _kfree_run("events", [LS, KD1, KD2, LS, LS])
    res = compare(host, guest)
    assert res.equivalent, res.first
    assert res.applied["preempt-order"] == 1
    moved = [n for n in res.normalized if n.rule == "preempt-order"]
    assert [(n.index, n.a_value, n.b_value) for n in moved] == [(1, "ls-127", "ls-127")]
    # the sides given the other way round: the guest's side is still the one moved
    res = compare(guest, host)
    assert res.equivalent and res.applied["preempt-order"] == 1
    # one task's own hits are never reordered: ls's two frees in the other order diverge
    ls2 = ("ls", 127, "0x5")
    res = compare(_kfree_run("host", [LS, ls2, KD1]), _kfree_run("events", [ls2, KD1, LS]))
    assert not res.equivalent and res.first.field == "arg:object"
    # ... a return probe's, it can (its trampoline runs first when it hijacked last)
    ret = [dataclasses.replace(h, kind="r") for h in guest.hits]
    hret = [dataclasses.replace(h, kind="r") for h in host.hits]
    assert compare(SideResult("events", guest.outcomes, ret, {}, preempt="lazy"),
                   SideResult("host", host.outcomes, hret, {})).equivalent


def test_a_preemption_nested_in_the_window_is_put_right_the_same_way():
    """preempt=full: task A is preempted between the host's breakpoint and the guest's
    handler, B runs and is preempted in its own window, C runs through; then B's, then
    A's guest records come: host A B C, guest C B A (two moves, each on one CPU)."""
    a, b, c = ("ls", 128, "0x1"), ("sh", 130, "0x2"), ("cat", 129, "0x3")
    res = compare(_kfree_run("host", [a, b, c]), _kfree_run("events", [c, b, a]))
    assert res.equivalent, res.first
    assert res.applied["preempt-order"] == 2
    # the inner window on another CPU is no such window
    host, guest = _kfree_run("host", [a, b, c]), _kfree_run("events", [c, b, a])
    hh = [dataclasses.replace(h, cpu=1) if h.pid == 129 else h for h in host.hits]
    gg = [dataclasses.replace(h, cpu=1) if h.pid == 129 else h for h in guest.hits]
    res = compare(SideResult("host", host.outcomes, hh, {}),
                  SideResult("events", guest.outcomes, gg, {}, preempt="lazy"))
    assert not res.equivalent and "preempt-order" not in res.applied
    # one task's own two records swapped inside the run: no window makes that
    b2 = ("sh", 130, "0x4")
    # (A's move is allowed; B's two records then differ in value, in the task's order)
    res = compare(_kfree_run("host", [a, b, b2]), _kfree_run("events", [b2, b, a]))
    assert not res.equivalent and res.first.field == "arg:object"


def _ctx_run(side, order):
    """``(comm, pid, object, context)`` items: a kfree run whose hits know their context."""
    o = [Outcome("kprobes/kpevent", True)]
    return run(side, [dataclasses.replace(_task_hit(side, i, c, p, v), irq=x)
                      for i, (c, p, v, x) in enumerate(order)], o)


def test_the_interrupt_that_preempted_the_window_s_task_moves_with_it():
    """7.3 lazy, add_remove_tprobe.tc: ls is at the host's breakpoint, an interrupt
    frees on ls's behalf (context irq), preempts it at its exit, kdamond.0 frees three
    times, then ls's guest record: host ls, ls-irq, kd x3; guest ls-irq, kd x3, ls."""
    ls, ls_irq = ("ls", 211, "0x1", "task"), ("ls", 211, "0x2", "irq")
    kd = [("kdamond.0", 44, f"0x{i}0", "task") for i in range(1, 4)]
    res = compare(_ctx_run("host", [ls, ls_irq, *kd]), _ctx_run("events", [ls_irq, *kd, ls]))
    assert res.equivalent, res.first
    assert res.applied["preempt-order"] == 1
    # an interrupt-context hit is never preempted: the same order with ls's first hit
    # in an interrupt diverges
    ls_in_irq = ("ls", 211, "0x1", "irq")
    res = compare(_ctx_run("host", [ls_in_irq, *kd]), _ctx_run("events", [*kd, ls_in_irq]))
    assert not res.equivalent and "preempt-order" not in res.applied
    # no other task ran: ls's own interrupt hits crossed in another order than the host
    # saw them are no preemption (irq-order's run must be exactly the host's)
    ls_irq2 = ("ls", 211, "0x3", "irq")
    res = compare(_ctx_run("host", [ls, ls_irq, ls_irq2]),
                  _ctx_run("events", [ls_irq2, ls_irq, ls]))
    assert not res.equivalent and "preempt-order" not in res.applied
    # ls's own task-context hit in the run: a task's own records keep their order
    ls2 = ("ls", 211, "0x4", "task")
    res = compare(_ctx_run("host", [ls, ls2, *kd]), _ctx_run("events", [ls2, *kd, ls]))
    assert not res.equivalent and res.first.field == "arg:object"


def test_preempt_order_moves_nothing_that_is_not_such_a_run():
    host = _kfree_run("host", [LS, KD1, KD2])
    # the run differs from what the host recorded next (values): moved, then compared
    bad = compare(host, _kfree_run("events", [KD2, KD1, LS]))
    assert not bad.equivalent
    # a hit of another task with no counterpart is no reorder: the first difference stays
    res = compare(_kfree_run("host", [LS, LS]), _kfree_run("events", [KD1, LS]))
    assert not res.equivalent and res.first.field in ("comm", "pid", "arg:object")
    assert "preempt-order" not in res.applied
    # a value that differs is still a divergence after the move
    res = compare(_kfree_run("host", [LS, KD1]),
                  _kfree_run("events", [KD1, ("ls", 127, "0x1")]))
    assert not res.equivalent and res.first.field == "arg:object"


# -- every rule applied and refused; verdicts that are not "equivalent" (issue 25) -----------

def test_irq_order_compares_per_context_and_only_when_every_context_is_known():
    """Applied: an interrupt's hit recorded between the task's on one side only."""
    t1, t2 = (dataclasses.replace(hit("host", i, dfd=i), irq="task") for i in (0, 1))
    i1 = dataclasses.replace(hit("host", 2, comm="swapper", dfd=9), irq="irq")
    g = [dataclasses.replace(h, side="events") for h in (t1, i1, t2)]
    res = compare(run("host", [t1, t2, i1]), run("events", g))
    assert res.equivalent and res.applied["irq-order"] == 1
    # refused: a side that does not know a hit's context keeps the order, and diverges
    g[1] = dataclasses.replace(g[1], irq="")
    res = compare(run("host", [t1, t2, i1]), run("events", g))
    assert not res.equivalent and "irq-order" not in res.applied


def test_a_rename_seen_at_its_entry_comes_after_the_hits_that_still_show_the_old_comm():
    """The host sees a rename at __set_task_comm()'s entry; an interrupt taken before the
    comm is written records hits of that pid under the old comm after it (seen: a kfree
    tracepoint probe, two interrupt hits of pid 73 between the entry and strscpy_pad()).
    The rename comes after those hits, and not after the first that shows the new comm."""
    from harness.backends.tracelayer import saved_cmdlines

    def h(seq, pid, comm):
        return Hit(side="host", probe="tracepoints/tpevent", kind="p", seq=seq, cpu=0, pid=pid,
                   comm=comm, ip="__probestub_kfree+0x0/0x6", args=())
    hits = [h(0, 71, "sh"), h(1, 73, "sh"), h(2, 73, "sh"), h(3, 73, "ls"), h(4, 73, "sh")]
    out = saved_cmdlines(hits, [(2, 73, "ls"), (4, 73, "sh")])
    assert [x.comm_alts for x in out] == [(), ("ls", "sh"), ("ls", "sh"), ("sh",), ()]
    assert [x.comm for x in out] == ["sh", "sh", "sh", "sh", "sh"]   # each pid's last comm
    # a rename no later hit shows stays after every hit of its pid from its entry on
    assert [x.comm_alts for x in saved_cmdlines(hits[:3], [(1, 73, "ls")])] == [(), ("ls",), ("ls",)]


def test_a_rename_no_hit_shows_has_taken_effect_by_a_later_rename_of_its_pid():
    """``sh -c 'dd ...'`` from qemu-ga: pid 117 renamed to sh, then to dd, no hit under sh.
    The sh rename took effect by the time the dd one did (a task's renames are one after
    the other), so a dd hit after that carries no later comm, and a side that printed sh
    for it differs."""
    from harness.backends.tracelayer import saved_cmdlines
    from harness.diff.rules import _comm_change

    def h(seq, comm):
        return Hit(side="host", probe="kprobes/rd", kind="p", seq=seq, cpu=0, pid=117,
                   comm=comm, ip="vfs_read+0x0/0x10", args=())
    hits = [h(0, "qemu-ga"), h(1, "dd"), h(2, "dd")]
    out = saved_cmdlines(hits, [(1, 117, "sh"), (1, 117, "dd")])
    assert [x.comm_alts for x in out] == [("sh", "dd"), (), ()]
    assert out[1] is hits[1] and out[2] is hits[2]      # nothing to change: the same objects

    def sh(x):      # the other side's hit, printed under sh, sh among its later comms
        return dataclasses.replace(x, side="events", comm="sh", comm_alts=("sh", "dd"))
    assert not _comm_change(out[2], sh(out[2]), "comm", "dd", "sh", None)
    assert _comm_change(out[0], sh(out[0]), "comm", "qemu-ga", "sh", None)


def test_a_hit_changed_is_the_hit_replace_makes_and_hits_unchanged_stay_themselves():
    """Hit.changed() is dataclasses.replace() without __init__; saved_cmdlines() hands
    back a hit nothing changes as that very object; JSON's hit_doc() is asdict()'s."""
    import json

    import pytest

    from harness.backends.tracelayer import saved_cmdlines
    from harness.diff.report import hit_doc
    h = dataclasses.replace(hit("host", 3, comm="sh", dfd=1), unknown=(("dfd", "stale"),))
    c = h.changed(comm="ls", comm_alts=("cat",))
    assert c == dataclasses.replace(h, comm="ls", comm_alts=("cat",)) and h.comm == "sh"
    with pytest.raises(TypeError, match="no field 'bogus'"):
        h.changed(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.comm = "x"
    other = h.changed(pid=8, comm="ls")
    out = saved_cmdlines([h, other], [])
    assert out[0] is h and out[1] is other
    renamed = saved_cmdlines([h, dataclasses.replace(h, seq=4, comm="dd")], [])
    assert renamed[0] is not h and renamed[0].comm == "dd"
    assert json.dumps(hit_doc(c)) == json.dumps(dataclasses.asdict(c))


def test_a_hit_placed_is_the_hit_changed_makes():
    """Hit.placed() (a decoded payload at another record's place) is changed() of seq,
    cpu, pid, comm and irq, nothing else altered, the base left as it was."""
    h = dataclasses.replace(hit("events", 3, comm="sh", dfd=1), irq="task", excess=4)
    p = h.placed(9, 1, 77, "dd", "irq")
    assert p == h.changed(seq=9, cpu=1, pid=77, comm="dd", irq="irq")
    assert (h.seq, h.cpu, h.comm, h.irq) == (3, 0, "sh", "task")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.comm = "x"


def test_gc_paused_nests_across_threads_and_puts_the_collector_back_as_it_was():
    import gc
    import threading

    from harness.records import gc_paused
    assert gc.isenabled()
    inside = threading.Event()
    leave = threading.Event()
    seen = []

    def other():
        with gc_paused():
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=other)
    with gc_paused():
        assert not gc.isenabled()
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()       # the thread's block is still open
    leave.set()
    t.join(10)
    seen.append(gc.isenabled())
    assert seen == [True]
    gc.disable()                    # off before: left off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(KeyError):   # on after an exception too
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_saved_cmdlines_gives_what_the_plain_scan_gives_on_random_runs():
    """saved_cmdlines() finds each rename's effect and a hit's later comms through
    per-pid indexes; the plain quadratic scan it replaced is the reference here."""
    import random

    from harness.backends.tracelayer import saved_cmdlines

    def reference(hits, changes):
        last = {0: "<idle>"}
        for h in hits:
            if h.pid:
                last[h.pid] = h.comm
        effect = [next((k for k in range(j, len(hits)) if hits[k].pid == pid and hits[k].comm == c),
                       len(hits)) for j, pid, c in changes]
        effect = [min([effect[r]] + [effect[q] for q in range(r + 1, len(changes))
                                     if changes[q][1] == changes[r][1]])
                  for r in range(len(changes))]
        return [h if h.pid is None else dataclasses.replace(
            h, comm=last.get(h.pid, h.comm),
            comm_alts=tuple(c for (j, pid, c), k in zip(changes, effect) if pid == h.pid and k > i))
            for i, h in enumerate(hits)]

    rng = random.Random(39)
    # a few pids (found in C) and more than _FEW_PIDS (one Python pass)
    for pids in ([None, 0, 7, 8, 9], [None, 0, *range(7, 20)]):
        for _ in range(300):
            n = rng.randint(0, 40)
            hits = [dataclasses.replace(hit("host", i, comm=rng.choice(["sh", "ls", "dd"])),
                                        pid=rng.choice(pids))
                    for i in range(n)]
            if rng.random() < 0.3:          # hits that carry the comms they will show
                hits = reference(hits, [])
            changes = sorted((rng.randint(0, n), rng.choice(pids[1:4]),
                              rng.choice(["sh", "ls", "dd"])) for _ in range(rng.randint(0, 5)))
            assert saved_cmdlines(hits, changes) == reference(hits, changes), (hits, changes)


def test_comm_change_takes_only_a_comm_the_pid_took_later():
    h = dataclasses.replace(hit("host", 0, comm="sh", dfd=1), comm_alts=("cat",))
    g = dataclasses.replace(hit("events", 0, comm="cat", dfd=1), comm_alts=("cat",))
    res = compare(run("host", [h]), run("events", [g]))
    assert res.equivalent and res.applied["comm-change"] == 1
    res = compare(run("host", [h]), run("events", [dataclasses.replace(g, comm="ls")]))
    assert not res.equivalent and res.first.field == "comm"
    # the host's word alone (the guest recorded no such rename) is no evidence (issue 36)
    res = compare(run("host", [h]), run("events", [hit("events", 0, comm="cat", dfd=1)]))
    assert not res.equivalent and res.first.field == "comm"


def test_int3_nmi_takes_only_a_hardirq_caller_under_an_int3_probe():
    h = dataclasses.replace(hit("host", 0, dfd=1), irq="irq", hardirq=True)
    g = dataclasses.replace(hit("events", 0, dfd=1), irq="task", mode="int3")
    res = compare(run("host", [h]), run("events", [g]))
    assert res.equivalent and res.applied["int3-nmi"] == 1
    # an optimized or ftrace-based probe runs its handler in the caller's context
    res = compare(run("host", [h]), run("events", [dataclasses.replace(g, mode="optimized")]))
    assert not res.equivalent and res.first.field == "irq"
    # a softirq (or no measured hardirq) shows through the NMI: no evidence
    res = compare(run("host", [dataclasses.replace(h, hardirq=False)]), run("events", [g]))
    assert not res.equivalent and res.first.field == "irq"
    # the other way round (a guest irq, a host task) is no NMI's doing
    res = compare(run("host", [dataclasses.replace(h, irq="task")]),
                  run("events", [dataclasses.replace(g, irq="irq")]))
    assert not res.equivalent and res.first.field == "irq"


def test_pid_and_cpu_are_compared_and_a_pid_one_side_lacks_is_counted():
    res = compare(run("host", [hit("host", 0, dfd=1)]),
                  run("events", [dataclasses.replace(hit("events", 0, dfd=1), pid=8)]))
    assert not res.equivalent and res.first.field == "pid"
    res = compare(run("host", [hit("host", 0, dfd=1)]),
                  run("events", [dataclasses.replace(hit("events", 0, dfd=1), cpu=1)]))
    assert not res.equivalent and res.first.field == "cpu"
    res = compare(run("host", [dataclasses.replace(hit("host", 0, dfd=1), pid=None)]),
                  run("events", [hit("events", 0, dfd=1)]))
    assert res.equivalent and res.applied["pid"] == 1
    assert [n.rule for n in res.normalized if n.field == "pid"] == ["pid"]


def test_a_line_refused_on_one_side_and_missing_on_the_other_is_counted():
    a = run("host", [], [Outcome.rejected("kprobes/x", 22)])
    b = SideResult("events", [], [], {})
    res = compare(a, b)
    assert res.applied["refused-missing"] == 1
    assert compare(a, b, strict=True).verdict_word == "not-strict"
    # refused: accepted on one side and missing on the other is no such case
    res = compare(run("host", [], [Outcome("kprobes/x", True)]), b)
    assert "refused-missing" not in res.applied and res.first.field == "registration"


def test_nothing_measured_is_empty_not_equivalent():
    a = run("host", [hit("host", 0, comm="qemu-ga", dfd=1)])
    b = run("events", [])
    res = compare(a, b)
    assert not res.equivalent and res.verdict_word == "empty" and res.silent == ["kprobes/open"]
    res = compare(a, b, expect_empty=True)
    assert res.equivalent
    # both refused and nothing armed: the refusals were measured
    o = [Outcome.rejected("kprobes/open", 22)]
    assert compare(run("host", [], o), run("events", [], o)).equivalent


def test_a_probe_without_hits_is_named_not_folded_into_the_agreement():
    from harness.diff import report

    o = [Outcome("kprobes/open", True, index=0), Outcome("kprobes/never", True, index=1)]
    res = compare(run("host", [hit("host", 0, dfd=1)], o), run("events", [hit("events", 0, dfd=1)], o))
    assert res.equivalent and res.silent == ["kprobes/never"]
    assert "no hit on either side: kprobes/never" in report.verdict(res)


def test_strict_refuses_every_rule_not_allowed_and_names_it():
    from harness.diff import report

    a = run("host", [hit("host", 0, dfd=1), hit("host", 1, comm="qemu-ga", dfd=2)])
    b = run("events", [hit("events", 0, dfd=1)])
    assert compare(a, b).equivalent
    res = compare(a, b, strict=True)
    assert not res.equivalent and res.strict_violations == {"agent": 1}
    assert "NOT STRICT" in report.text(res) and "--allow agent" in report.text(res)
    assert compare(a, b, strict=True, allow=("agent",)).equivalent
    import pytest
    with pytest.raises(ValueError, match="unknown normalization"):
        compare(a, b, strict=True, allow=("agnet",))


def test_json_names_every_normalization_with_its_count():
    import json

    from harness.diff import report

    a = run("host", [hit("host", 0, dfd=1), hit("host", 1, comm="qemu-ga", dfd=2)])
    doc = json.loads(report.to_json(compare(a, run("events", [hit("events", 0, dfd=1)]))))
    assert doc["result"] == "equivalent" and doc["normalizations"]["agent"]["count"] == 1


def test_docs_list_every_normalization():
    from pathlib import Path

    from harness.diff.verdict import NORMALIZATIONS

    text = (Path(__file__).resolve().parents[2] / "docs" / "diff.md").read_text()
    missing = [k for k in NORMALIZATIONS if f"`{k}`" not in text]
    assert not missing, f"docs/diff.md does not name: {missing}"


def test_agent_rule_leaves_out_only_the_agent_s_comm():
    """Refused: a comm that only looks like the agent's is compared."""
    a = run("host", [hit("host", 0, comm="qemu-gax", dfd=1)])
    res = compare(a, run("events", []))
    assert not res.equivalent and res.first.field == "count" and not res.applied["agent"]


def test_nhit_is_compared_only_where_both_sides_counted_over_the_window():
    """nhit counted from a side's own registration or enabling is not compared (rule
    ``nhit``, named); where both sides counted it over the one recording window
    (``Counters.window``) it is, and a count that differs is a divergence; nmissed is
    compared either way."""
    a = run("host", [hit("host", 0, dfd=1)],
            counters={"kprobes/open": Counters("kprobes/open", 1, 0, window=True)})
    b = run("events", [hit("events", 0, dfd=1)], counters={"kprobes/open": Counters("kprobes/open", 9, 0)})
    res = compare(a, b)
    assert res.equivalent and res.applied["nhit"] == 1
    b = run("events", [hit("events", 0, dfd=1)], counters={"kprobes/open": Counters("kprobes/open", 9, 1)})
    assert compare(a, b).first.field == "nmissed"
    b = run("events", [hit("events", 0, dfd=1)],
            counters={"kprobes/open": Counters("kprobes/open", 2, 0, window=True)})
    res = compare(a, b)
    assert not res.equivalent and res.first.field == "nhit" and not res.applied.get("nhit")
    assert (res.first.a_value, res.first.b_value) == ("1", "2")
    b = run("events", [hit("events", 0, dfd=1)],
            counters={"kprobes/open": Counters("kprobes/open", 1, 0, window=True)})
    res = compare(a, b)
    assert res.equivalent and not res.applied.get("nhit")
    # the host cannot switch the comparison off: its counts are always over the window
    a = run("host", [hit("host", 0, dfd=1)], counters={"kprobes/open": Counters("kprobes/open", 1, 0)})
    res = compare(a, b)
    assert not res.equivalent and res.first.field == "counter", res.first


def test_a_guest_value_that_is_the_kretprobe_trampoline_compares_equal_and_no_other():
    """An fprobe's or kprobe's ``$stack0`` at an ftrace location a host return probe
    hooked first: the guest reads the host's trampoline (``_etext``) as a value,
    ``trampoline_text`` gives its number too. Any other value still diverges."""
    tramp = ("_etext+0x0", "0xffffffff82000000")
    o = [Outcome("u/work", True, mode="fprobe")]
    host = [dataclasses.replace(uhit("host", 0, 10, s0="0xffffffff810bd1c4"), slot_args=("s0",))]
    same = SideResult("events", o, [uhit("events", 0, 10, s0="0xffffffff82000000")], {})
    other = SideResult("events", o, [uhit("events", 0, 10, s0="0xffffffff82000008")], {})
    assert compare(SideResult("host", o, host, {}), same, trampoline=tramp).equivalent
    assert not compare(SideResult("host", o, host, {}), other, trampoline=tramp).equivalent
    assert not compare(SideResult("host", o, host, {}), same, trampoline=("_etext+0x0",)).equivalent


# -- issue 36: verdicts that passed wrongly, each now caught ----------------------------------

def test_a_probe_without_a_counter_on_one_side_is_named_not_skipped():
    """Defect 2: nmissed is compared where both sides count; a probe one side has no
    counter for is named (uncounted) and printed, never passed over in silence."""
    from harness.diff import report

    a = run("host", [hit("host", 0, dfd=1)], counters={"kprobes/open": Counters("kprobes/open", 1, 3)})
    b = run("events", [hit("events", 0, dfd=1)])
    res = compare(a, b)
    assert res.uncounted == {"kprobes/open": "events"}
    assert "nmissed not compared" in report.text(res) and "kprobes/open" in report.text(res)
    # a host engine counts every probe it placed: its missing counter diverges
    g = run("events", [hit("events", 0, dfd=1)], counters={"kprobes/open": Counters("kprobes/open", 4, 3)})
    res = compare(run("host", [hit("host", 0, dfd=1)]), g)
    assert not res.equivalent and res.first.field == "counter" and res.uncounted == {}
    res = compare(run("host", [hit("host", 0, dfd=1)]), run("plugin", [hit("plugin", 0, dfd=1)],
                                                           counters=a.counters))
    assert not res.equivalent and res.first.field == "counter"
    # counters keyed per group and event: g1/x and g2/x are two probes
    a = run("host", [], counters={"g1/x": Counters("g1/x", 1, 0), "g2/x": Counters("g2/x", 1, 2)})
    b = run("events", [], counters={"g1/x": Counters("g1/x", 1, 0), "g2/x": Counters("g2/x", 1, 0)})
    d = compare(a, b).first
    assert (d.probe, d.field) == ("g2/x", "nmissed")


def _ret(side, seq, probe="kprobes/r", pid=7, cpu=0, irq=""):
    return Hit(side=side, probe=probe, kind="r", seq=seq, cpu=cpu, pid=pid, comm="cat",
               ip="__x64_sys_openat+0x6a/0xa0", ret_from="do_sys_openat2", irq=irq)


def _ent(side, seq, probe="kprobes/p", pid=7, cpu=0, irq=""):
    return Hit(side=side, probe=probe, kind="p", seq=seq, cpu=cpu, pid=pid, comm="cat",
               ip="do_sys_openat2+0x0/0x170", irq=irq)


def test_the_order_of_hits_across_probes_is_compared_within_a_task():
    """Defect 3: a host that records every return before its entries diverges (field
    order), even though each probe's own hits agree; across tasks or CPUs no order is
    asked for (the kernel guarantees none there)."""
    o = [Outcome("kprobes/p", True, index=0), Outcome("kprobes/r", True, index=1)]
    guest = run("events", [_ent("events", 0), _ret("events", 1), _ent("events", 2),
                           _ret("events", 3)], o)
    host = run("host", [_ret("host", 0), _ret("host", 1), _ent("host", 2), _ent("host", 3)], o)
    res = compare(host, guest)
    assert not res.equivalent and res.first.field == "order"
    assert not compare(host, guest, strict=True).equivalent
    same = run("host", [_ent("host", 0), _ret("host", 1), _ent("host", 2), _ret("host", 3)], o)
    assert compare(same, guest).equivalent
    # two tasks: their interleaving is not the kernel's to keep
    g2 = run("events", [_ent("events", 0, pid=8), _ent("events", 1)], o)
    h2 = run("host", [_ent("host", 0), _ent("host", 1, pid=8)], o)
    assert compare(h2, g2).equivalent
    # the divergence shows each side's hits around it, in each side's recorded order
    d = res.first
    assert [h.seq for h in d.a_context] == [0, 1, 2, 3]
    assert [h.seq for h in d.a_context] == [h.seq for h in d.b_context]
    assert [h.kind for h in d.a_context] == ["r", "r", "p", "p"]
    assert [h.kind for h in d.b_context] == ["p", "r", "p", "r"]


def test_one_probe_whose_recorded_order_is_not_its_list_order_diverges_on_order():
    """The order check with a single probe: its pairs' seqs rise on both sides in the
    usual run (nothing to sort); a side whose list does not follow its own recorded
    order (here the second pair was recorded first) still diverges, field order."""
    o = [Outcome("kprobes/p", True, index=0)]
    guest = run("events", [_ent("events", 0), _ent("events", 1)], o)
    host = run("host", [_ent("host", 1), _ent("host", 0)], o)
    res = compare(host, guest)
    assert not res.equivalent and res.first.field == "order", res.first
    assert compare(run("host", [_ent("host", 0), _ent("host", 1)], o), guest).equivalent
    # seqs alike on one side are no rising order either: sorted stably, then compared
    tie = run("host", [_ent("host", 5), _ent("host", 5)], o)
    assert compare(tie, guest).equivalent


def test_preempt_order_moves_only_on_one_cpu():
    """Defect 4: the swap preempt-order allows is a preemption on the CPU the hit was
    recorded on; the same swap across CPUs is no such window and diverges."""
    host = _kfree_run("host", [LS, LS, KD1, KD2, LS])
    guest = _kfree_run("events", [LS, KD1, KD2, LS, LS])
    assert compare(host, guest).equivalent
    g = [dataclasses.replace(h, cpu=1) if h.pid == 44 else h for h in guest.hits]
    hh = [dataclasses.replace(h, cpu=1) if h.pid == 44 else h for h in host.hits]
    res = compare(SideResult("host", host.outcomes, hh, {}),
                  SideResult("events", guest.outcomes, g, {}, preempt="lazy"))
    assert not res.equivalent and "preempt-order" not in res.applied
    # the same swap on one CPU, where the guest kernel does not preempt on interrupt exit
    # (6.1's and 6.12's voluntary model), or where its model was not read: no window
    for model in ("voluntary", "none", None):
        res = compare(host, dataclasses.replace(guest, preempt=model))
        assert not res.equivalent and "preempt-order" not in res.applied, model


def test_irq_order_moves_only_the_hit_the_interrupt_passed():
    """Defect 4: irq-order moves one hit across the run of the other context's hits that
    the other side recorded next; it no longer re-sorts whole lists, so two task hits the
    sides recorded in different orders still diverge."""
    t = [dataclasses.replace(hit("host", i, dfd=i), irq="task") for i in range(3)]
    i1 = dataclasses.replace(hit("host", 9, comm="swapper", dfd=9), irq="irq")
    ev = lambda hs: [dataclasses.replace(h, side="events") for h in hs]   # noqa: E731
    res = compare(run("host", [t[0], i1, t[1]]), run("events", ev([i1, t[0], t[1]])))
    assert res.equivalent and res.applied["irq-order"] == 1
    # the interrupt's hit far from where the other side has it: not one window
    res = compare(run("host", [t[0], t[1], t[2], i1]), run("events", ev([i1, t[0], t[1], t[2]])))
    assert not res.equivalent
    # task hits swapped: no rule moves them
    res = compare(run("host", [t[1], t[0], i1]), run("events", ev([t[0], t[1], i1])))
    assert not res.equivalent and "irq-order" not in res.applied
    # the context itself is compared where both sides know it
    res = compare(run("host", [t[0]]), run("events", ev([dataclasses.replace(t[0], irq="irq")])))
    assert not res.equivalent and res.first.field == "irq"


def test_a_context_one_side_did_not_read_is_a_difference_not_a_pass():
    """Defect 5 (``irq``): a host that reads no context for a kernel hit (an engine that
    lost its preempt_count() read) is compared, not left out: the field is ``irq``."""
    g = dataclasses.replace(hit("events", 0, dfd=1), irq="task")
    for host_irq, guest_irq in (("", "task"), ("task", ""), ("", "irq")):
        res = compare(run("host", [dataclasses.replace(g, side="host", irq=host_irq)]),
                      run("events", [dataclasses.replace(g, irq=guest_irq)]))
        assert not res.equivalent and res.first.field == "irq", (host_irq, guest_irq)
    # neither side has one (uprobe hits): nothing to compare
    res = compare(run("host", [dataclasses.replace(g, side="host", irq="")]),
                  run("events", [dataclasses.replace(g, irq="")]))
    assert res.equivalent


def test_the_plugin_s_context_bits_are_judged_as_the_whole_count():
    """The plugin records what it read of preempt_count() as bits (kph_proto.h RF_CTX,
    RF_SOFTIRQ, RF_HARDIRQ, RF_NMI); each combination means what the count means."""
    from harness.backends.plugin import hit_context
    from harness.kernel.kprobes import preempt_context
    from harness.machine.pluginlink import RF_CTX, RF_HARDIRQ, RF_NMI, RF_PID, RF_SOFTIRQ

    assert hit_context(RF_PID) == ""
    assert hit_context(RF_CTX) == "task"
    assert hit_context(RF_CTX | RF_SOFTIRQ) == "irq"
    assert hit_context(RF_CTX | RF_HARDIRQ) == "irq"
    assert hit_context(RF_CTX | RF_HARDIRQ | RF_NMI) == "task"    # an NMI: task
    assert hit_context(RF_CTX | RF_SOFTIRQ | RF_HARDIRQ | RF_NMI) == "irq"
    # the count itself: preemption disabled is task, NEED_RESCHED (bit 31) ignored
    assert preempt_context(0x1) == "task" and preempt_context(0x80000000) == "task"
    assert preempt_context(0x200) == "task"        # softirqs disabled (SOFTIRQ_DISABLE_OFFSET)
    assert preempt_context(0x101) == "irq" and preempt_context(0x10001) == "irq"


def test_a_pid_one_hit_lacks_is_compared_unless_the_side_knows_no_pid_at_all():
    """Defect 5: a pid the host could not read at one hit (a swallowed fault) no longer
    switches the comparison off; only a side that knows no pid at all (no task offsets)
    is left out, counted."""
    a = run("host", [dataclasses.replace(hit("host", 0, dfd=1), pid=None), hit("host", 1, dfd=2)])
    b = run("events", [hit("events", 0, dfd=1), hit("events", 1, dfd=2)])
    res = compare(a, b)
    assert not res.equivalent and res.first.field == "pid" and "pid" not in res.applied
    a = run("host", [dataclasses.replace(hit("host", i, dfd=i), pid=None) for i in range(2)])
    b = run("events", [hit("events", i, dfd=i) for i in range(2)])
    res = compare(a, b)
    assert res.equivalent and res.applied["pid"] == 2


def test_a_line_the_host_calls_pending_is_armed_unless_the_guest_says_so_too():
    """Defect 5: a host that calls an armed, silent line pending gets EMPTY, not
    equivalent: only the guest's own state (its kprobes list) makes a line pending."""
    x = Outcome("kprobes/open", True, index=0, pending="kept, never installed")
    y = Outcome("kprobes/open", True, index=0)
    res = compare(run("host", [], [x]), run("events", [], [y]))
    assert res.verdict_word == "empty" and res.pending == []
    # and with guest hits it is a count divergence
    res = compare(run("host", [], [x]), run("events", [hit("events", 0, dfd=1)], [y]))
    assert not res.equivalent and res.first.field == "count"
    # the guest lists the probe as armed in its kprobes list: the host's pending diverges
    yl = Outcome("kprobes/open", True, index=0, mode="ftrace")
    res = compare(run("host", [], [x]), run("events", [hit("events", 0, dfd=1)], [yl]))
    assert not res.equivalent and res.first.field == "registration"
    res = compare(run("host", [], [x]), run("events", [], [yl]))
    assert not res.equivalent and res.first.field == "registration"
    yp = Outcome("kprobes/open", True, index=0, pending="not in the kprobes list")
    res = compare(run("host", [], [x]), run("events", [], [yp]))
    assert res.equivalent and res.pending == ["kprobes/open"]


def _stacked(side, frames):
    return dataclasses.replace(hit(side, 0, dfd=1), stack=tuple(frames))


def test_stack_machinery_takes_extra_frames_on_the_guest_side_only():
    """Defect 6: extra host frames named like probe machinery (trace_*, kprobe_*) or an
    unsymbolized module address are a divergence; extra guest frames of its probe
    machinery are not."""
    base = ["kernel_clone", "__do_sys_clone", "do_syscall_64"]
    guest = run("events", [_stacked("events", ["kprobe_trace_func", "kprobe_dispatcher", *base])])
    res = compare(run("host", [_stacked("host", base)]), guest)
    assert res.equivalent and res.applied["stack-machinery"] == 1
    host = run("host", [_stacked("host", ["trace_foo", "0xffffffffc0401000", *base])])
    res = compare(host, run("events", [_stacked("events", base)]))
    assert not res.equivalent and res.first.field == "stack"
    # between two host engines neither side is the guest's: no frame is machinery
    res = compare(run("host", [_stacked("host", base)]),
                  run("plugin", [_stacked("plugin", ["kprobe_trace_func", *base])]))
    assert not res.equivalent


def test_trampoline_matches_whole_and_only_the_return_slot():
    """Defect 7: the trampoline's text is matched whole (no prefix such as _etext+0x01),
    a return hit's ip only between two return hits of the same function, and a value
    only in an argument that reads the return slot."""
    o = [Outcome("kprobes/r", True)]
    ra = _ret("host", 0)
    for ip in ("_etext+0x0/0x0", "_etext+0x0"):
        rb = dataclasses.replace(_ret("events", 0), ip=ip)
        assert compare(run("host", [ra], o), run("events", [rb], o), trampoline="_etext+0x0").equivalent
    rb = dataclasses.replace(_ret("events", 0), ip="_etext+0x01/0x0")
    assert not compare(run("host", [ra], o), run("events", [rb], o), trampoline="_etext+0x0").equivalent
    rb = dataclasses.replace(_ret("events", 0), ip="_etext+0x0/0x0", ret_from="kernel_clone")
    assert not compare(run("host", [ra], o), run("events", [rb], o), trampoline="_etext+0x0").equivalent
    # an entry argument that does not read the return slot, showing the trampoline's value
    t = ("_etext+0x0", "0xffffffff82000000")
    ha = hit("host", 0, x="0xffffffff810bd1c4")
    hb = hit("events", 0, x="0xffffffff82000000")
    assert not compare(run("host", [ha]), run("events", [hb]), trampoline=t).equivalent
    assert compare(run("host", [dataclasses.replace(ha, slot_args=("x",))]),
                   run("events", [hb]), trampoline=t).equivalent
    # an entry hit's ip is never a trampoline's
    hb = dataclasses.replace(hit("events", 0), ip="_etext+0x0/0x0")
    assert not compare(run("host", [hit("host", 0)]), run("events", [hb]), trampoline=t).equivalent


def test_the_plugin_flags_rule_holds_only_on_the_plugin_engine_side():
    """Defect 5: a (unknown) %flags with the reason flags from the gdbstub engine (which
    reads the real flags) is no match."""
    h = dataclasses.replace(hit("host", 0, fl="(unknown)"), unknown=(("fl", "flags"),))
    assert not compare(run("host", [h]), run("events", [hit("events", 0, fl="0x246")])).equivalent


def test_slot_args_are_the_arguments_that_read_the_word_at_sp():
    from harness.kernel.grammar import parse

    s = parse("p:a kernel_clone s=$stack0 t=+0($stack) u=+0(%sp) v=$stack1 w=+8($stack) x=%di")
    assert s.slot_args == ("s", "t", "u")
    assert parse("r:b kernel_clone s=$stack0").slot_args == ()


def test_in_flight_leaves_out_only_the_host_hits_the_last_halt_found_in_flight():
    """7.3, add_remove_tprobe.tc: the halt that ended the recording found kthreadd
    between the host's breakpoint on its kmem_cache_alloc and the guest's handler: the
    host's record is left out, counted and named; an unmarked extra hit still diverges."""
    tail = hit("host", 1, comm="kthreadd")
    a = run("host", [hit("host", 0), dataclasses.replace(tail, in_flight=True)])
    res = compare(a, run("events", [hit("events", 0)]))
    assert res.equivalent and res.applied["in-flight"] == 1
    assert [(n.probe, n.rule, n.a_value) for n in res.normalized] == \
        [("kprobes/open", "in-flight", "kthreadd-7 cpu0 do_sys_openat2+0x0/0x170")]
    assert res.left_out == {}
    assert not compare(run("host", [hit("host", 0), tail]),
                       run("events", [hit("events", 0)])).equivalent
    # a mark the recorded order does not bear out is refused: a later task-context hit
    # on its CPU, or a guest side's mark
    early = dataclasses.replace(hit("host", 0), in_flight=True)
    res = compare(run("host", [early, hit("host", 1)]), run("events", [hit("events", 0)]))
    assert not res.equivalent and "in-flight" not in res.applied
    g = run("events", [hit("events", 0), dataclasses.replace(hit("events", 1), in_flight=True)])
    assert not compare(run("host", [hit("host", 0)]), g).equivalent
    # a later interrupt hit nested in a task-context window is no objection
    f = dataclasses.replace(hit("host", 1), irq="task", in_flight=True)
    i = dataclasses.replace(hit("host", 2), irq="irq")
    res = compare(run("host", [hit("host", 0), f, i]),
                  run("events", [hit("events", 0), dataclasses.replace(hit("events", 2), irq="irq")]))
    assert res.applied.get("in-flight") == 1
    # strict: a window edge is a normalization like any other
    assert not compare(a, run("events", [hit("events", 0)]), strict=True).equivalent


def test_raced_takes_one_memory_change_between_the_two_reads_only():
    """7.3 stock, ``f ____fput b=+0(+8($stack)):x64``: the host read the task's
    thread_info flags as 0x1 at its breakpoint, the guest 0x80001 in its handler
    (TIF_NEED_FPU_LOAD set in between), and from the next hit on both read 0x80001."""
    def h(side, seq, b, c="0x0"):
        x = hit(side, seq, b=b, c=c)
        return dataclasses.replace(x, mem_args=("b",)) if side == "host" else x

    a = run("host", [h("host", 0, "0x1"), h("host", 1, "0x1"), h("host", 2, "0x80001")])
    g = run("events", [h("events", 0, "0x1"), h("events", 1, "0x80001"),
                       h("events", 2, "0x80001")])
    res = compare(a, g)
    assert res.equivalent and res.applied["raced"] == 1
    assert [(n.index, n.rule, n.a_value, n.b_value) for n in res.normalized] == \
        [(1, "raced", "0x1", "0x80001")]
    assert not compare(a, g, strict=True).equivalent
    # a register argument never races
    reg = run("host", [dataclasses.replace(x, mem_args=()) for x in a.hits])
    assert not compare(reg, g).equivalent
    # the host's next read did not see the guest's value: no change measured
    stay = run("host", [h("host", 0, "0x1"), h("host", 1, "0x1"), h("host", 2, "0x1")])
    assert not compare(stay, g).equivalent
    # an (unknown) is no value that changed (the oracle mutant stale-spurious: a host
    # (unknown) "stale" with no fault taken, on a value that did not change)
    unk = run("host", [h("host", 0, "0x1"), dataclasses.replace(
        h("host", 1, "(unknown)"), unknown=(("b", "stale"),)), h("host", 2, "0x80001")])
    assert not compare(unk, g).equivalent
    # no next pair (the last hit): nothing measured
    assert not compare(run("host", a.hits[:2]), run("events", g.hits[:2])).equivalent
    # a guest one step late at every hit (it read after the probed store): its next
    # pair differs too, so nothing is measured
    late_a = run("host", [h("host", i, str(i)) for i in range(4)])
    late_g = run("events", [h("events", i, str(i + 1)) for i in range(4)])
    res = compare(late_a, late_g)
    assert not res.equivalent and res.first.index == 0 and "raced" not in res.applied
    # each change is measured on its own (the flag set, then cleared: 7.3, seen both ways)
    twice_a = run("host", [h("host", i, v) for i, v in enumerate("001100")])
    twice_g = run("events", [h("events", i, v) for i, v in enumerate("011000")])
    res = compare(twice_a, twice_g)
    assert res.equivalent and res.applied["raced"] == 2
    # a guest value the next pair does not bear out diverges, after an excused one
    bad_g = run("events", [h("events", i, v) for i, v in enumerate("011020")])
    res = compare(twice_a, bad_g)
    assert not res.equivalent and res.first.index == 3
    # the next pair of another task is no evidence
    other = run("host", [h("host", 0, "0x1"), h("host", 1, "0x1"),
                         dataclasses.replace(h("host", 2, "0x80001"), pid=8)])
    og = run("events", [*g.hits[:2], dataclasses.replace(g.hits[2], pid=8)])
    assert not compare(other, og).equivalent


# -- the registry -----------------------------------------------------------------------------

#: Each rule, with the test above that shows it refusing a real difference.
def test_record_slack_takes_only_the_slack_the_hosts_two_passes_reserve():
    """record-slack: 6.1's record of ``cat ''`` at do_sys_openat2 with path=+0(%si):ustring
    reserves 1 byte for the empty string (strnlen_user_nofault() counts its NUL) and
    stores none (strncpy_from_user_nofault() returns 0): 4 bytes after the rounding,
    which the host's model of the two passes predicts (``Hit.slack``). An excess the
    host does not predict (no slack, or a length counted twice) still diverges."""
    reach = 8 + 8 + 4                       # trace_entry, __probe_ip, path's data_loc
    guest = dataclasses.replace(hit("events", 0, s="(fault)"), excess=4, reach=reach)
    host = dataclasses.replace(hit("host", 0, s="(fault)"), slack=1)
    res = compare(run("host", [host]), run("events", [guest]))
    assert res.equivalent and res.applied["record-slack"] == 1
    for h, g in ((dataclasses.replace(host, slack=0), guest),         # nothing predicted
                 (host, dataclasses.replace(guest, excess=60)),        # counted twice
                 (dataclasses.replace(host, slack=9), guest)):         # not this slack
        res = compare(run("host", [h]), run("events", [g]))
        assert not res.equivalent and res.first.field == "record-size", (h.slack, g.excess)


REFUSED_BY = {
    "refused-missing": test_a_line_refused_on_one_side_and_missing_on_the_other_is_counted,
    "refusal-text": test_refusals_compare_by_errno,
    "agent": test_agent_rule_leaves_out_only_the_agent_s_comm,
    "in-flight": test_in_flight_leaves_out_only_the_host_hits_the_last_halt_found_in_flight,
    "thread-order": test_uprobe_hits_compare_per_thread_only_for_uprobes,
    "irq-order": test_irq_order_moves_only_the_hit_the_interrupt_passed,
    "preempt-order": test_preempt_order_moves_only_on_one_cpu,
    "trampoline": test_trampoline_matches_whole_and_only_the_return_slot,
    "record-slack": test_record_slack_takes_only_the_slack_the_hosts_two_passes_reserve,
    "stale": test_a_stale_reason_without_the_failed_read_it_stands_for_is_a_divergence,
    "below-sp": test_host_unknown_matches_any_value_only_where_the_record_says_why,
    "flags": test_the_plugin_flags_rule_holds_only_on_the_plugin_engine_side,
    "kernel-data": test_kernel_data_unknown_matches_only_an_unknown_host_value_of_that_argument,
    "comm-change": test_comm_change_takes_only_a_comm_the_pid_took_later,
    "raced": test_raced_takes_one_memory_change_between_the_two_reads_only,
    "int3-nmi": test_int3_nmi_takes_only_a_hardirq_caller_under_an_int3_probe,
    "stack-machinery": test_stack_machinery_takes_extra_frames_on_the_guest_side_only,
    "pid": test_a_pid_one_hit_lacks_is_compared_unless_the_side_knows_no_pid_at_all,
    "nhit": test_nhit_is_compared_only_where_both_sides_counted_over_the_window,
}


def test_every_rule_of_the_registry_has_a_reason_evidence_doc_and_a_refusing_test():
    from pathlib import Path

    from harness.diff.rules import REGISTRY, help_text

    assert set(REFUSED_BY) == {r.name for r in REGISTRY}
    text = (Path(__file__).resolve().parents[2] / "docs" / "diff.md").read_text()
    for r in REGISTRY:
        assert r.reason and r.evidence and r.summary, r.name
        assert f"`{r.name}`" in text, f"docs/diff.md does not name {r.name}"
        assert r.name in help_text()
        assert r.stage in ("line", "hits", "order", "field", "counter")
    from harness.diff.rules import markdown_table
    assert markdown_table() in text, "docs/diff.md's registry table is not the registry's"


def test_the_host_marks_every_line_s_record_of_each_stop_found_in_flight():
    """``HostBackend._mark_in_flight``: per ``(cpu, address)`` found in flight, innermost
    first, the latest stop there and every line's record of it (two lines on one
    address); an outer window on the same address takes the stop before."""
    from harness.backends.host import HostBackend

    b = object.__new__(HostBackend)
    kf = 0xFFFFFFFF81300000
    at = [(0, kf, 1), (0, kf, 2), (0, kf, 2), (1, kf, 3), (0, kf + 8, 4), (0, kf, 5)]
    b._hits = [hit("host", i) for i in range(len(at))]
    b._hit_at = dict(enumerate(at))
    b._mark_in_flight([(0, kf)])
    assert [h.in_flight for h in b._hits] == [False, False, False, False, False, True]
    b._mark_in_flight([(0, kf)])            # the outer window: stop 2, both its records
    assert [h.in_flight for h in b._hits] == [False, True, True, False, False, True]
    b._mark_in_flight([(2, kf)])            # nothing recorded there: nothing marked
    assert sum(h.in_flight for h in b._hits) == 3


def test_a_guest_record_longer_or_shorter_than_its_data_diverges_on_record_size():
    """harness.kernel.ringbuf.record_excess: a record holding bytes its fields and
    data_locs do not account for (a string length counted twice, an error code added to
    a length) is no equivalent run, whatever its printed values."""
    a = run("host", [hit("host", 0, s='"x"')])
    b = run("events", [dataclasses.replace(hit("events", 0, s='"x"'), excess=60)])
    res = compare(a, b)
    assert not res.equivalent
    assert (res.first.field, res.first.a_value) == ("record-size", "<none>")
    assert res.first.b_value.startswith("+60 bytes")


def test_a_record_size_is_left_to_the_rule_of_an_unstable_argument_of_that_hit():
    """record-size where the host says an argument of the same hit read the stack below
    the probed sp: the kernel's two passes over it may see other bytes (below-sp); the
    same record with no such argument diverges (stale needs its failed read too)."""
    base = dataclasses.replace(hit("host", 0, s='(unknown)'), unknown=(("s", "below-sp"),))
    guest = dataclasses.replace(hit("events", 0, s='"x"'), excess=-8)
    res = compare(run("host", [base]), run("events", [guest]))
    assert res.equivalent and res.applied["below-sp"] == 2          # s, and the record
    stale = dataclasses.replace(base, unknown=(("s", "stale"),))
    assert not compare(run("host", [stale]), run("events", [guest])).equivalent
    proven = dataclasses.replace(stale, failed=(("s", 0x10),))
    assert compare(run("host", [proven]), run("events", [guest])).equivalent


def test_the_preempt_count_layout_of_each_series():
    """include/linux/preempt.h: HARDIRQ at bit 16 up to 6.x (NMI at 20), at bit 24 in 7.3
    (after HARDIRQ_DISABLE; NMI at 28); x86's PREEMPT_NEED_RESCHED is the top bit of an
    int (6.x) or an unsigned long (7.3). Values read on the 7.3 guest in fast_mix (hardirq)
    and a softirq."""
    from harness.kernel.kprobes import preempt_context, preempt_hardirq_only
    from harness.kernel.rules import rules_for

    s73 = rules_for("7.3").preempt_hardirq_shift
    assert (s73, rules_for("6.12").preempt_hardirq_shift) == (24, 16)
    assert preempt_context(0x8000000001000001, s73) == "irq"       # hardirq
    assert preempt_hardirq_only(0x8000000001000001, s73)
    assert preempt_context(0x8000000001000100, s73) == "irq"       # a softirq served
    assert not preempt_hardirq_only(0x1000100, s73)
    assert preempt_context(0x10001, s73) == "task"                 # 7.3: HARDIRQ_DISABLE
    assert preempt_context(0x11000001, s73) == "task"              # an NMI
    assert preempt_context(0x80010001) == "irq" and preempt_context(0x110001) == "task"


def test_nhit_is_compared_without_each_sides_agent_hits_and_no_more():
    """``r x64_sys_call`` (kph fuzz, 2026-11-30): the guest's nhit over the window is one
    more than the host's, the agent's ppoll() entered after the guest's events were
    enabled and returning in the window (kretprobe_dispatcher() counts at the return),
    and that agent hit is the guest's only extra record. nhit less each side's agent
    hits agrees (rule ``agent``, on nhit); one more hit of another task still diverges."""
    def side(name, agents, others, nhit):
        hits = [hit(name, i, comm="qemu-ga", dfd=1) for i in range(agents)] + \
            [hit(name, agents + i, dfd=1) for i in range(others)]
        return run(name, hits, counters={"kprobes/open": Counters("kprobes/open", nhit, 0,
                                                                  window=True)})
    res = compare(side("host", 2, 3, 5), side("events", 3, 3, 6))
    assert res.equivalent, res.first
    assert res.applied["agent"] >= 1
    assert [(n.field, n.rule, n.a_value, n.b_value) for n in res.normalized
            if n.field == "nhit"] == [("nhit", "agent", "5", "6")]
    res = compare(side("host", 2, 3, 5), side("events", 2, 3, 6))     # not the agent's
    assert not res.equivalent and res.first.field == "nhit"
    assert (res.first.a_value, res.first.b_value) == ("5", "6")


def _saved_cmdlines_per_hit(hits, comm_changes):
    """saved_cmdlines()'s per-hit loop as it was before the pid-by-pid one (3cee02f): the
    reference the faster form must equal, over the same rename effects."""
    from harness.backends.tracelayer import rename_effects

    last, _, renames = rename_effects(hits, comm_changes)
    out = []
    for i, h in enumerate(hits):
        if h.pid is None:
            out.append(h)
            continue
        later = tuple(c for k, c in renames[h.pid] if k > i) if h.pid in renames else ()
        comm = last.get(h.pid, h.comm)
        out.append(h if comm == h.comm and later == h.comm_alts
                   else h.changed(comm=comm, comm_alts=later))
    return out


def test_saved_cmdlines_pid_by_pid_equals_the_per_hit_form_on_random_runs():
    """Random runs of a few pids (None and 0 among them), renames at random points, some
    hits carrying later comms already: the same hits, and the very objects where nothing
    changes."""
    import random

    from harness.backends.tracelayer import saved_cmdlines

    rng = random.Random(39)
    comms = ["sh", "dd", "ls", "cat", "<idle>"]
    for _ in range(400):
        n = rng.randrange(0, 40)
        hits = [Hit(side="host", probe="kprobes/rd", kind="p", seq=i, cpu=0,
                    pid=rng.choice([None, 0, 5, 7, 9]), comm=rng.choice(comms),
                    ip="vfs_read+0x0/0x10", args=(),
                    comm_alts=rng.choice([(), (), ("dd",), ("sh", "dd")]))
                for i in range(n)]
        changes = sorted((rng.randrange(0, n + 1), rng.choice([5, 7, 9, 11]), rng.choice(comms))
                         for _ in range(rng.randrange(0, 5)))
        want, got = _saved_cmdlines_per_hit(hits, changes), saved_cmdlines(hits, changes)
        assert got == want, (hits, changes)
        assert [g is h for g, h in zip(got, hits)] == [w is h for w, h in zip(want, hits)]
