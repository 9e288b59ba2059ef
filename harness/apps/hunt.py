"""``kph hunt``: run what the harness has against one kernel, told nothing about where a
bug might be, and report each finding once.

Six phases share one time budget (:class:`Budget`), each ending at its share of it
(time a phase leaves unused goes to the next):

1. **selftests**: the booted kernel's own ftrace selftest cases
   (:mod:`harness.apps.selftests` for 6.1, :mod:`harness.apps.selftests_newer` for 6.12 and
   7.3: accepted lines with their workloads, alternating with the lines that kernel refuses
   while parsing), each judged host against guest by the fuzzer's oracle
   (:class:`harness.apps.fuzz.Oracle`: the same parse, registration, events, left-behind
   and kernel-report checks);
2. **scenarios**: the generic ``probes/scenarios/*.toml`` (not ``upstream/``, whose
   expectations are known bugs; none with a ``[kernels]`` table), each through ``kph
   repro``'s runner on this image: a scenario NOT MET is a finding;
3. **kprobes**: kprobes registered as a kernel module registers them (``kph diff --guest
   module --raw-kprobes``: ``register_kprobe()`` alone, without ``trace_kprobe``'s checks)
   at the entry of text symbols drawn from all of vmlinux's (seeded), registrations
   only: what ``register_kprobe()`` refuses and with which errno (the blacklist, text
   ranges, reserved sites, CFI preambles, instruction boundaries) against the host's
   model of it;
4. **insns**: kprobes on the instructions of the functions the workload calls (the
   fuzzer's symbol pool, in a seeded order), each with a post_handler (``kph diff --guest
   module --post-handler``): where the kernel handed each post_handler (after emulating a
   Jcc, jmp or call, or single-stepping anything else out of line) against where the
   instruction goes (:func:`harness.kernel.emulate.next_ip`), with every other check of a
   run. The kernel itself says where the instructions are (the module registers a kprobe
   at every byte, ``ModuleBackend.instructions``); the branches go first;
5. **writers**: on a second machine with two CPUs, lines the host refuses with a logged
   error, each refused alike alone, then written by four writers at once
   (:func:`harness.apps.fuzz.concurrent_writers`, ``kph diff --refusals --writers``):
   every ``error_log`` entry must be one line's own;
6. **fuzz**: :func:`harness.apps.fuzz.run` in seeded rounds, over every probe kind the
   series has, until the budget ends.

The kernel-side oracles are in every run (a splat is a ``kernel`` finding, a hang a
``hang`` one). A finding is kept at its fewest lines (the fuzzer's findings are shrunk by
Hypothesis; a selftest case's lines are dropped one at a time while the same finding
stays), with the command that shows it again. Findings are one per :attr:`Finding.key`
(kind, probe kind, field or verdict). One that looks like a finding docs/upstream.md
reports for Debian's kernels (:data:`KNOWN`, matched by what it looks like) is listed as
known and does not count.
"""
from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..diff.ktap import Case
from ..backends.module import ModuleBackend
from ..errors import HarnessError, ProbeSpecError, SetupError
from ..kernel.grammar import parse
from ..kernel.emulate import next_ip
from ..machine.image.kbuild import missing_options
from ..vmctl import Machine
from . import fuzz, fuzzdraw, selftests, selftests_newer
from .scenario import load
from .selftests import fill

#: Each phase's share of the budget, in order; a phase ends at the sum of the shares so
#: far (the last at the budget's end).
SHARES: tuple[tuple[str, float], ...] = (("selftests", 0.33), ("scenarios", 0.18),
                                          ("kprobes", 0.04), ("insns", 0.12),
                                          ("writers", 0.03), ("fuzz", 0.30))
PHASES = tuple(p for p, _ in SHARES)
SCENARIOS = Path(__file__).resolve().parents[2] / "probes" / "scenarios"
#: the options a kernel needs for a hunt (its config, as the image keeps it)
NEEDS = {"CONFIG_KPROBES": "the guest's kprobes", "CONFIG_KPROBE_EVENTS": "kprobe_events",
         "CONFIG_FTRACE": "tracefs"}
FUZZ_ROUND = 25
#: the insns phase: kprobes per run, and the bytes of a function swept for instructions
INSN_PROBES, INSN_SWEEP = 16, 1024
#: the insns phase leaves out functions the workload's tracer pass saw called more often
INSN_MAX_CALLS = 40
#: the kprobes phase: raw kprobes registered a run
RAW_PROBES = 16
#: the writers phase: its machine's CPUs, writers at once, refused lines a run
WRITER_CPUS, WRITERS, WRITER_LINES = 2, 4, 4
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
#: a scenario's run may go this far past its phase's end before it is ended
SCENARIO_GRACE = 60.0

