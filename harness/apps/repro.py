"""``kph repro``: run a scenario, decide whether its expectation is met, keep the evidence.

Flow: boot; setup commands; place the probes (host-side first, then in-guest, as the
differential runner does); run the trigger while watching for a panic (pvpanic
GUEST_PANICKED or "Kernel panic"), Oops/BUG/WARNING lines and a hang (the trigger's
agent call and the console both silent past the limit); on a crash or hang read every
vCPU's registers and stack through the gdbstub; write the bundle; compare what happened
with ``[expect]``.

Bundle (``--out DIR``, default ``kph-runs/repro-<name>-<time>/`` under the current
directory: ``RUNS_DIR``, git-ignored, so bundles made in a checkout stay out of its sources): summary.md, console.log,
registers.txt (+ .json), stack.txt (symbolized, reliable or ``?``), kprobes_list.txt (the
guest's debugfs list before the trigger, and after if the guest still answers),
host_probes.txt, hits.json, scenario.toml, manifest.json.
"""
from __future__ import annotations

import dataclasses
import errno as _errno
import importlib
import importlib.util
import json
import logging
import operator
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..backends.events import EventsBackend
from ..backends.host import HostBackend
from ..errors import GuestPanicError, HarnessError, ProbeSpecError, VMError, VMLostError
from ..kernel.kprobes import Kprobe, Kretprobe
from ..kernel.grammar import KernelView, parse
from ..records import Counters, Hit, Outcome, SideResult
from .scenario import COUNTER_RE, Scenario
from ..backends.module import ModuleBackend
from ..diff.runner import trampoline_text
from ..diff.verdict import AGENT_COMMS, compare
from ..diff.report import findings_text
from ..machine.kwatch import KernelWatch
from ..vmctl import Machine
from ..machine.image.build import image_for
from ..machine.image.facts import kernel_view

log = logging.getLogger(__name__)

#: Where bundles go when no ``--out`` is given (relative to the current directory).
RUNS_DIR = Path("kph-runs")
OOPS_RE = re.compile(r"(BUG: [^\n]*|Oops: [^\n]*|general protection fault[^\n]*|"
                     r"kernel BUG at [^\n]*|WARNING: [^\n]*|Kernel panic - not syncing[^\n]*)")
_OPS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge,
    "<": operator.lt, "<=": operator.le}


@dataclass
class Observed:
    outcome: str = "ok"                   # ok, panic, oops, hang, refused
    trigger_status: int | None = None
    output: str = ""
    oops: list[str] = field(default_factory=list)
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    hits: dict[str, list[Hit]] = field(default_factory=dict)
    counters: dict[str, dict[str, Counters]] = field(default_factory=dict)
    stack: str = ""
    error: str = ""
    console: str = ""
    trampoline: str | None = None        # how the host trampoline prints in the guest
    #: what the kernel printed from the probes' placing on (``harness.kernel.splat``)
    splats: tuple[Any, ...] = ()
    #: the sides whose hits or counters could not be read, and why: a check that needs
    #: them was not measured, so NOT MET cannot be said (:func:`run` raises instead)
    unmeasured: dict[str, str] = field(default_factory=dict)


@dataclass
class ReproResult:
    scenario: Scenario
    observed: Observed
    met: bool
    reasons: list[str]
    cause: str
    bundle: Path


