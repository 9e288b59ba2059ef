"""`kph repro --record` then `--replay`: the null-deref oops comes back with the same console."""
import json
import signal
import time
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def kph(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness.cli", "repro", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def null_bundle(tmp_path_factory, default_image):
    out = tmp_path_factory.mktemp("rr") / "bundle"
    rec = kph("probes/scenarios/null-deref-handler.toml", "--record", "--out", str(out))
    return out, rec


@pytest.mark.timeout(240)
def test_null_deref_record_then_replay_gives_the_same_oops(null_bundle):
    out, rec = null_bundle
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert any(ln.startswith("MET: ") for ln in rec.stderr.splitlines()), rec.stderr
    assert "kph_null_deref_handler" in rec.stderr
    meta = json.loads((out / "record.json").read_text())
    assert meta["end"] == "panic" and meta["icount"] > 0
    recorded = (out / "console.log").read_bytes()[:meta["console_bytes"]]
    assert b"BUG: kernel NULL pointer dereference" in recorded
    assert re.search(rb"RIP: 0010:kph_null_deref_handler\+0x[0-9a-f]+/0x[0-9a-f]+ \[kph_kprobes\]",
                     recorded)
    stack = (out / "stack.txt").read_text()
    assert "kph_null_deref_handler" in stack and "kprobe_ftrace_handler" in stack
    summary = (out / "summary.md").read_text()
    assert "**Verdict: MET**" in summary and "NULL pointer dereference" in summary

    rep = kph("--replay", str(out))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "console identical" in rep.stderr and "registers at the end identical" in rep.stderr
    # The acceptance, checked on the bytes: the replay's console is the recording's.
    assert (out / "replay-console.log").read_bytes()[:len(recorded)] == recorded
    assert (out / "replay-stack.txt").read_text() == stack
    assert (out / "replay-registers.txt").read_text() == (out / "registers.txt").read_text()


@pytest.mark.timeout(240)
def test_replay_gdb_keeps_the_stub_for_reverse_stepping_until_ctrl_c(null_bundle):
    out, rec = null_bundle
    assert rec.returncode == 0, rec.stderr
    p = subprocess.Popen([sys.executable, "-m", "harness.cli", "repro", "--replay", str(out), "--gdb"],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 300
        while "gdb is welcome" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()       # the offer is text for people: stderr
            assert line or p.poll() is None, "kph exited before offering gdb"
        sock = re.search(r"target remote (\S+)'", line)[1]
        g = subprocess.run(["gdb", "-batch", "-nx", "-ex", f"target remote {sock}", "-ex", "p/x $pc",
                            "-ex", "reverse-stepi", "-ex", "p/x $pc"],
                           capture_output=True, text=True, timeout=300)
        pcs = [int(v, 16) for v in re.findall(r"^\$\d+ = (0x[0-9a-f]+)$", g.stdout, re.M)]
        assert len(pcs) == 2 and 0 < pcs[0] - pcs[1] <= 15, g.stdout + g.stderr
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not Path(sock).exists()  # the run directory went with QEMU


@pytest.mark.timeout(240)
def test_recorded_events_scenario_replays_the_same_trace(tmp_path, default_image):
    from harness.apps import repro_rr, scenario

    scn_file = tmp_path / "ev.toml"
    scn_file.write_text(
        'name="open is traced"\ntrigger="cat /proc/version; head -c 8 /dev/urandom | od -x"\n'
        '[[probe]]\nside="events"\nspec="p:kprobes/o do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring"\n'
        '[expect]\noutcome="ok"\noutput="Linux version"\n'
        "console='o: \\(do_sys_openat2\\+0x0/0x[0-9a-f]+\\) dfd=-100 path=\"/proc/version\"'\n")
    res = repro_rr.record_scenario(scenario.load(scn_file), out_dir=tmp_path / "b")
    assert res.met, res.reasons
    trace = repro_rr.sections(res.observed.console)["trace"]
    assert any('path="/proc/version"' in ln for ln in trace)
    rep = repro_rr.replay_scenario(tmp_path / "b")
    assert rep.same_console and rep.met
    assert rep.same_registers is None  # a poweroff end: QEMU stops the vCPU asynchronously
    # Same pids, same timestamps, same random bytes: nothing differs in a replay.
    assert repro_rr.sections(rep.result.console)["trace"] == trace