#: the kinds of finding that are a comparison of the two sides (the others are the kernel's
#: own reports, hangs and crashes)
COMPARISONS = ("parse", "registration", "events")
#: exit statuses (harness.cli.output's)
EXIT_OK, EXIT_DIVERGED, EXIT_KERNEL, EXIT_HANG = 0, 1, 5, 6


@dataclass(frozen=True)
class Known:
    """A kernel finding the harness already reported (docs/upstream.md), as it looks when a
    hunt meets it: the finding's kinds and a pattern its detail or lines match."""

    title: str
    where: str
    kinds: tuple[str, ...]
    detail: str = ""
    lines: str = ""
    unless: str = ""     # a detail that matches this is another finding

    def matches(self, f: "Finding") -> bool:
        if f.kind not in self.kinds:
            return False
        if self.detail and not re.search(self.detail, f.detail):
            return False
        if self.unless and re.search(self.unless, f.detail):
            return False
        return not self.lines or any(re.search(self.lines, ln) for ln in f.lines)


#: docs/upstream.md's findings, by their signature (the host side mirrors Debian's
#: kernels, so on them these agree; a kernel that changes one diverges there)
KNOWN: tuple[Known, ...] = (
    Known("btf_type_is_char_ptr() takes a non-pointer's size for a type id",
          "docs/upstream.md#1", ("parse", "registration", "events"),
          # the refusal alone: on Debian's kernels both sides accept the line and print
          # (fault), so a (fault) against a string is another bug (the recall run's
          # eprobe reading a pointer's low byte was taken for this one, 2026-11-29)
          detail=r"does not fit for string", lines=r":u?string\b"),
    # both sides refuse, with other errnos: a kernel that accepts the line is another bug
    Known("a symbol that matches several is refused with EINVAL, not EADDRNOTAVAIL",
          "docs/upstream.md#2", ("parse", "registration"), detail=r"symbol is not unique",
          unless=r"\baccept(s|ed)\b"),
    Known("a second return probe on one call prints [unknown/kretprobe'd]",
          "docs/upstream.md#3", ("events",), detail=r"unknown/kretprobe'd"),
)


@dataclass
class Finding:
    """One finding of the hunt, at its fewest lines."""

    phase: str
    kind: str            # parse, registration, events, crash, timeout, kernel, hang, scenario
    probe_kind: str      # kprobe, kretprobe, uprobe, uretprobe, fprobe, tprobe, eprobe, dynevent
    what: str            # the field that diverged, or the kernel's verdict
    lines: tuple[str, ...]
    detail: str
    reproduce: str
    source: str = ""     # the selftest file, the scenario, "fuzz"
    known: str = ""      # the KNOWN entry it matches ("" for a new one)
    #: run again with the same lines, the sides agreed (or differed otherwise): the
    #: guest's execution was not the same twice (a value read at two instants that another
    #: context changed in between), so no reproducer shows it
    flaky: bool = False

    @property
    def unconfirmed(self) -> bool:
        """A comparison that did not repeat: listed, not counted as a finding (a kernel
        report, a hang or a crash counts however often it repeats)."""
        return self.flaky and self.kind in COMPARISONS

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.probe_kind, self.what)

    @property
    def status(self) -> int:
        return EXIT_KERNEL if self.kind == "kernel" else EXIT_HANG if self.kind == "hang" \
            else EXIT_DIVERGED

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lines": list(self.lines),
                "new": not self.known and not self.unconfirmed,
                "unconfirmed": self.unconfirmed}


def check_image(img: Any) -> None:
    """The image's kernel has what a hunt needs (:data:`NEEDS`, from the config the image
    keeps); else a SetupError naming each option."""
    cfg = Path(img.dir) / "config"
    if not cfg.is_file():
        return              # an image made without its config: the boot will tell
    gone = missing_options(cfg.read_text(errors="replace"), {k: "y" for k in NEEDS})
    if gone:
        raise SetupError(f"{img.version} cannot be hunted: " + "; ".join(
            f"{k} is not set (y) ({NEEDS[k]})" for k in gone),
            "build a kernel with them (images/kernel.config has them)")


def probe_kind(lines: Iterable[str]) -> str:
    """The kind of probe a finding's lines define (the first that is no ``-:`` line)."""
    for ln in lines:
        toks = ln.split()
        if not toks or ln.startswith("-"):
            continue
        head, place = toks[0], toks[1] if len(toks) > 1 else ""
        ret = head[0] == "r" or place.endswith("%return")
        if "/" in place and ":" in place and head[0] in "pr":
            return "uretprobe" if ret else "uprobe"
        return {"p": "kretprobe" if ret else "kprobe", "r": "kretprobe", "f": "fprobe",
                "t": "tprobe", "e": "eprobe"}.get(head[0], "other")
    return "dynevent"


