"""Run probe specs on one side, or on two sides observing one execution, for a workload.

Why one execution and not two runs: fetch args such as ``%dx`` at ``do_sys_openat2`` are
kernel stack pointers, different in every process; only the very same hits can be
compared field by field. So both sides are armed at once: host-side first (its address
checks see the original instructions, not the guest's int3), then in-guest, then the host
forgets what it decoded (the guest's probes changed the text). At a shared address the
host breakpoint fires before the guest's own ftrace call, int3 or jump, records, then
executes the instruction, which runs the guest's probe. One workload, the same calls.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Callable, Mapping, Sequence

from ..backends import make_backend
from ..backends.triggers import check_counts as check_trigger_counts, resolve as resolve_triggers
from ..errors import HarnessError, NotMirroredError, SetupError, VMError
from ..backends.host import FetchHook, HostBackend
from ..kernel.grammar import ProbeSpec
from ..progress import ProgressFn, hits_text, say, ticking
from ..records import SideResult
from ..kernel.grammar.uprobe import resolve_symbol
from ..backends.tracelayer import uprobe_file_refusal
from ..backends.plugin import PluginBackend
from ..engines.uprobes import UprobeNeverFires, cached_elf, file_stat, one_stat_each
from ..machine.image.store import default_image
from ..machine.kwatch import KernelWatch
from ..kernel.splat import KernelFinding
from .matrix import KernelRun, MatrixResult, compare_kernels
from .rules import GUEST_SIDES
from .verdict import compare
from ..vmctl import Machine
from ..machine.image.build import image_for

log = logging.getLogger(__name__)


def resolve_uprobes(vm: Machine, specs: Sequence[ProbeSpec]) -> list[ProbeSpec]:
    """Turn the harness's ``PATH:SYMBOL[+OFFS]`` uprobe form into the file offset the
    kernel needs, from the program's ELF read out of the guest; other specs pass as is."""
    out = []
    for spec in specs:
        if spec.is_uprobe and spec.symbol is not None:
            if uprobe_file_refusal(vm, spec) is not None:
                # The kernel checks the file before the offset: leave the offset at 0 so
                # every side refuses the line for its file, with the kernel's text.
                out.append(dataclasses.replace(spec, symbol=None, offset=0,
                                               event=spec.event if spec.explicit_event else ""))
                continue
            try:
                # the program as pulled before on this machine while its stat is the same
                # (0.75 MB for kph-loop: ~0.1 s a pull under TCG)
                f = file_stat(vm, spec.path)
                try:
                    elf: Any = cached_elf(vm, f, spec.path) if f is not None else vm.pull(spec.path)
                except UprobeNeverFires:        # not an ELF file: resolve_symbol says so
                    elf = vm.pull(spec.path)
            except HarnessError as exc:
                raise SetupError(f"cannot read {spec.path} in the guest to resolve "
                                 f"{spec.symbol} ({exc})",
                                 "give a program that exists in the image, or PATH:OFFSET") from None
            new = resolve_symbol(spec, elf)
            log.info("%s:%s resolved to file offset %#x", spec.path, spec.symbol, new.offset)
            spec = new
        out.append(spec)
    return out


def _live_hits(side: Any) -> Any:
    """What ``ticking`` shows while the workload runs: the hits counted so far by a
    host-side backend (its counters are host memory, readable while the guest runs);
    in-guest counts are read only after the workload."""
    return lambda s: f"workload running {s:.0f} s: {side.side} {hits_text(side.counters())}"


def run_single(vm: Machine, backend: str, specs: Sequence[ProbeSpec], workload: str, *,
               timeout: float = 120.0, progress: ProgressFn | None = None) -> SideResult:
    """Place ``specs`` with one backend, run ``workload``, collect, unregister.

    :param progress: told each phase (``harness.progress``), and the host-side hit count
        while the workload runs when it can show live lines.
    """
    watch = KernelWatch(vm)
    with watch.watching():
        res = _single(vm, backend, specs, workload, timeout=timeout, progress=progress)
        return dataclasses.replace(res, splats=watch.finish())


