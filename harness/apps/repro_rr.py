"""``kph repro --record`` and ``--replay``: a scenario under QEMU record/replay.

A recorded guest takes no input from outside (``harness.machine.replay``: only the serial
console is part of QEMU's log, the guest agent is not), so a scenario cannot be driven
through the agent as ``kph repro`` does. Instead the scenario becomes one shell script
that the image's init runs on the console: setup commands, the in-guest probes
(``kprobe_events`` lines, the harness's module with its ``add`` lines), the debugfs
kprobes list, the trigger, then the trace and the module's records. Every section
starts with an ``@kph`` marker line, so the console alone holds what happened, and a
replay that reproduces the console byte for byte reproduces every event record too.

The machine state at the end (registers and a symbolized stack) is read through the
human monitor (``info registers``, ``x``), which reads a stopped guest without changing
it: the recording and its replay are read the same way, at the same instruction, and
must agree.

What a recorded scenario cannot have (each refused with the key at fault):
host-side probes (the host's breakpoints and handler writes are not in QEMU's log: the
replay would diverge), ``expect.counters`` and ``expect.equivalent`` (they need the
agent or the host side), ``machine.smp`` other than 1 (record/replay is single-vCPU),
``machine.append`` and ``machine.memory`` (the recorded machine is the default one).
"""
from __future__ import annotations

import dataclasses
import errno as _errno
import json
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from .. import constants as C
from ..backends.events import STRERROR, KPROBES_LIST, TRACING
from ..backends.module import FLAG_BUG_NULL, GUEST_KO, KPH_DIR, add_line, compile_arg
from ..errors import HarnessError, ScenarioError, SetupError
from ..kernel.grammar.fetch import MAX_STRING_SIZE
from ..kernel.grammar import kernel_format, parse
from ..records import Outcome
from .repro import OOPS_RE, RUNS_DIR, Observed, ReproResult, evaluate, probe_sections, symbolized_stack
from .scenario import Scenario
from ..machine.replay import End, decode_console, hmp, load_recording, record, replay
from ..machine.image.store import default_image
from ..kernel.symbols import SymbolTable, load_kallsyms_cached
from . import scenario

Progress = Callable[[str], None]
MARK = "@kph "
_KALLSYMS_MOD_RE = re.compile(r"^[0-9a-f]+ \w \S+\s+\[(\S+)\]$")
_REG_RE = re.compile(r"\b([A-Z][A-Z0-9]{1,3})=([0-9a-f]{8,16})\b")


# -- what can be recorded ---------------------------------------------------------------------

def check_recordable(scn: Scenario) -> None:
    """:raise ScenarioError: naming the first key a recorded run cannot honour."""
    ps = str(scn.path)
    for i, d in enumerate(scn.probes):
        if d.side == "host" or d.spec is None:
            raise ScenarioError(ps, f"probe[{i}].side", "host-side probes cannot be recorded (the "
                                "host's breakpoints are not in QEMU's replay log); run without --record")
    for key in ("counters", "equivalent"):
        if getattr(scn.expect, key) not in ((), None):
            raise ScenarioError(ps, f"expect.{key}", "not available under --record (it needs the "
                                "guest agent or host-side probes); run without --record")
    if int(scn.machine.get("smp", 1)) != 1:
        raise ScenarioError(ps, "machine.smp", "QEMU record/replay runs one vCPU; use smp = 1")
    for key in ("append", "memory"):
        if key in scn.machine:
            raise ScenarioError(ps, f"machine.{key}", "a recorded run uses the default machine; "
                                "drop the key to record")


# -- the scenario as one guest script ------------------------------------------------------------