def what_of(f: fuzz.Finding) -> str:
    """The field or verdict of a fuzzer finding's signature (``events:arg:...:x``, ``kernel:
    KERNEL-WARNING:...``, ``parse:MSG|MSG|False``): what makes two findings one class."""
    kind, _, rest = f.signature.partition(":")
    if f.kind == "parse":
        return "host-refuses" if rest.startswith("host-refuses") else "error_log"
    if f.kind in ("events", "registration"):
        field_ = rest.rsplit(":", 1)[0] if "|" in rest.rsplit(":", 1)[-1] else rest
        # an argument by its type (its name and fetch are the example's, not the class)
        return "arg:" + field_.rsplit(":", 1)[-1] if field_.startswith("arg:") else field_
    return rest.split(":", 1)[0] or f.kind


def known_of(f: Finding, table: Iterable[Known] = KNOWN) -> str:
    for k in table:
        if k.matches(f):
            return f"{k.title} ({k.where})"
    return ""


@dataclass
class Budget:
    """``seconds`` from ``start``, split across :data:`SHARES`."""

    seconds: float
    start: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise SetupError(f"a budget of {self.seconds / 60:g} minute(s) runs nothing",
                             "give --minutes more than 0, e.g. --minutes 10")

    def phase_end(self, phase: str) -> float:
        """When ``phase`` must stop: its cumulative share of the budget."""
        acc = 0.0
        for p, share in SHARES:
            acc += share
            if p == phase:
                return self.start + self.seconds * (1.0 if p == SHARES[-1][0] else acc)
        raise KeyError(phase)

    def left(self, phase: str) -> float:
        return max(0.0, self.phase_end(phase) - self.clock())

    def over(self, phase: str) -> bool:
        return self.left(phase) <= 0


@dataclass
class Findings:
    """The hunt's findings, one per key; the first seen of a key is kept."""

    items: list[Finding] = field(default_factory=list)
    repeats: int = 0

    def add(self, f: Finding) -> bool:
        """Keep ``f`` unless its key is there; True when kept."""
        if any(g.key == f.key for g in self.items):
            self.repeats += 1
            return False
        f.known = f.known or known_of(f)
        self.items.append(f)
        return True

    def seen(self, key: tuple[str, str, str]) -> bool:
        return any(g.key == key for g in self.items)

    @property
    def new(self) -> list[Finding]:
        return [f for f in self.items if not f.known and not f.unconfirmed]

    @property
    def unconfirmed(self) -> list[Finding]:
        return [f for f in self.items if not f.known and f.unconfirmed]

    @property
    def status(self) -> int:
        """The exit status: 5 when a new finding is a kernel report, else 6 for a hang,
        else 1 for any other new finding, 0 when nothing new was found."""
        got = {f.status for f in self.new}
        for s in (EXIT_KERNEL, EXIT_HANG, EXIT_DIVERGED):
            if s in got:
                return s
        return EXIT_OK


@dataclass
class HuntResult:
    image: str
    kernel: str
    seconds: float
    findings: Findings
    counts: dict[str, dict[str, int]]
    stopped_early: bool = False      # --stop-at-first ended it at a new finding

    def as_dict(self) -> dict[str, Any]:
        return {"image": self.image, "kernel": self.kernel, "seconds": round(self.seconds, 1),
                "status": self.findings.status, "counts": self.counts,
                "stopped_early": self.stopped_early,
                "findings": [f.as_dict() for f in self.findings.items],
                "new": len(self.findings.new),
                "unconfirmed": len(self.findings.unconfirmed),
                "known": len(self.findings.items) - len(self.findings.new)
                - len(self.findings.unconfirmed)}


# -- the selftest cases -----------------------------------------------------------------

