"""``kph fuzz``: probe definitions generated from the grammar, host against guest, every
divergence shrunk to one line.

The kernel is the oracle. Each example is one or two ``kprobe_events`` lines drawn by
Hypothesis (``harness.apps.fuzzdraw``) from the grammar data the harness mirrors (registers, fetch
types, limits, the kernel's own function names) plus deliberate mistakes. The example is
judged on one booted guest (``Oracle``):

- a line the host's parser refuses is written to the guest's ``kprobe_events`` as is; the
  guest must refuse it too, with the same ``error_log`` message and caret column;
- lines the host parses go through ``harness.diff.runner.run_differential`` (both worlds on one
  execution of the workload) and ``harness.diff.verdict.compare``: the same registration verdict,
  errno and message, and the same events, with the normalizations ``kph diff`` documents
  and no new ones;
- a traceback or a hang (each example has a timeout) is a finding too.

A divergence makes the example fail; Hypothesis shrinks it to a minimal definition, the run
records it (``Finding``: a ``kph diff`` one-liner and a regression line) and goes on with
its class (``Finding.signature``) known, until the budget is spent. The example database
lives in the cache (``$KPH_CACHE/fuzz/db``), so a failure found once is tried first next
time. The same seed draws the same examples (``fuzzdraw.list_examples``).

The symbol pool comes from the functions the workload really calls: one in-guest
function-tracer pass per image and workload, cached (``symbol_pool``), so most examples
record hits.
"""
from __future__ import annotations

import errno as _errno_mod
import hashlib
import json
import logging
import re
import shlex
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import constants as C
from ..errors import (GuestAgentError, HarnessError, HostSlowedError, NotMirroredError,
                      ProbeSpecError, SetupError, VMError)
from ..kernel.grammar import parse
from ..diff.runner import resolve_uprobes, run_differential, trampoline_text
from ..diff.verdict import compare
from ..diff.report import findings_text
from ..kernel.splat import KernelFinding, during, headline
from ..machine.kwatch import KernelWatch
from ..backends.events import try_lines
from ..kernel.dynevent import events_file_of
from ..backends.tracelayer import TraceLayer
from .fuzzdraw import UPROBE_PLACES, grammar_only, strategies
from ..vmctl import Machine

log = logging.getLogger(__name__)

#: A workload with opens, reads, forks, execs and sleeps: most kernel paths a probe on a
#: called function would see.
DEFAULT_WORKLOAD = ("cat /proc/version > /dev/null; head -c 20 /proc/cpuinfo > /dev/null; "
                    "sh -c 'true & wait'; /usr/bin/kph-loop 2 kph > /dev/null")
EXAMPLE_TIMEOUT = 30.0
#: uprobe places the strategies draw (PATH:SYMBOL of the image's test programs)
MAX_POOL = 400
#: An engine whose every hit stops the guest (gdbstub: ~1.3-3.5 ms a stop) draws on no
#: function the tracer pass saw called more often than this in the workload: one example
#: on a function called 2,043 times (PageHeadHuge on 6.1) took 8-15 s against ~0.3 s.
#: 18 of 6.1's 400 pool functions; the plugin engine, whose hits cost ~1 us, keeps them.
MAX_STOP_CALLS = 300
#: Names that are not functions, or not probeable: the misses a pool must also hold.
MISSES = ("no_such_function_kph", "init_task", "linux_proc_banner", "kprobe_int3_handler",
          "do_int3", "asm_exc_int3")


#: Known differences the harness does not mirror, as signature patterns, each with its
#: reason (docs: kph fuzz, "Findings"); an example that only shows one is not a finding.
KNOWN: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Finding:
    """One class of divergence, at its shrunk example."""

    lines: tuple[str, ...]
    kind: str                    # parse, registration, events, crash, timeout, kernel, hang
    detail: str
    signature: str
    repro: str = ""
    #: Hypothesis replayed the example and the verdict changed (the guest's execution is
    #: not the same twice): reported, but no regression case the suite could replay
    flaky: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FuzzStats:
    examples: int = 0
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    agreed_refusals: int = 0
    agreed_runs: int = 0
    #: examples with a construct the host engine or the guest side does not mirror
    not_mirrored: int = 0
    #: each reason, as the refusal's first line says it, and how many examples had it
    not_mirrored_why: dict[str, int] = field(default_factory=dict)
    #: examples not compared: the host's probes slowed the guest past the timeout
    #: (``harness.errors.HostSlowedError``); neither agreed nor a finding
    slowed: int = 0
    events: int = 0
    known: dict[str, int] = field(default_factory=dict)
    #: The machine the run ended on (a reboot replaces the first).
    vm: Machine = None

    @property
    def per_minute(self) -> float:
        return 60.0 * self.examples / self.seconds if self.seconds else 0.0