def scenario_script(scn: Scenario, symbols: Any) -> str:
    """The guest script of a recorded scenario; see the module docstring for its sections."""
    specs = {"events": [], "module": []}  # type: dict[str, list[tuple[Any, bool]]]
    for d in scn.probes:
        specs[d.side].append((parse(d.spec), d.bug is not None))
    out = ["exec 2>&1", f"echo '{MARK}setup'", *scn.setup, f"echo '{MARK}probes'"]
    for spec, _ in specs["events"]:
        name = f"{spec.group}/{spec.event}"
        out.append(f"if echo {shlex.quote(kernel_format(spec))} >> {TRACING}/kprobe_events "
                   f"2>/tmp/kph.err; then echo 1 > {TRACING}/events/{name}/enable && "
                   f"echo '{MARK}probe {name} ok'; else echo \"{MARK}probe {name} err "
                   "$(cat /tmp/kph.err)\"; fi")
    if specs["module"]:
        lines = []
        for i, (spec, buggy) in enumerate(specs["module"], 1):
            addr = spec.addr if spec.addr is not None else \
                symbols.lookup(spec.symbol_name).addr + spec.offset
            progs = [compile_arg(a, resolve=lambda n: symbols.lookup(n).addr, maxlen=MAX_STRING_SIZE)
                     for a in spec.args]
            lines.append(add_line(i, "r" if spec.is_return else "p", addr, progs,
                                  maxactive=spec.maxactive, flags=FLAG_BUG_NULL if buggy else 0))
            out.append(f"echo '{MARK}module-probe {i} {spec.group}/{spec.event}'")
        out += [f"insmod {GUEST_KO}",
                f"printf '%s\\n' {' '.join(shlex.quote(x) for x in lines)} > {KPH_DIR}/control"
                f" || echo '{MARK}control refused'",
                f"echo '{MARK}module-list'", f"cat {KPH_DIR}/list",
                # Module symbols for the stack at the end (the handler's frames are in the
                # module). Reading all of /proc/kallsyms costs ~2.5 s of guest time.
                f"echo '{MARK}modules'", "grep '\\[' /proc/kallsyms"]
    out += [f"echo '{MARK}list'", f"cat {KPROBES_LIST}",
            f"echo '{MARK}trigger'"]
    if specs["module"]:  # the module records (and a buggy handler bites) from here on
        out.append(f"echo 'record on' > {KPH_DIR}/control")
    out += [f"( {scn.trigger}\n)", f"echo \"{MARK}trigger exit $?\""]
    if specs["events"]:
        out += [f"echo '{MARK}trace'", f"grep -v '^#' {TRACING}/trace"]
    if specs["module"]:
        out += [f"echo '{MARK}module-events'", f"cat {KPH_DIR}/events"]
    out += [f"echo '{MARK}list-after'", f"cat {KPROBES_LIST}", f"echo '{MARK}end'"]
    return "\n".join(out) + "\n"


#: Marker words that open a section; other ``@kph`` lines stay in the section they are in.
SECTIONS = ("setup", "probes", "module-list", "modules", "list", "trigger", "trace", "module-events",
            "list-after", "end")


def sections(console: str) -> dict[str, list[str]]:
    """The console's lines by ``@kph`` section."""
    out: dict[str, list[str]] = {"boot": []}
    cur = "boot"
    for line in console.splitlines():
        if line.startswith(MARK) and line[len(MARK):] in SECTIONS:
            cur = line[len(MARK):]
            out.setdefault(cur, [])
        else:
            out[cur].append(line)
    return out


def observe(scn: Scenario, console: str, stack: str, *, timed_out: bool, panicked: bool) -> Observed:
    """What the console says happened, in ``kph repro``'s terms."""
    obs = Observed(console=console, stack=stack)
    sec = sections(console)
    events = []
    for line in sec.get("probes", []):
        m = re.match(r"@kph probe (\S+) (ok|err)\s*(.*)", line)
        if m and m[2] == "ok":
            events.append(Outcome(m[1], True))
        elif m:
            msg = m[3].rsplit("write error: ", 1)[-1].strip()
            events.append(Outcome.rejected(m[1], STRERROR.get(msg, _errno.EINVAL), msg))
    if events:
        obs.outcomes["events"] = events
    names = {}
    for lines in sec.values():
        for line in lines:
            m = re.match(r"@kph module-probe (\d+) (\S+)", line)
            if m:
                names[int(m[1])] = m[2]
    if names:
        listed = {}
        for line in sec.get("module-list", []):
            p = line.split()
            if len(p) >= 6 and p[0].isdigit():
                listed[int(p[0])] = (p[3], int(p[4]), p[5])
        mod = []
        for i, name in names.items():
            state, err, mode = listed.get(i, ("missing", -_errno.EIO, "-"))
            mod.append(Outcome(name, True, mode=mode) if state == "registered" else
                       Outcome.rejected(name, -err, f"register_kprobe() returned {err}"))
        obs.outcomes["module"] = mod
    trig = sec.get("trigger", [])
    status = next((ln for ln in trig if ln.startswith(f"{MARK}trigger exit ")), None)
    obs.output = "\n".join(ln for ln in trig if not ln.startswith(MARK))
    obs.trigger_status = int(status.rsplit(" ", 1)[1]) if status else None
    obs.oops = OOPS_RE.findall(console)
    if panicked:
        panic = next((x for x in obs.oops if x.startswith("Kernel panic")), "the guest panicked")
        obs.outcome, obs.error = "panic", panic
    elif timed_out and status is None:
        obs.outcome, obs.error = "hang", "the recording reached its timeout"
    elif obs.oops:
        obs.outcome = "oops"
    elif obs.outcomes and all(not o.accepted for outs in obs.outcomes.values() for o in outs):
        obs.outcome = "refused"
    return obs


