"""kprobe_events specs placed host-side in QEMU's TCG plugin (``harness.engines.plugin_engine``).

The plugin counterpart of ``harness.backends.host``: same specs, same ``Hit`` records,
same text, so ``kph diff`` compares it with the guest (or with the gdbstub engine) field
by field. Each spec's fetch args are compiled (``harness.kernel.grammar.program``) and run in C at
every hit, which records the registers, ``current``'s pid and comm, and every memory read
the program made; no hit waits for the host. Each record is evaluated with
``harness.kernel.grammar.fetch.evaluate`` over exactly those reads and printed with
``format_value`` (while the workload runs, on a thread of the backend's own; ``collect()``
takes the rest), under the kernel's conventions the gdbstub backend mirrors too:
``%ip`` is the probe address + 1 (int3 convention, emulated by ftrace-based and
optimized probes), a return probe prints its real return address ``<-`` the function,
and a trace prints each pid under the comm it had at its last hit (``saved_cmdlines``).
"""
from __future__ import annotations

import functools
import logging
import operator
import struct
import threading
from bisect import bisect_left
from types import SimpleNamespace
from typing import Any, Sequence

from ..errors import (DROPPED, EngineReadError, HarnessError, PluginRecordError,
                      ProbeRejectedError, SetupError, ring_mib)
from ..kernel.grammar.fetch import (UNKNOWN, FaultError, below_sp, evaluate, format_ip,
                                   format_value)
from ..kernel.grammar.program import EDATA, PERCPU, REGS, CaptureContext, compile_spec, parse_blocks
from ..kernel.kprobes import INT3_INSN_SIZE, kernel_rethook_trampoline, preempt_context
from ..machine.pluginlink import (RF_BADPROG, RF_COMM, RF_CTX, RF_HARDIRQ, RF_NMI, RF_NOUACCESS,
                                  RF_PID, RF_SOFTIRQ, RF_TASK, RF_TRUNC, RF_UNCONFIRMED, REC_HIT,
                                  REC_HDR, REC_RET, REGS_OFF, PluginRecord, decode, lean_seq)
from ..kernel.grammar import ProbeSpec, parse
from ..records import DECODED_MAX, Counters, Hit, Outcome, gc_paused
from ..engines.plugin_uprobes import user_filter, user_trampoline
from ..engines.uprobes import Uprobe, UprobeManager
from .eprobes import COMMIT, CommitSite, trigger_args, triggered
from .tracelayer import (FprobeOps, GuestWrite, TraceLayer, attach_stubs, detach_stubs, fprobe_pool,
                         register_lines, saved_cmdlines, spec_group)
from ..vmctl import Machine

log = logging.getLogger(__name__)

EINVAL = 22
#: seconds between two decodings of the records while a recording window is open
STREAM_INTERVAL = 0.05


def _unknown_like(v: Any) -> Any:
    return [UNKNOWN] * len(v) if isinstance(v, list) else UNKNOWN


def hit_context(flags: int) -> str:
    """A record's context, ``irq`` or ``task``, from what the plugin read of the caller's
    ``preempt_count()`` (``RF_CTX`` and its bits; kph_proto.h), judged as the gdbstub
    engine judges the whole count (``harness.kernel.kprobes.preempt_context``); "" when
    the plugin could not read it."""
    if not flags & RF_CTX:
        return ""
    return preempt_context((0x100 if flags & RF_SOFTIRQ else 0) |
                           (0x10000 if flags & RF_HARDIRQ else 0) |
                           (0x100000 if flags & RF_NMI else 0))


def hit_hardirq(flags: int) -> bool:
    """Whether :func:`hit_context` is ``irq`` for a hardirq alone
    (``harness.kernel.kprobes.preempt_hardirq_only``)."""
    return bool(flags & RF_CTX) and bool(flags & RF_HARDIRQ) and \
        not flags & (RF_SOFTIRQ | RF_NMI)


