"""The trace-event layer, for the backends that stand in for ``kprobe_events``.

The ``events`` backend writes lines to the guest's tracefs, so the guest kernel decides
everything. The ``host`` backend (and the ``module`` backend, whose kernel module calls
``register_kprobe()`` directly) must decide what tracefs would decide around that call, in
the kernel's order (``__trace_kprobe_create()`` then ``register_trace_kprobe()``, Linux 6.1):

1. uprobe lines: the file (``kern_path()``: ENOENT "Failed to find the given file"; not
   ``d_is_reg()``: EINVAL "Not a regular file"), before anything else of the line;
2. the line parsed again as the booted kernel parses it (:func:`harness.kernel.grammar.parse`
   with the kernel's :class:`harness.kernel.grammar.KernelView`: its series' rules, its BTF,
   the running guest's symbols): a line written before the kernel was known (``kph
   matrix``) gets that kernel's types, names and refusals, with its errno and caret;
   ``number_of_same_symbols()`` over vmlinux and the loaded modules is part of it (6.1:
   after the return-probe check; 6.12+: ``validate_probe_symbol()`` first; 7.3: vmlinux
   alone when it has the name);
3. the event name: EEXIST and its three texts, or appending (:class:`harness.kernel.dynevent.EventTable`);
4. ``within_notrace_func()``: a function without an ftrace location (``notrace``, or built
   without ``-pg`` such as kernel/trace/) is EINVAL, as Debian's 6.1 has
   ``CONFIG_KPROBE_EVENTS_ON_NOTRACE`` off; the guest's ``available_filter_functions`` says
   which functions have one (a ``.isra.0`` piece counts as its stem's);
5. ``traceprobe_update_arg()``: ``@SYM`` resolved once (:func:`harness.kernel.dynevent.resolve_fetch_symbols`);
6. ``register_kprobe()`` (the backend's own), whose -ENOENT the kernel forgives for a raw
   address and for ``MOD:SYM`` of a module not loaded (the event stays, unregistered).

Module symbols are taken from the running guest whenever a line names one, or a name the
core kernel does not have: module addresses differ from boot to boot (the image's harvested
kallsyms holds one boot's), and ``kallsyms_lookup_name()`` looks an unqualified name up in
the modules after vmlinux.
"""
from __future__ import annotations

import bisect
import dataclasses
import errno as _errno
import fnmatch
import logging
import operator
import re
import weakref
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, Callable, Sequence

from ..kernel.dynevent import (FAIL_REG_PROBE, EventTable, Refusal, arg_column, events_file,
                              line_files, other_event_names, registration_refusal,
                              resolve_fetch_symbols, target_refusal)
from ..errors import NotMirroredError, ProbeRejectedError, ProbeSpecError, SetupError
from ..kernel.grammar import (ProbeSpec, error_subsystem, format as format_spec, parse,
                              split_symbol_offset)
from ..kernel.grammar.fprobe import probestub
from ..engines.uprobes import file_stat, file_type
from ..records import Hit, Outcome
from ..kernel.ringbuf import EventFormat, parse_format
from ..kernel.rules import rules_for
from ..machine.image.facts import kernel_view
from ..machine.memo import PerMachine
from ..vmctl import Machine

log = logging.getLogger(__name__)

TRACING_EVENTS = "/sys/kernel/tracing/events"
FILE_NOT_FOUND = "Failed to find the given file"
NO_REGULAR_FILE = "Not a regular file"


@dataclass(frozen=True)
class Admission:
    """What the trace layer says about one line before the backend registers it.

    ``spec`` has its ``@SYM`` arguments resolved; ``refusal`` is set when the kernel refuses
    the line before ``register_kprobe()``; ``pending`` when it keeps the event without
    registering anything (it never fires)."""

    spec: ProbeSpec
    refusal: Refusal | None = None
    pending: str = ""
    reason: str = ""


def uprobe_file_refusal(vm: Machine, spec: ProbeSpec) -> Refusal | None:
    """``__trace_uprobe_create()``'s first check, ``kern_path(LOOKUP_FOLLOW)`` and
    ``d_is_reg()`` (kernel/trace/trace_uprobe.c), made in the guest with ``stat -L``."""
    kind = file_type(vm, spec.path or "")
    col = arg_column(spec, 1)
    if kind is None:
        return Refusal(_errno.ENOENT, FILE_NOT_FOUND, col)
    if not kind.startswith("regular"):       # "regular [empty ]file"
        return Refusal(_errno.EINVAL, NO_REGULAR_FILE, col)
    return None


#: (machine, tracefs file) -> (its loaded modules, the file's lines)
_FTRACE_FILES: PerMachine[str, tuple[frozenset[str], list[str]]] = PerMachine()


#: (snapshot directory, tracefs file, loaded modules) -> the file's lines, for machines
#: restored from one snapshot: the same kernel state, so the same ftrace locations
_SNAPSHOT_FTRACE_FILES: dict[tuple[str, str, frozenset[str]], list[str]] = {}