# -- machine state through the human monitor ------------------------------------------------

class _MonitorMemory:
    """The slice of ``GdbStub`` that ``repro.symbolized_stack`` uses, over HMP ``x``
    (guest virtual addresses through the vCPU's page tables)."""

    current_thread = 1

    def __init__(self, run: Any) -> None:
        self.run = run

    def select_thread(self, thread: int) -> None:
        pass

    def read_memory(self, addr: int, size: int) -> bytes:
        text = hmp(self.run, f"x/{size}bx {addr:#x}")
        data = bytearray()
        for line in text.splitlines():
            head, sep, rest = line.partition(":")
            if not sep or "Cannot access" in line:
                break
            data += bytes(int(v, 16) for v in re.findall(r"0x([0-9a-f]{2})\b", rest))
        if len(data) < size:
            raise HarnessError(f"memory at {addr:#x} unreadable: {text.strip()[:80]}")
        return bytes(data[:size])


@dataclasses.dataclass
class EndState:
    regs_text: str = "(not read)"
    regs: dict[str, int] = dataclasses.field(default_factory=dict)
    stack: str = ""


def with_modules(symbols: Any, console: str) -> Any:
    """``symbols`` plus the modules the script listed (the ``modules`` section)."""
    per: dict[str, list[str]] = {}
    for line in sections(console).get("modules", []):
        m = _KALLSYMS_MOD_RE.match(line)
        if m:
            per.setdefault(m[1], []).append(line)
    if not per:
        return symbols
    table = symbols.copy()
    for mod, lines in per.items():
        table.add_module(mod, "\n".join(lines))
    return table


def read_end_state(run: Any, symbols: Any, console: str) -> EndState:
    """Registers and symbolized stack of the (one) vCPU of a stopped rr run; module
    symbols come from the run's ``console``."""
    symbols = with_modules(symbols, console)
    st = EndState()
    try:
        st.regs_text = hmp(run, "info registers")
    except HarnessError as exc:
        st.regs_text = f"(registers unavailable: {exc})"
        return st
    st.regs = {k.lower(): int(v, 16) for k, v in _REG_RE.findall(st.regs_text)}
    if "rip" in st.regs and "rsp" in st.regs:
        st.stack = "vCPU 0: " + symbolized_stack(symbols, _MonitorMemory(run), 1, st.regs)
    return st


# -- record ----------------------------------------------------------------------------------

def _symbols(scn: Scenario) -> Any:
    m = scn.machine
    if m.get("vmlinux"):
        return SymbolTable.from_vmlinux(m["vmlinux"])
    if m.get("kernel"):
        raise ScenarioError(str(scn.path), "machine.vmlinux", "a recorded run of your own kernel "
                            "needs its vmlinux for symbols; add vmlinux = \"PATH\"")
    return load_kallsyms_cached(default_image(m.get("image")).kallsyms)


def record_scenario(scn: Scenario, *, out_dir: Path | None = None, qemu: str | None = None,
                    progress: Progress = lambda s: None) -> ReproResult:
    """Record ``scn`` (see the module docstring) and write its bundle next to the recording."""
    check_recordable(scn)
    symbols = _symbols(scn)
    script = scenario_script(scn, symbols)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = out_dir or RUNS_DIR / f"repro-{re.sub(r'[^A-Za-z0-9_.-]+', '-', scn.path.stem)}-{stamp}"
    state = EndState()

    def at_end(run: Any) -> None:
        nonlocal state

        state = read_end_state(run, symbols, decode_console(run.console))

    m = scn.machine
    timeout = scn.timeouts.get("boot", C.BOOT_TIMEOUT) + scn.timeouts.get("trigger", 60) + 60
    progress(f"repro: recording under QEMU rr=record (one vCPU, icount; up to {timeout:.0f} s)")
    rec = record(script, out, image=m.get("image"), kernel=m.get("kernel"), initrd=m.get("initrd"),
                 qemu=qemu, timeout=timeout, at_end=at_end)
    progress(f"repro: recorded {rec.icount} instructions in {rec.seconds:.1f} s, end {rec.end.value}")
    obs = observe(scn, rec.console, state.stack, timed_out=rec.end is End.TIMEOUT,
                  panicked=rec.end is End.PANIC)
    met, reasons, cause = evaluate(scn, obs, obs.stack)
    _write_bundle(out, scn, obs, state, met, reasons, cause, rec)
    return ReproResult(scn, obs, met, reasons, cause, out)