class _RecordCtx:
    """``harness.kernel.grammar.fetch.FetchContext`` over one plugin record."""

    def __init__(self, backend: "PluginBackend", rec: PluginRecord, ip: int,
                 up: Uprobe | None = None) -> None:
        self.rec, self.ip, self.backend, self.up = rec, ip, backend, up
        self.mem = CaptureContext(parse_blocks(rec.body, rec.nblocks))
        self._regs = dict(zip(REGS, rec.regs))

    @property
    def empty_user_string_len(self) -> int:
        return self.backend.vm.facts.rules.empty_user_string_len

    def uaccess_okay(self) -> bool:
        """``nmi_uaccess_okay()`` as the plugin judged it at the hit (``RF_NOUACCESS``);
        a uprobe's reads do not ask (copy_from_user())."""
        return self.up is not None or not self.rec.flags & RF_NOUACCESS

    def reg(self, name: str) -> int:
        if name == "ip":
            return self.ip
        return self._regs[name]

    def read(self, addr: int, size: int) -> bytes:
        below_sp(self._regs["sp"], addr, size)     # the guest probe's own frames live there
        return self.mem.read(addr, size)

    read_user = read

    def comm(self) -> str:
        return self.rec.comm.decode("utf-8", "replace") if self.rec.flags & RF_COMM else ""

    def current_task(self) -> int:
        """``$current`` (7.3, ``FETCH_OP_CURRENT``): the task the plugin read at the hit."""
        if not self.rec.flags & RF_TASK:
            raise EngineReadError("the plugin could not read current at this hit")
        return self.rec.task

    def percpu_offset(self) -> int:
        """``this_cpu_ptr()``'s offset (7.3, ``FETCH_OP_CPU_PTR``), as the plugin added it."""
        for b in self.mem.blocks:
            if b.kind == PERCPU:
                return int.from_bytes(b.data, "little")
        raise FaultError(0, 8)      # fetch.c could not read it: the fetch stopped there

    def entry_arg(self, n: int) -> int:
        """``$argN`` of a return probe (6.12+, ``FETCH_OP_EDATA``): what the plugin's entry
        saved of argument ``n`` (0-based)."""
        for b in self.mem.blocks:
            if b.kind == EDATA and b.addr == n:
                return int.from_bytes(b.data, "little")
        raise EngineReadError(f"the plugin saved no argument {n + 1} at the entry")

    def event_record(self) -> int:
        """An event probe's record: ``fbuffer->entry``, read at the hit (captured)."""
        site = self.backend._site
        if site is None:
            raise ValueError("not an event probe's hit")
        return int.from_bytes(self.mem.read(self._regs["di"] + site.entry, 8), "little")

    def comm_address(self) -> int:
        """``current->comm`` as an address (an event probe's untyped ``$comm``)."""
        off = self.backend.engine.task_offsets[2]
        if not self.rec.task or not off:
            raise EngineReadError("the plugin engine does not know where current->comm is")
        return self.rec.task + off

    def retval(self) -> int:
        return self._regs["ax"]

    def symbol_addr(self, name: str) -> int:
        return self.backend.engine.symbols.lookup(name).addr

    def symbolize(self, addr: int) -> str | None:
        syms = self.backend.engine.symbols
        return syms.format(addr) if syms.symbolize(addr) else None

    def file_offset_vaddr(self, offset: int) -> int:
        if self.up is None or self.up.vaddr is None or self.up.offset is None:
            raise ValueError("@+OFFS is for uprobes only")
        return self.up.vaddr - self.up.offset + offset



def _plan_registers(spec: ProbeSpec) -> tuple[int, ...] | None:
    """Where in a record's registers (:data:`REGS`) the arguments of ``spec`` read, when
    they read registers only (``ProbeSpec.register_plan``: no memory, no ``$comm``); None
    otherwise. ``%ip`` is the probed address (``_RecordCtx.reg``), which the record's
    ``func`` and ``ret_addr`` give; ``$retval`` is ``ax``."""
    plan = spec.register_plan
    if plan is None:
        return None
    names = ["ax" if kind == "retval" else reg for kind, reg, _, _ in plan
             if kind == "retval" or reg != "ip"]
    if not all(n in REGS for n in names):
        return None
    return tuple(REGS.index(n) for n in names)


@functools.lru_cache(maxsize=None)
def _plan_key(regs: tuple[int, ...]) -> Any:
    """What of a record's registers a register plan reads (``regs``: their indexes), as
    one hashable value of the record's bytes: the part of a record's memo key
    (``PluginBackend._hit``) that varies with its arguments."""
    if not regs:
        return lambda raw: b""
    return operator.itemgetter(*(slice(REGS_OFF + 8 * i, REGS_OFF + 8 * i + 8) for i in regs))


#: the record types that are a probe's hits
_HIT_TYPES = (REC_HIT, REC_RET)


def _undecodable(rec: PluginRecord, name: str, exc: BaseException) -> EngineReadError:
    """An engine error for a plugin record ``PluginBackend._take`` could not decode: what
    it was (hit or return, of which probe, at which address) and why."""
    kind = "return" if rec.type == REC_RET else "hit"
    err = EngineReadError(f"{name}: the plugin's {kind} record (probe {rec.probe_id}) could "
                          f"not be decoded: {type(exc).__name__}: {exc}",
                          getattr(exc, "address", 0) or 0)
    err.__cause__ = exc
    return err

