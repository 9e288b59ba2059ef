"""The HTML report of a real divergent ``kph diff`` run, in headless Chromium.

The run: three lines (an entry probe, a return probe whose guest records show the host
trampoline, a blacklisted line both sides refuse) over a workload of 20 ``cat``s, with a
host-side hook changing ``dfd`` at one hit, so the report has a divergence, normalized
fields and enough hits for timelines.
"""
from __future__ import annotations

import re

import pytest

from harness.diff import report
from harness.diff.verdict import compare
from harness.kernel.grammar import parse
from harness.diff.runner import run_differential, trampoline_text

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

SPECS = ["p:open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring",
         "r:openret do_sys_openat2 ret=$retval:s64", "p:x do_int3"]
WORKLOAD = "for i in $(seq 20); do cat /proc/version >/dev/null; done"


@pytest.fixture(scope="module")
def divergent(vm):
    def hook(probe, nth, overrides):
        if probe == "kprobes/open" and nth == 15:
            overrides["di"] = 7
    host, guest = run_differential(vm, [parse(s) for s in SPECS], WORKLOAD, hook=hook)
    res = compare(host, guest, trampoline=trampoline_text(vm))
    return res, report.to_html(res, (host, guest), workload=WORKLOAD)


def test_every_probe_the_diverging_hit_and_field_and_normalized_fields(divergent):
    res, page = divergent
    d = res.first
    assert (d.probe, d.field) == ("kprobes/open", "arg:dfd") and d.index >= 12
    for probe in ("kprobes/open", "kprobes/openret", "kprobes/x"):      # every probe a row
        assert f'data-probe="{probe}"' in page, probe
    assert re.search(r'<tr class="bad" data-probe="kprobes/open">', page)   # highlighted
    # the diverging hit's row, with the field marked on both sides
    row = re.search(rf'<tr class="bad" data-index="{d.index}">(.*?)</tr>', page).group(1)
    assert row.count('<span class="f badf" data-field="arg:dfd">') == 2, row
    assert "dfd=7" in row and "dfd=-100" in row
    # normalized fields carry the rule that applied
    assert any(n.rule == "trampoline" and n.field == "ip" for n in res.normalized)
    assert re.search(r'<span class="f normf" data-field="ip">[^<]*</span><sup class="rule"[^>]*>'
                     r'trampoline</sup>', page)
    assert page.count('<svg class="timeline"') == 2          # 20+ hits on both probes
    assert "both refused" in page


def test_the_report_reads_at_1100_and_1600_px(divergent, page_layout):
    """Screenshots in the test's output directory. Checked on the laid-out page
    (tests/data/layout_check.js): no sideways scrolling, no element cut off at the right
    edge, no clipped cell, no two cells of a row overlapping, no timeline label cut off
    or overlapping another."""
    _, page = divergent
    for width in (1100, 1600):
        res = page_layout(page, width, "diff-report")
        assert res["problems"] == [], (width, res["problems"], res["screenshot"])
        assert res["counts"]["elements"] > 100 and res["counts"]["svgTexts"] >= 8, res
