"""The output convention on real runs (docs/cli.md): ``--json`` is the only thing on
stdout and parses; the text report and progress are on stderr; ``-q`` leaves stderr
empty; ``-o FILE`` writes the same document; exit codes as documented."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

OPEN = "p:open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32"
OPENRET = "r:openret do_sys_openat2 ret=$retval:s64"


def kph(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_diff_json_pipes_into_json_tool_with_the_report_on_stderr(tmp_path):
    cmd = (f"{sys.executable} -m harness.cli diff '{OPEN}' '{OPENRET}' --run 'cat /proc/version' "
           f"--json | {sys.executable} -m json.tool")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["equivalent"] and doc["sides"] == ["host", "events"]
    assert "result: equivalent" in r.stderr and "kph diff: host vs events" in r.stderr
    assert "registering" in r.stderr and "workload running" in r.stderr   # plain progress lines


def test_quiet_json_and_file_for_probe_boot_and_repro(tmp_path):
    f = tmp_path / "probe.json"
    r = kph("-q", "probe", OPEN, "--run", "cat /proc/version", "--json", "-o", str(f))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads(f.read_text())
    assert doc["side"] == "host" and any(h["probe"] == "kprobes/open" for h in doc["hits"])
    r = kph("boot", "--run", "uname -r", "--run", "false", "-q", "--json")
    assert r.returncode == 1 and r.stderr == ""              # the last command's status
    doc = json.loads(r.stdout)
    assert [c["status"] for c in doc["commands"]] == [0, 1] and doc["start"]["mode"]
    # where the start's seconds went: each phase measured, together within the whole
    phases = doc["start"]["phases"]
    assert list(phases) == (["qemu", "agent", "resync"] if doc["start"]["mode"] == "snapshot"
                            else ["qemu", "agent"]), phases
    assert all(v > 0 for v in phases.values()), phases
    assert sum(phases.values()) <= doc["start"]["seconds"] + 0.003, doc["start"]
    r = kph("boot", "--run", "echo hi")                      # without --json: guest output
    assert r.returncode == 0 and r.stdout == "hi\n" and "boot: " in r.stderr
    r = kph("repro", "probes/scenarios/blacklisted.toml", "--out", str(tmp_path / "b"),
            "--json", "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc["met"] and doc["bundle"] == str(tmp_path / "b")


def test_repro_without_out_writes_under_kph_runs(tmp_path):
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "probes" / "scenarios", tmp_path / "scenarios")
    r = subprocess.run([sys.executable, "-m", "harness.cli", "-q", "--json", "repro",
                        "scenarios/blacklisted.toml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    bundle = Path(json.loads(r.stdout)["bundle"])
    assert bundle.parts[0] == "kph-runs" and (tmp_path / bundle / "summary.md").is_file()
    assert "kph-runs/" in (root / ".gitignore").read_text().split()
