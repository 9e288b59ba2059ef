"""The trap-flow demo against the kernel's real path, and its page in headless Chromium."""
from __future__ import annotations

import html
import re
import subprocess
import sys

import pytest

from harness.apps import trapflow

pytestmark = [pytest.mark.vm, pytest.mark.timeout(180)]

INT3_PATH = [
    ("CPU", "do_sys_openat2+0x5"), ("exception entry", "asm_exc_int3"),
    ("exception entry", "exc_int3"), ("kprobes core", "kprobe_int3_handler"),
    ("probe handler", "kph_pre"), ("instruction slot", None), ("instruction slot", None),
    ("exception entry", "asm_exc_int3"), ("exception entry", "exc_int3"),
    ("kprobes core", "kprobe_int3_handler"), ("probe handler", "kph_post"),
    ("CPU", "do_sys_openat2+0x7"),
]


@pytest.fixture(scope="module")
def flows(vm):
    fl = trapflow.demo(vm, target="do_sys_openat2+5", workload="cat /proc/version",
                       variants=("int3", "ftrace", "optimized", "kretprobe", "uprobe",
                                 "uretprobe"))
    yield {f.kind: f for f in fl}


def test_int3_flow_follows_the_kernels_path(flows, vm):
    steps = flows["int3"].steps

    def name(s, want):  # "asm_exc_int3" matches asm_exc_int3+0x0/0x40; "f+0x5" matches exactly
        if want is None:
            return None
        got = s.where.split("/")[0]
        return want if got == want or got.split("+")[0] == want else got
    assert [(s.lane, name(s, want)) for s, (_, want) in zip(steps, INT3_PATH)] == INT3_PATH
    assert len(steps) == len(INT3_PATH)
    first, slot, slot_int3 = steps[0], steps[5], steps[6]
    assert first.insn.startswith("cc") and "push r12" in first.note      # int3 over the push
    assert "push r12" in slot.insn and slot_int3.insn.startswith("cc")   # copy, then int3
    assert slot_int3.addr == slot.addr + 2
    assert not steps[1].regs["eflags"] & trapflow.IF                     # interrupts off in the trap
    assert steps[-1].regs["eflags"] & trapflow.IF                        # and back on after


def test_variants(flows):
    ft = [s.where.split("+")[0] for s in flows["ftrace"].steps]
    assert ft == ["do_sys_openat2", "kprobe_ftrace_handler", "kph_pre", "do_sys_openat2"]
    assert flows["ftrace"].steps[0].insn.split("  ")[1].startswith("call")
    opt = flows["optimized"].steps
    assert opt[0].insn.split("  ")[1].startswith("jmp") and "optimized" in flows["optimized"].probe
    assert [s.where.split("+")[0] for s in opt][2:4] == ["optimized_callback", "kph_pre"]
    ret = [s.where.split("+")[0] for s in flows["kretprobe"].steps]
    assert ret[0] == "arch_rethook_trampoline" and "kph_ret" in ret
    assert flows["kretprobe"].steps[-1].where.startswith("__x64_sys_openat")


def test_guest_is_left_as_it_was(flows, vm):
    assert vm.run("cat /sys/kernel/debug/kprobes/list").stdout == ""
    assert "kph_kprobes" not in vm.run("lsmod").stdout
    assert vm.run("cat /proc/version").ok


def test_page_renders_offline_in_chromium(flows, page_layout):
    """The demo page, every flow, at 1100 and 1600 px (screenshots in the test's output
    directory). Checked on the laid-out page (tests/data/layout_check.js): nothing cut off
    at the right edge and no sideways scrolling (the diagram scales down, its labels stay
    inside it), no clipped cell, and in every diagram no two texts overlap, no label sits
    on a circle, every step number is inside its circle, and no connecting line runs
    through a circle or over a label. Each diagram has only the lanes its flow visits."""
    page = trapflow.trapflow_html(list(flows.values()))
    for width in (1100, 1600):
        res = page_layout(page, width, "trap-flow")
        assert res["problems"] == [], (width, res["problems"], res["screenshot"])
        steps = sum(len(f.steps) for f in flows.values())
        assert res["counts"]["circles"] == steps and res["counts"]["lines"] >= steps, res
    for f in flows.values():
        svg = trapflow._svg(f)
        shown = re.findall(r'<text class="lane"[^>]*>([^<]+)</text>', svg)
        assert shown == [ln for ln in trapflow.LANES if any(s.lane == ln for s in f.steps)]
        if f.kind in ("int3", "ftrace", "optimized", "kretprobe"):
            assert "user task" not in shown and "uprobes core" not in shown, (f.kind, shown)
    pos = page.index('id="int3"')
    for s in flows["int3"].steps:  # every step's row, in order (titles repeat: search on)
        pos = page.index(f"<td>{s.n}</td>", pos) + 1
        assert page.index(f">{html.escape(s.title)}<", pos) > pos