def _single(vm: Machine, backend: str, specs: Sequence[ProbeSpec], workload: str, *,
            timeout: float, progress: ProgressFn | None) -> SideResult:
    specs = resolve_uprobes(vm, specs)
    be = make_backend(backend, vm)
    try:
        say(progress, f"registering {len(specs)} probe line(s) on {be.side}")
        outcomes = be.register(specs)
        be.enable()
        say(progress, f"workload running: {workload}")
        live = _live_hits(be) if be.side in ("host", "plugin") else (
            lambda s: f"workload running {s:.0f} s")
        with ticking(progress, live):
            r = vm.run(workload, timeout=timeout)
        be.disable()
        say(progress, f"collecting the hits ({be.side})")
        hits, counters = be.collect(), be.counters()
        after = getattr(be, "after_text", lambda name: None)
        return SideResult(be.side, outcomes, hits, counters, r.status,
                         r.stdout + r.stderr, r.stderr,
                         preempt=preempt_model(vm, after("preempt"))
                         if be.side in GUEST_SIDES else None)
    finally:
        be.close()


def run_differential(vm: Machine, specs: Sequence[ProbeSpec], workload: str, *,
                     guest: str = "events", hook: FetchHook | None = None,
                     timeout: float = 120.0, progress: ProgressFn | None = None,
                     triggers: Mapping[str, int] | None = None, post_handler: bool = False,
                     raw_kprobes: bool = False, registrations_only: bool = False,
                     buffer_mib: int | None = None) -> tuple[SideResult, SideResult]:
    """Host-side and in-guest (``guest``: events or module) on one execution of ``workload``.

    :param progress: told each phase (``harness.progress``), and the host-side hit count
        while the workload runs when it can show live lines.
    :param post_handler: with ``guest="module"``: each kprobe gets a post_handler, and
        where it saw the probed instruction go is checked (``Hit.post_ip``)
    :param raw_kprobes: with ``guest="module"``: the kprobes are registered as a kernel
        module registers them, ``register_kprobe()`` alone, on both sides: none of
        ``trace_kprobe``'s own checks around it (``TraceLayer.raw``)
    :param registrations_only: register on both sides and unregister, with no workload
        and no hit: the sides' outcomes alone (the host arms nothing)
    :param buffer_mib: the in-guest side's record buffer, MiB (``make_backend``); a run
        that overflows it fails with the size that would hold it (``GuestLossError``)
    :param triggers: ``{EVENT: count}`` of ``stacktrace`` triggers
        (``harness.backends.triggers.parse_triggers``; -1: no count): the guest's events
        get them, the host takes ``regs.stack_trace()`` at the same hits.

    The kernel is watched over the run (``harness.machine.kwatch``): both results carry
    its splats (``SideResult.splats``), a panic or a hang is raised as the finding it is
    (``KernelPanicFinding``, ``GuestHangError``), and each side says which dynamic events
    its lines left (``SideResult.events_left``: ``--guest events`` and the host model).
    """
    watch = KernelWatch(vm)
    # a uprobe's file is stat-ed once a run (its refusal, its ELF, its inode, its place):
    # the run's view of each file, as a registered uprobe keeps the inode it was given
    with watch.watching(), one_stat_each(vm):
        host, guest_res = _differential(vm, specs, workload, guest=guest, hook=hook,
                                        timeout=timeout, progress=progress, triggers=triggers,
                                        post_handler=post_handler, raw_kprobes=raw_kprobes,
                                        registrations_only=registrations_only,
                                        buffer_mib=buffer_mib)
        splats = watch.finish()
    return (dataclasses.replace(host, splats=splats),
            dataclasses.replace(guest_res, splats=splats))


