"""``assert_equivalent`` (harness.apps.pytest_plugin.check_equivalent) does not pass a
result that measured nothing because nothing was armed (issue 36): both sides refused
every line, or no line was registered, unless the caller asks for refusals."""
import errno

import pytest

from harness.apps.pytest_plugin import check_equivalent
from harness.diff.verdict import compare
from harness.records import Hit, Outcome, SideResult


def _refused(side):
    return SideResult(side, [Outcome.rejected("kprobes/x", errno.EINVAL, "blacklisted",
                                              index=0)])


def _hit(side):
    return Hit(side, "kprobes/o", "p", 0, 0, 7, "cat", "do_sys_openat2+0x0")


def test_both_sides_refusing_every_line_fails_unless_asked():
    res = compare(_refused("host"), _refused("events"))
    assert res.agrees
    for min_events in (0, 1):
        with pytest.raises(AssertionError, match="no line was armed on both sides"):
            check_equivalent(res, min_events)
    check_equivalent(res, 0, refusals_ok=True)


def test_nothing_registered_fails_even_with_min_events():
    res = compare(SideResult("host"), SideResult("events"))
    with pytest.raises(AssertionError, match="no line was armed"):
        check_equivalent(res, 1)


def test_an_armed_probe_with_hits_passes():
    ok = [Outcome("kprobes/o", True, index=0)]
    res = compare(SideResult("host", ok, [_hit("host")]),
                  SideResult("events", ok, [_hit("events")]))
    check_equivalent(res, 1)
    check_equivalent(res, 1, refusals_ok=True)


def test_a_kernel_report_during_the_run_fails_an_equivalent_result():
    """Issue 37: the pytest fixture's assert fails on a splat in the run's window, and
    names it; one printed before the run (boot) does not fail it."""
    import dataclasses

    import pytest

    from harness.apps.pytest_plugin import check_equivalent
    from harness.diff.verdict import compare
    from harness.kernel.splat import Splat
    from harness.records import Hit, Outcome, SideResult

    def side(name, splats):
        h = Hit(side=name, probe="kprobes/open", kind="p", seq=0, cpu=0, pid=7, comm="cat",
                ip="do_sys_openat2+0x0/0x170")
        return SideResult(name, [Outcome("kprobes/open", True)], [h], {}, splats=splats)
    warn = Splat("KERNEL-WARNING", "WARNING: CPU: 0 PID: 7 at kernel/trace/trace_probe.c:1",
                 "WARNING: CPU: 0 PID: 7 at kernel/trace/trace_probe.c:1", "dmesg")
    runs = (side("host", (warn,)), side("events", (warn,)))
    res = compare(*runs)
    res.runs = runs
    with pytest.raises(AssertionError, match="KERNEL-WARNING"):
        check_equivalent(res, 1)
    old = dataclasses.replace(warn, before=True)
    runs = (side("host", (old,)), side("events", (old,)))
    res = compare(*runs)
    res.runs = runs
    check_equivalent(res, 1)