def test_cli_shows_the_ordered_steps_and_step_pauses_once_per_step():
    """``--step`` on a terminal: one [Enter] prompt per step (12 for the int3 flow), on
    stderr; the steps are text (stderr), the JSON document alone on stdout."""
    import json
    import os
    import pty

    master, slave = pty.openpty()
    try:
        os.write(master, b"\n" * 40)          # more Enters than steps: extra ones unread
        r = subprocess.run([sys.executable, "-m", "harness.cli", "demo", "trap-flow",
                            "--variants", "int3", "--step", "--json"], stdin=slave,
                           capture_output=True, text=True, timeout=300)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[Enter]") == 12, r.stderr
    text = r.stderr.replace("  [Enter] ", "")     # the Enters typed here are not echoed
    lines = [ln for ln in text.splitlines() if ln[:4].strip().rstrip(".").isdigit()]
    assert len(lines) == 12 and "asm_exc_int3" in text and "kph_post" in text
    doc = json.loads(r.stdout)
    assert [len(f["steps"]) for f in doc["flows"]] == [12] and doc["guest_left_clean"]


def test_uprobe_variants_follow_the_kernels_user_path(flows, vm):
    fl = flows
    up = fl["uprobe"].steps
    where = [s.where.split("+")[0] for s in up]
    assert up[0].insn.startswith("cc") and up[0].regs["cs"] & 3 == 3   # int3 in user text
    assert up[0].where == f"{up[0].addr:#x} (kph_add+0x1)", up[0].where    # named from the ELF
    for name in ("asm_exc_int3", "uprobe_pre_sstep_notifier", "uprobe_notify_resume",
                 "uprobe_dispatcher", "arch_uprobe_pre_xol", "asm_exc_debug",
                 "arch_uprobe_post_xol"):
        assert name in where, name
    # TF set in the XOL slot (arch_uprobe_pre_xol()). CI on 2026-11-26 recorded a first
    # slot step with eflags 0x10202 (RF set, no TF), under load, not reproduced alone (an
    # interrupt taken at the slot is a candidate): one of the slot's steps carries TF.
    # Under load (a test run beside it, 2026-12-01) the first user-mode place after
    # arch_uprobe_pre_xol() was once another task's code (eflags 0x293), scheduled in on
    # the way back to user mode: the flow runs on to this task's slot (regs->ip as
    # pre_xol left it), in the [uprobes] page, whose first slot is the uretprobe
    # trampoline below.
    slots = [s for s in up if s.lane == "instruction slot"]
    assert slots and all(s.addr < 1 << 47 for s in slots)
    assert any(s.regs["eflags"] & trapflow.TF for s in slots), [hex(s.regs["eflags"]) for s in slots]
    assert where.index("uprobe_dispatcher") < where.index("arch_uprobe_pre_xol")
    assert up[-1].addr == up[0].addr + 3 and "push" in up[-1].insn      # after mov %rsp,%rbp
    ret = fl["uretprobe"].steps
    tramp = ret[0].regs["rdi"]
    assert slots[0].addr >> 12 == tramp >> 12, (hex(slots[0].addr), hex(tramp))
    assert ret[1].addr == tramp and ret[1].regs["cs"] & 3 == 3
    assert "uretprobe_dispatcher" in [s.where.split("+")[0] for s in ret]
    assert ret[-1].regs["cs"] & 3 == 3 and ret[-1].addr < 1 << 47 and ret[-1].addr != tramp
    assert vm.run("cat /sys/kernel/tracing/uprobe_events").stdout == ""  # left as it was


def test_the_observer_runs_past_other_code_to_the_place_it_waits_for(vm):
    """``run_to``: from the first stop at do_sys_openat2, the observer runs (a breakpoint
    of its own, not 20,000 single-steps) to do_filp_open, which the open calls next, and
    records it as the final place; the guest is left running and without breakpoints."""
    obs = trapflow._Observer(vm)
    start, target = trapflow._sym(vm, "do_sys_openat2"), trapflow._sym(vm, "do_filp_open")
    ran = []

    def run_to(pc):
        ran.append(pc)
        return target if pc != target else None
    steps = obs.run("cat /proc/version", {start: ("CPU", "entry")}, start, after_addr=start,
                    until=lambda last, pc: pc == target, run_to=run_to, final="do_filp_open")
    assert [s.addr for s in steps] == [start, target], [s.where for s in steps]
    assert ran and target not in ran and not obs.bps
    assert vm.run("true", timeout=30).ok
