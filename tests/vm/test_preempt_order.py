"""``preempt-order`` only where the guest kernel preempts on interrupt exit (issue 36,
defect 4): three shells taking turns on one CPU, ``kfree`` and ``ksys_write`` probed, on
Debian's 6.1 as it boots (``voluntary``: no task switch between the host's breakpoint and
the guest's handler, so none is explained) and with ``preempt=full`` (tasks preempted in
their windows, several at once: each their own move). Measured 2026-11-27: voluntary,
equivalent with no preempt-order move; full, equivalent with 24 and 31 moves (before the
rule took nested windows, 4 runs of 4 diverged)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import constants as C

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

TASKS = ("for j in 1 2 3; do (i=0; while [ $i -lt 15 ]; do i=$((i+1)); k=0; "
         "while [ $k -lt 100 ]; do k=$((k+1)); done; echo $i >/dev/null; done) & done; wait")
LINES = ("p:kf kfree obj=%di:x64", "p:wr ksys_write fd=%di:s32 n=%dx:u64")
CMDLINE = C.DEFAULT_APPEND


def diff(*extra: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "harness.cli", "diff", *LINES, "--run", TASKS,
                        "--json", *extra], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_preempt_order_applies_only_where_the_guest_kernel_preempts():
    doc = diff()
    assert dict((x["side"], x["preempt"]) for x in doc["runs"]) == {"host": None,
                                                                   "events": "voluntary"}
    assert doc["equivalent"] and "preempt-order" not in doc["normalizations"], doc["verdict"]
    doc = diff("--append", f"{CMDLINE} preempt=full")
    assert dict((x["side"], x["preempt"]) for x in doc["runs"])["events"] == "full"
    assert doc["equivalent"], doc["verdict"]
    assert doc["normalizations"]["preempt-order"]["count"] >= 1, doc["normalizations"]
