"""kprobe_events specs placed host-side: HostEngine probes that fetch like the kernel.

Each ``p`` spec becomes a ``Kprobe`` whose pre_handler evaluates the spec's fetch args on
the stopped vCPU (``harness.kernel.grammar.fetch.evaluate``) and records a ``Hit`` with the text the
guest's trace file would print; each ``r`` spec a ``Kretprobe`` doing the same at the
return. What the context gives the evaluator mirrors the kernel's view in a kprobe
handler: ``%ip`` is the probe address + 1 (the int3 convention that ftrace-based and
optimized probes emulate too), ``$comm`` is ``current->comm``, user memory is read in
the current address space.
"""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from ..errors import (EngineReadError, HandlerError, HarnessError, MemoryFaultError,
                      ProbeRejectedError)
from ..kernel.grammar.fetch import FaultError, below_sp, escape_bytes, evaluate, format_ip, format_value
from ..kernel.kprobes import Kprobe, Kretprobe, ProbeFlags, PtRegs
from ..kernel.unwind import stack_trace
from ..kernel.grammar import ProbeSpec
from ..records import Counters, Hit, Outcome
from ..engines.uprobes import Uprobe, UprobeNeverFires
from .eprobes import COMMIT, CommitSite, trigger_args, triggered
from .tracelayer import (FprobeOps, TraceLayer, attach_stubs, detach_stubs, fprobe_pool,
                         refused, register_lines, saved_cmdlines, spec_group)
from ..vmctl import Machine

log = logging.getLogger(__name__)

#: hook(probe_name, nth_hit, overrides): may set registers in ``overrides`` (kernel field
#: names) that the host's *evaluation* sees for that hit; the guest is not changed. A way
#: to make the two worlds disagree on purpose (tests, teaching).
FetchHook = Callable[[str, int, dict[str, int]], None]


