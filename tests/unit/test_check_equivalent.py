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
