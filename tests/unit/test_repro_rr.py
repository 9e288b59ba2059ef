"""kph repro --record/--replay: the scenario's script, its console sections, what may be recorded."""
import subprocess
import sys
from pathlib import Path

import pytest

from harness.apps import repro_rr
from harness.errors import ScenarioError
from harness.apps.scenario import load
from harness.kernel.symbols import SymbolTable

SCENARIOS = Path(__file__).resolve().parents[2] / "probes" / "scenarios"
KALLSYMS = """ffffffff81000000 T _stext
ffffffff8134a350 T do_sys_openat2
ffffffff8134a4c0 T do_sys_open
ffffffff81e00000 T _etext
"""


def test_null_deref_script_arms_the_bug_only_for_the_trigger():
    scn = load(SCENARIOS / "null-deref-handler.toml")
    script = repro_rr.scenario_script(scn, SymbolTable.from_kallsyms(KALLSYMS))
    lines = script.splitlines()
    add = next(ln for ln in lines if "> /sys/kernel/debug/kph/control" in ln and "add 1" in ln)
    assert "'add 1 p ffffffff8134a350 0 2'" in add  # FLAGS bit1: the NULL-dereferencing handler
    trigger = lines.index("echo '@kph trigger'")
    record_on = lines.index("echo 'record on' > /sys/kernel/debug/kph/control")
    assert lines.index("insmod /lib/modules/kph_kprobes.ko") < trigger < record_on
    assert lines[record_on + 1] == "( cat /proc/version"
    assert lines.index("echo '@kph modules'") < trigger  # module symbols, before the crash


def test_events_script_writes_kprobe_events_and_dumps_the_trace(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name="x"\ntrigger="true"\nsetup=["echo hi"]\n[[probe]]\nside="events"\n'
                 'spec="p:kprobes/o do_sys_openat2 dfd=%di:s32"\n[expect]\noutcome="ok"\n')
    script = repro_rr.scenario_script(load(p), SymbolTable.from_kallsyms(KALLSYMS))
    assert "echo 'p:kprobes/o do_sys_openat2 dfd=%di:s32' >> /sys/kernel/tracing/kprobe_events" in script
    assert script.index("echo hi") < script.index("@kph probes") < script.index("@kph trigger")
    assert "grep -v '^#' /sys/kernel/tracing/trace" in script
    assert "insmod" not in script and "@kph modules" not in script


CONSOLE = """[    0.000000] Linux version 6.1
@kph setup
@kph probes
@kph probe kprobes/o ok
@kph probe kprobes/bad err sh: write error: Invalid argument
@kph module-probe 1 kprobes/bl
@kph module-list
1 p ffffffff8134a350 rejected -22 -
@kph modules
ffffffffc0001000 t kph_pre\t[kph_kprobes]
[    8.2] RIP: 0010:kph_null_deref_handler+0x1f/0x28 [kph_kprobes]
@kph list
ffffffff8134a350  k  do_sys_openat2+0x0    [FTRACE]
@kph trigger
Linux version 6.1.0
@kph trigger exit 0
@kph trace
 cat-99 [000] ..... 8.0: o: (do_sys_openat2+0x0/0x170) dfd=-100
@kph list-after
@kph end
"""


def test_sections_and_observe_read_the_console():
    scn = load(SCENARIOS / "null-deref-handler.toml")
    sec = repro_rr.sections(CONSOLE)
    assert sec["trace"] == [" cat-99 [000] ..... 8.0: o: (do_sys_openat2+0x0/0x170) dfd=-100"]
    obs = repro_rr.observe(scn, CONSOLE, "", timed_out=False, panicked=False)
    assert obs.trigger_status == 0 and obs.output == "Linux version 6.1.0"
    ev = {o.probe: o for o in obs.outcomes["events"]}
    assert ev["kprobes/o"].accepted and not ev["kprobes/bad"].accepted and ev["kprobes/bad"].errno == 22
    (mod,) = obs.outcomes["module"]
    assert mod.probe == "kprobes/bl" and not mod.accepted and mod.errno == 22
    # Only real kallsyms lines become module symbols, not a console line that looks alike.
    table = repro_rr.with_modules(SymbolTable.from_kallsyms(KALLSYMS), CONSOLE)
    assert table.lookup("kph_pre").addr == 0xffffffffc0001000
    # A RIP line alone is no Oops, and one probe was accepted: nothing went wrong.
    assert obs.outcome == "ok" and obs.oops == []


def test_observe_outcomes():
    scn = load(SCENARIOS / "null-deref-handler.toml")
    assert repro_rr.observe(scn, "x\n", "", timed_out=True, panicked=False).outcome == "hang"
    panic = "BUG: kernel NULL pointer dereference, address: 0\nKernel panic - not syncing: Fatal exception\n"
    obs = repro_rr.observe(scn, panic, "", timed_out=False, panicked=True)
    assert obs.outcome == "panic" and obs.error.startswith("Kernel panic")
    assert repro_rr.observe(scn, "@kph trigger\n@kph trigger exit 1\n", "", timed_out=False,
                            panicked=False).outcome == "ok"


@pytest.mark.parametrize("name,key", [("change-path", "probe[0].side"),
                                      ("blacklisted", "probe[0].side"),
                                      ("maxactive-too-low", "probe[0].side")])
def test_host_side_scenarios_cannot_be_recorded(name, key):
    with pytest.raises(ScenarioError) as ei:
        repro_rr.check_recordable(load(SCENARIOS / f"{name}.toml"))
    assert ei.value.key == key


@pytest.mark.parametrize("extra,key", [
    ('[machine]\nsmp=2\n', "machine.smp"), ('[machine]\nappend="quiet"\n', "machine.append"),
    ('[expect]\noutcome="ok"\ncounters=["events:kprobes/o.hits > 0"]\n', "expect.counters")])
def test_recording_refuses_what_it_cannot_honour(tmp_path, extra, key):
    text = 'name="x"\ntrigger="true"\n[[probe]]\nside="events"\nspec="p:kprobes/o do_sys_openat2"\n'
    text += extra if "[expect]" in extra else extra + '[expect]\noutcome="ok"\n'
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(ScenarioError) as ei:
        repro_rr.check_recordable(load(p))
    assert ei.value.key == key


@pytest.mark.parametrize("args,want", [
    (["probes/scenarios/change-path.toml", "--record"], "probe[0].side: host-side probes cannot be recorded"),
    (["--gdb", "probes/scenarios/null-deref-handler.toml"], "--gdb goes with --replay DIR"),
    ([], "kph repro needs a scenario file"),
    (["--replay", "/nonexistent-kph"], "no recording in /nonexistent-kph"),
])
def test_cli_refusals_are_one_line(args, want):
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "harness.cli", "repro", *args], cwd=root,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert want in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