def events_listed(vm: Machine, specs: Sequence[ProbeSpec], text: str | None = None
                  ) -> tuple[str, ...]:
    """The guest's ``dynamic_events`` now (or ``text``, read with the run's collection:
    ``EventsBackend.after_text``), as ``GROUP/EVENT`` per line (sorted), of the groups
    ``specs`` name (other groups' events are not this run's)."""
    groups = {s.group for s in specs if s.group}
    if text is None:
        text = vm.pull("/sys/kernel/tracing/dynamic_events", timeout=60).decode("utf-8",
                                                                               "replace")
    names = []
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if ":" in head:
            name = head.split(":", 1)[1]
            if name.split("/", 1)[0] in groups:
                names.append(name)
    return tuple(sorted(names))


def events_modelled(backend: Any) -> tuple[str, ...] | None:
    """The dynamic events a host-side backend's model says its lines left
    (``TraceLayer.table``), as ``GROUP/EVENT`` per line (sorted); None without a model."""
    layer = getattr(backend, "layer", None)
    if layer is None:
        return None
    return tuple(sorted(f"{s.group}/{s.event}" for s in layer.table.specs()))


def _differential(vm: Machine, specs: Sequence[ProbeSpec], workload: str, *,
                  guest: str, hook: FetchHook | None, timeout: float,
                  progress: ProgressFn | None, triggers: Mapping[str, int] | None,
                  post_handler: bool = False, raw_kprobes: bool = False,
                  registrations_only: bool = False, buffer_mib: int | None = None
                  ) -> tuple[SideResult, SideResult]:
    specs = resolve_uprobes(vm, specs)
    trig = resolve_triggers(triggers or {}, [f"{s.group}/{s.event}" for s in specs
                                             if s.kind != "-"])
    check_trigger_counts(triggers or {}, specs)
    if trig and guest != "events":
        raise NotMirroredError("stacktrace triggers are event triggers: compare them with "
                               "--guest events", "", 0, hint="use --guest events")
    if trig and getattr(vm, "host_kind", "gdbstub") == "plugin":
        raise NotMirroredError("stacktrace triggers are mirrored by the gdbstub engine "
                               "(the plugin's records hold no stack)", "", 0,
                               hint="use --host gdbstub")
    if post_handler and guest != "module":
        raise SetupError("post_handlers are the module's (a kprobe_events probe has none)",
                         "use --guest module with --post-handler")
    if raw_kprobes and guest != "module":
        raise SetupError("raw kprobes are the module's (kprobe_events always runs "
                         "trace_kprobe's checks)", "use --guest module with --raw-kprobes")
    g = make_backend(guest, vm, post_handler=post_handler, buffer_mib=buffer_mib)
    g.raw_kprobes = raw_kprobes
    if trig:
        g.triggers = trig
    h: Any = None
    try:
        comm_rule = "saved_cmdlines" if guest == "events" else "at_hit"
        if getattr(vm, "host_kind", "gdbstub") == "plugin":   # issue 15: the plugin engine
            if hook is not None:
                raise SetupError("a fetch hook needs the gdbstub engine",
                                 "boot with host='gdbstub' to use hook=")
            h = PluginBackend(vm, comm_rule=comm_rule)
        else:
            h = HostBackend(vm, hook=hook, comm_rule=comm_rule, triggers=trig)
        h.raw_kprobes = raw_kprobes
        say(progress, f"registering {len(specs)} probe line(s): {h.side} and {guest}")
        h_out = h.register(specs)
        g_out = g.register(specs)
        if registrations_only:
            return SideResult(h.side, h_out), SideResult(g.side, g_out)
        vm.host.invalidate_code()
        # Both sides' probes are live over the same window, so that return-probe pools
        # (and their nmissed) see the same calls: events and host probes are enabled
        # together; the module's are live from its registration to its unloading, so the
        # host arms right after registering it and disarms after reading its counters.
        if guest == "module":
            h.arm()
        # With the gdbstub engine the guest's side (tracing_on, or the module's recording
        # flag) is switched on and off in the same halt of the guest as the host's probes:
        # no hit of another task (idle, softirq) falls between the two sides' windows,
        # and the halt is one where no vCPU is between the host's breakpoint and the
        # guest's handler (HostEngine.halted(settle=True)).
        # With the plugin engine the same: its recording window opens and closes with the
        # guest's switch, written by a vCPU as it enters or leaves idle
        # (PluginBackend.enable(switch=...)).
        same_halt = isinstance(h, HostBackend)
        g.enable(**({"tracing": False} if guest == "events" else {"recording": False}))
        # The guest's kprobe events count nhit from their enabling: read at both halts, the
        # difference is the window's, as the host's (Counters.window), when both are settled
        marks = guest == "events"
        unsettled = h.engine.stats.get("unsettled", 0)
        reads: list[int] = []
        if same_halt:
            def start() -> None:
                g.switch(True)
                if marks:
                    g.mark_nhits()
                if trig:    # the counts the guest's triggers have left, in this halt
                    h.trigger_counts(g.trigger_counts())
            h.enable(also=start)
        else:   # the plugin reads the guest's nhit words as its window switches
            reads = g.nhit_words() if marks else []
            h.enable(switch=g.switch_writes(True), reads=reads)
        say(progress, f"workload running: {workload}")
        with ticking(progress, _live_hits(h)):
            r = vm.run(workload, timeout=timeout)
        if same_halt:
            def stop() -> None:
                g.switch(False)
                if marks:
                    g.mark_nhits()
            h.disable(disarm=guest != "module", also=stop)
        else:
            h.disable(disarm=guest != "module", switch=g.switch_writes(False), reads=reads)
        g.disable()
        if not same_halt and reads:     # the closing is applied by now (the agent ran)
            for values in h.engine.window_marks():
                g.add_nhit_mark(values)
        say(progress, f"collecting the hits ({guest}: reading the guest's records)")
        settled = h.engine.stats.get("unsettled", 0) == unsettled
        g_hits = g.collect()
        g_counters = g.counters(window=settled) if marks else g.counters()
        after = getattr(g, "after_text", lambda name: None)
        g_left = events_listed(vm, specs, after("dynamic_events")) if guest == "events" else None
        h.disarm()
        host = SideResult(h.side, h_out, h.collect(), h.counters(), r.status, r.stdout + r.stderr,
                         r.stderr, events_left=events_modelled(h) if g_left is not None else None)
        guest_res = SideResult(g.side, g_out, g_hits, g_counters, r.status,
                              r.stdout + r.stderr, r.stderr, events_left=g_left,
                              preempt=preempt_model(vm, after("preempt")))
        return host, guest_res
    finally:
        if h is not None:
            h.close()
        g.close()