def _write_bundle(d: Path, scn: Scenario, obs: Observed, state: EndState, met: bool,
                  reasons: list[str], cause: str, rec: Any) -> None:
    sec = sections(obs.console)
    (d / "registers.txt").write_text(state.regs_text)
    (d / "registers.json").write_text(json.dumps({"vcpu0": state.regs}, indent=1) + "\n")
    (d / "stack.txt").write_text(obs.stack or "(not read)\n")
    (d / "kprobes_list.txt").write_text(
        "# before the trigger\n" + "\n".join(sec.get("list", [])) +
        "\n# after the trigger\n" + "\n".join(sec.get("list-after", ["(the guest did not get there)"])) + "\n")
    (d / "events.txt").write_text("\n".join(sec.get("trace", []) + sec.get("module-events", [])) + "\n")
    shutil.copy(scn.path, d / "scenario.toml")
    lines = [f"# {scn.name} (recorded)", "", scn.description.strip(), "",
             f"**Verdict: {'MET' if met else 'NOT MET'}** (expected `{scn.expect.outcome}`, "
             f"observed `{obs.outcome}`)", "", f"**Cause:** {cause}", "",
             f"Recorded {rec.icount} guest instructions in {rec.seconds:.1f} s; the run ended: "
             f"{rec.end.value}. Replay it with `kph repro --replay {d}` (add `--gdb` to step "
             "backwards with gdb).", "", "## Checks", ""]
    lines += [f"- {x}" for x in reasons]
    if obs.oops:
        lines += ["", "## Console (Oops/BUG/WARNING/panic lines)", "", "```"] + obs.oops[:20] + ["```"]
    if obs.stack:
        lines += ["", "## Stack at the recorded end", "", "```"] + obs.stack.splitlines()[:30] + ["```"]
    lines += probe_sections(obs)
    lines += ["", "Files: console.log (raw serial bytes), replay.bin (the QEMU replay log), "
              "registers.txt, stack.txt, kprobes_list.txt, events.txt, scenario.toml, "
              "record.json, argv.json, script.sh", ""]
    (d / "summary.md").write_text("\n".join(lines))


# -- replay ------------------------------------------------------------------------------------

@dataclasses.dataclass
class ReplayReport:
    result: Any                   # replay.ReplayResult
    same_console: bool
    same_registers: bool | None   # None: not comparable (see replay_scenario)
    met: bool
    reasons: list[str]
    state: EndState


def replay_scenario(bundle: Path, *, qemu: str | None = None, keep: bool = False,
                    progress: Progress = lambda s: None) -> ReplayReport:
    """Replay a bundle made by ``record_scenario`` to its recorded end, read the state
    there, and compare with the recording. ``keep``: QEMU stays stopped at the end with
    its gdbstub open (close ``report.result``)."""
    rec = load_recording(bundle)
    try:
        scn = scenario.load(bundle / "scenario.toml")
    except OSError as exc:
        raise SetupError(f"{bundle} has no scenario.toml ({exc})",
                         "pass a directory made by `kph repro --record`") from exc
    symbols = _symbols(scn)
    progress(f"repro: replaying {rec.icount} instructions (recorded in {rec.seconds:.1f} s)")
    res = replay(bundle, qemu=qemu, gdb=True)
    try:
        state = read_end_state(res._run, symbols, res.console)
        recorded = json.loads((bundle / "registers.json").read_text()).get("vcpu0", {})
        obs = observe(scn, res.console, state.stack, timed_out=res.end is End.STALLED,
                      panicked=rec.end is End.PANIC and res.end is End.PANIC)
        met, reasons, _ = evaluate(scn, obs, obs.stack)
        # Registers are compared only at a panic: pvpanic stops the vCPU on the very
        # instruction, where the replay's break stops too. A poweroff is handled by
        # QEMU's main loop, so the recorder read the vCPU a few instructions later.
        same_regs = (bool(state.regs) and state.regs == recorded) if rec.end is End.PANIC else None
        report = ReplayReport(res, res.matches, same_regs, met, reasons, state)
        (bundle / "replay-stack.txt").write_text(state.stack or "(not read)\n")
        (bundle / "replay-registers.txt").write_text(state.regs_text)
    except BaseException:
        res.close()
        raise
    if not keep:
        res.close()
    return report