def selftest_items(series: str) -> list[tuple[str, tuple[str, ...], str, str]]:
    """(source, lines, workload, guest) of the series' own selftest cases: accepted lines
    (or refused at registration) and the lines it refuses while parsing, one of each
    kind in turn (kprobe and uprobe, fprobe and tprobe, eprobe cases, then their
    refusals), so that a short budget reaches every probe kind the series has."""
    if series in selftests_newer.CASES:
        s, n = series, selftests_newer
        cases = [n.CASES[s], n.FPROBE_CASES[s], n.EPROBE_CASES[s]]
        parse = [n.PARSE[s], n.FPARSE[s], n.EPARSE[s]]
    else:
        cases, parse = [selftests.CASES], [selftests.PARSE]
    groups = [[(c.source, c.specs, c.workload, c.guest) for c in g] for g in cases] + \
        [[(src, (ln.replace("^", "", 1),), "true", "events") for src, ln in g] for g in parse]
    out = []
    for i in range(max(len(g) for g in groups)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def shrink_lines(lines: tuple[str, ...], same: Callable[[tuple[str, ...]], bool],
                 deadline: float, clock: Callable[[], float] = time.monotonic) -> tuple[str, ...]:
    """``lines`` with every line dropped whose absence keeps the finding (``same``), one at
    a time from the last, while ``deadline`` allows."""
    cur = tuple(lines)
    i = len(cur) - 1
    while i >= 0 and len(cur) > 1 and clock() < deadline:
        cand = cur[:i] + cur[i + 1:]
        if same(cand):
            cur = cand
        i -= 1
    return cur


# -- the run ----------------------------------------------------------------------------

class Hunt:
    """One hunt on one image (see the module docstring)."""

    stop_at_first = False    # end at the first new finding (a known one does not stop it)
    stopped = False

    def __init__(self, img: Any, *, minutes: float, seed: int = 0, image_arg: str | None = None,
                 max_cases: int | None = None, progress: Callable[[str], None] = lambda s: None,
                 out_dir: Path | None = None, scenarios: Path = SCENARIOS,
                 stop_at_first: bool = False) -> None:
        self.img, self.seed, self.image_arg = img, seed, image_arg
        self.stop_at_first = stop_at_first
        self.budget = Budget(minutes * 60.0)
        self.max_cases = max_cases
        self.say = progress
        self.out_dir = out_dir or Path(f"kph-runs/hunt-{time.strftime('%Y%m%d-%H%M%S')}")
        self.scenarios = scenarios
        self.findings = Findings()
        self.counts: dict[str, dict[str, int]] = {p: {"run": 0, "agreed": 0, "findings": 0,
                                                      "not_run": 0, "unjudged": 0}
                                                  for p in PHASES}
        self.vm: Any = None

    # machines
    def _boot(self) -> Any:
        return Machine.boot(self.img)

    def _fresh(self) -> None:
        try:
            if self.vm is not None:
                self.vm.close()
        except HarnessError:
            pass
        self.vm = self._boot()

    def _room(self, phase: str, n: int) -> bool:
        """Another case of ``phase``: within its time and ``max_cases``. Every phase runs
        one case at least, when earlier phases overran too; none once a hunt told to stop
        at its first new finding has one."""
        if self.stopped:
            return False
        return (n == 0 or not self.budget.over(phase)) and \
            (self.max_cases is None or n < self.max_cases)

    def _add(self, f: Finding) -> None:
        self.counts[f.phase]["findings"] += 1
        if self.findings.add(f):
            tag = f"known: {f.known}" if f.known else \
                "did not repeat: not counted" if f.unconfirmed else "NEW"
            self.say(f"hunt: {f.phase}: finding ({f.kind}, {f.probe_kind}, {f.what}) [{tag}]: "
                     f"{f.lines[0][:100] if f.lines else f.source}")
            if self.stop_at_first and not f.known and not f.unconfirmed and not self.stopped:
                self.stopped = True
                self.say("hunt: stopping at the first new finding (--stop-at-first)")

    def _repro(self, lines: tuple[str, ...], workload: str, guest: str, kind: str = "",
               post: bool = False, raw: bool = False) -> str:
        return fuzz.repro_line(fuzz.Finding(lines, kind, "", ""), image=self.image_arg,
                               guest=guest, workload=workload, post_handler=post,
                               raw_kprobes=raw)

    def run(self) -> HuntResult:
        t0 = time.monotonic()
        self.say(f"hunt: {self.img.version}: {self.budget.seconds / 60:g} min; phases "
                 + ", ".join(f"{p} until {self.budget.phase_end(p) - self.budget.start:.0f} s"
                             for p in PHASES))
        try:
            self.vm = self._boot()
            self.selftests()
            self.scenario_phase()
            self.kprobe_phase()
            self.insn_phase()
            self.writers_phase()
            self.fuzz_phase()
        finally:
            if self.vm is not None:
                try:
                    self.vm.close()
                except HarnessError:
                    pass
        return HuntResult(str(self.img.dir), self.img.version, time.monotonic() - t0,
                          self.findings, self.counts, stopped_early=self.stopped)

    # phase 1
    def selftests(self) -> None:
        items = selftest_items(self.img.facts.series)
        c = self.counts["selftests"]
        oracles: dict[str, fuzz.Oracle] = {}
        self.say(f"hunt: selftests: {len(items)} case(s) of {self.img.facts.series}'s own "
                 "selftests")
        for source, raw, workload, guest in items:
            if not self._room("selftests", c["run"]):
                break
            try:
                lines = tuple(fill(s, self.vm) for s in raw)
                work = fill(workload, self.vm)
            except (HarnessError, StopIteration, LookupError, IndexError) as exc:
                c["not_run"] += 1               # a placeholder this kernel cannot fill
                self.say(f"hunt: selftests: {source}: not run ({exc})")
                continue
            o = oracles.get(guest)
            if o is None or o.vm is not self.vm:
                o = oracles[guest] = fuzz.Oracle(self.vm, guest=guest, workload=work)
            o.workload = work
            c["run"] += 1
            if c["run"] % 10 == 0:
                self.say(f"hunt: selftests: {c['run']} of {len(items)}, "
                         f"{len(self.findings.items)} finding(s), "
                         f"{self.budget.left('selftests'):.0f} s left")
            got = o.judge(lines)
            if got is None:
                self._none(o, c, "selftests")
                continue
            self._judged(got, lines, work, guest, source, o, "selftests")

    def _none(self, o: fuzz.Oracle, c: dict[str, int], phase: str) -> None:
        """A run the oracle judged None: agreed, or not compared (``o.unjudged``: a
        construct not mirrored, a guest the host's probes slowed past the timeout), which
        is counted as not run, never as agreed."""
        if o.unjudged is None:
            c["agreed"] += 1
            return
        c["not_run"] += 1
        if o.unjudged.startswith("slowed"):
            self.say(f"hunt: {phase}: not compared: {o.unjudged.split(': ', 1)[1][:240]}")

    def _judged(self, got: fuzz.Finding, lines: tuple[str, ...], work: str, guest: str,
                source: str, o: fuzz.Oracle, phase: str) -> None:
        post, raw = o.post_handler, o.raw_kprobes
        f = self._finding(got, lines, work, guest, source, phase, post, raw)
        if got.kind in ("kernel", "hang", "crash", "timeout"):
            self._fresh()
            o.vm = self.vm
        elif not self.findings.seen(f.key) and len(lines) > 1:
            def same(cand: tuple[str, ...]) -> bool:
                g = o.judge(cand)
                return g is not None and \
                    self._finding(g, cand, work, guest, source, phase, post, raw).key == f.key
            short = shrink_lines(lines, same, self.budget.phase_end(phase))
            f.lines, f.reproduce = short, self._repro(short, work, guest, got.kind, post, raw)
        if got.kind in COMPARISONS and not self.findings.seen(f.key):
            # a comparison counts where it repeats: the same lines once more
            again = o.judge(f.lines)
            f.flaky = again is None or \
                self._finding(again, f.lines, work, guest, source, phase, post, raw).key != f.key
        self._add(f)

    def _finding(self, got: fuzz.Finding, lines: tuple[str, ...], work: str, guest: str,
                 source: str, phase: str, post: bool = False, raw: bool = False) -> Finding:
        return Finding(phase, got.kind, probe_kind(lines), what_of(got), tuple(lines),
                       got.detail, self._repro(tuple(lines), work, guest, got.kind, post, raw),
                       source)

    # phase 2
    def scenario_files(self) -> list[Path]:
        """The generic scenarios: not upstream/'s, none that names kernels and fixes."""
        out = []
        for p in sorted(self.scenarios.glob("*.toml")):
            try:
                if not load(p).kernels:
                    out.append(p)
            except HarnessError:
                continue
        return out

    def scenario_phase(self) -> None:
        c = self.counts["scenarios"]
        files = self.scenario_files()
        self.say(f"hunt: scenarios: {len(files)} scenario(s)")
        longest = 0.0
        for i, p in enumerate(files):
            # one more only when the longest so far would fit in what is left
            if not self._room("scenarios", c["run"]) or \
                    (c["run"] and self.budget.left("scenarios") < longest):
                c["not_run"] += len(files) - i
                break
            scn = load(p)
            self.say(f"hunt: scenarios: {p.name}")
            t0 = time.monotonic()
            cmd = f"kph repro {shlex.quote(str(p))}" + (
                f" --kernels {shlex.quote(self.image_arg)}" if self.image_arg else "")
            lines = tuple(d.spec for d in scn.probes if d.spec)
            pk = probe_kind(lines) if lines else "kprobe"
            res = self._repro_run(p, max(self.budget.left("scenarios"), 30.0) + SCENARIO_GRACE)
            longest = max(longest, time.monotonic() - t0)
            if res.get("error"):
                # a scenario this kernel cannot run as written (6.12's BTF refuses
                # $retval on a void function), or a run that did not finish: no verdict
                c["not_run"] += 1
                self.say(f"hunt: scenarios: {p.name}: not run: {res['error']}")
                continue
            c["run"] += 1
            failed = [r for r in res.get("reasons", []) if "NOT" in r]
            if res.get("met") or (failed and all(r.startswith("stack ") for r in failed)):
                # the stack is evidence the harness reads through the gdbstub (on 6.12 a
                # panicked guest's is not read): its miss alone is no finding, said so
                if not res.get("met"):
                    self.say(f"hunt: scenarios: {p.name}: met but for its stack, which "
                             f"was not read ({failed[0][:120]})")
                c["agreed"] += 1
                continue
            if res.get("result") == "kernel-finding":        # the kernel ended the run
                v = str(res.get("verdict"))
                self._add(Finding("scenarios", "hang" if v == "HANG" else "kernel", pk, v,
                                  lines, v, cmd, str(p)))
                continue
            self._add(Finding("scenarios", "scenario", pk, f"scenario:{p.stem}", lines,
                              "NOT MET: " + "; ".join(res.get("reasons", []))[:400], cmd,
                              str(p)))

    def _repro_run(self, path: Path, timeout: float) -> dict[str, Any]:
        """``kph repro PATH --kernels IMAGE --json`` in a process of its own, ended (SIGTERM:
        it ends its machines first) when it runs past ``timeout``: ``met`` and ``reasons``;
        ``result``/``verdict`` when the kernel ended it; ``error`` when it could not run."""
        cmd = [sys.executable, "-m", "harness.cli", "repro", str(path), "--kernels",
               str(self.img.dir), "--json", "--out", str(self.out_dir / f"repro-{path.stem}")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            return {"error": f"kph repro did not finish in {timeout:.0f} s (ended)"}
        try:
            doc = json.loads(out)
        except ValueError:
            lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
            said = [ln for ln in lines if "error" in ln] or lines[-1:]
            return {"error": (said[0] if said else f"kph repro exited {proc.returncode}")[:200]}
        if "kernels" in doc:
            k = doc["kernels"][0]
            return {"met": k.get("met"), "reasons": k.get("reasons", [])}
        return doc


    # phase 3
    def kprobe_phase(self) -> None:
        c = self.counts["kprobes"]
        names = raw_pool(self.vm.symbols)
        order = random.Random(self.seed).sample(names, len(names))
        self.say(f"hunt: kprobes: {len(order)} text symbol(s) of vmlinux, {RAW_PROBES} "
                 "kprobes registered as a module registers them a run (registrations only)")
        o: fuzz.Oracle | None = None
        for start in range(0, len(order), RAW_PROBES):
            if not self._room("kprobes", c["run"]):
                break
            lines = tuple(f"p:kph/k{i} {n}" for i, n in enumerate(order[start:start + RAW_PROBES]))
            if o is None or o.vm is not self.vm:
                o = fuzz.Oracle(self.vm, guest="module", workload="true", raw_kprobes=True,
                                registrations_only=True)
            c["run"] += 1
            got = o.judge(lines)
            if got is None:
                self._none(o, c, "kprobes")
                continue
            self._judged(got, lines, "true", "module", "kprobes", o, "kprobes")
        self.say(f"hunt: kprobes: {c['run']} run(s) of {RAW_PROBES}, {c['agreed']} agreed")

    # phase 4
    def insn_phase(self) -> None:
        c = self.counts["insns"]
        work = fuzz.DEFAULT_WORKLOAD
        try:
            pool = fuzz.symbol_pool(self.vm, work)
            calls, irq = fuzz.symbol_calls(self.vm, work), fuzz.symbol_irq(self.vm, work)
        except HarnessError as exc:
            self.say(f"hunt: insns: no symbol pool ({exc})")
            return
        # not what interrupts run (a timer tick's work, hit whatever the workload does:
        # with a trap at each instruction under TCG the ticks outgrow the workload), nor
        # the hottest
        order = [fn for fn in random.Random(self.seed).sample(pool, len(pool))
                 if fn not in irq and calls.get(fn, 0) <= INSN_MAX_CALLS]
        self.say(f"hunt: insns: {len(order)} function(s) the workload calls outside "
                 f"interrupts, {INSN_PROBES} kprobes with post_handlers a run")
        o: fuzz.Oracle | None = None
        for fn in order:
            if not self._room("insns", c["run"]):
                break
            sym = self.vm.symbols.get(fn)
            if sym is None or not sym.size:
                continue
            sweep = ModuleBackend(self.vm)
            try:
                try:
                    sites = sweep.instructions(sym.addr, min(sym.size, INSN_SWEEP))
                finally:
                    sweep.close()
            except HarnessError as exc:     # the guest died or hung under the sweep
                c["not_run"] += 1
                self.say(f"hunt: insns: {fn}: the instruction sweep failed ({exc}); "
                         "a fresh machine")
                self._fresh()
                continue
            lines = insn_lines(fn, sym.addr, sites, random.Random(f"{self.seed}:{fn}"))
            if not lines:
                continue
            if o is None or o.vm is not self.vm:
                o = fuzz.Oracle(self.vm, guest="module", workload=work, post_handler=True)
            c["run"] += 1
            got = o.judge(lines)
            if got is None:
                self._none(o, c, "insns")
                continue
            if got.kind == "events" and not got.signature.startswith("events:post-ip:"):
                # this phase's oracle is post-ip (and the kernel's reports, hangs, the
                # registrations); 16 probes on one function's instructions also meet
                # interleavings of task and interrupt hits the order rules do not cover
                # (an irq field flipping either way on rcu_report_qs_rdp, 7.3, not
                # repeatable): counted, shown, not a finding of this phase
                c["unjudged"] += 1
                self.say(f"hunt: insns: {fn}: not this phase's oracle, not judged: "
                         f"{got.detail.splitlines()[0][:160]}")
                continue
            self._judged(got, lines, work, "module", f"insns:{fn}", o, "insns")
        self.say(f"hunt: insns: {c['run']} function(s) run, {c['agreed']} agreed, "
                 f"{c['unjudged']} with another field's divergence (not judged here)")

    # phase 5
    def writers_phase(self) -> None:
        c = self.counts["writers"]
        try:
            pool = fuzz.symbol_pool(self.vm, fuzz.DEFAULT_WORKLOAD)
        except HarnessError as exc:
            self.say(f"hunt: writers: no symbol pool ({exc})")
            return
        rules = self.img.facts.rules
        drawn = [ln for (ln,) in fuzzdraw.list_examples(pool, examples=400, seed=self.seed,
                                                         rules=rules, mix="defects")]
        try:
            vm = Machine.boot(self.img, smp=WRITER_CPUS)
        except HarnessError as exc:
            c["not_run"] += 1
            self.say(f"hunt: writers: no {WRITER_CPUS}-CPU machine ({exc})")
            return
        cpus = vm.run("nproc", timeout=30).stdout.strip()
        # the phase says how many it got: a kernel that brings up one only runs the writers
        # interleaved where one sleeps
        self.say(f"hunt: writers: refused lines from {WRITERS} writers at once on "
                 f"{cpus} CPU(s) of {WRITER_CPUS}, {WRITER_LINES} lines a run")
        try:
            o = fuzz.Oracle(vm, guest="events", workload="true")
            start = 0
            while self._room("writers", c["run"]) and start < len(drawn):
                # lines the host refuses with a logged error, each refused alike alone
                lines: list[str] = []
                while len(lines) < WRITER_LINES and start < len(drawn):
                    ln, start = drawn[start], start + 1
                    if ln.lstrip().startswith("-") or not refused_logged(ln, o):
                        continue
                    if o.judge((ln,)) is None:
                        lines.append(ln)
                if not lines:
                    break
                c["run"] += 1
                got = fuzz.concurrent_writers(vm, tuple(lines), WRITERS)
                if got is None:
                    c["agreed"] += 1
                    continue
                f = Finding("writers", got.kind, probe_kind(lines), what_of(got), tuple(lines),
                            got.detail, self._writers_repro(tuple(lines)), "writers")
                self._add(f)
                if got.kind in ("kernel", "hang"):
                    break
        finally:
            try:
                vm.close()
            except HarnessError:
                pass
        self.say(f"hunt: writers: {c['run']} run(s), {c['agreed']} agreed")

    def _writers_repro(self, lines: tuple[str, ...]) -> str:
        return ("kph diff --refusals" + (f" --image {self.image_arg}" if self.image_arg else "")
                + f" --smp {WRITER_CPUS} --writers {WRITERS} --run true -- "
                + " ".join(shlex.quote(ln) for ln in lines))

    # phase 6
    def fuzz_phase(self) -> None:
        c = self.counts["fuzz"]
        rnd = 0
        while self._room("fuzz", c["run"]):
            left = max(self.budget.left("fuzz"), 1.0)       # one example at least
            n = FUZZ_ROUND if self.max_cases is None else min(FUZZ_ROUND, self.max_cases - c["run"])
            if rnd == 0:
                self.say(f"hunt: fuzz: rounds of {n} example(s), {left:.0f} s left")
            # every other round draws defects only: refusals are judged by one write
            # each, so a wrong acceptance or a wrong error_log entry is met far sooner
            mix = fuzzdraw.MIXES[rnd % 2]
            guest = "events"
            st = fuzz.run(self.vm, examples=n * (4 if mix == "defects" and self.max_cases is None else 1),
                          seed=self.seed * 1000 + rnd, time_budget=left, database=False,
                          reboot=self._boot, workload=fuzz.DEFAULT_WORKLOAD, mix=mix,
                          guest=guest)
            self.vm = st.vm
            rnd += 1
            c["run"] += st.examples
            c["agreed"] += st.agreed_runs + st.agreed_refusals
            c["not_run"] += st.not_mirrored + st.slowed
            for g in st.findings:
                f = self._finding(g, g.lines, fuzz.DEFAULT_WORKLOAD, guest, "fuzz", "fuzz")
                f.flaky = g.flaky       # Hypothesis replayed it and the verdict changed
                self._add(f)
            self.say(f"hunt: fuzz: {c['run']} example(s), {len(self.findings.items)} "
                     f"finding(s), {self.budget.left('fuzz'):.0f} s left")
            if st.examples == 0:
                break


def refused_logged(line: str, o: fuzz.Oracle) -> bool:
    """The host's parser (the booted kernel's grammar) refuses ``line`` with an
    ``error_log`` entry."""
    try:
        parse(o.kernel_form(line), uprobe_symbols=False, **o.parse_kw)
    except ProbeSpecError as exc:
        return exc.logged
    except HarnessError:
        return False
    return False


def raw_pool(symbols: Any) -> list[str]:
    """The kprobes phase's draw: vmlinux's text symbols (``t``/``T``, no module's) whose
    name is unique and plain, by name: each one a ``register_kprobe()`` at its entry."""
    seen: dict[str, int] = {}
    for sym in symbols:
        if sym.module is None and sym.is_text and _PLAIN_NAME.match(sym.name):
            seen[sym.name] = seen.get(sym.name, 0) + 1
    return sorted(n for n, k in seen.items() if k == 1)


def insn_lines(fn: str, addr: int, sites: list[tuple[int, bytes]], rnd: random.Random,
               n: int = INSN_PROBES) -> tuple[str, ...]:
    """Up to ``n`` probe lines on the instructions ``sites`` (offset, bytes) of ``fn``:
    its branches first (what x86 kprobes emulate: Jcc, jmp, call; arch/x86/kernel/kprobes/
    core.c: prepare_emulation()), then other instructions whose next address the bytes
    tell, drawn with ``rnd``; in address order."""
    told = [(off, next_ip(code, addr + off, 0)) for off, code in sites]
    branches = [off for off, k in told if k is not None and k[0] != "insn"]
    straight = [off for off, k in told if k is not None and k[0] == "insn"]
    pick = rnd.sample(branches, min(n, len(branches)))
    pick += rnd.sample(straight, min(n - len(pick), len(straight)))
    return tuple(f"p:kph/i{off:x} {fn}+{off:#x}" for off in sorted(pick))


def report_lines(res: HuntResult) -> Iterator[str]:
    """The text report: a summary line, then each finding once (new ones first)."""
    fs = res.findings
    runs = "; ".join(f"{p} {c['run']} run, {c['agreed']} agreed" for p, c in res.counts.items())
    yield (f"kph hunt: {res.kernel}: {res.seconds:.0f} s; {runs}; "
           f"{len(fs.new)} new finding(s), {len(fs.items) - len(fs.new) - len(fs.unconfirmed)} "
           f"known" + (f", {len(fs.unconfirmed)} that did not repeat (not counted)"
                       if fs.unconfirmed else "")
           + ("; stopped at the first new finding (--stop-at-first)" if res.stopped_early else ""))
    for f in sorted(fs.items, key=lambda f: (bool(f.known), f.unconfirmed)):
        tag = f"known: {f.known}" if f.known else \
            "did not repeat: not counted" if f.unconfirmed else "NEW"
        yield f"- [{tag}] {f.kind} / {f.probe_kind} / {f.what} ({f.phase}: {f.source})"
        yield f"  {f.detail.splitlines()[0][:300] if f.detail else ''}"
        for ln in f.lines:
            yield f"  line: {ln}"
        yield f"  {f.reproduce}"


def ktap_cases(res: HuntResult) -> list[Any]:
    """One test per phase (its runs), then one per finding: failing when new, ``xfail``
    when known (KCIDB: an issue)."""
    k = res.kernel
    cases = [Case(f"phase-{p}", "pass", f"{c['run']} run, {c['agreed']} agreed", kernel=k)
             for p, c in res.counts.items()]
    for i, f in enumerate(res.findings.items, 1):
        cases.append(Case(f"finding-{i}-{f.kind}-{f.probe_kind}",
                          "xfail" if f.known else "skip" if f.unconfirmed else "fail",
                          f.known or ("did not repeat" if f.unconfirmed else ""),
                          kernel=k, issue=f.known,
                          diagnostics=[(f.detail.splitlines() or ["finding"])[0][:200],
                                       *(f"line: {ln}" for ln in f.lines), f.reproduce]))
    return cases