class _Ctx:
    """``harness.kernel.grammar.fetch.FetchContext`` over one host-side hit."""

    def __init__(self, engine: Any, regs: PtRegs, ip: int, overrides: dict[str, int],
                 uprobe: Uprobe | None = None, entry: bytes = b"", record: int = 0) -> None:
        self.engine, self.regs, self.ip, self.overrides = engine, regs, ip, overrides
        self.uprobe = uprobe
        self.entry = entry
        self.record = record

    @property
    def empty_user_string_len(self) -> int:
        return self.engine.vm.facts.rules.empty_user_string_len

    def event_record(self) -> int:
        """An event probe's attached record (``rec`` of ``eprobe_trigger_func()``)."""
        return self.record

    def comm_address(self) -> int:
        """``current->comm`` as an address (an event probe's untyped ``$comm``)."""
        task, off = self.task(), getattr(self.engine, "_comm_off", None)
        if task is None or off is None:
            raise EngineReadError("the engine does not know where current->comm is")
        return task + off

    def entry_arg(self, n: int) -> int:
        """``$argN`` of a return probe (6.12+, ``FETCH_OP_EDATA``): what the entry handler
        saved for argument ``n`` (0-based), 8 bytes per argument in order of first use."""
        i = self.entry_index.index(n) if n in self.entry_index else -1
        if i < 0 or 8 * i + 8 > len(self.entry):
            raise ValueError(f"argument {n + 1} was not saved at the entry")
        return int.from_bytes(self.entry[8 * i:8 * i + 8], "little")

    entry_index: tuple[int, ...] = ()

    def current_task(self) -> int:
        """``$current`` (7.3, ``FETCH_OP_CURRENT``)."""
        task = self.task()
        if task is None:
            raise FaultError(0, 8)
        return task

    def percpu_offset(self) -> int:
        """``this_cpu_ptr()``'s offset on this vCPU (7.3, ``FETCH_OP_CPU_PTR``)."""
        base = self.engine.percpu_base(self.regs)
        if base is None:
            raise FaultError(0, 8)
        return base

    def file_offset_vaddr(self, offset: int) -> int:
        up = self.uprobe
        if up is None or up.vaddr is None or up.offset is None:
            raise ValueError("@+OFFS is for uprobes only")
        return up.vaddr - up.offset + offset

    def reg(self, name: str) -> int:
        if name in self.overrides:
            return self.overrides[name] & ((1 << 64) - 1)
        if name == "ip":
            return self.ip
        if name == "orig_ax":
            return self.regs.orig_ax
        return self.regs.get(name)

    def read(self, addr: int, size: int) -> bytes:
        """``copy_from_kernel_nofault()``: a fault only where the guest does not map the
        memory, confirmed by a second, raw read; any other failure is the engine's, not a
        value (:class:`EngineReadError`, the run fails)."""
        below_sp(self.regs.sp, addr, size)
        stub = self.engine.stub
        try:
            return self._kernel_view(addr, stub.read_memory(addr, size))
        except MemoryFaultError:
            pass
        except HarnessError as exc:
            raise EngineReadError(f"the gdbstub engine could not read {size} byte(s) at "
                                  f"{addr:#x}: {exc}", addr, size) from exc
        try:
            for a in range(addr, addr + size, 1024):    # the stub's packets hold 2 KiB
                stub.read_memory_raw(a, min(1024, addr + size - a))
        except MemoryFaultError:
            raise FaultError(addr, size) from None
        except HarnessError as exc:
            raise EngineReadError(f"the gdbstub engine could not check a fault at {addr:#x}: "
                                  f"{exc}", addr, size) from exc
        raise EngineReadError(f"the gdbstub engine's read of {size} byte(s) at {addr:#x} "
                              "failed, yet the stub's raw read of it works", addr, size)

    def _kernel_view(self, addr: int, data: bytes) -> bytes:
        """``data`` with each return-address slot the host hooked holding what the guest
        kernel's own hook would have put there (``Rethook.kernel_slot_values``)."""
        slots = getattr(self.engine, "kernel_slot_values", None)
        patch = slots(addr, len(data)) if slots is not None else None
        if not patch:
            return data
        buf = bytearray(data)
        for slot, value in patch.items():
            raw = value.to_bytes(8, "little")
            for i in range(8):
                if 0 <= slot + i - addr < len(buf):
                    buf[slot + i - addr] = raw[i]
        return bytes(buf)

    read_user = read  # the current task's address space is the one the vCPU is in

    def uaccess_okay(self) -> bool:
        """``nmi_uaccess_okay()`` at this hit (``harness.kernel.grammar.fetch`` refuses a
        plain user-half read without it); a uprobe's reads do not ask (copy_from_user())."""
        if self.uprobe is not None:
            return True
        if not hasattr(self, "_uaccess"):
            fn = getattr(self.engine, "uaccess_okay", None)
            self._uaccess = True if fn is None else fn(self.regs, self.task())
        return self._uaccess

    def task(self) -> int | None:
        if not hasattr(self, "_task"):
            self._task = self.engine.current_task(self.regs)
        return self._task

    def comm(self) -> str:
        return self.comm_bytes().decode("utf-8", "surrogateescape")

    def comm_bytes(self) -> bytes:
        """``current->comm`` as stored (``$comm`` records these bytes)."""
        return self.engine.task_comm_bytes(self.task()) or b""

    def pid(self) -> int | None:
        return self.engine.task_pid(self.task())

    def retval(self) -> int:
        return self.reg("ax")

    def symbol_addr(self, name: str) -> int:
        return self.engine.symbols.lookup(name).addr

    def symbolize(self, addr: int) -> str | None:
        return self.engine.symbols.format(addr) if self.engine.symbols.symbolize(addr) else None


def entry_args(spec: ProbeSpec) -> tuple[int, ...]:
    """The arguments (0-based) a return probe's ``$argN`` read from its entry, in the order
    the kernel stores them (``__store_entry_arg()``: first use first)."""
    out: list[int] = []
    for a in spec.args:
        for op in a.code:
            if op[0] == "edata" and op[1] not in out:
                out.append(op[1])
    return tuple(out)


