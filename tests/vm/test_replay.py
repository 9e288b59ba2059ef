"""Record a guest run under QEMU's rr=record, replay it, and compare.

Nothing is normalized between a recording and its replay: consoles are compared byte
for byte (CRLF made LF on both sides, the same bytes), from the kernel's first line to
the end. The scripts print values that differ from one boot to the next (uptime, random
bytes, interrupt counts, trace timestamps), so equality is the replay's doing.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from harness.machine.replay import End, record, replay

pytestmark = [pytest.mark.vm, pytest.mark.timeout(180)]

PANIC_SCRIPT = """cat /proc/uptime
head -c 16 /dev/urandom | od -x
cat /proc/interrupts | head -3
echo c > /proc/sysrq-trigger
"""
KPROBE_SCRIPT = """echo 'p:kprobes/o do_sys_openat2 dfd=%di:s32' > /sys/kernel/tracing/kprobe_events
echo 1 > /sys/kernel/tracing/events/kprobes/enable
cat /proc/version
cat /sys/kernel/tracing/trace
"""


@pytest.fixture(scope="module")
def panic_recording(tmp_path_factory, default_image):
    out = tmp_path_factory.mktemp("rr") / "panic"
    # ignore_loglevel: every kernel message on the console, so the comparison covers the
    # whole boot, not only the script's output.
    rec = record(PANIC_SCRIPT, out, image=default_image, append_extra="ignore_loglevel")
    return rec


def test_record_runs_the_script_and_ends_at_the_panic(panic_recording):
    rec = panic_recording
    assert rec.end is End.PANIC, rec.console[-2000:]
    assert "sysrq triggered crash" in rec.panic_line
    assert rec.exit_code is None and rec.icount > 0
    lines = rec.console.splitlines()
    assert lines[0].startswith("[    0.000000] Linux version ")
    script_out = rec.console.split("kph: script start\n", 1)[1]
    # Kernel messages may interleave ("random: crng init done"), so each part on its own.
    assert re.match(r"\d+\.\d+ \d+\.\d+\n", script_out)
    assert re.search(r"^0000000( [0-9a-f]{4}){8}\n0000020$", script_out, re.M)
    assert re.search(r"^ +CPU0 *\n +0: +\d+ ", script_out, re.M)
    assert "kph: guest agent" not in rec.console  # no agent in a recorded run
    argv = json.loads((rec.out_dir / "argv.json").read_text())["argv"]
    icount = argv[argv.index("-icount") + 1]
    assert "rr=record" in icount and "rrsnapshot=init" in icount
    assert argv[argv.index("-smp") + 1] == "1"
    assert not any("tcp" in a or "port=" in a for a in argv)
    for name in ("replay.bin", "script.sh", "initrd.img", "vmlinuz", "snapshots.qcow2",
                 "console.log", "record.json"):
        assert (rec.out_dir / name).is_file(), name


def test_replay_reproduces_the_console_to_the_panic(panic_recording, tmp_path):
    # A copy elsewhere: a recording is a self-contained directory.
    moved = tmp_path / "moved"
    shutil.copytree(panic_recording.out_dir, moved)
    rep = replay(moved)
    assert rep.end is End.PANIC
    assert rep.icount == panic_recording.icount
    assert rep.console == panic_recording.console
    assert rep.matches
    replayed = (moved / "replay-console.log").read_bytes()
    assert replayed == (moved / "console.log").read_bytes()[:len(replayed)]
    assert len(replayed) == json.loads((moved / "record.json").read_text())["console_bytes"]


def _gdb(sock, cmds, timeout):
    args = ["gdb", "-batch", "-nx", "-ex", f"target remote {sock}"]
    for c in cmds:
        args += ["-ex", c]
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout).stdout
    return out, [int(v, 16) for v in re.findall(r"^\$\d+ = (0x[0-9a-f]+)$", out, re.M)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gdb_steps_backwards_in_the_replay(panic_recording, tmp_path):
    """gdb 13 on the kept QEMU: reverse-stepi, then stepi back onto the recorded end.
    Each reverse command replays from the snapshot at instruction 0."""
    moved = tmp_path / "gdb"
    shutil.copytree(panic_recording.out_dir, moved)
    with replay(moved, gdb=True) as rep:
        assert rep.end is End.PANIC and rep.gdb_socket is not None
        out, pcs = _gdb(rep.gdb_socket, ["p/x $pc", "reverse-stepi", "p/x $pc", "stepi", "p/x $pc"], 300)
    assert len(pcs) == 3, out
    end, back, again = pcs
    assert 0 < end - back <= 15 and again == end  # one instruction back, then forward
    assert rep.pid is not None and not _alive(rep.pid)


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(900)
def test_gdb_reverse_continues_to_panic(panic_recording, tmp_path):
    """``reverse-continue`` from the recorded end back to ``break *panic``, panic()'s
    argument read back in time, then ``stepi`` forward from there.

    QEMU 11.1.3's reverse-continue sometimes never returns (the replaying QEMU sleeps and
    gdb's Ctrl-C does not wake it; most often with the host's CPUs saturated, once in a
    CI run with the other worker held off). So it runs ``alone``, and a stalled attempt
    is retried on a fresh replay, as a user would: three stalls, or any wrong result,
    fail. Stalled attempts are reported in the output."""
    panic_addr = _kallsyms_addr("panic")
    cmds = [f"break *{panic_addr:#x}", "reverse-continue", "p/x $pc", "x/s $rdi", "delete",
            "stepi", "p/x $pc"]
    stalls = 0
    for attempt in range(3):
        moved = tmp_path / f"gdb{attempt}"
        shutil.copytree(panic_recording.out_dir, moved)
        with replay(moved, gdb=True) as rep:
            try:
                out, pcs = _gdb(rep.gdb_socket, cmds, 150)
                break
            except subprocess.TimeoutExpired:
                stalls += 1
                print(f"attempt {attempt + 1}: reverse-continue stalled (QEMU), retrying")
    else:
        raise AssertionError(f"reverse-continue stalled in {stalls} replays out of {stalls}")
    assert len(pcs) == 2, out
    at_panic, stepped = pcs
    assert at_panic == panic_addr
    assert '"sysrq triggered crash\\n"' in out  # panic()'s first argument, back in time
    assert 0 < stepped - panic_addr <= 15  # and forward again from there
    assert rep.pid is not None and not _alive(rep.pid)


def test_in_guest_kprobe_trace_replays_to_the_same_lines(default_image, tmp_path):
    rec = record(KPROBE_SCRIPT, tmp_path / "kprobe", image=default_image)
    assert rec.end is End.EXIT and rec.exit_code == 0, rec.console[-2000:]
    hits = [ln for ln in rec.console.splitlines() if "o: (do_sys_openat2+0x0/" in ln]
    assert hits and all("dfd=-100" in ln for ln in hits), rec.console[-2000:]
    rep = replay(rec.out_dir)
    assert rep.end is End.EXIT and rep.exit_code == 0
    # Same events, same pids, same timestamps: the trace clock is guest time.
    assert [ln for ln in rep.console.splitlines() if "o: (do_sys_openat2+0x0/" in ln] == hits
    assert rep.console == rec.console


def _kallsyms_addr(name: str) -> int:
    from harness.machine.image.store import default_image

    for line in default_image().kallsyms.read_text().splitlines():
        addr, _, sym = line.split()[:3]
        if sym == name:
            return int(addr, 16)
    raise AssertionError(f"{name} not in kallsyms")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False