# -- the symbol pool --------------------------------------------------------------------

def symbol_pool(vm: Machine, workload: str) -> list[str]:
    """Functions ``workload`` calls on this image, probeable by the kernel's rules
    (cached per image and workload): an in-guest function-tracer pass."""
    return list(_traced(vm, workload)["pool"])


def drawing_pool(vm: Machine, workload: str, host: str) -> list[str]:
    """The functions examples are drawn on for host engine ``host``: :func:`symbol_pool`,
    less those called more than :data:`MAX_STOP_CALLS` times for an engine whose hits
    stop the guest (all of them if that would leave none)."""
    pool = symbol_pool(vm, workload)
    if host != "gdbstub":
        return pool
    calls = symbol_calls(vm, workload)
    return [fn for fn in pool if calls.get(fn, 0) <= MAX_STOP_CALLS] or pool


def unbounded_functions(vm: Machine, pool: list[str]) -> list[str]:
    """The functions of ``pool`` without a BTF prototype on this kernel (compiler-made
    pieces such as ``iput.part.0``, ``mm_init.isra.0``: pahole leaves them out), where
    ``$argN`` is not bounded by the function's parameters; none where the kernel has no
    BTF arguments (6.1)."""
    btf = getattr(vm, "btf", None)
    if btf is None or not getattr(vm.facts.rules, "btf_args", False):
        return []
    return [fn for fn in pool if btf.func_proto(fn) is None]


def symbol_calls(vm: Machine, workload: str) -> dict[str, int]:
    """How many calls of each function of :func:`symbol_pool` the same pass saw: what
    a probe on it costs (each hit traps under TCG)."""
    return dict(_traced(vm, workload)["calls"])


def symbol_irq(vm: Machine, workload: str) -> frozenset[str]:
    """The functions of :func:`symbol_pool` the same pass saw called in interrupt
    context (a timer tick's work: a probe there is hit whatever the workload does)."""
    return frozenset(_traced(vm, workload).get("irq", ()))