class HostBackend:
    """kprobe_events specs as host-side kprobes on ``vm.host``."""

    #: kprobes as a kernel module registers them: ``register_kprobe()`` alone, without
    #: ``trace_kprobe``'s checks around it (``TraceLayer.raw``; set before ``register()``)
    raw_kprobes = False

    side = "host"

    def __init__(self, vm: Machine, *, hook: FetchHook | None = None,
                 comm_rule: str = "saved_cmdlines", armed: bool = True,
                 alone: bool = False, triggers: Mapping[str, int] | None = None) -> None:
        """``comm_rule``: ``saved_cmdlines`` reports each hit under the comm its pid had at
        its last hit, as the trace file prints it; ``at_hit`` keeps the comm of the moment
        (what a kernel module reading ``current->comm`` records).

        kprobes are registered with ``KPROBE_FLAG_DISABLED``, as ``kprobe_events`` registers
        them until the event is enabled, and armed by :meth:`arm` (:meth:`enable` arms
        too): a return probe's instance pool is then in use over the same window as the
        guest's (the harness's own guest commands between registering and enabling exit
        through ``do_exit`` too). ``armed=False`` never arms them: every registration rule
        applies, no breakpoint is inserted.

        ``alone``: a host-only run (no guest side): a tracepoint probe's stub is put on
        its tracepoint by the harness (:func:`harness.backends.tracelayer.attach_stubs`),
        where in a differential run the guest's own ``t`` event does it.

        ``triggers``: ``{GROUP/EVENT: count}`` of ``stacktrace`` triggers
        (``harness.backends.triggers``): each hit of the event while armed uses one
        (-1: no limit), and a recorded one carries ``regs.stack_trace()``."""
        self.vm = vm
        # where the kernel keeps HARDIRQ in preempt_count (7.3 moved it up 8 bits)
        self._hardirq_shift = vm.facts.rules.preempt_hardirq_shift
        self._stacks_left = dict(triggers or {})
        self.armed = armed
        self.alone = alone
        self._stubs: list[str] = []         # tracepoints attach_stubs() put a stub on
        self._estubs: list[tuple[str, str]] = []    # and events it put an e event on
        self._armed_now = False
        self.comm_rule = comm_rule
        self.engine = vm.host
        self.hook = hook
        self.recording = False
        self._hits: list[Hit] = []
        #: hit index -> (cpu, probe address, the engine's stop count) of each entry hit,
        #: for ``_mark_in_flight``
        self._hit_at: dict[int, tuple[int, int, int]] = {}
        #: Hits that could not be evaluated (probe, the engine's error): collect() fails.
        self.engine_errors: list[tuple[str, EngineReadError]] = []
        self._probes: list[tuple[str, Kprobe | Kretprobe | Uprobe]] = []
        #: the probe placed for each accepted line (id of its spec), for `-:` lines
        self._placed: dict[int, Any] = {}
        self._nhit: dict[str, int] = {}
        #: the kernel's callback order where fprobes are (made with the trace layer), and
        #: the lines counted in it (id of spec)
        self._ops: FprobeOps | None = None
        self._grouped: dict[int, bool] = {}
        self.layer: TraceLayer | None = None
        self._comm_probe: Kprobe | None = None
        #: event probes (spec, name, the attached event's ID, their trigger arguments), in
        #: trigger order, and the probe at trace_event_buffer_commit() they share
        self._eprobes: list[tuple[ProbeSpec, str, int, tuple]] = []
        self._commit: Kprobe | None = None
        self._site: CommitSite | None = None
        #: (hits recorded before it, pid, new comm) of every rename while recording
        self._comm_changes: list[tuple[int, int, str]] = []

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """Place every line as ``kprobe_events`` would: the trace layer's checks in the
        kernel's order (``harness.backends.tracelayer``), then the engine's
        ``register_kprobe()`` rules; one Outcome per line, refusals with the kernel's
        errno and ``error_log`` text."""
        if self.layer is None:
            self.layer = TraceLayer(self.vm, raw=self.raw_kprobes)
            self._ops = FprobeOps(self.layer.rules)
        out = register_lines(self.layer, specs, self._place_line, self._release, "host")
        self._arrange()
        return out

    def _place_line(self, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """``register_kprobe()`` (or a uprobe's) for one admitted line.

        :raise ProbeRejectedError: the kernel's rules refuse it.
        """
        if spec.is_fprobe:
            return self._place_fprobe(spec, name, i)
        if spec.is_eprobe:
            return self._place_eprobe(spec, name, i)
        try:
            p = self._make(spec, name)
            if isinstance(p, Uprobe):
                self.engine.register_uprobe(p)
            elif isinstance(p, Kretprobe):
                self.engine.register_kretprobe(p)
            else:
                self.engine.register_kprobe(p)
        except UprobeNeverFires as exc:
            # uprobe_events takes it; uprobe_register() installs it nowhere
            self.layer.accept_pending(spec)
            return Outcome(name, True, mode="host", index=i,
                           pending=f"kept, never installed: {exc.reason}")
        self.layer.registered(spec, None)
        self._probes.append((name, p))
        self._placed[id(spec)] = p
        kp = p.kp if isinstance(p, Kretprobe) else p
        if isinstance(kp, Kprobe) and kp.flags & ProbeFlags.FTRACE:
            self._ops_changed(spec, +1)         # kprobe_ftrace_ops
        return Outcome(name, True, mode="host", index=i)

    def _ops_changed(self, spec: ProbeSpec, delta: int) -> None:
        if self._ops is not None:
            self._ops.changed(spec_group(spec), delta)
            self._grouped[id(spec)] = delta > 0

    def _arrange(self) -> None:
        """The kernel's order of the callbacks at each place an fprobe is
        (:class:`FprobeOps`): ftrace kprobes and fprobes by group, newest first within one."""
        if self._ops is None:
            return
        arrange = getattr(self.engine, "arrange", None)
        addrs = {p.addr for _, p in self._probes
                 if isinstance(p, (Kprobe, Kretprobe)) and p.ftrace_ops}
        if arrange is None or not addrs:
            return
        ops = self._ops

        def rank(p: Kprobe) -> int:
            if not p.ftrace_ops:
                return ops.rank("kprobe")
            return ops.rank("exit" if getattr(p, "_kph_rp", None) is not None else "entry")
        for addr in addrs:
            arrange(addr, rank)

    def _place_fprobe(self, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """``register_fprobe()`` of an ``f`` line (kernel/trace/fprobe.c): one ftrace_ops
        callback at each ftrace location its filter matches (the trace layer found at least
        one), registered all or none; an exit line's instances as :func:`fprobe_pool` says."""
        assert self.layer is not None
        targets = self.layer.fprobe_targets(spec)
        probes: list[Kprobe | Kretprobe] = []
        pool = fprobe_pool(self.layer.rules, spec, len(targets), self.vm.smp)
        for addr, _fn in targets:
            if spec.is_return:
                probes.append(self._make_return(spec, name, {"addr": addr}, pool, fprobe=True))
            else:
                probes.append(Kprobe(addr=addr, flags=ProbeFlags.DISABLED, ftrace_ops=True,
                                     pre_handler=lambda p, regs: self._record(spec, name, regs, p)
                                     or 0))
        done: list[Kprobe | Kretprobe] = []
        try:
            for p in probes:
                if isinstance(p, Kretprobe):
                    self.engine.register_kretprobe(p)
                else:
                    self.engine.register_kprobe(p)
                done.append(p)
        except BaseException:
            for p in done:
                self._unregister(p)
            raise
        self.layer.registered(spec, None)
        self._probes.extend((name, p) for p in probes)
        self._placed[id(spec)] = probes
        self._ops_changed(spec, +1)
        return Outcome(name, True, mode="tprobe" if spec.is_tprobe else "fprobe", index=i)

    def _place_eprobe(self, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """An ``e`` line: a trigger on the attached event (trace_eprobe.c:
        ``enable_eprobe()``), run by ``event_triggers_call()`` from
        ``trace_event_buffer_commit()`` once the event's record is complete
        (:mod:`harness.backends.eprobes`). One probe there serves every event probe
        (:meth:`_commit_hit`); triggers run in the order they were added
        (``list_add_tail_rcu()``): here, the lines'."""
        assert self.layer is not None and spec.attach is not None
        fmt = self.layer.event_format(*spec.attach)
        if fmt is None:                     # the trace layer checked it: not expected
            raise ProbeRejectedError(f"no trace event {spec.attach[0]}.{spec.attach[1]}",
                                     errno=19)
        if self._commit is None:
            self._site = CommitSite.of(self.vm.facts.btf, self.engine.symbols)
            self._commit = Kprobe(symbol_name=COMMIT, flags=ProbeFlags.DISABLED,
                                  pre_handler=self._commit_hit)
            self.engine.register_kprobe(self._commit)
            if self._armed_now:
                self.engine.enable_kprobe(self._commit)
        self._eprobes.append((spec, name, fmt.id, trigger_args(spec, self._site)))
        self.layer.registered(spec, None)
        self._placed[id(spec)] = ("eprobe", spec)
        return Outcome(name, True, mode="eprobe", index=i)

    def _commit_hit(self, p: Kprobe, regs: PtRegs) -> int:
        """``trace_event_buffer_commit(fbuffer)``: each event probe whose trigger the
        kernel runs on this record (:func:`harness.backends.eprobes.triggered`)."""
        if not self.recording or not self._eprobes or self._site is None:
            return 0
        rec: int | None = None
        for spec, name, ident, targs in list(self._eprobes):
            try:
                if rec is None:     # fbuffer->entry, once per commit
                    rec = int.from_bytes(self.engine.stub.read_memory(
                        regs.di + self._site.entry, 8), "little")
                ctx = _Ctx(self.engine, regs, regs.ip, {}, record=rec)
                values = evaluate(SimpleNamespace(args=targs), ctx)
                if triggered(spec, ident, self._site, values, regs.cpu):
                    self._record_hit(spec, name, regs, rec, None)
            except HarnessError as exc:
                err = exc if isinstance(exc, EngineReadError) else EngineReadError(
                    f"the gdbstub engine failed during a hit of {name}: {exc}")
                self.engine_errors.append((name, err))
        return 0

    def _release(self, layer: Any, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """A ``-:`` line (``dyn_event_release()``): the probes of the lines it frees are
        unregistered; none matching is -ENOENT."""
        gone, ref = layer.release(spec)
        if ref is not None:
            return refused(name, spec, ref, index=i,
                           reason="no event matches it (dyn_event_release())")
        for s in gone:
            placed = self._placed.pop(id(s), None)
            if placed is None:
                continue                    # kept unregistered (pending): nothing placed
            if isinstance(placed, tuple):   # an event probe's trigger
                self._eprobes = [e for e in self._eprobes if e[0] is not s]
                continue
            for p in placed if isinstance(placed, list) else [placed]:
                self._probes = [(n, q) for n, q in self._probes if q is not p]
                self._unregister(p)
            if self._grouped.pop(id(s), False):
                self._ops_changed(s, -1)
                self._grouped.pop(id(s), None)
        return Outcome(name, True, mode="host", index=i)

    def _unregister(self, p: Kprobe | Kretprobe | Uprobe) -> None:
        if isinstance(p, Uprobe):
            self.engine.unregister_uprobe(p)
        elif isinstance(p, Kretprobe):
            self.engine.unregister_kretprobe(p)
        else:
            self.engine.unregister_kprobe(p)

    def _make(self, spec: ProbeSpec, name: str) -> Kprobe | Kretprobe | Uprobe:
        if spec.is_uprobe:
            assert spec.path is not None
            up = Uprobe(spec.path, spec.offset if spec.symbol is None else None,
                        symbol=spec.symbol)
            if spec.is_return:
                up.ret_handler = lambda ri, regs: self._record(spec, name, regs, ri, up)
            else:
                up.handler = lambda u, regs: self._record(spec, name, regs, u, up)
            return up
        where: dict[str, Any] = ({"symbol_name": spec.symbol_name, "offset": spec.offset}
                                 if spec.symbol_name else {"addr": spec.addr})
        if spec.is_return:
            return self._make_return(spec, name, where, spec.maxactive)
        return Kprobe(**where, flags=ProbeFlags.DISABLED,       # until arm()
                      pre_handler=lambda p, regs: self._record(spec, name, regs, p) or 0)

    def _make_return(self, spec: ProbeSpec, name: str, where: dict[str, Any], maxactive: int,
                     *, fprobe: bool = False) -> Kretprobe:
        """A return probe of a ``r`` or ``f ...%return`` line. Its entry handler saves
        what the line's ``$argN`` read at the entry (6.12+: ``trace_kprobe_entry_handler()``
        and ``trace_fprobe_entry_handler()``, ``store_trace_entry_data()``). A kretprobe's
        entry is a kprobe and misses while a guest kprobe handler runs
        (``pre_handler_kretprobe()`` is not called); an fprobe's is an ftrace_ops callback
        (``fprobe_handler()``), which ``kprobe_running()`` does not stop."""
        saved = entry_args(spec)

        def entry(ri: Any, regs: PtRegs) -> int:
            if not fprobe and self.engine.guest_kprobe_running(regs):
                ri.rp.nmissed += 1      # the entry kprobe is missed: no instance
                return 1
            ri.data[:] = b"".join(
                (self._entry_value(regs, n) & ((1 << 64) - 1)).to_bytes(8, "little")
                for n in saved)
            return 0
        return Kretprobe(**where, flags=ProbeFlags.DISABLED, maxactive=maxactive,
                         entry_handler=entry, data_size=8 * len(saved), ftrace_ops=fprobe,
                         handler=lambda ri, regs: self._record(spec, name, regs, ri))

    def _entry_value(self, regs: PtRegs, n: int) -> int:
        """``regs_get_kernel_argument(regs, n)`` at the function's entry."""
        if n < 6:
            return regs.get(("di", "si", "dx", "cx", "r8", "r9")[n])
        try:
            return int.from_bytes(self.engine.stub.read_memory(regs.sp + 8 * (n - 5), 8),
                                  "little")
        except MemoryFaultError:    # regs_get_kernel_stack_nth(): 0 off the stack
            return 0

    def _record(self, spec: ProbeSpec, name: str, regs: PtRegs, what: Any,
                up: Uprobe | None = None) -> int:
        """The probe's handler: record the hit as the kernel's trace would. A failure of
        the engine is not a value: the hit is not recorded and collect() fails the run
        (only ``MemoryFaultError`` is a fault the guest takes too, handled below it)."""
        try:
            return self._record_hit(spec, name, regs, what, up)
        except HarnessError as exc:
            err = exc
            if not isinstance(exc, EngineReadError):
                err = EngineReadError(f"the gdbstub engine failed during a hit of {name}: {exc}")
                err.__cause__ = exc
            self.engine_errors.append((name, err))
            return 0

    def _record_hit(self, spec: ProbeSpec, name: str, regs: PtRegs, what: Any,
                    up: Uprobe | None) -> int:
        eng = self.engine
        if up is None and not spec.is_fprobe and not spec.is_eprobe and \
                eng.guest_kprobe_running(regs):
            # A call made from inside one of the guest's own kprobe handlers (an in-guest
            # probe on kfree(), and its handler frees): the kernel misses any probe hit
            # there, its own and the one this mirrors. Counted whenever armed, recording
            # or not: the kernel counts its misses over the whole time its probe is live
            # (the module's, from registration to unloading, as the host is armed).
            target = what.rp if spec.is_return else what
            target.nmissed += 1
            return 0
        stack = self._stacks_left.get(name, 0) != 0     # stacktrace_count_trigger()
        if stack and self._stacks_left[name] > 0:
            self._stacks_left[name] -= 1
        if not self.recording:
            return 0
        # trace_kprobe's nhit: kprobe_dispatcher()/kretprobe_dispatcher() count every hit
        # their handler runs for, before the event's filter and triggers
        # (kernel/trace/trace_kprobe.c); counted here over the recording window only
        self._nhit[name] = nth = self._nhit.get(name, 0) + 1     # this hit's number
        overrides: dict[str, int] = {}
        if self.hook is not None:
            self.hook(name, nth, overrides)
        if up is not None:
            # print_uprobe_event(): "(0x%lx)", or "(0x%lx <- 0x%lx)" with the real return
            # address first; %ip is the probed address itself (handle_swbp() sets it).
            ip_val = regs.ip
            ip_text = f"0x{regs.ip:x}"
            ret_from = f"0x{what.func:x}" if spec.is_return else None
        elif spec.is_eprobe:
            # print_eprobe_event(): "(SYSTEM.EVENT)" where a kprobe shows "(SYM+OFFS)"
            ip_val = regs.ip
            ip_text = "{}.{}".format(*(spec.attach or ("", "")))
            ret_from = None
        elif spec.is_return:
            func = what.rp.addr
            ip_val = regs.ip
            hit = self._symname(func)
            # get_kretprobe_retaddr(ri) for a kretprobe; a 6.12 fprobe's exit handler is
            # given the real return address (rethook_trampoline_handler()'s
            # correct_ret_addr); 7.3's, what the slot held when the function graph hooked
            # it (fprobe_return(): the return stack's entry), another hook's trampoline if
            # one came first
            real = spec.is_fprobe and self.layer is not None and \
                self.layer.rules.fprobe == "rethook"
            shown = what.ret_addr if real else what.node_ret_addr or what.ret_addr
            ip_text = format_ip(shown, lambda a: eng.symbols.format(a)
                                if eng.symbols.symbolize(a) else None,
                                kretprobe_trampoline=eng.kernel_rethook_trampoline())
            ret_from: str | None = hit
        else:
            # regs.ip is probe address + 1 here, on all three x86 paths (the engine's
            # pre_handler convention); a newer probe's pre_handler may have moved it.
            ip_val = regs.ip
            ip_text = eng.symbols.format(what.addr)
            ret_from = None
        ctx = _Ctx(eng, regs, ip_val, overrides, up,
                   bytes(getattr(what, "data", b"") or b"") if spec.is_return else b"",
                   record=what if spec.is_eprobe else 0)
        ctx.entry_index = entry_args(spec)
        why: dict[int, str] = {}
        failed: dict[int, int] = {}
        slack: list[int] = []
        values = evaluate(spec, ctx, why, failed, slack)
        symbolize = ctx.symbolize
        args = tuple((a.name, format_value(a, v, symbolize)) for a, v in zip(spec.args, values))
        pid, comm = ctx.pid(), escape_bytes(ctx.comm_bytes())
        irq, hard = eng.hit_contexts(regs, self._hardirq_shift) if up is None else ("", False)
        if up is None and not spec.is_return and not spec.is_eprobe:
            self._hit_at[len(self._hits)] = (regs.cpu, what.addr, eng.stats["hits"])
        self._hits.append(Hit(side=self.side, probe=name, kind="r" if spec.is_return else "p",
                              seq=len(self._hits), cpu=regs.cpu, pid=pid,
                              comm=comm, ip=ip_text,
                              ret_from=ret_from, args=args,
                              mode="host", irq=irq, hardirq=hard,
                              ret_ip_args=spec.ret_ip_args, slot_args=spec.slot_args,
                              mem_args=spec.mem_args,
                              unknown=tuple((spec.args[i].name, w) for i, w in why.items()),
                              failed=tuple((spec.args[i].name, a) for i, a in failed.items()),
                              slack=slack[0] if slack else 0,
                              stack=self._stack(regs, what) if stack else None))
        return 0

    def trigger_counts(self, left: Mapping[str, int]) -> None:
        """Take what the guest's counted triggers have left at the window's start (the
        guest's own setup runs them down: ``EventsBackend.trigger_counts``)."""
        self._stacks_left.update({n: c for n, c in left.items() if n in self._stacks_left})

    def _stack(self, regs: PtRegs, what: Any) -> tuple[str, ...]:
        """The functions of the stack as the guest's own unwinder finds it at this hit
        (``harness.kernel.unwind.stack_trace(guest_view=True)``), as the trace's ``=>``
        lines name them (``%ps``: no offset).

        The guest's handlers run after the host's stop: where a host return probe on the
        same place takes the call at this stop, the guest's unwinder finds the host's
        trampoline in the function's return slot and ends after the function itself."""
        if hasattr(what, "rp"):
            # a return hit: the guest's handler runs under its return trampoline
            # (arch_rethook_trampoline, arch/x86/kernel/rethook.c; 7.3's fprobe exits:
            # return_to_handler, arch/x86/kernel/ftrace_64.S), where its unwinder ends:
            # the function returned and the trampoline's frame leads nowhere (measured on
            # 6.12 and 7.3). The trace holds the probe machinery only.
            return ()
        at = getattr(what, "addr", None)
        addrs = stack_trace(self.engine, regs, 64, guest_view=True,
                            optprobe=at is not None and self._guest_optimized(at))
        if at is not None and self._armed_now and any(
                isinstance(p, Kretprobe) and p.addr == at for _, p in self._probes):
            addrs = addrs[:1]
        return tuple(self.engine.symbols.frame_name(addr) for addr in addrs)

    def _guest_optimized(self, addr: int) -> bool:
        """Is the guest's own probe at ``addr`` optimized at this hit? Its optimizer
        (``arch_optimize_kprobes()``, arch/x86/kernel/kprobes/opt.c) puts a ``jmp rel32``
        there, into a detour buffer no symbol names; before that, and after, an int3.
        The host's breakpoint is not in memory: the bytes read are the guest's."""
        try:
            text = self.engine.stub.read_memory(addr, 5)
        except HarnessError:
            return False
        if text[0] != 0xE9:
            return False
        target = (addr + 5 + int.from_bytes(text[1:5], "little", signed=True)) & ((1 << 64) - 1)
        return self.engine.symbols.symbolize(target) is None

    def _symname(self, addr: int) -> str:
        hit = self.engine.symbols.symbolize(addr)
        return hit[0].name if hit else f"0x{addr:x}"

    def arm(self) -> None:
        """Enable every kprobe (``enable_kprobe()``), as writing 1 to an event's enable."""
        if self.armed and not self._armed_now:
            for _, p in self._probes:
                if not isinstance(p, Uprobe):
                    self.engine.enable_kprobe(p)
            if self._commit is not None:
                self.engine.enable_kprobe(self._commit)
            self._armed_now = True

    def disarm(self) -> None:
        if self._armed_now:
            for _, p in self._probes:
                if not isinstance(p, Uprobe):
                    self.engine.disable_kprobe(p)
            if self._commit is not None:
                self.engine.disable_kprobe(self._commit)
            self._armed_now = False

    def enable(self, *, also: Callable[[], None] | None = None) -> None:
        """Arm and record. ``also`` runs in the same halt of the guest as the arming (the
        runner switches the guest's tracing on there): both sides then start at the same
        guest instruction, in a halt where no vCPU is between the host's breakpoint and
        the guest's handler (``HostEngine.halted(settle=True)``)."""
        self._hits.clear()
        self._nhit.clear()
        self._hit_at.clear()
        self._comm_changes.clear()
        self._watch_comms()
        if self.alone and not self._stubs and not self._estubs and self.layer is not None:
            specs = self.layer.table.specs()
            self._stubs = sorted({s.symbol for s in specs if s.is_tprobe})
            self._estubs = sorted({s.attach for s in specs if s.is_eprobe and s.attach})
            attach_stubs(self.vm, self._stubs, self._estubs)
        if also is None:
            self.arm()
            self.recording = True
            return

        def start() -> None:
            self.arm()
            self.recording = True
            also()
        self.engine.halted(start, settle=True)

    def _watch_comms(self) -> None:
        """With the trace's comm rule, know every comm a task takes while recording: a
        hidden probe on ``__set_task_comm(tsk, buf, exec)`` (fs/exec.c; exec renames the
        task). The trace prints comms from ``saved_cmdlines``, saved at a CPU's first sched
        switch or wakeup after an event (kernel/trace/trace.c: tracing_record_taskinfo()),
        which may come after the rename: the diff accepts a later comm of the same pid."""
        if self.comm_rule != "saved_cmdlines" or self._comm_probe is not None:
            return
        if self.engine.symbols.get("__set_task_comm") is None:
            return

        def renamed(p: Kprobe, regs: PtRegs) -> int:
            if self.recording:
                task = regs.di
                pid = self.engine.task_pid(task)
                raw = self.engine.read_string(regs.si, 16) or b""
                if pid:
                    self._comm_changes.append((len(self._hits), pid, escape_bytes(raw[:15])))
            return 0
        try:
            self._comm_probe = self.engine.register_kprobe(
                Kprobe(symbol_name="__set_task_comm", pre_handler=renamed))
        except ProbeRejectedError as exc:
            log.info("comm changes are not followed: %s", exc)

    def disable(self, *, disarm: bool = True, also: Callable[[], None] | None = None) -> None:
        """Stop recording; ``disarm=False`` leaves the probes armed (:meth:`disarm` later).
        ``also`` runs in the same halt of the guest (the guest's tracing switched off),
        a settled one as in :meth:`enable`."""
        if also is None:
            self.recording = False
            if disarm:
                self.disarm()
            return

        def stop() -> None:
            self.recording = False
            self._mark_in_flight(getattr(self.engine, "in_flight_hits", ()))
            also()
            if disarm:
                self.disarm()
        self.engine.halted(stop, settle=True)

    def _mark_in_flight(self, flying: Sequence[tuple[int, int]]) -> None:
        """Mark the records of the entry hits the last halt found in flight
        (``(cpu, probe address)``, innermost first): each is the latest stop at that
        address on that CPU not marked yet (an interrupt's hit in the window of its
        task's is the later one), with every line's record of it (several lines on one
        address record one stop each)."""
        for cpu, addr in flying:
            stop = next((self._hit_at[k][2] for k in range(len(self._hits) - 1, -1, -1)
                         if self._hit_at.get(k, ())[:2] == (cpu, addr)
                         and not self._hits[k].in_flight), None)
            # every line's record of that one stop (several lines on one address)
            for k, at in self._hit_at.items():
                if at == (cpu, addr, stop):
                    self._hits[k] = dataclasses.replace(self._hits[k], in_flight=True)

    def collect(self) -> list[Hit]:
        """The hits, each under the comm its pid had at its *last* hit: the trace file
        stores only pids and prints comms from ``saved_cmdlines``, recorded after the
        events, so a child that execs after its first events prints with the new name.
        Each hit also carries the comms its pid took after it (``comm_alts``)."""
        EngineReadError.raise_first(self.engine_errors)
        if self.comm_rule == "at_hit":
            return list(self._hits)
        return saved_cmdlines(self._hits, self._comm_changes)

    def counters(self) -> dict[str, Counters]:
        """Per event, summed over its probes (kprobe_profile has a line per probe): ``nhit``
        the hits its handlers ran for while recording (``Counters.window``: the runner
        opens and closes the window in the halts where the guest's opens and closes),
        ``nmissed`` the misses whenever armed."""
        nmissed: dict[str, int] = {}
        for name, p in self._probes:
            nmissed[name] = nmissed.get(name, 0) + p.nmissed
        return {name: Counters(name, self._nhit.get(name, 0), nmissed[name], window=True)
                for name in nmissed}

    def close(self) -> None:
        """Unregister every probe; then raise ``HandlerError`` if a handler raised (a bug
        of the harness's own handlers: it must not pass for a divergence)."""
        if self.vm.aborting:  # interrupted: the guest is about to vanish
            self._probes.clear()
            return
        detach_stubs(self.vm, self._stubs, self._estubs)
        self._stubs, self._estubs = [], []
        handler_error: HandlerError | None = None
        probes = list(self._probes)
        if self._comm_probe is not None:
            probes.append(("(comm watch)", self._comm_probe))
            self._comm_probe = None
        if self._commit is not None:
            probes.append(("(event probes)", self._commit))
            self._commit = None
            self._eprobes.clear()
        for _, p in probes:
            try:
                self._unregister(p)
            except HandlerError as exc:
                handler_error = handler_error or exc
            except HarnessError as exc:
                # a guest that is gone (a panic reset it) has no probes left to remove
                lost = getattr(getattr(self.engine, "stub", None), "gone", "")
                (log.debug if lost else log.warning)("unregistering %r failed: %s", p, exc)
        self._probes.clear()
        if handler_error is not None:
            raise handler_error