class PluginBackend:
    """kprobe_events specs as compiled probes in the QEMU plugin of ``vm.host``."""

    #: kprobes as a kernel module registers them: ``register_kprobe()`` alone, without
    #: ``trace_kprobe``'s checks around it (``TraceLayer.raw``; set before ``register()``)
    raw_kprobes = False

    side = "plugin"

    def __init__(self, vm: Machine, *, comm_rule: str = "saved_cmdlines",
                 alone: bool = False) -> None:
        self.vm = vm
        self.engine = vm.host
        if getattr(self.engine, "kind", "") != "plugin":
            raise HarnessError(f"{vm.name}'s host-side engine is not the plugin; boot it "
                               "with Machine.boot(host='plugin')")
        self.comm_rule = comm_rule
        #: a host-only run: tracepoint probes' stubs put on by the harness (HostBackend)
        self.alone = alone
        self._stubs: list[str] = []
        self.recording = False
        self._specs: dict[int, tuple[ProbeSpec, str]] = {}
        self._uprobes: dict[int, Uprobe] = {}
        #: event probes: probe id -> (the attached event's ID, the trigger arguments)
        self._eprobes: dict[int, tuple[int, tuple]] = {}
        self._site: CommitSite | None = None
        self._probes: dict[str, list[Any]] = {}
        #: the kernel's callback order where fprobes are, and the lines counted in it
        self._ops: Any = None
        self._grouped: set[int] = set()
        self._hits: list[Hit] = []
        self._ip_text: dict[int, str] = {}     # a probed address -> its %pS text (one run)
        self._templates: dict[int, Hit] = {}   # a probe id -> the fields all its hits share
        #: a probe id -> where its register-only arguments read (_plan_registers)
        self._plan_regs: dict[int, tuple[int, ...] | None] = {}
        #: probe id -> (event name, the key of its register plan's values) for the probes
        #: whose records :meth:`_decode` places from a decoded one without :meth:`_hit`
        self._placeable: dict[int, tuple[str, Any]] = {}
        #: a record's comm bytes -> text (a run's records carry a few comms)
        self._comm_text: dict[bytes, str] = {}
        self._comm_raw: dict[bytes, str] = {}  # the same, of a record's NUL-padded bytes
        #: what a register-only probe's records decoded to (_hit), for the window
        self._decoded: dict[tuple[int, ...], Hit] = {}
        self._nhit: dict[str, int] = {}     # recorded hits per event, over the window
        self.capture_misses = 0
        self.dropped = 0
        #: with records dropped: the ring per vCPU that would have held them (MiB, 0: none)
        self.ring_mib = 0
        #: Hits that could not be evaluated (probe, the error) and records the plugin
        #: left incomplete (kind -> count): collect() fails the run on either.
        self.engine_errors: list[tuple[str, EngineReadError]] = []
        self.bad_records: dict[str, int] = {}
        self.layer: Any = None
        self._comm_probe: Any = None
        self._comm_changes: list[tuple[int, int, str]] = []
        self._armed = False
        # Decoding while the workload runs (see _take): the window's records, the plugin's
        # order of each hit and comm change (its ``seq``), what the decoding read the
        # symbols from, and the thread
        self._lock = threading.Lock()
        self._raw: list[tuple[tuple[Any, ...], bytes]] = []   # pluginlink.lean()'s
        self._seqs: list[int] = []
        self._comm_seqs: list[int] = []
        self._basis: tuple[Any, int] | None = None
        self._stream: threading.Thread | None = None
        self._stream_stop = threading.Event()
        self._stream_error: BaseException | None = None

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """Place every line as ``kprobe_events`` would: the trace layer's checks in the
        kernel's order (``harness.backends.tracelayer``, as the gdbstub backend), then the
        plugin's ``register_kprobe()`` rules; one Outcome per line."""
        if self.layer is None:
            self.layer = TraceLayer(self.vm, raw=self.raw_kprobes)
            self._ops = FprobeOps(self.layer.rules)
        with self.engine.text_reads():
            out = register_lines(self.layer, specs, self._place_line, self._release, "plugin")
        self._arrange()
        return out

    def _place_line(self, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """The plugin's ``register_kprobe()`` for one admitted line.

        :raise ProbeRejectedError: the kernel's rules refuse it.
        :raise SetupError: a limit of the plugin's (not the kernel's), naming the line.
        """
        try:
            if spec.is_eprobe:
                return self._place_eprobe(spec, name, i)
            placed = self._place_fprobe(spec) if spec.is_fprobe else [self._place(spec)]
        except SetupError as exc:
            raise SetupError(f"{name}: {exc}") from None
        self.layer.registered(spec, None)
        for p in placed:
            self._specs[p.id] = (spec, name)
            self._probes.setdefault(name, []).append(p)
        if spec.is_fprobe or (not spec.is_uprobe and self.engine.ftrace_flag(placed[0].addr)):
            self._ops.changed(spec_group(spec), +1)     # an fprobe, or kprobe_ftrace_ops
            self._grouped.add(id(spec))
        mode = "tprobe" if spec.is_tprobe else "fprobe" if spec.is_fprobe else "plugin"
        return Outcome(name, True, mode=mode, index=i)

    def _place_fprobe(self, spec: ProbeSpec) -> list[Any]:
        """An ``f`` line: a plugin probe at each ftrace location its filter matches, all
        or none, with the exit pool the gdbstub backend gives it
        (``HostBackend._place_fprobe``). The plugin's probes do not miss while a guest
        kprobe handler runs, which an fprobe does not either."""
        targets = self.layer.fprobe_targets(spec)
        fgraph = self.layer.rules.fprobe == "fgraph"
        pool = fprobe_pool(self.layer.rules, spec, len(targets), self.vm.smp)
        prog = compile_spec(spec.args, resolve=lambda s: self.engine.symbols.lookup(s).addr)
        self.engine.prefetch_text([addr for addr, _fn in targets])
        done: list[Any] = []
        try:
            for addr, _fn in targets:
                where = self.engine.ftrace_location(None, addr)
                done.append(self.engine.add_spec_probe(where, ret=spec.is_return, program=prog,
                                                       maxactive=pool, enabled=False,
                                                       fgraph=fgraph, fprobe=True))
        except BaseException:
            for p in done:
                self.engine.remove_probe(p)
            raise
        return done

    def _place_eprobe(self, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """An ``e`` line: a compiled probe at ``trace_event_buffer_commit()`` running its
        trigger arguments, then its own (:mod:`harness.backends.eprobes`); :meth:`_hit`
        keeps the records of commits the kernel's trigger runs on. Each line its own probe
        there, added in the lines' order (the plugin runs a place's probes newest first:
        :meth:`_hit` does not depend on it)."""
        assert spec.attach is not None
        fmt = self.layer.event_format(*spec.attach)
        if fmt is None:                     # the trace layer checked it: not expected
            raise ProbeRejectedError(f"no trace event {spec.attach[0]}.{spec.attach[1]}",
                                     errno=19)
        if self._site is None:
            self._site = CommitSite.of(self.vm.btf, self.engine.symbols)
        addr = self.engine.resolve(COMMIT, 0, None)
        self.engine.check_address(addr, kretprobe=False)
        targs = trigger_args(spec, self._site)
        prog = compile_spec(targs + spec.args, event_entry=self._site.entry,
                            resolve=lambda s: self.engine.symbols.lookup(s).addr)
        p = self.engine.add_spec_probe(addr, ret=False, program=prog, enabled=False)
        self.layer.registered(spec, None)
        self._specs[p.id] = (spec, name)
        self._probes.setdefault(name, []).append(p)
        self._eprobes[p.id] = (fmt.id, targs)
        return Outcome(name, True, mode="eprobe", index=i)

    def _arrange(self) -> None:
        """The kernel's order of the callbacks at each place an fprobe is (``FprobeOps``):
        this side's probes there by group, newest first within one."""
        at: dict[int, list[Any]] = {}
        for ps in self._probes.values():
            for p in ps:
                at.setdefault(p.addr, []).append(p)
        for addr, here in at.items():
            if not any(self._specs[p.id][0].is_fprobe for p in here):
                continue
            here.sort(key=lambda p: (self._ops.rank(spec_group(self._specs[p.id][0])), -p.id))
            self.engine.arrange_probes(addr, here)

    def _release(self, layer: Any, spec: ProbeSpec, name: str, i: int) -> Outcome:
        """A ``-:`` line (``dyn_event_release()``): the probes of the lines it frees are
        removed; none matching is -ENOENT."""
        gone, ref = layer.release(spec)
        if ref is not None:
            return Outcome.rejected(name, ref.errno, ref.message, index=i,
                                    reason="no event matches it (dyn_event_release())")
        gone_ids = {id(s) for s in gone}
        for s in gone:
            if id(s) in self._grouped:
                self._grouped.discard(id(s))
                self._ops.changed(spec_group(s), -1)
        for ev, ps in list(self._probes.items()):
            for p in [p for p in ps if id(self._specs[p.id][0]) in gone_ids]:
                self.engine.remove_probe(p)
                ps.remove(p)
            if not ps:
                del self._probes[ev]
        return Outcome(name, True, mode="plugin", index=i)

    def _place(self, spec: ProbeSpec, *, kprobe: bool = True) -> Any:
        """One admitted line as a plugin probe (registered disabled; ``enable`` arms). A
        ``p``/``r`` line is a kprobe of the guest's: its hits while a guest kprobe handler
        runs are missed (``kprobe``; the gdbstub backend's ``guest_kprobe_running()``
        test, ``HostBackend._record_hit``); the hidden comm probe is not a line
        (``kprobe=False``, as the gdbstub backend's is a plain host kprobe)."""
        if spec.is_uprobe:
            p, up = self._add_uprobe(spec)
            self._uprobes[p.id] = up
            return p
        addr = self.engine.resolve(spec.symbol_name, spec.offset,
                                   spec.addr if spec.symbol_name is None else None)
        self.engine.check_address(addr, kretprobe=spec.is_return)
        prog = compile_spec(spec.args, resolve=lambda s: self.engine.symbols.lookup(s).addr)
        return self.engine.add_spec_probe(addr, ret=spec.is_return, program=prog,
                                          maxactive=spec.maxactive, enabled=False,
                                          kprobe=kprobe)

    def _add_uprobe(self, spec: ProbeSpec) -> tuple[Any, Uprobe]:
        """A ``uprobe_events`` line: the same checks as the gdbstub engine's
        (``harness.engines.uprobes.UprobeManager.prepare``: ELF, executable text, inode, no PIE),
        then a plugin probe at the program's address, for processes whose executable is
        that file (``current->mm->exe_file->f_inode->i_ino``, offsets from BTF)."""
        assert spec.path is not None
        eng = self.engine
        up = Uprobe(spec.path, spec.offset if spec.symbol is None else None, symbol=spec.symbol)
        mgr = UprobeManager.resolver(self.vm, stats=eng.stats, symbols=eng.symbols)
        mgr.prepare(up)
        assert up.vaddr is not None and up.ino is not None
        chain, ino = user_filter(self.vm.btf, up)
        tramp = user_trampoline(mgr, up) if spec.is_return else eng.trampoline
        prog = compile_spec(spec.args, file_offset_vaddr=lambda off: up.vaddr - up.offset + off)
        p = eng.add_spec_probe(up.vaddr, ret=spec.is_return, program=prog, enabled=False,
                               user=(tramp, chain, ino))
        return p, up

    def arm(self) -> None:
        """Enable every probe, as writing 1 to an event's enable (the runner arms the
        host side over the same window as the guest's, for return-probe pools)."""
        if not self._armed:
            for ps in self._probes.values():
                for p in ps:
                    self.engine.enable_probe(p, True)
            self._armed = True

    def disarm(self) -> None:
        if self._armed:
            for ps in self._probes.values():
                for p in ps:
                    self.engine.enable_probe(p, False)
            self._armed = False

    def enable(self, *, switch: Sequence[GuestWrite] | None = None, opened: bool = True,
               reads: Sequence[int] = ()) -> None:
        """Start recording. ``switch``: the guest side's own switch on (its
        ``switch_writes(True)``: tracing_on, the module's recording flag), made as the
        plugin's recording window opens, at one instant where no vCPU is between a hit
        and the guest's handler of it (``PluginEngine.window``): the two sides record over
        the same guest instructions, so an interrupt's hit at either edge of the window
        is on both or neither (the gdbstub engine's one halt, ``HostBackend.enable``).
        Without it the window opens now and the guest side switches itself.
        ``opened=False``: the window stays closed; the caller opens it
        (``engine.window(True)``) in a halt of the guest (``harness.diff.worlds``: in the
        gdbstub engine's settled halt, with every vCPU stopped). ``reads``: words the
        switch reads at its instant (the guest's counters: ``PluginEngine.window_marks``)."""
        self._stop_stream()
        self._forget()
        self._raw.clear()
        self._stream_error = None
        self._watch_comms()
        if self.alone and not self._stubs and self.layer is not None:
            self._stubs = sorted({s.symbol for s in self.layer.table.specs() if s.is_tprobe})
            attach_stubs(self.vm, self._stubs)
        # with a guest switch, the window stays closed while the probes arm
        self.engine.window(switch is None and opened, now=True)
        self.engine.lean_records()         # what came before does not count
        self._dropped0 = self.engine.link.dropped
        self.arm()
        if switch is not None:
            self.engine.window(True, switch, reads=reads)
        self.recording = True
        syms = self.engine.symbols
        self._basis = (syms, getattr(syms, "generation", 0))
        self._stream_stop.clear()
        self._stream = threading.Thread(target=self._decode_while_recording, daemon=True,
                                        name=f"{self.vm.name}-plugin-decode")
        self._stream.start()

    def disable(self, *, disarm: bool = True, switch: Sequence[GuestWrite] | None = None,
                reads: Sequence[int] = ()) -> None:
        """Stop recording; ``disarm=False`` leaves the probes armed (:meth:`disarm` later).
        ``switch``: the guest side's own switch off, made as the window closes (see
        :meth:`enable`); a caller that opened the window closes it before."""
        if switch is not None:
            self.engine.window(False, switch, reads=reads)
        if disarm:
            self.disarm()
        self.recording = False
        self._stop_stream()
        self._take()
        #: Records the plugin had to drop (a ring full: the host drained too slowly).
        self.dropped = self.engine.link.dropped - getattr(self, "_dropped0", 0)
        with self._lock:
            self._redecode_if_stale()
            sizes = [len(raw) for _, raw in self._raw] if self.dropped else []
            self._raw, self._basis = [], None   # decoded as the window closed, as before
        if self.dropped:
            self.bad_records[DROPPED] = self.dropped
            self.ring_mib = ring_mib(self.engine.link.ring.size, self.dropped,
                                     sum(sizes) / len(sizes) if sizes else REC_HDR.size)

    def _decode_while_recording(self) -> None:
        """The recording window's records, decoded as they come (every
        :data:`STREAM_INTERVAL`) on a thread of their own: with a vCPU a host core, the
        decoding (~15 us a hit in Python) runs beside the workload instead of after it.
        What it read the symbols from is checked when the window closes (:meth:`_settle`).
        A ring that cannot be read stops it; :meth:`disable` raises that."""
        while not self._stream_stop.wait(STREAM_INTERVAL):
            try:
                self._take()
            except BaseException as exc:  # noqa: BLE001 - raised by disable(), in its thread
                self._stream_error = exc
                return

    def _stop_stream(self) -> None:
        th, self._stream = self._stream, None
        if th is not None:
            self._stream_stop.set()
            th.join(30)
            if th.is_alive():       # a decoding that does not end: not a result
                raise EngineReadError("the plugin engine's records were still being decoded "
                                      "30 s after the recording window closed")
        if self._stream_error is not None:
            exc, self._stream_error = self._stream_error, None
            raise exc

    def _forget(self) -> None:
        """Drop what decoding the window's records produced (not the records)."""
        self._hits.clear()
        self._seqs.clear()
        self._nhit.clear()
        self._comm_changes.clear()
        self._comm_seqs.clear()
        self._ip_text.clear()
        self._decoded.clear()
        self.engine_errors.clear()
        self.capture_misses = 0
        for k in ("truncated", "program refused by the plugin"):
            self.bad_records.pop(k, None)

    def _redecode_if_stale(self) -> None:
        """A symbol table changed since the window opened (module symbols merged: a
        ``%pS`` value, a return probe's function) makes every record of the window
        decode again, from the table as it is now."""
        syms = self.engine.symbols
        if self._basis is not None and (self._basis[0] is not syms or
                                        self._basis[1] != getattr(syms, "generation", 0)):
            recs = sorted(self._raw, key=lean_seq)
            self._forget()
            self._basis = (syms, getattr(syms, "generation", 0))
            self._decode(recs)

    @gc_paused()
    def _settle(self) -> None:
        """The hits in the plugin's order, from the symbols as they are (while
        recording) or were when the window closed. The records were decoded in batches
        while the workload ran, each batch in ``seq`` order; a record of one vCPU can
        reach the ring after a later one of another vCPU was taken, so the batches are
        merged by ``seq``."""
        self._redecode_if_stale()
        seqs = self._seqs
        if any(a > b for a, b in zip(seqs, seqs[1:])):
            order = sorted(range(len(seqs)), key=seqs.__getitem__)
            self._hits = [self._hits[i] for i in order]
            self._seqs = [seqs[i] for i in order]
            for i, h in enumerate(self._hits):
                # freshly made here, not handed out yet: renumbered in place (Hit.changed
                # would copy every one)
                h.__dict__["seq"] = i
            self._comm_changes = [(bisect_left(self._seqs, cs), pid, comm) for cs, (_, pid, comm)
                                  in sorted(zip(self._comm_seqs, self._comm_changes))]
            self._comm_seqs.sort()

    @gc_paused()
    def _take(self) -> None:
        """The plugin's records so far, decoded into hits (kept too, for :meth:`_settle`).

        :raise EngineReadError: when the plugin's ring itself cannot be read.
        """
        with self._lock:
            try:
                recs = self.engine.lean_records()
            except (FaultError, ValueError, struct.error) as exc:
                raise EngineReadError(f"the plugin engine's ring could not be decoded: "
                                      f"{type(exc).__name__}: {exc}") from exc
            self._raw.extend(recs)
            self._decode(recs)

    def _decode(self, recs: Sequence[tuple[tuple[Any, ...], bytes]]) -> None:
        """Records (``pluginlink.lean()``'s, in ``seq`` order) as hits. A record that
        does not decode (a fault, a value or a layout the decoder cannot read) is an
        engine error naming the record, counted with the others (:meth:`_check`): never a
        crash, never a value."""
        placeable, decoded, hits, seqs = self._placeable, self._decoded, self._hits, self._seqs
        nhit, comms = self._nhit, self._comm_raw
        for f, raw in recs:
            # a hit of a register-plan probe whose payload was decoded already: placed
            # here from the record's header and bytes, as _hit() would place it (the same
            # key; the flags are part of it, and no truncated, refused or unconfirmed
            # record is ever decoded into the memo)
            _, rtype, vcpu, probe_id, _, seq, _, func, ret_addr, pid, flags, comm = f
            fast = placeable.get(probe_id)
            if fast is not None and rtype in _HIT_TYPES:
                base = decoded.get((probe_id, rtype, func, ret_addr, flags, fast[1](raw)))
                if base is not None:
                    name = fast[0]
                    nhit[name] = nhit.get(name, 0) + 1
                    if flags & RF_COMM:
                        text = comms.get(comm)
                        if text is None:
                            text = comms[comm] = self._comm(decode(raw))
                    else:
                        text = ""
                    hits.append(base.placed(len(hits), vcpu, pid if flags & RF_PID else None,
                                            text, base.irq))
                    seqs.append(seq)
                    continue
            self._decode_one(decode(raw), raw)

    def _decode_one(self, rec: PluginRecord, raw: bytes) -> None:
        """One record (``raw``, decoded: ``rec``) as a hit, a comm change, or what made
        it none."""
        if rec.type not in _HIT_TYPES or rec.probe_id not in self._specs:
            return
        name = self._specs[rec.probe_id][1]
        # trace_kprobe's nhit (kprobe_dispatcher(), kretprobe_dispatcher()): every hit
        # the window recorded, counted before its record is read
        self._nhit[name] = self._nhit.get(name, 0) + 1
        if rec.flags & (RF_TRUNC | RF_BADPROG):
            what = "truncated" if rec.flags & RF_TRUNC else "program refused by the plugin"
            self.bad_records[what] = self.bad_records.get(what, 0) + 1
            return
        try:
            h = self._hit(rec, len(self._hits), raw)
        except EngineReadError as exc:
            self.engine_errors.append((name, exc))
            return
        except (FaultError, ValueError, struct.error) as exc:
            self.engine_errors.append((name, _undecodable(rec, name, exc)))
            return
        if h is None:       # a commit no event probe's trigger runs on
            return
        if self._comm_probe is not None and rec.probe_id == self._comm_probe.id:
            if h.pid:
                self._comm_changes.append((len(self._hits), h.pid, h.arg("comm")[1:-1]))
                self._comm_seqs.append(rec.seq)
            return
        self._hits.append(h)
        self._seqs.append(rec.seq)

    def _check(self) -> None:
        """Fail the run on an incomplete record stream (never a warning alone).

        :raise PluginRecordError: records dropped, truncated or refused, with counts.
        :raise EngineReadError: a record the evaluator could not read from.
        """
        if self.bad_records:
            what = ", ".join(f"{n} {k}" for k, n in self.bad_records.items())
            raise PluginRecordError(f"the plugin engine's records are incomplete: {what}; "
                                    "the run is not compared", self.bad_records,
                                    self.ring_mib if DROPPED in self.bad_records else 0)
        EngineReadError.raise_first(self.engine_errors)

    def _watch_comms(self) -> None:
        """As the gdbstub backend does (``HostBackend._watch_comms``): a hidden probe on
        ``__set_task_comm(tsk, buf, exec)``, here a compiled one recording the renamed
        task's pid and its new comm, in order with the other records."""
        if self.comm_rule != "saved_cmdlines" or self._comm_probe is not None:
            return
        pid_off = self.engine.task_offsets[1]
        if self.engine.symbols.get("__set_task_comm") is None or not pid_off:
            return

        spec = parse(f"p:kphinternal/comm __set_task_comm pid=+{pid_off}(%di):s32 "
                     "comm=+0(%si):string")
        try:
            self._comm_probe = self._place(spec, kprobe=False)
        except ProbeRejectedError as exc:
            log.info("comm changes are not followed: %s", exc)
            return
        self._specs[self._comm_probe.id] = (spec, "kphinternal/comm")
        self.engine.enable_probe(self._comm_probe, True)

    def _comm(self, rec: PluginRecord) -> str:
        """The record's comm as text ("" when the plugin could not read it)."""
        if not rec.flags & RF_COMM:
            return ""
        text = self._comm_text.get(rec.comm)
        if text is None:
            text = self._comm_text[rec.comm] = rec.comm.decode("utf-8", "replace")
        return text

    def _hit(self, rec: PluginRecord, seq: int, raw: bytes = b"") -> Hit | None:
        """The record as a hit (None: an event probe's commit no trigger runs on); with
        the record's bytes (``raw``), a register-only probe's hit is kept for the records
        that carry the same (:meth:`_decode`).

        :raise EngineReadError: a read of the hit's program failed where the memory maps
            (``RF_UNCONFIRMED``: the plugin's failure, not a fault the guest took; the
            gdbstub engine's unconfirmed faults are the same error: harness.backends.host
            ``_Ctx.read``), so no fault of this record passes as ``stale``.
        """
        spec, name = self._specs[rec.probe_id]
        if rec.flags & RF_UNCONFIRMED:
            raise EngineReadError(f"the plugin engine's read at a hit of {name} failed "
                                  "where the guest's memory maps (not a fault the guest "
                                  "takes); the hit cannot be evaluated")
        syms = self.engine.symbols
        up = self._uprobes.get(rec.probe_id)
        ep = self._eprobes.get(rec.probe_id)
        if ep is not None:
            return self._eprobe_hit(rec, seq, spec, name, *ep)
        # a probe whose arguments read registers only (a register plan): its hit, but for
        # the place (seq, vCPU, pid, comm), is what the record's type, addresses, flags
        # and those registers say; decoded once per distinct set (Hit.placed)
        regs = self._plan_regs.get(rec.probe_id, False)
        if regs is False:
            regs = self._plan_regs[rec.probe_id] = _plan_registers(spec)
            if regs is not None and (self._comm_probe is None
                                     or rec.probe_id != self._comm_probe.id):
                self._placeable[rec.probe_id] = (name, _plan_key(regs))
        key = None
        if regs is not None and raw:
            key = (rec.probe_id, rec.type, rec.func, rec.ret_addr, rec.flags,
                   _plan_key(regs)(raw))
            base = self._decoded.get(key)
            if base is not None:
                return base.placed(seq, rec.vcpu, rec.pid if rec.flags & RF_PID else None,
                                   self._comm(rec), base.irq)
        if up is not None:
            # print_uprobe_event(): "(0x%lx)", or "(0x%lx <- 0x%lx)" with the real return
            # address first; %ip is the probed address itself (handle_swbp() sets it)
            ip = rec.ret_addr if rec.type == REC_RET else rec.func
            ip_text = f"0x{ip:x}"
            ret_from: str | None = f"0x{rec.func:x}" if rec.type == REC_RET else None
        elif rec.type == REC_RET:
            ip = rec.ret_addr
            ktramp = kernel_rethook_trampoline(syms)
            if ip == self.engine.trampoline:    # stacked on another kretprobe of the call
                ip = ktramp or ip
            ip_text = format_ip(ip, lambda a: syms.format(a) if syms.symbolize(a) else None,
                                kretprobe_trampoline=ktramp)
            hit = syms.symbolize(rec.func)
            ret_from = hit[0].name if hit else f"0x{rec.func:x}"
        else:
            ip = rec.func + INT3_INSN_SIZE
            ip_text = self._ip_text.get(rec.func)
            if ip_text is None:     # a probe's address prints the same at every hit
                ip_text = self._ip_text[rec.func] = syms.format(rec.func)
            ret_from = None
        ctx = _RecordCtx(self, rec, ip, up)
        why: dict[int, str] = {}
        failed: dict[int, int] = {}
        slack: list[int] = []
        try:
            values = evaluate(spec, ctx, why, failed, slack)
        finally:
            self.capture_misses += ctx.mem.misses
        flags_at = spec.flags_args
        if flags_at:
            # TCG computes the arithmetic flags lazily and the plugin API cannot make it
            # (qemu_plugin_read_register gives eflags without ZF/SF/CF ...): a %flags the
            # host cannot know is (unknown), never a wrong value; the diff's "flags" rule
            # matches it, for that argument only. Flags from an exception or interrupt
            # frame are exact but are not what a probe's %flags reads.
            values = tuple(_unknown_like(v) if i in flags_at else v for i, v in enumerate(values))
            why.update({i: "flags" for i in flags_at})
        args = tuple((a.name, format_value(a, v, ctx.symbolize)) for a, v in zip(spec.args, values))
        tpl = self._templates.get(rec.probe_id)
        if tpl is None:
            tpl = self._templates[rec.probe_id] = Hit.template(
                self.side, name, "r" if spec.is_return else "p", mode="plugin",
                ret_ip_args=spec.ret_ip_args, slot_args=spec.slot_args, mem_args=spec.mem_args)
        hit = tpl.changed(
            seq=seq, cpu=rec.vcpu, pid=rec.pid if rec.flags & RF_PID else None, comm=ctx.comm(),
            ip=ip_text, ret_from=ret_from, args=args,
            irq="" if up is not None else hit_context(rec.flags),
            hardirq=up is None and hit_hardirq(rec.flags),
            unknown=tuple((spec.args[i].name, w) for i, w in why.items()) if why else (),
            failed=tuple((spec.args[i].name, a) for i, a in failed.items()) if failed else (),
            slack=slack[0] if slack else 0)
        if key is not None and len(self._decoded) < DECODED_MAX:
            self._decoded[key] = hit
        return hit

    def _eprobe_hit(self, rec: PluginRecord, seq: int, spec: ProbeSpec, name: str,
                    event_id: int, targs: tuple) -> Hit | None:
        """A commit an event probe's trigger runs on, as its hit; else None
        (:func:`harness.backends.eprobes.triggered`, on the trigger arguments captured)."""
        assert self._site is not None
        ctx = _RecordCtx(self, rec, rec.func + INT3_INSN_SIZE)
        site = self._site
        try:
            values = evaluate(SimpleNamespace(args=targs), ctx)
            if not triggered(spec, event_id, site, values, rec.vcpu):
                return None
            why: dict[int, str] = {}
            failed: dict[int, int] = {}
            slack: list[int] = []
            values = evaluate(spec, ctx, why, failed, slack)
        finally:
            self.capture_misses += ctx.mem.misses
        args = tuple((a.name, format_value(a, v, ctx.symbolize)) for a, v in zip(spec.args, values))
        return Hit(side=self.side, probe=name, kind="p", seq=seq, cpu=rec.vcpu,
                   pid=rec.pid if rec.flags & RF_PID else None, comm=ctx.comm(),
                   ip="{}.{}".format(*(spec.attach or ("", ""))), ret_from=None, args=args,
                   mode="plugin", irq=hit_context(rec.flags), hardirq=hit_hardirq(rec.flags),
                   unknown=tuple((spec.args[i].name, w) for i, w in why.items()),
                   failed=tuple((spec.args[i].name, a) for i, a in failed.items()),
                   slack=slack[0] if slack else 0)

    def collect(self) -> list[Hit]:
        """The hits, each pid under the comm of its last hit (see the module docstring).

        :raise PluginRecordError: the plugin's records of the run are incomplete.
        :raise EngineReadError: a hit could not be evaluated from its record.
        """
        if self.recording:
            self._take()
        with self._lock:            # (while recording, the decoding thread waits)
            self._settle()
            self._check()
            if self.comm_rule == "at_hit":
                return list(self._hits)
            return saved_cmdlines(self._hits, self._comm_changes)

    def counters(self) -> dict[str, Counters]:
        """Per event: ``nhit`` the hits the recording window took (``Counters.window``:
        the runner opens and closes it with the guest's switch), ``nmissed`` the plugin's
        misses since registration."""
        out = {}
        for name, ps in self._probes.items():
            if any(p.id in self._eprobes for p in ps):
                continue        # an event probe has no kprobe_profile line
            nmissed = sum(self.engine.probe_stats(p)[1] for p in ps)
            out[name] = Counters(name, self._nhit.get(name, 0), nmissed, window=True)
        return out

    def close(self) -> None:
        th, self._stream = self._stream, None
        if th is not None:          # closed without disable(): an error ended the run
            self._stream_stop.set()
            th.join(5)
        self._raw = []
        if not getattr(self.vm, "aborting", False):
            detach_stubs(self.vm, self._stubs)
        self._stubs = []
        if self._comm_probe is not None:
            self._probes.setdefault("kphinternal/comm", []).append(self._comm_probe)
            self._comm_probe = None
        for ps in self._probes.values():
            for p in ps:
                try:
                    self.engine.remove_probe(p)
                except HarnessError as exc:
                    log.warning("removing plugin probe %d failed: %s", p.id, exc)
        self._probes.clear()
        # the window open again for the engine's other users (a run that closed it with
        # the guest's switch is over: the guest side has switched itself off since)
        if not getattr(self.vm, "aborting", False):
            try:
                self.engine.window(True, now=True)
            except (HarnessError, OSError) as exc:
                log.debug("reopening the plugin's window failed: %s", exc)