def _ftrace_file(vm: Machine, name: str, modules: frozenset[str], fix: str) -> list[str]:
    """The lines of a tracefs file of ftrace's locations, read once per machine while its
    loaded modules stay the same: vmlinux's ftrace locations are fixed at boot, a module's
    come and go with it (kernel/trace/ftrace.c: ftrace_module_init()). Machines restored
    from one snapshot share one read per set of loaded modules (0.4-0.7 s a read of
    6.1's or 6.12's 40,000 lines through the agent, once per test before), kept in the
    snapshot for later processes (``Machine.kept``: 0.25 s a ``kph`` command)."""
    cache = _FTRACE_FILES.table(vm)
    got = cache.get(name)
    if got is not None and got[0] == modules:
        return got[1]
    snap = getattr(vm, "snapshot", None) if getattr(vm, "start_mode", "") == "snapshot" else None
    key = (str(snap.dir), name, modules) if snap is not None else None
    lines = _SNAPSHOT_FTRACE_FILES.get(key) if key is not None else None
    state = (name, tuple(sorted(modules)))
    if lines is None and snap is not None:      # kept by an earlier process (Machine.kept)
        kept = vm.kept("tracefs", state)
        if kept is not None:
            lines = [ln for ln in kept.decode("utf-8", "replace").splitlines() if ln]
    if lines is None:
        (got,) = vm.pull_many([f"/sys/kernel/tracing/{name}"], timeout=60)
        if isinstance(got, Exception):
            raise SetupError(f"cannot read {name} in the guest: {got}", fix)
        lines = [ln for ln in got.decode("utf-8", "replace").splitlines() if ln]
        if snap is not None:
            vm.keep("tracefs", state, "\n".join(lines).encode())
    if key is not None:
        _SNAPSHOT_FTRACE_FILES[key] = lines
    cache[name] = (modules, lines)
    return lines


#: machine -> (the available_filter_functions lines, their names): the set made once per
#: list of lines (~12 ms for 6.1's 36,000, at every registration of a kph fuzz run)
_FILTER_NAMES: "weakref.WeakKeyDictionary[Any, tuple[list[str], frozenset[str]]]" = \
    weakref.WeakKeyDictionary()


def filter_functions(vm: Machine, modules: frozenset[str]) -> frozenset[str]:
    """The function names of the guest's ``available_filter_functions`` (one ``cat``,
    0.4 s on 6.12's 40,000 lines; a ``grep -F -f`` of 128 names took 2 s)."""
    lines = _ftrace_file(vm, "available_filter_functions", modules,
                         "boot an image whose kernel has CONFIG_DYNAMIC_FTRACE and tracefs")
    got = _FILTER_NAMES.get(vm)
    if got is not None and got[0] is lines:
        return got[1]
    names = frozenset(ln.split(" ", 1)[0] for ln in lines)
    _FILTER_NAMES[vm] = (lines, names)
    return names


#: machine -> (the available_filter_functions_addrs lines, their (address, name)s): parsed
#: once per list of lines (~70 ms for 6.12's 55,000, twice at each registration of an
#: ``f:`` line: its admission and its placing)
_FILTER_ADDRS: "weakref.WeakKeyDictionary[Any, tuple[list[str], list[tuple[int, str]]]]" = \
    weakref.WeakKeyDictionary()


def ftrace_addrs(vm: Machine, modules: frozenset[str]) -> list[tuple[int, str]]:
    """The guest's ``available_filter_functions_addrs`` (6.5+): each ftrace location with
    its function's name, as ``ftrace_set_filter()`` matches a filter against them."""
    lines = _ftrace_file(vm, "available_filter_functions_addrs", modules,
                         "fprobe events need a 6.5+ kernel with CONFIG_DYNAMIC_FTRACE")
    got = _FILTER_ADDRS.get(vm)
    if got is not None and got[0] is lines:
        return got[1]
    out = []
    for ln in lines:
        addr, _, rest = ln.partition(" ")
        try:
            out.append((int(addr, 16), rest.split(" ", 1)[0]))
        except ValueError:
            continue
    _FILTER_ADDRS[vm] = (lines, out)
    return out