def preempt_model(vm: Machine, text: str | None = None) -> str | None:
    """The guest kernel's preemption model now: the mode in parentheses of
    ``/sys/kernel/debug/sched/preempt`` (PREEMPT_DYNAMIC: kernel/sched/debug.c:
    sched_dynamic_show(); "none (voluntary) full" on Debian's 6.1 and 6.12, "full (lazy)"
    on 7.3), else the model the image's config builds (CONFIG_PREEMPT: full,
    CONFIG_PREEMPT_LAZY: lazy, else voluntary or none); None when neither is known."""
    if text is None:        # else read with the run's collection (EventsBackend.after_text)
        (got,) = vm.pull_many(["/sys/kernel/debug/sched/preempt"], timeout=30)
        text = "" if isinstance(got, Exception) else got.decode("utf-8", "replace")
    m = re.search(r"\((\w+)\)", text)
    if m:
        return m[1]
    facts = getattr(getattr(vm, "image", None), "facts", None)
    config = getattr(facts, "config", None) or {}
    if not config:
        return None
    for opt, model in (("CONFIG_PREEMPT", "full"), ("CONFIG_PREEMPT_LAZY", "lazy"),
                       ("CONFIG_PREEMPT_VOLUNTARY", "voluntary")):
        if config.get(opt) == "y":
            return model
    return "none"