def _traced(vm: Machine, workload: str) -> dict[str, Any]:
    key = hashlib.sha256(f"{vm.kernel}\0{workload}".encode()).hexdigest()[:16]
    d = C.cache_dir() / "fuzz" / "pools"
    f = d / f"{key}.json"
    if f.exists():
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc.get("pool"):
            return doc
    t = "/sys/kernel/tracing"
    script = (f"cd {t}; echo 0 > tracing_on; echo > trace; echo function > current_tracer; "
              f"echo 1 > tracing_on; ({workload}) >/dev/null 2>&1; echo 0 > tracing_on")
    vm.run(script, timeout=120)
    # read before the tracer goes back to nop: changing current_tracer empties the ring
    # buffer (kernel/trace/trace.c: tracing_set_tracer() -> tracing_reset_online_cpus())
    text = vm.run(f"cat {t}/trace", timeout=120).stdout
    vm.run(f"echo nop > {t}/current_tracer; echo > {t}/trace", timeout=120)
    names: dict[str, int] = {}
    irq: set[str] = set()
    for line in text.splitlines():
        m = re.search(r"\]\s+(\S+)\s+[\d.]+:\s+([\w.]+) <-", line)
        if m:
            names[m[2]] = names.get(m[2], 0) + 1
            # the irq-info column: h/H a hardirq, s a softirq (kernel/trace/
            # trace_output.c: trace_print_lat_fmt())
            if len(m[1]) > 2 and m[1][2] in "hHsz":
                irq.add(m[2])
    syms, bl = vm.symbols, vm.blacklist
    pool = []
    for n in names:
        s = syms.get(n)
        if s is None or s.module or not s.is_text or bl.find(s.addr) is not None:
            continue
        pool.append(n)
    pool = sorted(pool)
    if len(pool) > MAX_POOL:        # every k-th by name: all of the alphabet, not its start
        pool = [pool[i * len(pool) // MAX_POOL] for i in range(MAX_POOL)]
    if not pool:        # never cached: every kprobe would be drawn on one fallback name
        raise SetupError(f"the function tracer saw no probeable function during {workload!r} "
                         f"({len(names)} traced)", "check that the kernel has "
                         "CONFIG_FUNCTION_TRACER and that tracefs works in the guest")
    doc = {"pool": pool, "calls": {n: names[n] for n in pool},
           "irq": sorted(n for n in pool if n in irq)}
    d.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(doc))
    return doc


# -- strategies -------------------------------------------------------------------------

# -- the oracle -------------------------------------------------------------------------

def guest_error(vm: Machine, line: str) -> tuple[bool, int, str | None, int | None]:
    """Write ``line`` to the guest's tracefs file it names, alone: (accepted, errno,
    error_log message or None, caret column or None). An accepted line is deleted
    again (``harness.backends.events.try_lines``)."""
    return try_lines(vm, [line])[0]


#: one error_log entry: "[ts] SUBSYSTEM: error: MSG", "  Command: CMD", the caret line
_LOG_ENTRY = re.compile(r"^\[[ \d.]+\] (\S+): error: (.*)\n  Command: (.*)\n( *)\^", re.M)
#: concurrent refusals: rounds, and the writes of each writer in a round
WRITER_ROUNDS, WRITER_WRITES = 10, 40


def concurrent_refusals(vm: Machine, lines: tuple[str, ...], *, writers: int,
                        rounds: int = WRITER_ROUNDS, writes: int = WRITER_WRITES
                        ) -> Finding | None:
    """Refused ``lines``, each first written alone (its ``error_log`` entry: subsystem,
    message, command, caret), then by ``writers`` writers at once for each line, in
    ``rounds`` rounds of ``writes`` writes each: every entry ``error_log`` keeps must be
    one of the lines' own. The kernel keeps one ``trace_probe_log`` (the command being
    parsed) for every probe kind and parses under ``dyn_event_ops_mutex``
    (kernel/trace/trace_dynevent.c: ``dyn_event_create()``, 6.12.y and 7.3;
    trace_probe.c: ``trace_probe_log_init()`` asserts it held); two writers parsing at
    once would log one's message against the other's command. A finding of kind
    ``error_log``; None when every entry is a line's own (the kernel's reports are the
    run's kernel watch's)."""
    # Every entry a line logs alone is its own: one command may log more than one (7.3's
    # kernel/trace/trace_eprobe.c: __trace_eprobe_create(): traceprobe_parse_event_name()
    # logs BAD_EVENT_NAME, then the caller NO_EVENT_INFO, for one bad attach name)
    alone: dict[tuple[str, ...], str] = {}
    for ln in lines:
        r = vm.run(f"cd /sys/kernel/tracing; : > error_log; echo {shlex.quote(ln)} >> "
                   f"{events_file_of(ln)}; cat error_log", timeout=30)
        for entry in _LOG_ENTRY.findall(r.stdout):
            alone.setdefault(entry, ln)
    if not alone:
        return None
    mine = list(dict.fromkeys(alone.values()))
    loops = " ".join(
        f"(i=0; while [ $i -lt {writes} ]; do echo {shlex.quote(ln)} >> {events_file_of(ln)} "
        "2>/dev/null; i=$((i+1)); done) &"
        for ln in (mine[k % len(mine)] for k in range(max(writers, len(mine)))))
    for rnd in range(rounds):
        r = vm.run(f"cd /sys/kernel/tracing; : > error_log; {loops} wait; cat error_log",
                   timeout=120)
        entries = _LOG_ENTRY.findall(r.stdout)
        odd = [e for e in entries if e not in alone]
        if odd:
            sub, msg, cmd, pad = odd[0]
            return Finding(tuple(mine), "error_log",
                           f"round {rnd + 1}: {len(odd)} of {len(entries)} error_log "
                           f"entries are no line's own, first: {sub}: {msg!r} against "
                           f"{cmd!r} at {len(pad) - len('  Command: ')}",
                           f"error_log:concurrent:{_shape(msg)}")
    return None


def concurrent_writers(vm: Machine, lines: tuple[str, ...], writers: int) -> Finding | None:
    """:func:`concurrent_refusals` with the kernel watched (a splat, a panic or a hang of
    the guest under the writers is a ``kernel`` or ``hang`` finding)."""
    watch = KernelWatch(vm)
    try:
        with watch.watching():
            got = concurrent_refusals(vm, lines, writers=writers)
            splats = watch.finish()
    except KernelFinding as exc:
        return kernel_finding(lines, exc.verdict, exc.splats)
    if headline(splats) is not None:
        return kernel_finding(lines, str(headline(splats)), splats)
    return got


class Oracle:
    """Judges examples on one machine (probes removed after each; the guest's tracefs is
    checked empty before the next)."""

    def __init__(self, vm: Machine, *, guest: str = "events", workload: str = DEFAULT_WORKLOAD,
                 timeout: float = EXAMPLE_TIMEOUT, post_handler: bool = False,
                 raw_kprobes: bool = False, registrations_only: bool = False) -> None:
        self.guest, self.workload, self.timeout = guest, workload, timeout
        #: judge registrations alone: no workload, no hit (``run_differential``)
        self.registrations_only = registrations_only
        self.post_handler = post_handler        # the module's kprobes get post_handlers
        self.raw_kprobes = raw_kprobes          # ... registered as a module does
        self.vm = vm
        self.stats = FuzzStats()
        #: why the last :meth:`judge` that returned None judged nothing (a construct not
        #: mirrored, a run the host's probes slowed past its timeout); None: it agreed
        self.unjudged: str | None = None

    @property
    def vm(self) -> Machine:
        return self._vm

    @vm.setter
    def vm(self, vm: Machine) -> None:
        """The machine examples run on; a new one (after a crash or a hang) gets its own
        view: the old one's reads (event formats, BTF) would go to a closed machine."""
        self._vm = vm
        # The booted kernel's grammar (harness.kernel.rules), BTF and symbols, and the
        # trace events an event probe attaches to (TraceLayer.event_format): the host
        # parses each line as that kernel does.
        self._parse_kw = {"kernel": TraceLayer(vm).view()}
        self._places: dict[str, str] = {}

    @property
    def parse_kw(self) -> dict[str, Any]:
        """What :func:`harness.kernel.grammar.parse` takes to parse as the booted kernel."""
        return self._parse_kw

    def kernel_form(self, line: str) -> str:
        """``line`` with the harness's ``PATH:SYMBOL`` uprobe places (UPROBE_PLACES) as the
        ``PATH:0xOFFSET`` the kernel's ``uprobe_events`` takes, so both sides get one text."""
        for place in UPROBE_PLACES:
            if place in line:
                if place not in self._places:
                    (spec,) = resolve_uprobes(self.vm, [parse(f"p {place}")])
                    self._places[place] = f"{spec.path}:{spec.offset:#x}"
                line = line.replace(place, self._places[place])
        return line

    def judge(self, lines: tuple[str, ...]) -> Finding | None:
        """None when host and guest agree on ``lines``, or when they could not be
        compared (:attr:`unjudged` then says why); else the finding."""
        self.unjudged = None
        try:
            lines = tuple(self.kernel_form(ln) for ln in lines)
        except VMError as exc:          # the guest died (a panic) or hung under the last one
            return self._vm_error(lines, exc)
        specs = []
        for ln in lines:
            try:
                # the kernel's text only: a PATH:SYMBOL left (a mutated place) is its
                # BAD_UPROBE_OFFS, not a symbol for the harness to look up
                specs.append(parse(ln, uprobe_symbols=False, **self._parse_kw))
            except NotMirroredError as exc:
                self._not_mirrored(exc)
                return None
            except ProbeSpecError as exc:
                return self._parse_refusal(ln, exc)
        try:
            return self._differential(lines, specs)
        except NotMirroredError as exc:
            # a construct this host engine or in-guest side says it does not mirror
            # (harness.kernel.grammar.program: the plugin engine's, 7.3's $current): not a verdict
            self._not_mirrored(exc)
            return None
        except HostSlowedError as exc:
            # the guest ran, slowed by the host's own probes past the timeout: nothing
            # was measured, so neither an agreement nor a finding
            self.stats.slowed += 1
            self.unjudged = "slowed: " + str(exc.args[0]).splitlines()[0]
            return None
        except VMError as exc:
            return self._vm_error(lines, exc)
        except HarnessError as exc:
            return Finding(lines, "crash", f"{type(exc).__name__}: {exc}",
                           f"crash:{type(exc).__name__}:{_shape(str(exc))}")
        except Exception as exc:  # noqa: BLE001 - a traceback is a finding, with its text
            tb = traceback.format_exc(limit=6)
            return Finding(lines, "crash", tb, f"crash:{type(exc).__name__}:{_where(exc)}")

    def _not_mirrored(self, exc: NotMirroredError) -> None:
        """Count an example the oracle cannot judge, by its reason (the run's summary
        names them, so a count is never left unexplained)."""
        why = str(exc).splitlines()[0]
        self.unjudged = "not mirrored: " + why
        self.stats.not_mirrored += 1
        self.stats.not_mirrored_why[why] = self.stats.not_mirrored_why.get(why, 0) + 1

    def _vm_error(self, lines: tuple[str, ...], exc: Exception) -> Finding:
        """A guest that died or hung: the finding, with the kernel's last console lines
        when it panicked (the oops names the code and the call trace). A panic or a hang
        the run's kernel watch saw (``harness.machine.kwatch``) is a ``kernel`` or ``hang``
        finding with its splats."""
        if isinstance(exc, KernelFinding):
            return kernel_finding(lines, exc.verdict, exc.splats)
        detail = str(exc).splitlines()[0]
        if "panicked" in detail:
            try:
                detail += "\n" + self.vm.console_tail(60)
            except Exception:  # noqa: BLE001 - the finding stands without the console
                pass
        return Finding(lines, "timeout" if "did not" in str(exc) else "crash", detail,
                       f"crash:{type(exc).__name__}")

    def _parse_refusal(self, line: str, exc: ProbeSpecError) -> Finding | None:
        ok, code, msg, col = guest_error(self.vm, line)
        ours = (str(exc), exc.column)
        if ok:
            return Finding((line,), "parse", f"host refuses ({ours[0]!r} at {ours[1]}), the "
                           "guest accepts", f"parse:host-refuses:{ours[0]}")
        if code != exc.errno:
            return Finding((line,), "parse", f"guest refuses with {_errname(code)}, host with "
                           f"{_errname(exc.errno)} ({ours[0]!r} at {ours[1]})",
                           f"parse:errno:{_errname(code)}|{_errname(exc.errno)}")
        if msg is None:                 # the kernel refused without a log entry
            if exc.logged:              # where the host says it logs one
                return Finding((line,), "parse", f"guest refuses ({_errname(code)}) with "
                               f"nothing in error_log, host logs {ours[0]!r} at {ours[1]}",
                               f"parse:unlogged:{ours[0]}")
            self.stats.agreed_refusals += 1
            return None
        if not exc.logged:
            return Finding((line,), "parse", f"guest logs {msg!r} at {col}, host refuses "
                           f"({ours[0]!r}) with nothing in error_log", f"parse:logged:{msg}")
        if (msg, col) != ours:
            return Finding((line,), "parse", f"guest {msg!r} at {col}, host {ours[0]!r} at "
                           f"{ours[1]}", f"parse:{msg}|{ours[0]}|{col == ours[1]}")
        self.stats.agreed_refusals += 1
        return None

    def _differential(self, lines: tuple[str, ...], specs: list[Any]) -> Finding | None:
        vm = self.vm
        host, guest = run_differential(vm, specs, self.workload, guest=self.guest,
                                       timeout=self.timeout, post_handler=self.post_handler,
                                       raw_kprobes=self.raw_kprobes,
                                       registrations_only=self.registrations_only)
        res = compare(host, guest, trampoline=trampoline_text(vm))
        left = _events_left(vm)
        if left.strip():
            vm.run("cd /sys/kernel/tracing; echo > kprobe_events; echo > uprobe_events", timeout=30)
        if headline(host.splats) is not None:       # the kernel complained during the run
            return kernel_finding(lines, str(headline(host.splats)), host.splats)
        if left.strip():
            return Finding(lines, "crash", f"probes left in the guest: {left.strip()}",
                           "crash:left-behind")
        if res.agrees:      # an empty run (nothing fired) agrees: it is no finding
            self.stats.agreed_runs += 1
            self.stats.events += res.total_matched
            return None
        d = res.divergences[0]
        kind = "registration" if d.field == "registration" else "events"
        # The class: which construct diverged (the argument as written, numbers blurred),
        # not which values: two different fetches that both differ are two findings.
        what = d.field
        if d.field.startswith("arg:"):
            for spec in specs:
                for a in spec.args:
                    if a.name == d.field[4:]:
                        what = "arg:" + _shape(a.comm or d.field[4:]) + (":" + a.type)
        sig = f"{kind}:{what}:{_shape(d.a_value)}|{_shape(d.b_value)}"
        for pattern, why in KNOWN:
            if re.search(pattern, sig):
                self.stats.known[why] = self.stats.known.get(why, 0) + 1
                return None
        return Finding(lines, kind, d.describe(res.a_side, res.b_side), sig)


def _events_left(vm: Machine) -> str:
    """The guest's ``kprobe_events`` and ``uprobe_events`` after a run, through the
    agent's file API in one pipelined read: no guest process (an exec is ~15 ms under
    TCG). A file the kernel lacks (no uprobe events) is empty, as ``cat`` of it printed
    nothing."""
    got = vm.pull_many([f"/sys/kernel/tracing/{f}" for f in ("kprobe_events", "uprobe_events")],
                       timeout=30)
    return "".join(d.decode("utf-8", "replace") for d in got if not isinstance(d, GuestAgentError))


def kernel_finding(lines: tuple[str, ...], verdict: str, splats: Any) -> Finding:
    """A run the kernel complained about (``harness.kernel.splat``): kind ``hang`` for
    ``HANG``, else ``kernel``; its class is the verdict and the first splat's title."""
    now = during(splats)
    title = now[0].title if now else verdict
    return Finding(lines, "hang" if verdict == "HANG" else "kernel", findings_text(splats),
                   f"kernel:{verdict}:{_shape(title)}")


def _errname(n: int) -> str:
    return _errno_mod.errorcode.get(n, str(n))


def _shape(text: str) -> str:
    """A value with its numbers and names blurred: what makes two findings one class."""
    text = re.sub(r"0x[0-9a-f]+", "0xN", str(text))
    text = re.sub(r"\d+", "N", text)
    return re.sub(r"'[^']*'", "'S'", text)[:120]


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    return f"{Path(last.filename).name}:{last.name}" if last else "?"


def repro_line(f: Finding, *, image: str | None = None, guest: str = "events",
               workload: str = DEFAULT_WORKLOAD, post_handler: bool = False,
               raw_kprobes: bool = False) -> str:
    """The ``kph diff`` one-liner that shows ``f`` again."""
    opts = (f" --image {image}" if image else "") + (f" --guest {guest}" if guest != "events" else "") \
        + (" --post-handler" if post_handler else "") \
        + (" --raw-kprobes" if raw_kprobes else "") \
        + (" --refusals" if f.kind == "parse" else "")     # the host refuses the line
    # "--" first: a -: line would read as an option
    return "kph diff" + opts + f" --run {shlex.quote(workload)} -- " + \
        " ".join(shlex.quote(ln) for ln in f.lines)


# -- running ----------------------------------------------------------------------------

class _Found(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.detail)
        self.finding = finding


def db_dir() -> Path:
    return C.cache_dir() / "fuzz" / "db"


def run(vm: Machine, *, examples: int, seed: int, guest: str = "events",
        workload: str = DEFAULT_WORKLOAD, time_budget: float | None = None,
        progress: Callable[[str], None] | None = None, database: bool = True,
        reboot: Callable[[], Any] | None = None,
        tick: Callable[[FuzzStats], None] | None = None, mix: str = "all") -> FuzzStats:
    """Fuzz ``examples`` examples (or until ``time_budget`` seconds) on ``vm``.

    ``reboot`` makes a fresh machine after a crash or a hang (the old one is closed and
    the run goes on there; the caller closes the last one, ``stats.vm``). ``tick`` is
    called with the stats after each example (``kph fuzz -n``'s shards report with it).
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.database import DirectoryBasedExampleDatabase

    oracle = Oracle(vm, guest=guest, workload=workload)
    stats = oracle.stats
    stats.vm = vm
    # Examples past MAX_TRACE_ARGS are generated on purpose; the parser's warning about
    # them (one per example) is not news here.
    logging.getLogger("harness.kernel.grammar").setLevel(logging.ERROR)
    pool = drawing_pool(vm, workload, getattr(vm, "host_kind", "gdbstub"))
    strat = strategies(pool, rules=vm.facts.rules, guest=guest, mix=mix,
                       unbounded=unbounded_functions(vm, pool))
    known: set[str] = set()
    t0 = time.monotonic()
    say = progress or (lambda s: None)
    db = DirectoryBasedExampleDatabase(str(db_dir())) if database else None

    def body(lines: tuple[str, ...]) -> None:
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            return
        stats.examples += 1
        if stats.examples % 25 == 0:
            say(f"fuzz: {stats.examples} examples, {len(stats.findings)} finding(s), "
                f"{60 * stats.examples / max(1e-9, time.monotonic() - t0):.0f}/min")
        f = oracle.judge(lines)
        if tick is not None:
            tick(stats)
        if f is not None and f.signature not in known:
            raise _Found(f)

    rounds = 0
    while stats.examples < examples and rounds < 50:
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            break
        rounds += 1
        left = examples - stats.examples
        test = settings(max_examples=left, database=db, deadline=None, derandomize=False,
                        suppress_health_check=list(HealthCheck),
                        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                        report_multiple_bugs=False)(given(strat)(body))
        test = hseed(seed + rounds - 1)(test)
        try:
            with grammar_only():
                test()
            break
        except BaseException as exc:  # noqa: BLE001 - _Found, or Hypothesis's flaky group
            found = _found_in(exc)
            if found is None:
                raise
            f = found.finding
            if _is_flaky(exc):
                # The oracle's verdict changed when Hypothesis replayed the example: the
                # guest's execution is not the same twice (timing, other tasks). Kept, and
                # said so, with the example as first seen (not shrunk further).
                f = Finding(f.lines, f.kind, f.detail + " (did not repeat on replay)",
                            f.signature, f.repro, flaky=True)
            known.add(f.signature)
            stats.findings.append(f)
            say(f"fuzz: finding {len(stats.findings)} ({f.kind}): {f.lines[0][:100]}: "
                f"{f.detail.splitlines()[0][:160]}")
            if f.kind in ("crash", "timeout", "kernel", "hang") and reboot is not None:
                # The machine may be wedged after a crash or a hang: go on with a new one.
                try:
                    oracle.vm.close()
                except HarnessError:
                    pass
                oracle.vm = stats.vm = reboot()
                say("fuzz: a fresh machine after that finding")
    stats.seconds = time.monotonic() - t0
    return stats


def _found_in(exc: BaseException) -> "_Found | None":
    """The ``_Found`` in ``exc``, or in the exception group Hypothesis raised around it."""
    if isinstance(exc, _Found):
        return exc
    for sub in getattr(exc, "exceptions", ()) or ():
        got = _found_in(sub)
        if got is not None:
            return got
    cause = exc.__cause__ or exc.__context__
    return _found_in(cause) if isinstance(cause, BaseException) and cause is not exc else None


def _is_flaky(exc: BaseException) -> bool:
    from hypothesis.errors import Flaky

    return isinstance(exc, Flaky)


# -- findings on disk -------------------------------------------------------------------

#: The suite replays every file here (tests/vm/test_fuzz.py): one example per file, its
#: lines one per line, ``#`` comments (the finding, the fix, the kernel source).
REGRESSIONS = Path(__file__).resolve().parents[2] / "tests" / "data" / "fuzz"


def regression_name(f: Finding) -> str:
    return hashlib.sha256(f.signature.encode()).hexdigest()[:12] + ".txt"


def write_regression(f: Finding, directory: Path = REGRESSIONS,
                     kernel: str | None = None) -> Path:
    """The finding as a case the suite replays (it must agree once the class is fixed);
    ``kernel``: the series it was found on, when not the default image's (a
    ``# kernel: SERIES`` line: the suite replays it on that kernel)."""
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / regression_name(f)
    p.write_text(f"# kph fuzz finding ({f.kind}): {f.detail.splitlines()[0][:300]}\n"
                 + (f"# kernel: {kernel}\n" if kernel else "")
                 + f"# signature: {f.signature}\n" + "".join(ln + "\n" for ln in f.lines))
    return p


_KERNEL_LINE = re.compile(r"^# kernel: (\S+)\s*$", re.M)


def read_regressions(directory: Path = REGRESSIONS) -> list[tuple[str, tuple[str, ...]]]:
    """(file name, lines) of every case (see :func:`regression_kernel` for its kernel)."""
    out = []
    for p in sorted(directory.glob("*.txt")) if directory.is_dir() else []:
        lines = tuple(ln for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#"))
        if lines:
            out.append((p.name, lines))
    return out


def regression_kernel(name: str, directory: Path = REGRESSIONS) -> str | None:
    """The series a case names (``# kernel: 6.12``), None for the default image."""
    m = _KERNEL_LINE.search((directory / name).read_text())
    return m[1] if m else None
