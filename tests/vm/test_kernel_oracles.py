"""The kernel-side oracles on real runs of ``kph diff`` (docs/diff.md, "Kernel-side
oracles"): what the kernel printed during the run is a finding with its own verdict and
exit status.

No stock 6.1 facility gives a clean ``WARN()`` from userspace (no lkdtm, no fault
injection in Debian's cloud kernel), so the kernel is made to report for real with
``echo c > /proc/sysrq-trigger`` (``sysrq_handle_crash()``: ``panic("sysrq triggered
crash")``, pvpanic), and the dmesg path, which a ``WARN()`` takes under ``quiet``
(KERN_WARNING is not printed on the console), with a ``WARNING:`` line the workload writes
to ``/dev/kmsg`` at level 4 (the kernel's log, not a kernel warning: it checks the
plumbing; the parser's unit tests hold the kernel's own formats). A workload past its
``--timeout`` is ``HANG``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

OPEN = "p:open do_sys_openat2"


def kph(*args, timeout=200):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_panic_a_warning_in_dmesg_and_a_hang_are_kernel_findings():
    # a real kernel panic in the middle of the run: KERNEL-PANIC, exit 5, its splat
    r = kph("diff", OPEN, "--run", "cat /proc/version; echo c > /proc/sysrq-trigger", "--json")
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert doc["result"] == "kernel-finding" and doc["verdict"] == "KERNEL-PANIC"
    (panic,) = [s for s in doc["kernel"]["splats"] if not s["before"]]
    assert panic["title"] == "Kernel panic - not syncing: sysrq triggered crash"
    assert panic["source"] == "console" and panic["verdict"] == "KERNEL-PANIC"
    assert "KERNEL-PANIC: Kernel panic - not syncing: sysrq triggered crash" in r.stderr
    assert "result: KERNEL-PANIC" in r.stderr

    # a WARNING: in the kernel's log at KERN_WARNING, below quiet's console level: found
    # in dmesg, after the run's mark; the comparison still made, the exit 5
    warn = "WARNING: CPU: 0 PID: 1 at kernel/kph/oracle.c:1 kph_oracle+0x0/0x10"
    r = kph("diff", OPEN, "--run", f"echo '<4>{warn}' > /dev/kmsg; cat /proc/version",
            "--json")
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert doc["result"] == "equivalent"              # what the probes saw agrees
    assert doc["kernel"]["verdict"] == "KERNEL-WARNING"
    (w,) = [s for s in doc["kernel"]["splats"] if not s["before"]]
    assert w["title"] == warn and w["source"] == "dmesg"
    assert "kernel: KERNEL-WARNING: 1 kernel report(s) during the run" in r.stderr

    # a guest that does not finish the workload while QEMU runs it: HANG, exit 6
    r = kph("diff", OPEN, "--run", "sleep 60", "--timeout", "3", "--json")
    assert r.returncode == 6, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "HANG"
    (h,) = [s for s in doc["kernel"]["splats"] if s["verdict"] == "HANG"]
    assert "the guest agent still answers" in h["title"] and h["source"] == "agent"


def test_a_guest_the_host_probes_slow_past_the_timeout_is_not_compared_not_hung():
    """200,000 one-byte reads, each a stop of the gdbstub engine (a round trip of some
    ms): the workload outlasts --timeout while the guest runs. Not HANG (exit 6): not
    compared, exit 2, one line; the same probe over a short workload is compared."""
    r = kph("diff", "p:rd ksys_read", "--run",
            "dd if=/dev/zero of=/dev/null bs=1 count=200000", "--timeout", "5")
    assert r.returncode == 2, r.stderr
    assert "not compared: the host's probes slowed the guest past the timeout" in r.stderr
    assert "HANG" not in r.stderr and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == \
        [r.stderr.strip().splitlines()[-1]]
    # few enough stops: compared as ever
    r = kph("diff", "p:rd ksys_read", "--run", "dd if=/dev/zero of=/dev/null bs=1 count=20")
    assert r.returncode == 0, r.stderr