def trampoline_text(vm: Machine) -> tuple[str, ...]:
    """How the host trampolines print in a guest trace: the kretprobe one (``_etext+0x0``
    as an ip, ``0xffffffff82000000`` as a value: a guest probe at the same ftrace location
    fetches the return-address slot after the host hooked it) and each uretprobe one used
    (``0x478c71``: the print is ``0x%lx``, matched whole)."""
    hit = vm.symbols.symbolize(vm.host.trampoline)
    texts = [f"{hit[0].name}+{hit[1]:#x}" if hit else f"0x{vm.host.trampoline:x}"]
    if hit:
        texts.append(f"0x{vm.host.trampoline:x}")
    up = vm.host._uprobes
    if up is not None:
        texts += [f"0x{t:x}" for t in up.used_trampolines]
    return tuple(texts)


class _prefixed:
    """A progress sink that prefixes every line (phases and live ones) for another sink."""

    def __init__(self, sink: Any, prefix: str) -> None:
        self.sink, self.prefix = sink, prefix
        if getattr(sink, "transient", None) is not None:
            self.transient = lambda text: sink.transient(prefix + text)

    def __call__(self, text: str) -> None:
        if self.sink is not None:
            self.sink(self.prefix + text)


def row_names(images: Sequence[Any]) -> list[str]:
    """A matrix row's name: a Debian kernel's series (6.12); a tree's series with ``src``
    and its patches (``6.12 src``, ``6.12 src+btf-char-ptr-needs-a-pointer``); the image's
    directory name where two rows would share one."""
    names = []
    for img in images:
        tree = img.manifest.get("tree")
        if tree is None:
            names.append(img.series)
        else:
            pats = "+".join(p["name"].removesuffix(".patch") for p in tree.get("patches", []))
            names.append(f"{img.series} src" + (f"+{pats}" if pats else ""))
    return [img.dir.name if names.count(n) > 1 else n for n, img in zip(names, images)]


def run_matrix(kernels: Sequence[str], specs: Sequence[ProbeSpec], workload: str, *,
               guest: str = "events", timeout: float = 120.0, qemu: str | None = None,
               build: bool = True, progress: Any = None,
               check_run: Callable[[SideResult], None] | None = None,
               findings: dict[str, tuple[Any, ...]] | None = None) -> Any:
    """``run_differential`` on each kernel's image (built first when missing and
    ``build``), then the kernels' guests compared (``harness.diff.matrix``).

    A kernel that cannot be run (no image and no build, a boot failure) is reported in its
    row with the reason; the others still run. ``check_run`` sees each kernel's host
    result first and may raise ``SetupError`` (``kph matrix``: a workload that did not
    run, exit 126 or 127, ends the matrix at the first kernel, as ``kph diff`` ends).
    ``findings``, when given, gets each row's kernel splats (``harness.kernel.splat``), a
    row lost to a panic or a hang included (its error then names the verdict).
    """
    say = progress or (lambda s: None)
    out = MatrixResult(workload)
    images = []
    for sel in kernels:
        if not build:
            img = default_image(sel)
        else:
            img = image_for(sel, qemu=qemu, progress=say)
        images.append(img)
    for img, name in zip(images, row_names(images), strict=True):
        rules = img.facts.rules.series
        say(f"matrix: {name} ({img.version}, rules {rules}): booting")
        kr = KernelRun(name, img.version, rules=rules)
        try:
            with Machine.boot(img, qemu=qemu) as vm:
                host, guest_res = run_differential(
                    vm, specs, workload, guest=guest, timeout=timeout,
                    progress=_prefixed(progress, f"matrix: {name}: "))
                if check_run is not None:
                    check_run(host)
                say(f"matrix: {name}: comparing")
                kr.diff = compare(host, guest_res, trampoline=trampoline_text(vm))
                kr.host, kr.guest = host, guest_res
                if findings is not None:
                    findings[name] = host.splats
        except (VMError, HarnessError) as exc:
            if isinstance(exc, SetupError):
                raise
            kr.error = str(exc).splitlines()[0]
            if isinstance(exc, KernelFinding):
                kr.error = f"{exc.verdict}: {kr.error}"
                if findings is not None:
                    findings[name] = exc.splats
            say(f"matrix: {name}: {kr.error}")
        out.kernels.append(kr)
    out.differences = compare_kernels(out.kernels)
    return out