def fprobe_matches(filter_: str, funcs: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """The ftrace locations an fprobe's filter takes (kernel/trace/ftrace.c:
    ``ftrace_match_records()``): the whole name, or a glob of ``*``, ``?`` and ``[...]``
    (``filter_parse_regex()``, ``glob_match()``), over every location, duplicates of a
    static name included."""
    if not any(c in filter_ for c in "*?["):
        return [(a, n) for a, n in funcs if n == filter_]
    match = re.compile(fnmatch.translate(filter_)).match    # fnmatchcase(), compiled once
    return [(a, n) for a, n in funcs if match(n)]


#: 7.3's fprobe exits take no instance from a pool (kernel/trace/fprobe.c:
#: fprobe_fgraph_entry() reserves room on the task's function-graph return stack): the
#: host's pool is made larger than any call depth a run reaches.
FGRAPH_INSTANCES = 1024


def fprobe_pool(rules: Any, spec: ProbeSpec, locations: int, cpus: int) -> int:
    """The exit instances of an ``f ...%return`` line host-side: 6.12's ``f[N]`` gives N,
    else ``fprobe_init_rethook()`` allocates 2 * possible CPUs per matched location, one
    pool for them all (host-side one pool per location, of that size); 7.3 has none
    (:data:`FGRAPH_INSTANCES`). 0 for an entry line."""
    if not spec.is_return:
        return 0
    if rules.fprobe == "fgraph":
        return FGRAPH_INSTANCES
    return spec.maxactive or locations * 2 * max(1, cpus)


class FprobeOps:
    """The order the guest kernel runs the ftrace callbacks of one function in, where
    fprobes are (``__ftrace_ops_list_func()`` walks ``ftrace_ops_list``, and
    ``add_ftrace_ops()`` puts a newly registered ops at its head). Measured in the guest
    by walking ``ftrace_ops_list`` after ``kprobe_events``/``dynamic_events`` writes and
    enables (tests/vm/test_selftests_newer.py: test_fprobe_handlers_order_on_one_function):

    - kprobes at ftrace locations share ``kprobe_ftrace_ops``, registered when the first
      of them is armed, at enable (kernel/kprobes.c: ``arm_kprobe_ftrace()``);
    - 6.12 gives each fprobe its own ops, registered when the event is created
      (kernel/trace/fprobe.c: ``register_fprobe()``): newest first, after the kprobes';
    - 7.3 runs entry-only fprobes from ``fprobe_ftrace_ops`` and exit fprobes from the
      function graph's ``graph_ops``, each registered at the enable of its first fprobe
      (kernel/trace/fprobe.c: ``fprobe_ftrace_add_ips()``, ``fprobe_graph_add_ips()``):
      the group (kprobes, entries, exits) enabled last runs first; newest first within
      a group (``rhltable_insert()``).

    A diff enables its events in the order of its lines, so the order is that of the
    lines' groups."""

    def __init__(self, rules: Any) -> None:
        self.fgraph = rules.fprobe == "fgraph"
        self.order: list[str] = []          # "kprobe", "entry", "exit", as first enabled
        self.count: dict[str, int] = {}

    def changed(self, group: str, delta: int) -> None:
        self.count[group] = self.count.get(group, 0) + delta
        if self.count[group] <= 0:
            self.count.pop(group, None)
            if group in self.order:
                self.order.remove(group)
        elif group not in self.order:
            self.order.append(group)

    def rank(self, group: str) -> int:
        """The sort key of a probe of ``group`` at a place (smallest runs first; a
        stable sort keeps newest first within one)."""
        if not self.fgraph:
            return -1 if group == "kprobe" else 0
        return len(self.order) - 1 - self.order.index(group) if group in self.order else 0


def spec_group(spec: ProbeSpec) -> str:
    """The :class:`FprobeOps` group of a kernel probe line."""
    if spec.is_fprobe:
        return "exit" if spec.is_return else "entry"
    return "kprobe"


#: the group of the events a host-only run puts a tracepoint probe's stub on with
STUB_GROUP = "kphstub"
MAX_EVENT_NAME_LEN = 64


def _stub_lines(tracepoints: Sequence[str], events: Sequence[tuple[str, str]]
                ) -> list[tuple[str, str]]:
    """(group/event, line) of each guest-side stub event."""
    out = [(f"{STUB_GROUP}/{tp}", f"t:{STUB_GROUP}/{tp} {tp}") for tp in tracepoints]
    for sys, ev in events:
        name = f"e_{ev}"[:MAX_EVENT_NAME_LEN - 1]
        out.append((f"{STUB_GROUP}/{name}", f"e:{STUB_GROUP}/{name} {sys}.{ev}"))
    return out


def attach_stubs(vm: Machine, tracepoints: Sequence[str],
                 events: Sequence[tuple[str, str]] = ()) -> None:
    """For a host-only run: put each tracepoint's stub on it, as a ``t`` event does, so that
    the host's probe at the stub fires. The guest's own ``t`` event does it, in a group of
    the harness's (``kphstub``), enabled (7.3 puts the stub on at enable; 6.12 at
    creation) with a filter no record passes (``common_pid < 0``): the guest keeps nothing.
    In a differential run the guest side's event puts it on instead.

    ``events`` (system, event): the same for the events event probes attach to. An event
    no one enabled records nothing; an ``e`` event of the harness's on it, enabled, makes
    the kernel build each record and commit it (``trace_event_buffer_commit()``, where the
    host's event probes fire), and its filter (the attached event's ``common_pid < 0``)
    keeps its trigger from recording anything."""
    if not tracepoints and not events:
        return
    script = [f"cd {TRACING_EVENTS}/.."]
    for ev, line in _stub_lines(tracepoints, events):
        script.append(f"echo '{line}' >> dynamic_events && "
                      f"echo 'common_pid < 0' > events/{ev}/filter && "
                      f"echo 1 > events/{ev}/enable || echo @fail {ev}")
    r = vm.run("\n".join(script), timeout=60)
    for ln in r.stdout.splitlines():
        if ln.startswith("@fail"):
            log.warning("%s: the guest-side stub could not be put on (%s); the host's probe "
                        "fires only while something else enables it", ln[6:],
                        r.stderr.strip()[:200])


def detach_stubs(vm: Machine, tracepoints: Sequence[str],
                 events: Sequence[tuple[str, str]] = ()) -> None:
    if not tracepoints and not events or getattr(vm, "aborting", False):
        return
    vm.run("; ".join([f"cd {TRACING_EVENTS}/.."] + [
        f"echo 0 > events/{ev}/enable; echo '-:{ev}' >> dynamic_events"
        for ev, _ in _stub_lines(tracepoints, events)]), timeout=60)


def _names(spec: ProbeSpec) -> list[str]:
    """The kernel symbols a kprobe line names: its target and every ``@SYM``."""
    out = [spec.symbol_name] if spec.symbol_name else []
    for a in spec.args:
        if a.code and a.code[0][0] == "nop_symbol":
            name, _ = split_symbol_offset(a.code[0][1])
            if name:
                out.append(name)
    return out


#: per machine, and per snapshot its machines were restored from: the events
#: ``available_events`` leaves out (see :func:`guest_event_names`)
_UNLISTED: "weakref.WeakKeyDictionary[Machine, frozenset[str]]" = weakref.WeakKeyDictionary()
_SNAPSHOT_UNLISTED: dict[str, frozenset[str]] = {}


#: per machine: (its :func:`_event_sources` then, the events ``available_events`` listed)
_LISTED: "weakref.WeakKeyDictionary[Machine, tuple[tuple[str, str], frozenset[str]]]" = \
    weakref.WeakKeyDictionary()


def _event_sources(vm: Machine) -> tuple[str, str] | None:
    """What the guest's set of trace events depends on after boot, in one read of two files:
    ``dynamic_events`` (every dynamic event: kprobe, uprobe, synthetic, eprobe, fprobe,
    tracepoint probe; kernel/trace/trace_dynevent.c, ``dyn_event_list``) and each loaded
    module (a module's events come and go with it: kernel/trace/trace_events.c,
    ``trace_module_notify()``), by name, size, state and address, less its use count
    and users, which a probe in it changes. None when either cannot be read (then
    nothing is kept)."""
    got = vm.pull_many(["/sys/kernel/tracing/dynamic_events", "/proc/modules"], timeout=30)
    if any(isinstance(d, Exception) for d in got):
        return None
    dyn, mods = (bytes(d).decode("utf-8", "replace") for d in got)  # type: ignore[arg-type]
    modules = "\n".join(" ".join(f[:2] + f[4:]) for f in (ln.split() for ln in mods.splitlines()))
    return dyn, modules


def guest_event_names(vm: Machine) -> set[str]:
    """Every ``GROUP/EVENT`` the guest's tracefs has now (``events/*/*/``): the names an
    existing event takes, so a dynamic event of that name is EVENT_EXIST
    (``trace_probe_register_event_call()``: ``find_trace_event_call()`` walks every
    event).

    ``available_events`` lists them all but those that cannot be enabled
    (kernel/trace/trace_events.c: ``t_next()`` skips a call without ``class->reg`` or with
    ``TRACE_EVENT_FL_IGNORE_ENABLE``: ftrace's own entries, kernel/trace/trace_export.c,
    built in). It is read as a file (``Machine.pull``, no guest process, where listing
    the directories is an exec, ~55 ms under TCG: issue 39's fuzzing rate); the events
    it leaves out (built in, so the same in every machine of one snapshot) are listed with
    ``ls`` once per machine, or once per snapshot (``Machine.kept``). And
    ``available_events`` itself is read again only when what makes and removes events
    changed since (:func:`_event_sources`: the dynamic events and the loaded modules;
    a read of 6.1's ~2,000 events, at every registration of kph fuzz, took 13 ms through
    the agent and 2.8 ms through kph-reader, the two small files 4.3 and 0.5 ms)."""
    sources = _event_sources(vm)
    memo = _LISTED.get(vm)
    if sources is not None and memo is not None and memo[0] == sources:
        listed = set(memo[1])
    else:
        text = vm.pull("/sys/kernel/tracing/available_events").decode("utf-8", "replace")
        listed = {ln.strip().replace(":", "/", 1) for ln in text.splitlines() if ":" in ln}
        if sources is not None:
            _LISTED[vm] = (sources, frozenset(listed))
    snap = getattr(vm, "snapshot", None) if getattr(vm, "start_mode", "") == "snapshot" else None
    unlisted = _UNLISTED.get(vm)
    if unlisted is None and snap is not None:
        unlisted = _SNAPSHOT_UNLISTED.get(str(snap.dir))
        kept = vm.kept("tracefs", "unlisted events") if unlisted is None else None
        if kept is not None:
            unlisted = frozenset(kept.decode("utf-8", "replace").split())
    if unlisted is None:
        listing = vm.run(f"cd {TRACING_EVENTS} && ls -d */*/ 2>/dev/null || true",
                         timeout=60).stdout
        unlisted = frozenset(other_event_names(listing) - listed)
        if snap is not None:
            vm.keep("tracefs", "unlisted events", "\n".join(sorted(unlisted)).encode())
    if snap is not None:
        _SNAPSHOT_UNLISTED[str(snap.dir)] = unlisted
    _UNLISTED[vm] = unlisted
    return listed | unlisted


class TraceLayer:
    """One side's dynamic events on one Machine (``dyn_event_list`` and friends)."""

    def __init__(self, vm: Machine, *, raw: bool = False) -> None:
        self.vm = vm
        #: kprobes registered as a kernel module registers them (``register_kprobe()``
        #: called directly, samples/kprobes/kprobe_example.c): none of ``trace_kprobe``'s
        #: own checks around that call (step 4, ``within_notrace_func()``), on both sides
        self.raw = raw
        self.table = EventTable(identity=self._inode)
        self._events_read = False
        self._inodes: dict[str, object] = {}
        self._loaded: frozenset[str] | None = None
        self._traced: dict[str, bool] = {}      # function name -> has an ftrace location
        self._formats: dict[tuple[str, str], EventFormat | None] = {}
        #: GROUP/EVENT -> the file its line of the batch goes to (a ``-:`` line's file)
        self._line_files: dict[str, set[str]] = {}

    @property
    def symbols(self) -> Any:
        return self.vm.symbols

    def _inode(self, spec: ProbeSpec) -> object:
        path = spec.path or ""
        if path not in self._inodes:
            f = file_stat(self.vm, path)
            self._inodes[path] = f"{f.key[1]}:{f.ino}" if f is not None else path
        return self._inodes[path]

    def sync_modules(self, specs: Sequence[ProbeSpec]) -> None:
        """Take module symbols from the running guest when a line may need them."""
        need = False
        for spec in specs:
            if spec.is_uprobe or spec.kind == "-":
                continue
            for name in _names(spec):
                sym = self.symbols.get(name)
                if ":" in name or sym is None or sym.module is not None:
                    need = True
        if need:
            self.refresh_modules()

    def prepare(self, specs: Sequence[ProbeSpec]) -> None:
        """Before admitting ``specs``: module symbols, and which probed functions have an
        ftrace location (two guest commands at most, for the whole batch); which file each
        event's line goes to, where a ``-:`` line of the batch goes (:func:`line_files`)."""
        self._line_files = line_files(specs)
        self.sync_modules(specs)
        self._ftrace_locations(specs)

    def _function_of(self, spec: ProbeSpec) -> tuple[str, str | None] | None:
        """``trace_kprobe_address()`` then the function holding it: (name, its stem when
        the name is a compiler-made piece such as ``foo.isra.0``), or None."""
        if spec.symbol is not None:
            base = self.lookup(spec.symbol_name or "")
            if not base:
                return None
            addr = base + spec.offset
        else:
            addr = spec.addr or 0
        hit = self.symbols.symbolize(addr)
        if hit is None:
            return None
        name = hit[0].name
        return name, (name.split(".", 1)[0] if "." in name else None)

    def _ftrace_locations(self, specs: Sequence[ProbeSpec]) -> None:
        """Which of the functions these lines probe have an ftrace location: the guest's
        ``available_filter_functions``, read once per machine and set of loaded modules."""
        names = set()
        for spec in specs:
            if spec.is_uprobe or spec.kind == "-":
                continue
            fn = self._function_of(spec)
            if fn is not None:
                names.update(n for n in fn if n)
        names -= set(self._traced)
        if not names or not self._notrace_applies():
            return
        have = filter_functions(self.vm, frozenset(self.symbols.modules()))
        for n in names:
            self._traced[n] = n in have

    def _notrace_applies(self) -> bool:
        """``within_notrace_func()`` exists with ``CONFIG_DYNAMIC_FTRACE`` and without
        ``CONFIG_KPROBE_EVENTS_ON_NOTRACE``: read from the image's config when there is one
        (a kernel without it, ``--kernel``, is taken to be built like Debian's)."""
        if not hasattr(self, "_notrace_rule"):
            cfg = ""
            image = getattr(self.vm, "image", None)
            try:
                cfg = image.config.read_text() if image is not None else ""
            except OSError:
                pass
            self._notrace_rule = (not cfg or ("CONFIG_DYNAMIC_FTRACE=y" in cfg and
                                              "CONFIG_KPROBE_EVENTS_ON_NOTRACE=y" not in cfg))
        return self._notrace_rule

    def notrace(self, spec: ProbeSpec) -> bool:
        """``within_notrace_func()`` (kernel/trace/trace_kprobe.c) for a kprobe line."""
        if self.raw or not self._notrace_applies():
            return False
        fn = self._function_of(spec)
        if fn is None:
            return False
        name, stem = fn
        if name not in self._traced:
            self._ftrace_locations([spec])
        if self._traced.get(name, True):
            return False
        if stem is not None and self.lookup(stem):
            if stem not in self._traced:
                self._traced[stem] = True
            return not self._traced[stem]
        return True

    def fprobe_targets(self, spec: ProbeSpec) -> list[tuple[int, str]]:
        """The ftrace locations (address, function) an ``f`` line's filter matches, or a
        ``t`` line's stub (``__probestub_TP``)."""
        if spec.symbol is None:
            return []
        funcs = ftrace_addrs(self.vm, frozenset(self.symbols.modules()))
        if spec.is_tprobe:
            return fprobe_matches(probestub(spec.symbol), funcs)
        return fprobe_matches(spec.symbol, funcs)

    def refresh_modules(self) -> frozenset[str]:
        loaded = frozenset(self.vm.refresh_module_symbols())
        for mod in self.symbols.modules() - loaded:
            self.symbols.drop_module(mod)
        self._loaded = loaded
        return loaded

    def module_loaded(self, name: str) -> bool:
        loaded = self._loaded if self._loaded is not None else self.refresh_modules()
        return name in loaded

    def lookup(self, name: str) -> int | None:
        """``kallsyms_lookup_name()``: vmlinux first, then the modules; ``MOD:SYM`` too."""
        sym = self.symbols.get(name)
        return sym.addr if sym is not None else None

    @property
    def rules(self) -> Any:
        """The booted kernel's probe-event rules (``harness.kernel.rules``)."""
        facts = getattr(self.vm, "facts", None)
        if facts is None:
            return rules_for(None)
        return facts.rules

    def view(self) -> Any:
        """The booted kernel as the parser sees it (``harness.kernel.grammar.KernelView``)."""
        def read(addr: int, n: int) -> bytes:
            return self.vm.host.read(addr, n)
        view = kernel_view(self.vm.facts, self.symbols, read=read, loaded=self.module_loaded)
        return dataclasses.replace(view, event_format=self.event_format)

    def event_format(self, system: str, event: str) -> EventFormat | None:
        """The guest's ``events/SYSTEM/EVENT/format`` (None: no such event), for an event
        probe's ``find_and_get_event()`` and its fields; read once per event."""
        key = (system, event)
        if key not in self._formats:
            path = f"{TRACING_EVENTS}/{system}/{event}/format"
            (got,) = self.vm.pull_many([path], timeout=30)
            try:
                self._formats[key] = None if isinstance(got, Exception) else \
                    parse_format(got.decode("utf-8", "replace"))
            except ValueError:
                self._formats[key] = None
        return self._formats[key]

    def kernel_spec(self, spec: ProbeSpec) -> ProbeSpec | Refusal:
        """Step 2: ``spec`` as the booted kernel parses it, or its refusal.

        :raise NotMirroredError: a kind this kernel takes and the host does not mirror.
        """
        if spec.kind == "-" or getattr(self.vm, "facts", None) is None:
            return spec
        # A uprobe's PATH:SYMBOL was resolved to PATH:OFFSET (runner.resolve_uprobes()): its
        # canonical line says so, its text does not.
        text = format_spec(spec) if spec.is_uprobe else \
            (spec.text or format_spec(spec)).split("#", 1)[0]
        try:
            got = parse(text, kernel=self.view())
        except NotMirroredError:
            raise
        except ProbeSpecError as exc:
            # the kernel's words: its logger (the parser of the line's kind, an event
            # filter, 7.3's dynevent), message and caret; a refusal it does not log shows
            # as the write's strerror() text (Refusal.words())
            return Refusal(exc.errno, str(exc), exc.column if exc.logged else -1,
                           error_subsystem(exc), exc.logged)
        if spec.is_uprobe:      # the harness's own PATH:SYMBOL resolution is kept
            import dataclasses
            got = dataclasses.replace(got, path=spec.path, offset=spec.offset, symbol=spec.symbol,
                                      ref_ctr_offset=spec.ref_ctr_offset,
                                      event=spec.event, explicit_event=spec.explicit_event)
        return got

    def admit(self, spec: ProbeSpec) -> Admission:
        """Steps 1-4 of the module docstring for one line."""
        if spec.is_uprobe:
            ref = uprobe_file_refusal(self.vm, spec)
            if ref is not None:
                return Admission(spec, ref)
        got = self.kernel_spec(spec)
        if isinstance(got, Refusal):
            return Admission(spec, got, reason=f"{self.rules.series}'s parser: {got.message}")
        spec = got
        if not spec.is_uprobe and not spec.is_eprobe:
            ref = target_refusal(spec, self.symbols.count) \
                if self.rules.symbol_check == "after_retprobe" else None
            if ref is not None:
                return Admission(spec, ref)
        if not self._events_read:       # the guest's trace events, read once, lazily
            self.table.other |= guest_event_names(self.vm)
            self._events_read = True
        # register_trace_fprobe() (6.12) / register_trace_fprobe_event() (7.3): the event
        # (a new one, or one appended to) first, then the fprobe itself
        # (__register_trace_fprobe()): kph fuzz found a t: line on a missing tracepoint,
        # named as an existing kprobe event, taken as pending instead of EVENT_EXIST
        ref = self.table.check(spec)
        if ref is None and spec.is_fprobe and not self.fprobe_targets(spec):
            if spec.is_tprobe:
                # find_tracepoint() found none: TRACEPOINT_STUB, registered when a module
                # brings the tracepoint (__tracepoint_probe_module_cb())
                return Admission(spec, pending=f"kept unregistered: no tracepoint "
                                               f"{spec.symbol} in the kernel (a module may "
                                               "bring it)")
            # register_fprobe(): ftrace_set_filter() matches no location
            return Admission(spec, Refusal(_errno.EINVAL, self.rules.message(
                self.rules.fprobe_no_match), arg_column(spec, 1)),
                reason=f"no ftrace location matches {spec.symbol!r} "
                       "(available_filter_functions_addrs)")
        if ref is None and spec.is_tprobe and self.rules.tprobe_stub_once and any(
                o.is_tprobe and o.symbol == spec.symbol
                for olds in self.table.defined.values() for o in olds):
            ref = Refusal.silent(_errno.EEXIST)
        if ref is not None:
            if spec.is_fprobe and self.rules.fprobe_register_errno is not None:
                ref = dataclasses.replace(ref, errno=self.rules.fprobe_register_errno)
            return Admission(spec, ref)
        if spec.is_uprobe:
            return Admission(spec)
        if not spec.is_fprobe and not spec.is_eprobe and self.notrace(spec):
            return Admission(spec, Refusal(_errno.EINVAL, FAIL_REG_PROBE, arg_column(spec, 1)),
                             reason="no ftrace location (notrace): within_notrace_func()")
        resolved = resolve_fetch_symbols(spec, self.lookup)
        if isinstance(resolved, Refusal) and spec.is_eprobe:
            # traceprobe_update_arg() fails the line, and trace_eprobe_create_internal()
            # returns its errno without logging anything (6.12, 7.3)
            return Admission(spec, Refusal.silent(resolved.errno),
                             reason=f"@SYM: {resolved.message} (traceprobe_update_arg())")
        if isinstance(resolved, Refusal) and spec.is_fprobe:
            # __register_trace_fprobe()'s traceprobe_update_arg(): 6.12 at the write, the
            # create function logging it at the target as for a kprobe; 7.3 at the
            # event's enable, which fails with its errno and logs nothing
            why = f"@SYM: {resolved.message} (traceprobe_update_arg())"
            if self.rules.fprobe_register_at_enable:
                return Admission(spec, Refusal.silent(resolved.errno),
                                 reason=f"{why}, at enable")
            return Admission(spec, resolved, reason=why)
        if isinstance(resolved, Refusal):
            after = registration_refusal(spec, resolved.errno, self.module_loaded)
            if after is None:
                return Admission(spec, pending=self._pending_reason(spec))
            return Admission(spec, resolved)
        if spec.module is not None and not self.module_loaded(spec.module):
            return Admission(resolved, pending=self._pending_reason(spec))
        return Admission(resolved)

    def registered(self, spec: ProbeSpec, errno: int | None) -> Admission:
        """Step 5: the backend's ``register_kprobe()`` gave ``-errno`` (None: success)."""
        if errno is None:
            self.table.add(spec)
            return Admission(spec)
        ref = registration_refusal(spec, errno, self.module_loaded)
        if ref is None:
            self.table.add(spec)
            return Admission(spec, pending=self._pending_reason(spec))
        if spec.is_fprobe and self.rules.fprobe_register_errno is not None:
            # 7.3's trace_fprobe_create_internal() fails the write with -EINVAL after
            # logging what register_trace_fprobe_event() said
            ref = dataclasses.replace(ref, errno=self.rules.fprobe_register_errno)
        return Admission(spec, ref)

    def release(self, spec: ProbeSpec) -> tuple[list[ProbeSpec], Refusal | None]:
        """A ``-:`` line: the lines it frees written to the file the guest's side writes
        it to (``EventTable.release``), or -ENOENT when it matches none
        (``dyn_event_release()`` logs nothing then)."""
        gone = self.table.release(spec, events_file(spec, self._line_files))
        if not gone:
            return [], Refusal.silent(_errno.ENOENT)
        return gone, None

    def accept_pending(self, spec: ProbeSpec) -> None:
        self.table.add(spec)

    @staticmethod
    def _pending_reason(spec: ProbeSpec) -> str:
        if spec.symbol is None:
            return ("kept unregistered: register_kprobe() found nothing there, and 6.1 keeps "
                    "a raw-address event on -ENOENT")
        return (f"kept unregistered: module {spec.module} is not loaded (6.1 registers it "
                "when the module loads)")


#: place(spec, name, index) -> the Outcome of a placed line; raises ProbeRejectedError
#: with the kernel's errno when ``register_kprobe()`` would refuse it.
Place = Callable[[ProbeSpec, str, int], Outcome]
#: release(layer, spec, name, index) -> the Outcome of a ``-:`` line.
Release = Callable[["TraceLayer", ProbeSpec, str, int], Outcome]


#: one word of guest memory a side's switch changes: ``(addr, size, set, clear)``, the new
#: value ``(old & ~clear) | set`` (what the plugin's CMD_WINDOW writes, kph_proto.h)
GuestWrite = tuple[int, int, int, int]


def write_switch(engine: Any, writes: Sequence[GuestWrite]) -> None:
    """Apply a side's switch through a host engine that holds the guest halted (the
    gdbstub engine's ``halted()``): each word read, changed and written back."""
    for addr, size, set_, clear in writes:
        old = int.from_bytes(engine.read(addr, size), "little")
        engine.write(addr, ((old & ~clear) | set_).to_bytes(size, "little"))


def refused(name: str, spec: ProbeSpec, refusal: Refusal, *, index: int,
            reason: str = "", words: str = "") -> Outcome:
    """The Outcome of a line the kernel refuses: its errno and its ``error_log`` words
    (:meth:`harness.kernel.dynevent.Refusal.words`: the subsystem of the line's kind, the
    message, the caret), ``reason`` the side's own account (default: the message);
    ``words`` names the case when this side cannot know them
    (:data:`harness.kernel.dynevent.UNKNOWN_WORDS`)."""
    sub, msg, col = refusal.words(spec)
    return Outcome.rejected(name, refusal.errno, msg, index=index,
                            reason=reason or refusal.message, subsystem=sub, column=col,
                            words=words)


def register_lines(layer: TraceLayer, specs: Sequence[ProbeSpec], place: Place,
                   release: Release, mode: str) -> list[Outcome]:
    """Place every line as ``kprobe_events`` would, for a host engine's backend: the
    trace layer's checks in the kernel's order, then the engine's ``register_kprobe()``
    rules (``place``); one Outcome per line, refusals with the kernel's errno and
    ``error_log`` text, lines kept unregistered as pending."""
    layer.prepare(specs)
    out = []
    for i, spec in enumerate(specs):
        name = f"{spec.group}/{spec.event}"
        if spec.kind == "-":
            out.append(release(layer, spec, name, i))
            continue
        adm = layer.admit(spec)
        spec = adm.spec          # as the booted kernel parsed it
        reason = adm.reason
        if adm.refusal is None and not adm.pending:
            try:
                out.append(place(spec, name, i))
                continue
            except ProbeRejectedError as exc:
                if spec.is_uprobe:
                    # uprobe_register() fails at enable in the guest, where nothing is
                    # logged (trace_uprobe.c: probe_event_enable())
                    out.append(refused(name, spec, Refusal.silent(exc.errno), index=i,
                                       reason=exc.reason))
                    continue
                adm, reason = layer.registered(spec, exc.errno), exc.reason
        elif adm.pending:
            layer.accept_pending(spec)
        if adm.refusal is not None:
            out.append(refused(name, spec, adm.refusal, index=i, reason=reason))
        else:
            out.append(Outcome(name, True, mode=mode, index=i, pending=adm.pending))
    return out


#: :func:`rename_effects`: each pid's last comm, its hits' indexes, its renames
Effects = tuple[dict[int, str], dict[int, list[int]], dict[int, list[tuple[int, str]]]]


def rename_effects(hits: Sequence[Hit], comm_changes: Sequence[tuple[int, int, str]]) -> Effects:
    """For :func:`saved_cmdlines`: each pid's last comm (pid 0 ``<idle>``), each pid's hits'
    indexes in order, and each pid's renames in their order with the index of the hit
    where each takes effect (``len(hits)``: none)."""
    mine: dict[int, list[int]] = {}             # pid -> its hits' indexes, in order
    pids = list(map(_pid, hits))
    distinct = set(pids) - {None}
    if len(distinct) <= _FEW_PIDS:              # a hot probe's run: a few pids, found in C
        mine = {p: list(compress(range(len(pids)), map(operator.eq, pids, repeat(p))))
                for p in distinct}
    else:
        for i, p in enumerate(pids):
            if p is not None:
                mine.setdefault(p, []).append(i)
    last = {0: "<idle>", **{p: hits[idx[-1]].comm for p, idx in mine.items() if p}}
    effect = []
    for j, pid, c in comm_changes:
        idx = mine.get(pid, [])
        at = bisect.bisect_left(idx, j)
        effect.append(next((k for k in idx[at:] if hits[k].comm == c), len(hits)))
    # a task's renames are one after the other (__set_task_comm() under task_lock()), so
    # one has taken effect by the time a later one of its pid has: ``sh -c CMD`` is
    # renamed to sh and then to CMD, and no hit may show sh once one shows CMD
    soonest: dict[int, int] = {}
    for r in range(len(comm_changes) - 1, -1, -1):
        pid = comm_changes[r][1]
        effect[r] = soonest[pid] = min(effect[r], soonest.get(pid, effect[r]))
    # per pid, the renames in their order with where each takes effect
    renames: dict[int, list[tuple[int, str]]] = {}
    for (_, pid, c), k in zip(comm_changes, effect):
        renames.setdefault(pid, []).append((k, c))
    return last, mine, renames


def saved_cmdlines(hits: Sequence[Hit], comm_changes: Sequence[tuple[int, int, str]]) -> list[Hit]:
    """The hits as the trace file prints them: each pid under the comm of its *last* hit
    (the trace stores pids and prints comms from ``saved_cmdlines``, recorded after the
    events; pid 0 is ``<idle>``: kernel/trace/trace.c, ``trace_find_cmdline()``), each
    hit carrying the comms its pid took after it (``comm_changes``: (hits recorded
    before the rename, pid, new comm)) for ``harness.diff.verdict``'s ``comm-change`` rule.

    A rename is seen at ``__set_task_comm()``'s entry, and the comm changes later in it
    (fs/exec.c, 6.1 to 7.3: ``task_lock()``, ``trace_task_rename()``, then
    ``strscpy_pad()`` into ``tsk->comm``; interrupts stay on): an interrupt taken in
    between records hits of that pid under the old comm after the rename was seen. So a
    rename takes effect at the first hit of its pid from then on that shows the new comm,
    or where a later rename of that pid does if that is sooner, and comes after every hit
    of that pid before it."""
    last, mine, renames = rename_effects(hits, comm_changes)
    # pid by pid, in pieces of its hits cut where its renames take effect: a piece's
    # later comms are one, and a piece that shows them and the pid's comm already (a
    # hot probe's 100,000 hits are a few pids' runs) is found so in C
    out = list(hits)
    comms, alts = list(map(_comm, hits)), list(map(_alts, hits))
    for pid, idx in mine.items():
        comm = last[pid]
        rs = renames.get(pid) or []
        cuts = [bisect.bisect_left(idx, k) for k in sorted({k for k, _ in rs})]
        for lo, hi in zip([0, *cuts], [*cuts, len(idx)]):
            piece = idx[lo:hi]
            if not piece:
                continue
            later = tuple(c for k, c in rs if k > piece[0])
            if list(map(comms.__getitem__, piece)).count(comm) == len(piece) and \
                    list(map(alts.__getitem__, piece)).count(later) == len(piece):
                continue
            for i in piece:
                h = hits[i]
                if comm != h.comm or later != h.comm_alts:
                    out[i] = h.changed(comm=comm, comm_alts=later)
    return out


#: :func:`rename_effects` finds each pid's hits in C (a pass each) up to this many pids
_FEW_PIDS = 8
_pid, _comm, _alts = (operator.attrgetter(a) for a in ("pid", "comm", "comm_alts"))