def _load_handler(ref: str, base: Path, vm: Machine) -> Callable[..., Any]:
    """``file.py:function`` (relative to the scenario) or ``package.module:function``.
    The handler's module gets ``vm`` set, so handlers can read guest memory."""
    target, _, func = ref.rpartition(":")
    if target.endswith(".py"):
        path = (base / target).resolve()
        spec = importlib.util.spec_from_file_location(f"kph_scenario_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise HarnessError(f"cannot load handler file {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(target)
    mod.vm = vm  # type: ignore[attr-defined]
    return getattr(mod, func)


class _Run:
    """One scenario run on one machine."""

    def __init__(self, scn: Scenario, vm: Machine) -> None:
        self.scn, self.vm = scn, vm
        self.obs = Observed()
        self.specs: dict[str, list[Any]] = {"host": [], "events": [], "module": []}
        self.backends: dict[str, Any] = {}
        self.py_probes: list[Any] = []
        self.lists: list[str] = []

    def place(self) -> None:
        scn, vm = self.scn, self.vm
        buggy = set()
        facts = vm.ensure_facts()
        view = kernel_view(facts)               # the booted kernel's grammar, BTF, symbols
        for d in scn.probes:
            if d.spec is not None:
                try:
                    spec = parse(d.spec, kernel=view)
                except ProbeSpecError:
                    if d.side == "host":
                        raise
                    # an in-guest line is the guest's to judge (a non-unique symbol, ...):
                    # parsed with the series' grammar alone, it is written as it is
                    spec = parse(d.spec, kernel=KernelView(facts.rules))
                self.specs[d.side].append(spec)
                if d.bug:
                    buggy.add(f"{spec.group}/{spec.event}")
        if self.specs["host"]:
            self.backends["host"] = HostBackend(vm, comm_rule="saved_cmdlines")
        for d in scn.probes:  # Python handlers, host-side
            if d.spec is None:
                self.py_probes.append(self._python_probe(d))
        if self.specs["events"]:
            self.backends["events"] = EventsBackend(vm)
        if self.specs["module"]:
            self.backends["module"] = ModuleBackend(vm, buggy=frozenset(buggy))
        for side in ("host", "events", "module"):
            if side in self.backends:
                self.obs.outcomes[side] = self.backends[side].register(self.specs[side])
        if self.vm._host is not None:
            vm.host.invalidate_code()
            self.obs.trampoline = trampoline_text(vm)
        if self.specs["module"]:
            vm.refresh_module_symbols()
        self.lists.append("# before the trigger\n" + vm.run("cat /sys/kernel/debug/kprobes/list").stdout)

    def _python_probe(self, d: Any) -> Any:
        base = self.scn.path.parent
        h = {k: _load_handler(getattr(d, k), base, self.vm)
             for k in ("pre_handler", "post_handler", "handler", "entry_handler") if getattr(d, k)}
        if d.kind == "r":
            p: Any = Kretprobe(symbol_name=d.symbol, offset=d.offset, maxactive=d.maxactive,
                               handler=h.get("handler"), entry_handler=h.get("entry_handler"))
            self.vm.host.register_kretprobe(p)
        else:
            p = Kprobe(symbol_name=d.symbol, offset=d.offset, pre_handler=h.get("pre_handler"),
                       post_handler=h.get("post_handler"))
            self.vm.host.register_kprobe(p)
        return p

    def trigger(self) -> None:
        vm, obs = self.vm, self.obs
        for be in self.backends.values():
            be.enable()
        try:
            r = vm.run(self.scn.trigger, timeout=self.scn.timeouts["trigger"])
            obs.trigger_status, obs.output = r.status, r.stdout + r.stderr
        except GuestPanicError as exc:
            obs.outcome, obs.error = "panic", str(exc.args[0])
        except VMLostError as exc:
            obs.outcome, obs.error = "hang", str(exc.args[0])
        except VMError as exc:
            obs.outcome, obs.error = "lost", str(exc.args[0])
        time.sleep(0.2)  # let the console catch up with a last Oops line
        obs.oops = OOPS_RE.findall(vm.console_text())
        if obs.outcome == "ok" and obs.oops:
            obs.outcome = "oops"
        if obs.outcome == "ok" and obs.outcomes and all(
                not o.accepted for outs in obs.outcomes.values() for o in outs):
            obs.outcome = "refused"

    def collect(self) -> None:
        obs, alive = self.obs, self.obs.outcome in ("ok", "oops", "refused")
        for side, be in self.backends.items():
            if alive:
                try:
                    be.disable()
                    obs.hits[side] = be.collect()
                    obs.counters[side] = be.counters()
                except HarnessError as exc:
                    log.warning("collecting %s failed: %s", side, exc)
                    obs.unmeasured[side] = str(exc)
        if obs.outcome in ("panic", "hang", "lost") or obs.oops:
            obs.stack = self._crash_state()
        if obs.outcome == "panic":
            self._flush_panic_console()
        if alive:
            try:
                self.lists.append("# after the trigger\n" +
                                  self.vm.run("cat /sys/kernel/debug/kprobes/list").stdout)
            except HarnessError:
                pass

    def _crash_state(self) -> str:
        """Registers and symbolized stack of every vCPU, through the gdbstub."""
        vm = self.vm
        self.regs: dict[int, dict[str, int]] = {}
        if vm._host is not None and not vm._host.closed:
            try:
                text = vm.qmp("human-monitor-command", {"command-line": "info registers -a"})
                self.regs_text = str(text)
            except HarnessError as exc:
                self.regs_text = f"(registers unavailable: {exc})"
            return "(the gdbstub serves host-side probes; registers from QMP in registers.txt)"
        try:
            stub = vm.gdbstub(resume=False)
            if stub.running:
                stub.interrupt(timeout=5)
            out = []
            for th in stub.threads():
                regs = stub.read_registers(thread=th)
                self.regs[th] = regs
                out.append(f"vCPU {th - 1}: " + symbolized_stack(vm.symbols, stub, th, regs))
            self.regs_text = "\n\n".join(
                f"vCPU {th - 1}\n" + "\n".join(f"  {k:10s} {v:#018x}" for k, v in r.items())
                for th, r in self.regs.items())
            return "\n\n".join(out)
        except HarnessError as exc:
            self.regs_text = f"(registers unavailable: {exc})"
            return f"(stack unavailable: {exc})"

    def _flush_panic_console(self) -> None:
        """Let panic() finish printing. pvpanic pauses the guest from the panic notifiers,
        which 6.1's panic() calls before console_flush_on_panic(): lines still in the printk
        buffer (often the Oops's RIP line) reach the console only if it runs on. The
        registers and stack were read already; the guest then reboots, which ends QEMU."""
        vm = self.vm
        try:
            if vm._stub is not None:
                vm._stub.close()
                vm._stub = None
            vm.qmp("cont", timeout=2)
        except HarnessError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and vm.proc.poll() is None and \
                "---[ end Kernel panic" not in vm.console_text():
            time.sleep(0.05)

    def close(self) -> None:
        alive = self.obs.outcome in ("ok", "oops", "refused")
        if not alive:
            return  # the machine is torn down as a whole
        for p in self.py_probes:
            try:
                (self.vm.host.unregister_kretprobe if isinstance(p, Kretprobe)
                 else self.vm.host.unregister_kprobe)(p)
            except HarnessError:
                pass
        for be in self.backends.values():
            try:
                be.close()
            except HarnessError as exc:
                log.warning("closing %s: %s", be.side, exc)


def symbolized_stack(symbols: Any, stub: Any, th: int, regs: dict[str, int],
                     words: int = 128) -> str:
    """rip, then every kernel text address in the stack's first ``words`` words. An
    address right after a call instruction is a return address (printed plainly); any
    other is marked ``?``, as the kernel's own stack dumps mark unverified entries."""
    lines = [f"rip {symbols.format(regs['rip'])}  (rsp {regs['rsp']:#x})"]
    try:
        data = _read_stack(stub, th, regs["rsp"], words)
    except HarnessError as exc:
        return "\n".join(lines + [f"  (stack unreadable: {exc})"])
    for i in range(0, len(data), 8):
        v = int.from_bytes(data[i:i + 8], "little")
        if not symbols.is_text(v):
            continue
        sure = _after_call(stub, v)
        lines.append(f"  [rsp+{i:#05x}] {'  ' if sure else '? '}{symbols.format(v)}")
    return "\n".join(lines)


def _read_stack(stub: Any, th: int, rsp: int, words: int) -> bytes:
    if stub.current_thread != th:
        stub.select_thread(th)
    out = b""
    for off in range(0, 8 * words, 256):  # stop at the first unreadable chunk
        try:
            out += stub.read_memory(rsp + off, 256)
        except HarnessError:
            break
    return out


def _after_call(stub: Any, addr: int) -> bool:
    try:
        b = stub.read_memory(addr - 7, 7)
    except HarnessError:
        return False
    # call rel32 (e8 xx xx xx xx); call *%reg (ff d0+r, 41 ff d0+r); call *disp(%reg)
    return b[2] == 0xE8 or (b[5] == 0xFF and 0xD0 <= b[6] <= 0xD7) or \
        (b[4] == 0x41 and b[5] == 0xFF) or (b[1] == 0xFF and (b[2] >> 3) & 7 == 2)


def evaluate(scn: Scenario, obs: Observed, regs_stack: str) -> tuple[bool, list[str], str]:
    """Met or not, the reasons, and a one-line cause for the summary."""
    exp, reasons = scn.expect, []
    ok = True
    seen = obs.outcome
    if exp.outcome == "oops":
        good = bool(obs.oops) and any(not x.startswith("Kernel panic") for x in obs.oops)
    elif exp.outcome == "panic":
        good = seen == "panic"
    else:
        good = seen == exp.outcome
    reasons.append(f"outcome: expected {exp.outcome}, saw {seen}" + (" (met)" if good else " (NOT met)"))
    ok &= good
    if exp.outcome == "refused" and exp.errno:
        want = getattr(_errno, exp.errno, None)
        errs = {o.errno for outs in obs.outcomes.values() for o in outs}
        good = errs == {want}
        reasons.append(f"errno: expected {exp.errno} on every side, saw "
                       f"{sorted(_errno.errorcode.get(e, str(e)) for e in errs)}" + ("" if good else " (NOT met)"))
        ok &= good
    for key, text in (("console", obs.console),
                      ("output", obs.output), ("stack", regs_stack)):
        rx = getattr(exp, key)
        if rx:
            m = re.search(rx, text or "")
            reasons.append(f"{key} /{rx}/: " + (f"found {m.group(0)!r}" if m else "NOT found"))
            ok &= m is not None
    for c in exp.counters:
        good, text = _counter(c, obs)
        reasons.append(f"counter {c}: {text}")
        ok &= good
    if exp.equivalent is not None:
        hs = obs.hits.get("host", [])
        guest = "module" if "module" in obs.hits else "events"
        res = compare(SideResult("host", obs.outcomes.get("host", []), hs, obs.counters.get("host", {})),
                      SideResult(guest, obs.outcomes.get(guest, []), obs.hits.get(guest, []),
                                obs.counters.get(guest, {})), trampoline=obs.trampoline)
        good = res.equivalent == exp.equivalent
        first = res.first.describe("host", guest) if res.first else "none"
        reasons.append(f"host vs {guest} equivalent: {res.equivalent} (first divergence: {first})"
                       + ("" if good else " (NOT met)"))
        ok &= good
    return ok, reasons, _cause(scn, obs, regs_stack)


def _counter(expr: str, obs: Observed) -> tuple[bool, str]:
    m = COUNTER_RE.match(expr)
    assert m is not None
    vals = []
    for operand in (m[1], m[3]):
        if operand.lstrip("-").isdigit():
            vals.append(int(operand))
            continue
        side, rest = operand.split(":", 1)
        probe, fld = rest.rsplit(".", 1)
        if fld == "hits":       # the trigger's: the guest agent's own hits left out
            vals.append(sum(1 for h in obs.hits.get(side, []) if h.probe == probe
                            and h.comm not in AGENT_COMMS))
        else:
            c = obs.counters.get(side, {}).get(probe)
            if c is None:
                return False, f"{operand} is unknown (NOT met)"
            vals.append(getattr(c, fld))
    good = _OPS[m[2]](vals[0], vals[1])
    return good, f"{vals[0]} {m[2]} {vals[1]}" + ("" if good else " (NOT met)")


def _agent_part(obs: Observed, side: str, probe: str) -> str:
    """How many of a probe's nhit the guest agent's own processes made, when any: the
    kernel counts every call, and qemu-ga runs the trigger (a child it forks hits as
    ``qemu-ga`` until it execs: 6 runs in 60 of a three-sleep trigger had a thread of that
    child in do_nanosleep, killed by the exec), so nhit can be one more than the trigger's
    own calls. ``hits`` in ``[expect] counters`` leaves these out."""
    n = sum(1 for h in obs.hits.get(side, []) if h.probe == probe and h.comm in AGENT_COMMS)
    return f" ({n} the guest agent's)" if n else ""


def _cause(scn: Scenario, obs: Observed, stack: str) -> str:
    if obs.oops:
        first = next((x for x in obs.oops if not x.startswith("Kernel panic")), obs.oops[0])
        where = re.search(r"RIP: 0010:(\S+)", obs.console)
        return f"{first}" + (f" in {where.group(1)}" if where else "")
    if obs.outcome == "panic":
        return obs.error
    if obs.outcome == "hang":
        return f"the trigger did not finish within {scn.timeouts['trigger']:.0f} s: {obs.error}"
    refused = [(side, o) for side, outs in obs.outcomes.items() for o in outs if not o.accepted]
    if refused and obs.outcome == "refused":
        return "; ".join(f"{side} refused {o.probe}: {_errno.errorcode.get(o.errno, o.errno)} "
                         f"({_why(o)})" for side, o in refused)
    parts = [f"{side} {p}: nhit {c.nhit}{_agent_part(obs, side, p)}, nmissed {c.nmissed}"
             for side, cs in obs.counters.items() for p, c in cs.items()]
    head = f"trigger exited {obs.trigger_status}"
    if obs.output.strip():
        head += f", output {obs.output.strip().splitlines()[-1][:120]!r}"
    return head + ("; " + "; ".join(parts) if parts else "")


def run(scn: Scenario, *, out_dir: Path | None = None, qemu: str | None = None,
        progress: Callable[[str], None] = lambda s: None, image: Any = None) -> ReproResult:
    """Run ``scn`` and write its bundle; see the module docstring. ``image`` replaces the
    scenario's own kernel (``kph repro --kernels``)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bundle = out_dir or RUNS_DIR / f"repro-{re.sub(r'[^A-Za-z0-9_.-]+', '-', scn.path.stem)}-{stamp}"
    bundle.mkdir(parents=True, exist_ok=True)
    m = dict(scn.machine)
    if image is not None:
        m.pop("kernel", None)
        m.pop("initrd", None)
        m.pop("vmlinux", None)
        m["image"] = image
    progress(f"repro: booting ({m.get('kernel') or getattr(m.get('image'), 'version', m.get('image')) or 'default image'})")
    vm = Machine.boot(m.get("image"), kernel=m.get("kernel"), initrd=m.get("initrd"),
                      vmlinux=m.get("vmlinux"), smp=m.get("smp", 1), memory=m.get("memory", "512M"),
                      append=m.get("append"), qemu=qemu, timeout=scn.timeouts["boot"])
    r = _Run(scn, vm)
    try:
        with vm:
            for cmd in scn.setup:
                progress(f"repro: setup: {cmd}")
                res = vm.run(cmd, timeout=scn.timeouts["trigger"])
                if not res.ok:
                    log.warning("setup %r exited %d", cmd, res.status)
            progress("repro: placing probes")
            watch = KernelWatch(vm)     # the kernel's splats from here on (kernel.txt)
            watch.start()
            r.place()
            progress(f"repro: trigger: {scn.trigger}")
            r.trigger()
            progress(f"repro: observed {r.obs.outcome}; collecting evidence")
            r.collect()
            r.obs.splats = watch.finish(dmesg=r.obs.outcome in ("ok", "oops", "refused"))
            r.obs.console = vm.console_text()
            host_list = vm._host.list() if vm._host is not None and not vm._host.closed else ""
            r.close()
            manifest = dict(vm.image.manifest) if vm.image is not None else {"kernel": str(vm.kernel)}
            manifest["qemu"] = vm.qemu.version_str
    finally:
        if not r.obs.console:
            r.obs.console = vm.console_text()
    met, reasons, cause = evaluate(scn, r.obs, r.obs.stack)
    _write_bundle(bundle, scn, r, met, reasons, cause, host_list, manifest)
    if r.obs.splats:
        (bundle / "kernel.txt").write_text(findings_text(r.obs.splats))
    check_measured(scn, r.obs, met, bundle)
    return ReproResult(scn, r.obs, met, reasons, cause, bundle)


def check_measured(scn: Scenario, obs: Observed, met: bool, bundle: Path) -> None:
    """NOT MET says every check ran and one failed. A side whose hits or counters could
    not be read (a ring-buffer loss, a failed read) leaves its checks unrun, so a NOT MET
    then is an error, never a verdict (``kph bisect`` would call the commit good). MET
    stands: the checks that passed were measured.

    :raise HarnessError: naming the side, why, and the bundle."""
    if met or not obs.unmeasured:
        return
    side, why = next(iter(obs.unmeasured.items()))
    raise HarnessError(f"{scn.path.name}: not measured: collecting {side} failed: {why}; "
                       f"the evidence is in {bundle}")


@dataclass
class KernelRepro:
    """One kernel's run of a scenario under ``kph repro --kernels``."""

    name: str                   # stock, source, patched, or the selector as given
    selector: str
    image: Any                  # the Image it ran on
    result: ReproResult
    expect_met: bool            # a patched kernel is expected NOT MET: its fix works

    @property
    def as_expected(self) -> bool:
        return self.result.met == self.expect_met


#: ``--kernels NAME=SELECTOR``: NAME is a word
_NAMED = re.compile(r"([A-Za-z][\w.-]*)=(.*)")


def resolve_kernels(scn: Scenario, names: list[str],
                    series: str | None = None) -> list[tuple[str, str]]:
    """``--kernels`` as (name, selector): ``stock``, ``source`` and ``patched`` from the
    scenario's ``[kernels]`` table, of ``series`` (``--series``; default the table's own);
    ``NAME=SELECTOR`` names a kernel of one's own (``patched=tree:6.12+OTHER.patch``: a
    fix the table does not name, still expected NOT MET); anything else is a kernel
    selector as it is.

    :raise HarnessError: a named kernel the scenario does not define."""
    table = scn.kernel_selectors(series)
    out = []
    for n in names:
        named = _NAMED.fullmatch(n)     # a word before '=': a path may hold '=' itself
        if named:
            if not named[2].strip():
                raise HarnessError(f"--kernels {n}: NAME=SELECTOR needs a selector "
                                   "(e.g. patched=tree:6.12+FIX.patch)")
            out.append((named[1], named[2].strip()))
        elif n in ("stock", "source", "patched"):
            if n not in table:
                what = ("series" if n != "patched" else
                        "patch" if not series or series == scn.kernels.get("series") else
                        f'patches."{series}"')
                raise HarnessError(f"--kernels {n}: {scn.path.name} has no [kernels] {what}; "
                                   "name the kernel itself (6.12, tree:6.12+FIX.patch, an "
                                   "image directory)")
            out.append((n, table[n]))
        else:
            out.append((n, n))
    return out


def run_kernels(scn: Scenario, names: list[str], *, out_dir: Path | None = None,
                qemu: str | None = None, series: str | None = None,
                progress: Callable[[str], None] = lambda s: None) -> list[KernelRepro]:
    """Run ``scn`` on each kernel of ``names`` (``resolve_kernels``), each image built
    first when missing (``image_for``: a tree's build takes minutes the first time), each
    run with its own bundle under ``out_dir``. A kernel named ``patched`` is expected NOT
    MET (the scenario shows the bug; the patch fixes it), every other one MET."""
    pairs = resolve_kernels(scn, names, series)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    top = out_dir or RUNS_DIR / f"repro-{re.sub(r'[^A-Za-z0-9_.-]+', '-', scn.path.stem)}-{stamp}"
    images = []
    for name, sel in pairs:                 # every image first: a bad one stops before a run
        progress(f"repro: the {name} kernel ({sel})")
        images.append(image_for(sel, qemu=qemu, progress=progress))
    runs = []
    for (name, sel), img in zip(pairs, images):
        progress(f"repro: {name}: {img.version} ({img.dir.name})")
        res = run(scn, out_dir=top / re.sub(r"[^A-Za-z0-9_.-]+", "-", name), qemu=qemu,
                  progress=progress, image=img)
        runs.append(KernelRepro(name, sel, img, res, expect_met=name != "patched"))
    return runs


def probe_sections(obs: Observed) -> list[str]:
    """summary.md's "Probes on SIDE" sections: each probe accepted (and how) or refused."""
    lines: list[str] = []
    for side, outs in obs.outcomes.items():
        lines += ["", f"## Probes on {side}", ""]
        lines += [f"- {o.probe}: " + ("accepted" + (f" [{o.mode}]" if o.mode else "") if o.accepted else
                  f"refused {_errno.errorcode.get(o.errno, o.errno)} ({o.message})") for o in outs]
    return lines


def _write_bundle(d: Path, scn: Scenario, r: _Run, met: bool, reasons: list[str], cause: str,
                  host_list: str, manifest: dict[str, Any]) -> None:
    obs = r.obs
    (d / "console.log").write_text(obs.console)
    (d / "registers.txt").write_text(getattr(r, "regs_text", "(no crash or hang: not collected)\n"))
    (d / "registers.json").write_text(json.dumps(
        {f"vcpu{th - 1}": regs for th, regs in getattr(r, "regs", {}).items()}, indent=1))
    (d / "stack.txt").write_text(obs.stack or "(no crash or hang: not collected)\n")
    (d / "kprobes_list.txt").write_text("\n".join(r.lists) or "(guest did not answer)\n")
    (d / "host_probes.txt").write_text(host_list or "(no host-side probes)\n")
    (d / "hits.json").write_text(json.dumps(
        {side: [dataclasses.asdict(h) for h in hits] for side, hits in obs.hits.items()}, indent=1))
    shutil.copy(scn.path, d / "scenario.toml")
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    lines = [f"# {scn.name}", "", scn.description.strip(), "",
             f"**Verdict: {'MET' if met else 'NOT MET'}** (expected `{scn.expect.outcome}`, "
             f"observed `{obs.outcome}`)", "", f"**Cause:** {cause}", "", "## Checks", ""]
    lines += [f"- {x}" for x in reasons]
    if obs.oops:
        lines += ["", "## Console (Oops/BUG/WARNING/panic lines)", "", "```"] + obs.oops[:20] + ["```"]
    if obs.stack:
        lines += ["", "## Stack (first vCPU lines)", "", "```"] + obs.stack.splitlines()[:30] + ["```"]
    lines += probe_sections(obs)
    lines += ["", "Files: console.log, registers.txt, stack.txt, kprobes_list.txt, host_probes.txt, "
              "hits.json, scenario.toml, manifest.json", ""]
    (d / "summary.md").write_text("\n".join(lines))


def _why(o: Any) -> str:
    """The kernel's error_log text, and the side's own reason when it says more."""
    if o.reason and o.reason != o.message:
        return f"{o.message}: {o.reason}" if o.message else o.reason
    return o.message
