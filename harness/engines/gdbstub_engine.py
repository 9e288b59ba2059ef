"""Host-side kprobes: the kernel's kprobe semantics, run by the host at gdbstub stops.

One ``HostEngine`` per Machine (``vm.host``). It owns the machine's GdbStub from a single
dispatcher thread (GDB/MI is not thread-safe): every stop is handled there, and calls
from other threads (register, read memory, ...) are queued, the guest is halted with
``-exec-interrupt``, the call runs, the guest resumes. ``vm.run()`` keeps working while
probes fire, because the guest runs between hits.

The flow of one hit at ``addr`` mirrors ``kprobe_int3_handler`` and the aggregate
handlers of ``kernel/kprobes.c``:

1. every enabled probe at ``addr`` gets ``pre_handler(p, regs)``, newest first;
   the first non-zero return ends the chain and the guest resumes at ``regs.ip``
   (``aggr_pre_handler``), with no single-step and no post_handler;
2. otherwise the probed instruction runs: emulated on the host when it is simple
   (``harness.kernel.emulate``), else single-stepped on that vCPU alone;
3. if the step lands on an exception entry the instruction faulted: ``fault_handler(p,
   regs, trapnr)`` with the faulting registers; 1 = handled (the exception frame is
   undone, resume at ``regs.ip``), else the guest handles the exception itself;
4. ``post_handler(p, regs, 0)`` with the registers after the instruction;
5. if the next address is itself probed (or the trampoline), that hit is handled now,
   since resuming there would step over its breakpoint.

Several probes at one address run newest first, as ``add_new_kprobe()`` links a new probe
at the head of the aggregate's list.

Handler context (``harness.machine.handlerctx``): handlers run on the engine's dispatcher thread
with the guest stopped, so anything that needs the guest running (``vm.run``, ``push``,
``pull``) raises ``GuestStoppedError`` there at once. A handler that raises is logged at
WARNING with its traceback, the guest goes on as if it had returned 0 (the kernel's
handlers cannot raise; the host must not stop the guest either), and the next call on the
engine from outside a handler (or ``close()``) raises ``HandlerError`` with every such
exception, unless the caller took them first (``take_handler_errors()``). Opt out with
``engine.raise_on_handler_error = False``: then they are only logged and kept in
``handler_errors``.

Return probes put the trampoline address (default ``_etext``: the first byte past the
kernel's last instruction, inside the executable mapping, never reached by the guest's
own control flow; change it with ``HostEngine(trampoline=...)`` or ``$KPH_TRAMPOLINE``) in
the return-address slot. QEMU's gdbstub breakpoints do not modify guest memory under
TCG, so the guest sees no int3 anywhere; only the hijacked return address is visible
(as with the kernel's own kretprobes, a stack walk shows the trampoline).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from .. import constants as C
from ..kernel.emulate import Emulation, decode
from .base import ERROR_CODE_VECTORS, EXCEPTION_ENTRIES, EngineCore, read_cstring
from .rethook import Rethook
from ..errors import GdbMIError, HarnessError, MemoryFaultError, ProbeRejectedError, VMLostError
from ..gdbstub import GdbStub, Stop, readable
from ..machine.image.facts import percpu_current_task, percpu_offset, uaccess_offsets
from ..machine.handlerctx import HandlerErrors, mark_thread, probe_name
from ..kernel.kprobes import (GDB_TO_FIELD, INT3_INSN_SIZE, MASK64, PT_REGS_FIELDS,
                              X86_EFLAGS_RF, X86_EFLAGS_VM, Kprobe, Kretprobe, ProbeFlags,
                              PtRegs, preempt_context, preempt_hardirq_only)
from ..kernel.unwind import stack_trace
from ..kernel.symbols import ReservedText, is_ftrace_site
from ..vmctl import register_host_engine
from .uprobes import UprobeManager
from ..kernel import emucheck
from ..vmctl import Machine

log = logging.getLogger(__name__)

EINVAL, ENOENT = 22, 2
DEFAULT_TRAMPOLINE = "_etext"
_GENERAL = tuple(PT_REGS_FIELDS.values())
_CALL_INSN_SIZE = 5      # the call an ftrace site holds (MCOUNT_INSN_SIZE)
_JMP32_OPCODE = 0xE9     # the jump an optimized kprobe's address holds (JMP32_INSN_OPCODE)
_KERNEL_SPACE = 0xFFFF800000000000
_STACK_SIZE = 16384      # THREAD_SIZE, and IRQ_STACK_SIZE, on x86_64
#: GDB's refusal of a command while it has the target running, and how often a request
#: that met it is served again after a fresh halt
_TARGET_RUNNING = ("while the target is running", "Selected thread is running")
_REHALTS = 3
_MAX_CHAIN = 64          # probes handled back to back before resuming regardless
_REP_STEPS = 1 << 16     # single-steps of one REP instruction before giving up


class HostEngine(EngineCore, Rethook, HandlerErrors):
    """Host-side kprobes on one Machine. Use ``vm.host`` rather than constructing it."""

    def __init__(self, vm: Machine, *, trampoline: str | int | None = None,
                 emulate: bool = True) -> None:
        self.vm = vm
        # Everything the handlers will read about the kernel is on the host before the
        # first breakpoint goes in (harness.machine.image.facts); nothing is fetched from the guest later.
        self.symbols = vm.symbols
        self.blacklist = vm.blacklist
        self.btf = vm.btf
        self.stub: GdbStub = vm.gdbstub(resume=False)
        if self.stub.running:
            self.stub.interrupt()
        self.emulate = emulate
        self.stats: Counter[str] = Counter()
        self._init_handler_errors()
        #: (since, what): the guest is held stopped by this engine (a hit or a request).
        self._held: tuple[float, str] | None = None
        self._aggr: dict[int, list[Kprobe]] = {}
        self._bp: dict[int, int] = {}
        self._init_rethook()
        self._reserved: ReservedText | None = None
        self._emul: dict[int, Emulation | None] = {}
        self._emul_bytes: dict[int, bytes] = {}
        tramp = trampoline if trampoline is not None else os.environ.get("KPH_TRAMPOLINE",
                                                                         DEFAULT_TRAMPOLINE)
        self.trampoline = tramp if isinstance(tramp, int) else self.symbols.resolve(str(tramp))
        self._exc = {sym.addr: vec for name, vec in EXCEPTION_ENTRIES.items()
                     if (sym := self.symbols.get(name)) is not None}
        self._current_task_off = percpu_current_task(self.symbols, self.btf)
        self._uaccess_offs = uaccess_offsets(self.symbols, self.btf)
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._closing = False
        self._final_resume: int | None = None
        self._fatal: BaseException | None = None
        self._again: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._rehalted: dict[int, int] = {}
        #: ``(cpu, probe address)`` of each entry hit in flight in the last settled halt
        self.in_flight_hits: list[tuple[int, int]] = []
        #: ``(thread, address)`` of the probe stop the dispatcher handled and has not
        #: resumed from yet (requests are served in that halt): see :meth:`in_flight`
        self._unresumed: tuple[int, int] | None = None
        #: optprobe_template_call - optprobe_template_entry (0: no optprobes; None: not read)
        self._tmpl_call: int | None = None
        self._uprobes: Any = None
        self._task_off = {m: self._btf_offset("task_struct", m) for m in ("pid", "comm")}
        if self._task_off["comm"] is None:
            base = self.symbols.lookup("init_task").addr
            i = self.stub.read_memory(base, 0x2000).find(b"swapper/0\0")
            self._task_off["comm"] = i if i >= 0 else None
        self._comm_off = self._task_off["comm"]
        vm.add_stop_holder(self._holding)
        self._thread = threading.Thread(target=self._loop, name=f"{vm.name}-kprobes", daemon=True)
        self._thread.start()

    def _btf_offset(self, struct: str, member: str) -> int | None:
        try:
            return int(self.btf.offset(struct, member))
        except (KeyError, ValueError):
            return None

    def _holding(self) -> tuple[float, str] | None:
        """For the machine's stall check: since when, and in what, the guest is held."""
        return self._held

    # -- the dispatcher -------------------------------------------------------------------
    def _loop(self) -> None:
        mark_thread(f"a host-side probe handler (or the {self.vm.name} probe dispatcher)")
        resume_at: int | None = None
        try:
            while True:
                if self._serve_requests():
                    # GDB had the target running under a stop taken for current (a stop
                    # that crossed a resume): halt for real, then serve the request again
                    self.stats["rehalts"] += 1
                    resume_at = self._handle(self.stub.interrupt())
                    continue
                if self._closing:
                    # The last hit's resume address must not be lost: after an emulated
                    # instruction the vCPU still sits on it (a plain continue would run it
                    # twice), and GDB skips a byte at a location it takes for a permanent
                    # breakpoint (a guest int3).
                    self._final_resume = resume_at
                    return
                self._held = None
                self._unresumed = None
                self.stub.resume(resume_at)
                stop: Stop | None = None
                asked = False       # a halt for a call on the engine, not the guest's stop
                while stop is None:
                    stop = self.stub.wait_stop(timeout=3600, wake_fd=self._wake_r)
                    if stop is None:
                        self._held = (time.monotonic(), "a call on the host-side engine")
                        stop = self.stub.interrupt()
                        asked = True
                    elif self.stub.running:
                        # A stop queued before GDB resumed the target again (a late
                        # interrupt): handling it would read a running vCPU ("Selected
                        # thread is running", seen once under kph fuzz). Drop it and wait.
                        log.debug("dropping a stale stop at %#x", stop.addr)
                        self.stats["stale_stops"] += 1
                        stop = None
                got_at = time.monotonic()
                if self._held is None:
                    self._held = (got_at, f"the hit at {stop.addr:#x}")
                resume_at = self._handle(stop)
                if not asked:
                    self.vm.note_host_stop(time.monotonic() - got_at)
        except BaseException as exc:  # noqa: BLE001 - reported to every later caller
            self._fatal = exc
            log.debug("dispatcher stopped: %r", exc)
            self._fail_requests(exc)
            self._recover(exc)

    def _handle(self, stop: Stop) -> int | None:
        """:meth:`_on_stop`, noting the stop as not resumed from: requests are served in
        its halt, before the resume, where this vCPU sits on the probed instruction, its
        hit recorded here and not yet by the guest (:meth:`in_flight`)."""
        resume_at = self._on_stop(stop)
        self._unresumed = (stop.thread, stop.addr) if stop.addr in self._aggr else None
        return resume_at

    def _recover(self, exc: BaseException) -> None:
        """After the dispatcher died: leave the guest as ``close()`` would (return
        addresses put back, no breakpoint, running), so that the machine stays usable and
        one failed call does not hold the guest stopped for every later one (a CI run's
        next test once waited out the stall check on a guest nobody would resume)."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or getattr(self.vm, "aborting", False) \
                or self._closing or self.stub.proc.poll() is not None:
            return
        first = (str(exc).splitlines() or [repr(exc)])[0]    # a bare exception has no text
        try:
            self.stub.running = True        # whatever our flag says: halt for real
            self.stub.interrupt()
            self._shutdown(closing=False)
            self.stub.resume(None)
            self._held = None
            log.warning("the host-side probe dispatcher stopped (%s); its probes were "
                        "removed and the guest resumed", first)
        except BaseException as again:  # noqa: BLE001 - the first cause is what callers get
            log.debug("could not leave the guest running: %r", again)
            self._held = (time.monotonic(), f"the host-side probe dispatcher (it stopped on: "
                                            f"{first})")

    def _serve_requests(self) -> bool:
        """Run the queued calls; True when one met GDB with the target running (it is
        queued again, first, for after a real halt; at most ``_REHALTS`` times)."""
        while readable(self._wake_r):
            os.read(self._wake_r, 4096)
        while True:
            if self._again:
                fn, fut = self._again.pop(0)
            else:
                try:
                    fn, fut = self._requests.get_nowait()
                except queue.Empty:
                    return False
                if not fut.set_running_or_notify_cancel():
                    continue
            try:
                fut.set_result(fn())
            except GdbMIError as exc:
                tries = self._rehalted.get(id(fut), 0)
                if any(t in str(exc) for t in _TARGET_RUNNING) and tries < _REHALTS:
                    log.debug("GDB has the target running (%s); halting again", exc)
                    self._rehalted[id(fut)] = tries + 1
                    self.stub.running = True
                    self._again.insert(0, (fn, fut))
                    return True
                fut.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            self._rehalted.pop(id(fut), None)

    def _fail_requests(self, exc: BaseException) -> None:
        while self._again:
            _, fut = self._again.pop(0)
            fut.set_exception(VMLostError(f"host-side probes stopped: {exc}"))
        while True:
            try:
                _, fut = self._requests.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(VMLostError(f"host-side probes stopped: {exc}"))

    def _call(self, fn: Callable[[], Any], *, timeout: float = C.ENGINE_CALL_TIMEOUT,
              errors: str = "before") -> Any:
        """Run ``fn`` on the dispatcher with the guest halted; return its result.

        ``errors``: raise pending handler errors ``before`` running ``fn``, or ``after``
        it (teardown calls: the unregistering must still happen), or ``none``.
        """
        if threading.current_thread() is self._thread:
            return fn()
        if errors == "before":
            self.raise_handler_errors()
        if self._fatal is not None:
            raise VMLostError(f"host-side probes stopped: {self._fatal}") from self._fatal
        fut: Future[Any] = Future()
        self._requests.put((fn, fut))
        os.write(self._wake_w, b"!")
        try:
            out = fut.result(timeout)
        except TimeoutError:
            held = self._held
            what = f" ({held[1]} for {time.monotonic() - held[0]:.0f} s)" if held else ""
            raise VMLostError(f"the probe dispatcher did not answer within {timeout:.0f} s"
                              f"{what}: a handler that never returns?") from None
        if errors == "after":
            self.raise_handler_errors()
        return out

    # -- stops ----------------------------------------------------------------------------
    def _on_stop(self, stop: Stop) -> int | None:
        """Handle one stop; return where to resume (None: where the vCPU is)."""
        pc, th = stop.addr, stop.thread
        up = self._uprobes
        for _ in range(_MAX_CHAIN):
            if pc == self.trampoline and self._live:
                nxt = self._on_trampoline(th)
            elif pc in self._aggr and any(not p.disabled for p in self._aggr[pc]):
                nxt = self._on_probe(pc, th)
            elif up is not None and up.claims(pc):
                nxt = up.on_stop(pc, th)
            else:
                return None if pc == stop.addr else pc
            if nxt == pc or (nxt not in self._aggr and nxt != self.trampoline
                             and not (up is not None and up.claims(nxt))):
                return nxt
            pc = nxt
        log.warning("probe chain longer than %d at %#x; resuming", _MAX_CHAIN, pc)
        return pc

    def _regs(self, th: int, values: dict[str, int]) -> PtRegs:
        return PtRegs(values, loader=lambda names: self._read_regs(th, names),
                      sys_reader=lambda n: self.stub.read_registers((n,), thread=th)[n],
                      cpu=th - 1, unwinder=lambda r, n: stack_trace(self, r, n))

    def _read_regs(self, th: int, names: Iterable[str] | None = None) -> dict[str, int]:
        gdb_names = _GENERAL if names is None else tuple(PT_REGS_FIELDS[n] for n in names)
        raw = self.stub.read_registers(gdb_names, thread=th)
        return {GDB_TO_FIELD[k]: v for k, v in raw.items()}

    def _flush(self, regs: PtRegs, th: int, *, keep_ip: bool = True) -> None:
        dirty = regs.dirty
        if not keep_ip:
            dirty.pop("ip", None)
        self.stub.write_registers({PT_REGS_FIELDS[k]: v for k, v in dirty.items()}, thread=th)
        regs.clear_dirty()

    def _handler(self, fn: Callable[..., Any], *args: Any) -> Any:
        name = getattr(fn, "__name__", repr(fn))
        self._held = (self._held[0] if self._held else time.monotonic(),
                      f"the handler {name} of {probe_name(args[0])}")
        return self._run_handler(fn, *args)

    def _on_probe(self, addr: int, th: int) -> int:
        probes = [p for p in self._aggr[addr] if not p.disabled]
        self.stats["hits"] += 1
        # Every x86 path hands the pre_handler regs->ip = addr + 1: the int3 trap leaves it
        # there (kprobe_int3_handler(), arch/x86/kernel/kprobes/core.c), ftrace sets it
        # ("Kprobe handler expects regs->ip = ip + 1 as breakpoint hit",
        # kprobe_ftrace_handler(), ftrace.c), so does optimized_callback() (opt.c).
        regs = self._regs(th, {"ip": addr + INT3_INSN_SIZE})
        if probes and probes[0].flags & ProbeFlags.FTRACE:
            # kprobe_ftrace_handler() gets the regs ftrace_regs_caller saved, with
            # "movq $0, ORIG_RAX(%rsp)" (arch/x86/kernel/ftrace_64.S: save_mcount_regs);
            # an int3 exception frame has -1 there (entry_64.S: idtentry)
            regs.orig_ax = 0
            # and its flags with pushfq, which clears RF and VM in the image it pushes
            # (ftrace_regs_caller, the same in 6.1, 6.12 and 7.3): the vCPU's own RF is
            # set when it resumes at the probed instruction from an interrupt whose frame
            # had RF (TCG: seen at kernel_clone, host 0x10206 against the trace's 0x206)
            regs.mask_loaded("flags", ~(X86_EFLAGS_RF | X86_EFLAGS_VM) & MASK64)
        if self.pre_handlers(probes, regs):
            # The path was changed: no single-step, no post_handler; the guest resumes at
            # whatever regs.ip the handler left (addr + 1 if it left it alone, as in the kernel).
            self._flush(regs, th, keep_ip=False)
            return regs.ip
        # An ip changed by a pre_handler that returned 0 is overwritten by the kernel's
        # setup_singlestep(); only the other registers carry over.
        self._flush(regs, th, keep_ip=False)
        nxt, emulated, vector = self._execute_insn(addr, th, regs.get)
        if vector == 3:
            return nxt
        if vector is not None:
            return self._on_fault(addr, th, probes, vector, nxt)
        after: PtRegs | None = None
        if emulated is None:
            after = self._regs(th, {"ip": nxt})
        elif any(p.post_handler for p in probes):
            # The effect is in the guest now; the rest is read lazily. ip is not written
            # (the guest resumes there by jump), so it is given.
            after = self._regs(th, {**emulated, "ip": nxt})
        if after is not None:
            self.post_handlers(probes, after)
            self._flush(after, th)
            nxt = after.ip
        return nxt

    def _execute_insn(self, addr: int, th: int, reg: Callable[[str], int] | None = None
                      ) -> tuple[int, dict[str, int] | None, int | None]:
        """Run the instruction at ``addr`` on vCPU ``th``: emulated on the host when simple,
        else single-stepped with our breakpoint lifted. Returns ``(next ip, registers the
        emulation wrote or None when stepped, exception vector or None)``; with a vector,
        next ip is the exception entry (3: the guest's own int3 sits there and takes over
        from its #BP entry, as when in-guest and host-side probes observe one execution)."""
        emu = self._emulation(addr) if self.emulate else None
        if emu is not None:
            eff = emu.apply(reg or (lambda n: self._read_regs(th, (n,))[n]), self.stub.read_memory)
            for a, data in eff.mem:
                self.stub.write_memory(a, data)
            if eff.regs:
                self.stub.write_registers({PT_REGS_FIELDS[k]: v for k, v in eff.regs.items()},
                                          thread=th)
            self.stats["emulated"] += 1
            return eff.next_ip, dict(eff.regs), None
        stop = self._step_here(addr, th)
        steps, rcx = 1, None
        while stop.addr == addr and steps < _REP_STEPS:
            # A REP instruction runs one round per step, counting rcx down; a step that
            # moved nothing at all is not progress (never loop on it).
            now = self.stub.read_registers(("rcx",), thread=th)["rcx"]
            if now == rcx:
                log.warning("single-step at %#x makes no progress; resuming", addr)
                break
            rcx = now
            stop = self._step_here(addr, th)
            steps += 1
        self.stats["stepped"] += 1
        if stop.addr in self._exc and stop.addr != addr:
            if self._exc[stop.addr] == 3:
                self.stats["guest_int3"] += 1
            return stop.addr, None, self._exc[stop.addr]
        return stop.addr, None, None

    def _execute(self, addr: int, th: int, reg: Callable[[str], int] | None = None) -> int:
        """Run the instruction at ``addr`` as if no breakpoint were there; the next ip."""
        return self._execute_insn(addr, th, reg)[0]

    def _step_here(self, addr: int, th: int) -> Stop:
        """Single-step the instruction at ``addr`` with our breakpoint lifted for the step:
        a guest int3 planted there after our breakpoint is invisible to GDB's reads (they
        return the saved byte), and with the breakpoint in place such a step runs nothing."""
        num = self._bp.get(addr)
        if num is None:
            return self.stub.step(thread=th)
        self._remove_bp(addr, num)
        try:
            return self.stub.step(thread=th)
        finally:
            if num == -1:
                # A raw breakpoint stays raw: GDB knows nothing of it, and a GDB breakpoint
                # put there now could collide with one GDB still believes inserted.
                if self.stub.raw(f"Z0,{addr:x},1") != "OK":
                    raise HarnessError(f"QEMU refused a breakpoint at {addr:#x}")
            else:
                self._bp[addr] = self._insert_bp(addr)

    def _insert_bp(self, addr: int) -> int:
        """A breakpoint at ``addr``: GDB's, or a raw Z0 (returned as -1) where the guest's
        own int3 sits. GDB would take that one for a permanent breakpoint: send no Z0 to
        QEMU (so we would never stop there again) and skip a byte when resuming on it."""
        if self.stub.read_memory_raw(addr, 1) == b"\xcc":
            if self.stub.raw(f"Z0,{addr:x},1") != "OK":
                raise HarnessError(f"QEMU refused a breakpoint at {addr:#x}")
            return -1
        return self.stub.insert_breakpoint(addr)

    def _remove_bp(self, addr: int, num: int) -> None:
        if num == -1:
            self.stub.raw(f"z0,{addr:x},1")
        else:
            self.stub.delete_breakpoint(num)

    def _emulation(self, addr: int) -> Emulation | None:
        """The emulation for the instruction *really* at ``addr`` now, or None to step.

        The decode is cached, but the guest's bytes are checked on every hit (one raw read,
        past GDB's breakpoint shadow): the guest's own kprobes patch code under our
        breakpoints, sometimes later (the optimizer's deferred jmp), and emulating a stale
        instruction would resume in the middle of the new one."""
        real = self.stub.read_memory_raw(addr, 16)
        cached = self._emul.get(addr)
        if cached is not None and self._emul_bytes.get(addr) == real[:cached.length]:
            return cached
        emu = decode(real, addr)
        self._emul[addr] = emu
        if emu is not None:
            self._emul_bytes[addr] = real[:emu.length]
        return emu

    def _on_fault(self, addr: int, th: int, probes: list[Kprobe], vector: int, entry: int) -> int:
        """The probed instruction raised ``vector``; the vCPU is at the exception entry."""
        self.stats["faults"] += 1
        cur = self._read_regs(th)
        frame = cur["sp"] + (8 if vector in ERROR_CODE_VECTORS else 0)
        rip, cs, rflags, rsp, ss = (int.from_bytes(self.stub.read_memory(frame + 8 * i, 8), "little")
                                    for i in range(5))
        regs = self._regs(th, {**cur, "ip": rip, "cs": cs, "flags": rflags, "sp": rsp, "ss": ss})
        undo = self.fault_handlers(probes, regs, vector)
        if undo is not None:
            self.stub.write_registers({PT_REGS_FIELDS[k]: v for k, v in undo.items()}, thread=th)
            return regs.ip
        return entry

    # -- what handlers read of the kernel's state -------------------------------------------
    def current_task(self, regs: PtRegs) -> int | None:
        """``current`` (a ``struct task_struct *``) on the vCPU of ``regs``."""
        return self._current_task(regs)

    def uaccess_okay(self, regs: PtRegs, task: int | None) -> bool:
        """``nmi_uaccess_okay()`` (arch/x86/mm/tlb.c) on the vCPU of ``regs``:
        ``current->mm`` is the per-cpu ``cpu_tlbstate.loaded_mm``. False for a task past
        exit_mm() (its mm NULL, the CPU still on the old page tables), and for a kernel
        thread on a borrowed mm. True when the kernel's layout is not known."""
        offs = self._uaccess_offs
        if offs is None or task is None:
            return True
        try:
            mm = int.from_bytes(self.stub.read_memory(task + offs[0], 8), "little")
        except MemoryFaultError:
            return True
        loaded = self.percpu_read_at(regs, offs[1])
        return loaded is None or mm == loaded

    def task_pid(self, task: int | None) -> int | None:
        """``task->pid`` (the thread id the trace file prints)."""
        off = self._task_off["pid"]
        if task is None or off is None:
            return None
        try:
            return int.from_bytes(self.stub.read_memory(task + off, 4), "little", signed=True)
        except MemoryFaultError:
            return None

    def task_comm_bytes(self, task: int | None) -> bytes | None:
        """``task->comm`` as the kernel stores it, up to its NUL."""
        if task is None or self._comm_off is None:
            return None
        try:
            raw = self.stub.read_memory(task + self._comm_off, 16)
        except MemoryFaultError:
            return None
        return raw.split(b"\0", 1)[0]

    def task_comm(self, task: int | None) -> str | None:
        """``task->comm``."""
        raw = self.task_comm_bytes(task)
        return None if raw is None else raw.decode("utf-8", "replace")

    def hit_contexts(self, regs: PtRegs, hardirq_shift: int) -> tuple[str, bool]:
        """(``irq`` (the probed call runs in a softirq or a hardirq) or ``task``, as the
        guest's trace entry flags tell it (``tracing_gen_ctx()``), "" when the count
        cannot be read; whether it is ``irq`` for a hardirq alone), from one read of
        ``preempt_count()`` (``harness.kernel.kprobes.preempt_context``,
        ``preempt_hardirq_only``; where the count lives: ``facts.percpu_preempt_count``);
        ``hardirq_shift`` the kernel's HARDIRQ_SHIFT (``KernelRules.preempt_hardirq_shift``)."""
        off = self._percpu_off("__preempt_count", "preempt_count")
        pc = self.percpu_read_at(regs, off) if off is not None else None
        return ("", False) if pc is None else (preempt_context(pc, hardirq_shift),
                                               preempt_hardirq_only(pc, hardirq_shift))

    def _percpu_off(self, var: str, hot: str) -> int | None:
        """The per-cpu offset of ``var`` (``facts.percpu_offset``: its own per-cpu
        variable or member ``hot`` of ``pcpu_hot``), once per engine."""
        cache = self.__dict__.setdefault("_percpu_offs", {})
        if var not in cache:
            cache[var] = percpu_offset(self.symbols, self.btf, var, hot)
        return cache[var]

    def percpu_read(self, regs: PtRegs, name: str) -> int | None:
        """``this_cpu_read(name)`` for a per-cpu ``unsigned long`` or pointer on the vCPU of
        ``regs``. None when the kernel has no such symbol or it cannot be read."""
        sym = self.symbols.get(name)
        return None if sym is None else self.percpu_read_at(regs, sym.addr)

    def percpu_read_at(self, regs: PtRegs, off: int) -> int | None:
        """8 bytes at the GS base plus the per-cpu offset ``off`` on the vCPU of ``regs``
        (zero-based per-cpu symbols up to 6.14, section addresses in 7.x: the sum wraps
        as the CPU's segment addressing does); None when it cannot be read."""
        try:
            base = regs.read_sys("k_gs_base" if regs.get("cs") & 3 == 3 else "gs_base")
            addr = (base + off) & ((1 << 64) - 1)
            return int.from_bytes(self.stub.read_memory(addr, 8), "little")
        except MemoryFaultError:
            return None

    def percpu_base(self, regs: PtRegs) -> int | None:
        """What ``this_cpu_ptr()`` adds on this vCPU: ``this_cpu_read(this_cpu_off)``."""
        return self.percpu_read(regs, "this_cpu_off")

    def guest_kprobe_running(self, regs: PtRegs) -> bool:
        """``kprobe_running()`` in the guest on the vCPU of ``regs``: one of the guest's own
        kprobes is in its handler (per-cpu ``current_kprobe``). A probe hit then is missed
        in the kernel (``kprobe_ftrace_handler()``, ``kprobe_int3_handler()`` and
        ``kretprobe_rethook_handler()`` count ``nmissed`` and call no handler)."""
        return bool(self.percpu_read(regs, "current_kprobe"))

    def _current_task(self, regs: PtRegs) -> int | None:
        if self._current_task_off is None:
            return None
        try:
            # In user mode GS is the program's; the kernel's per-cpu base waits in
            # MSR_KERNEL_GS_BASE until swapgs on the next kernel entry.
            base = regs.read_sys("k_gs_base" if regs.get("cs") & 3 == 3 else "gs_base")
            return int.from_bytes(self.stub.read_memory(base + self._current_task_off, 8), "little")
        except MemoryFaultError:
            return None

    # -- registration (all run on the dispatcher, guest halted) ---------------------------
    def _register(self, p: Kprobe, *, kretprobe: bool = False) -> None:
        if p.registered:
            raise ProbeRejectedError("probe is already registered (-EINVAL)", EINVAL, p.addr)
        if p.ftrace_ops:
            addr = p.addr = self.ftrace_location(p.symbol_name, p.addr)
            p.flags |= ProbeFlags.FTRACE
        else:
            addr, on_entry = self.kprobe_addr(p.symbol_name, p.offset, p.addr)
            self.check_address(addr, kretprobe=kretprobe)
            p.addr = addr
            if on_entry and is_ftrace_site(self.stub.read_memory(addr, 5)):
                p.flags |= ProbeFlags.FTRACE
        # add_new_kprobe() puts a new probe at the head of the aggregate's list, so the
        # kernel runs probes at one address newest first; so does the host.
        # Code may have changed since an instruction was decoded (the guest's own kprobes
        # patch the ftrace nop into a call, or an int3 over the first byte): decode afresh.
        self._emul.clear()
        self._aggr.setdefault(addr, []).insert(0, p)
        p.registered = True
        self._arm(addr)

    def _arm(self, addr: int) -> None:
        active = any(not q.disabled for q in self._aggr.get(addr, ()))
        if active and addr not in self._bp:
            self._bp[addr] = self._insert_bp(addr)
        elif not active and addr in self._bp:
            self._remove_bp(addr, self._bp.pop(addr))

    def _unregister(self, p: Kprobe) -> None:
        if not p.registered or p.addr is None:
            return
        lst = self._aggr.get(p.addr, [])
        if p in lst:
            lst.remove(p)
        if not lst:
            self._aggr.pop(p.addr, None)
        p.registered = False
        self._arm(p.addr)

    # -- public API (kernel names) --------------------------------------------------------
    def register_kprobe(self, p: Kprobe) -> Kprobe:
        """Arm ``p``; raise ProbeRejectedError with the kernel's errno if it cannot go there."""
        self._fresh_module_symbols([p])
        self._call(lambda: self._register(p))
        return p

    def unregister_kprobe(self, p: Kprobe) -> None:
        self._call(lambda: self._unregister(p), errors="after")

    def register_kprobes(self, ps: Iterable[Kprobe]) -> None:
        """Register all or none: a failure unregisters those already done, then raises."""
        ps = list(ps)
        self._fresh_module_symbols(ps)
        self._call(lambda: self._register_all(ps))

    def unregister_kprobes(self, ps: Iterable[Kprobe]) -> None:
        self._call(lambda: [self._unregister(p) for p in list(ps)], errors="after")

    def enable_kprobe(self, p: Kprobe | Kretprobe) -> None:
        def go() -> None:
            target = p.kp if isinstance(p, Kretprobe) else p
            p.flags &= ~ProbeFlags.DISABLED
            if target is not None and target is not p:
                target.flags &= ~ProbeFlags.DISABLED
            if target is not None and target.addr is not None:
                self._arm(target.addr)
        self._call(go)

    def disable_kprobe(self, p: Kprobe | Kretprobe) -> None:
        def go() -> None:
            target = p.kp if isinstance(p, Kretprobe) else p
            p.flags |= ProbeFlags.DISABLED
            if target is not None and target is not p:
                target.flags |= ProbeFlags.DISABLED
            if target is not None and target.addr is not None:
                self._arm(target.addr)
        self._call(go)

    def _fresh_module_symbols(self, probes: Iterable[Any]) -> None:
        """``kallsyms_lookup_name()`` looks an unqualified name up in the modules after
        vmlinux, and module addresses change from boot to boot: take the module symbols
        from the running guest when a probe names a module symbol or one vmlinux lacks
        (not from a handler, where the guest cannot run a command)."""
        if threading.current_thread() is self._thread:
            return
        for p in probes:
            name = getattr(p, "symbol_name", None)
            if name and (":" in name or (sym := self.symbols.get(name)) is None
                         or sym.module is not None):
                self.vm.refresh_module_symbols()
                return

    @property
    def uprobes(self) -> Any:
        """The user-space probes (``harness.engines.uprobes.UprobeManager``), made on first use."""
        if self._uprobes is None:
            self._uprobes = UprobeManager(self)
        return self._uprobes

    def register_uprobe(self, up: Any) -> Any:
        """Arm a ``harness.engines.uprobes.Uprobe`` (a uretprobe too when it has ``ret_handler``).

        The ELF, inode and the process's mapping are looked up through the guest agent
        first (guest running), then the breakpoints go in with the guest halted.
        :raise ProbeRejectedError: no such file, symbol, process or mapping.
        """
        mgr = self.uprobes
        mgr.prepare(up)
        self._call(lambda: mgr.register(up))
        return up

    def unregister_uprobe(self, up: Any) -> None:
        if self._uprobes is not None:
            self._call(lambda: self._uprobes.unregister(up), errors="after")

    def invalidate_code(self) -> None:
        """Forget decoded instructions: the guest changed its text (its own kprobes were
        armed after ours: an ftrace nop became a call, an int3 or a jmp was planted)."""
        self._call(self._emul.clear)

    def _read_now(self, addr: int, n: int) -> bytes:
        return self.stub.read_memory(addr, n)

    def read(self, addr: int, n: int) -> bytes:
        """Guest virtual memory (from a handler, or from any thread: the guest is halted)."""
        return self._call(lambda: self.stub.read_memory(addr, n))

    def read_string(self, addr: int, maxlen: int = 4096) -> bytes | None:
        """A NUL-terminated string, read a page at a time as ``strncpy_from_user`` does;
        None when its first byte cannot be read."""
        return self._call(lambda: read_cstring(self.stub.read_memory, addr, maxlen,
                                                MemoryFaultError))

    def write(self, addr: int, data: bytes) -> None:
        self._call(lambda: self.stub.write_memory(addr, data))

    def halted(self, fn: Callable[[], Any], *, settle: bool = False) -> Any:
        """Run ``fn`` with the guest halted, as one step: no guest instruction runs between
        what it does (arming probes and switching the guest's tracing at the same instant).

        ``settle``: choose a halt where no vCPU is inside the kernel's handling of a hit
        (:meth:`in_flight`): the host records a hit at its breakpoint, the guest's probe
        records it in its handler, later (and a return probe the other way round), so a
        vCPU the halt catches between the two would be counted by one side only. Up to
        ``C.SETTLE_TRIES`` halts, the guest running a moment between them; the last one
        is taken regardless (``stats["unsettled"]``), and the entry hits in flight in it
        are in :attr:`in_flight_hits` while ``fn`` runs (empty after a settled halt): the
        caller that ends its recording there knows which of its records the guest's
        handlers, running after the halt, never made."""
        self.in_flight_hits = []
        if not settle:
            return self._call(fn)
        for attempt in range(C.SETTLE_TRIES):
            last = attempt == C.SETTLE_TRIES - 1

            def go() -> tuple[bool, Any]:
                busy = self._scan_in_flight()
                if busy and not last:
                    return False, busy
                self.in_flight_hits = [f for _, fs in busy for f in fs]
                if busy:
                    self.stats["unsettled"] += 1
                    log.debug("no settled halt in %d tries: %s", C.SETTLE_TRIES,
                              [d for d, _ in busy])
                return True, fn()
            done, val = self._call(go)
            if done:
                return val
            self.stats["settle_retries"] += 1
            time.sleep(C.SETTLE_PAUSE)
        raise AssertionError("unreachable")

    def in_flight(self) -> list[str]:
        """The vCPUs inside the kernel's handling of a hit at one of this engine's probe
        addresses, with the guest halted: a stack it is on (from ``rsp``, at most
        ``C.SETTLE_SCAN`` bytes, inside its 16 KiB stack) holds ``addr + 1``, which the
        int3 exception frame holds (arch/x86/kernel/kprobes/core.c:
        kprobe_int3_handler()) and ``kprobe_ftrace_handler()`` and
        ``optimized_callback()`` write to the pt_regs they hand on; or ``addr + 5``, the
        return address of an ftrace site's call (arch/x86/kernel/ftrace_64.S); or its pc
        or a return address lies in the kernel's kretprobe trampoline
        (``arch_rethook_trampoline``, arch/x86/kernel/rethook.c), where a return probe's
        handler runs, or in ``return_to_handler`` (arch/x86/kernel/ftrace_64.S), where
        7.3's fprobe exits run. A vCPU in an interrupt is on its CPU's hardirq stack; the
        interrupted stack is scanned too, from the stack pointer ``call_on_stack()``
        saved at the top of that stack (arch/x86/include/asm/irq_stack.h): a task whose
        hit an interrupt took in its window is as much in flight as the interrupt. A
        stale value in a frame only costs a retry. And a vCPU stopped at one of this
        engine's breakpoints whose hit the dispatcher recorded, in the halt before its
        resume: the guest's probe there has not run yet (CI, 7.3: ``nhit`` over the window
        15 on the host against 14, the closing halt being such a stop). And a vCPU in an
        optimized kprobe's detour buffer before its call of ``optimized_callback()``, or
        inside that call (its return address on the stack): the callback writes ``addr +
        1`` to the pt_regs only on its way to the handler, so the int3 mark alone missed
        these (6.1, ``p update_fast_timekeeper+35``: 6 of 15 runs one hit more on the
        host; none with ``debug.kprobes-optimization`` 0). Each entry hit in flight is in
        :attr:`in_flight_hits` as ``(cpu, probe address)``, innermost first."""
        return [d for d, _ in self._scan_in_flight()]

    def _scan_in_flight(self) -> list[tuple[str, list[tuple[int, int]]]]:
        marks: dict[int, int] = {}
        for addr, probes in self._aggr.items():
            marks[addr + INT3_INSN_SIZE] = addr
            if any(p.flags & ProbeFlags.FTRACE for p in probes):
                marks[addr + _CALL_INSN_SIZE] = addr
        ranges = []
        name = next((n for n in ("arch_rethook_trampoline", "__kretprobe_trampoline",
                                 "kretprobe_trampoline") if self.symbols.get(n)), None)
        # 7.3's fprobe exits run from the function graph's return_to_handler
        for n in (name, "return_to_handler"):
            sym = self.symbols.get(n) if n else None
            if sym is not None:
                ranges.append((sym.addr, sym.addr + max(sym.size, 1)))
        detours = self._detours()
        for addr, (_, call_ret) in detours.items():
            marks[call_ret] = addr
        if not marks and not ranges:
            return []
        busy: list[tuple[str, list[tuple[int, int]]]] = []
        cur = self.stub.current_thread
        try:
            for th in range(1, self.vm.smp + 1):
                try:
                    if th != self.stub.current_thread:
                        self.stub.select_thread(th)
                    r = self.stub.read_registers(("rsp", "rip"))
                except HarnessError:
                    continue
                sp, pc = r.get("rsp", 0), r.get("rip", 0)
                if self._unresumed == (th, pc):
                    # stopped at our breakpoint, the hit recorded by the host; the probed
                    # instruction (the guest's int3, its ftrace call) runs at the resume
                    busy.append((f"cpu{th - 1} at the probe {pc:#x}, not resumed", [(th - 1, pc)]))
                    continue
                if pc < _KERNEL_SPACE or sp < _KERNEL_SPACE:
                    continue            # in user mode: no kernel handler under way
                inside = next((a for a, (lo, ret) in detours.items() if lo <= pc < ret), None)
                if inside is not None:  # in the detour, its call not made yet
                    busy.append((f"cpu{th - 1} at {pc:#x}, in the detour of {inside:#x}",
                                 [(th - 1, inside)]))
                    continue
                if any(lo <= pc < hi for lo, hi in ranges):
                    busy.append((f"cpu{th - 1} at {pc:#x}", []))
                    continue
                found: list[tuple[int, int]] = []
                where = ""
                for lo, hi in self._stacks_of(th, sp):
                    n = min(C.SETTLE_SCAN, hi - lo) & ~7
                    try:
                        data = self.stub.read_memory(lo, n) if n > 0 else b""
                    except HarnessError:
                        continue
                    for i in range(0, len(data), 8):
                        v = int.from_bytes(data[i:i + 8], "little")
                        if v in marks:
                            found.append((th - 1, marks[v]))
                            where = where or f" ({v:#x} at {lo + i:#x})"
                            break       # one window per stack: its innermost frame
                        if any(lo_ <= v < hi_ for lo_, hi_ in ranges):
                            where = where or f" ({v:#x} at {lo + i:#x})"
                            found.append((th - 1, 0))
                            break
                if found:
                    busy.append((f"cpu{th - 1} at {pc:#x}{where}",
                                 [f for f in found if f[1]]))
        finally:
            # a pending ``-exec-jump`` must move the vCPU that stopped
            if cur is not None and self.stub.current_thread != cur:
                self.stub.select_thread(cur)
        return busy

    def _detours(self) -> dict[int, tuple[int, int]]:
        """probe address -> (its detour buffer, the return address of the buffer's call of
        ``optimized_callback()``) for each of this engine's probe addresses the kernel has
        optimized, read with the guest halted: an optimized kprobe's address holds a
        ``jmp`` to its buffer, a copy of ``optprobe_template_entry`` whose call sits at
        ``optprobe_template_call`` (arch/x86/kernel/kprobes/opt.c of 6.1, 6.12 and 7.3:
        __arm_kprobe() -> arch_optimize_kprobes(), arch_prepare_optimized_kprobe(),
        TMPL_CALL_IDX). Empty on a kernel without optprobes (no template symbols); no
        entry for an ftrace site (a kprobe there is never optimized)."""
        if self._tmpl_call is None:
            entry, call = (self.symbols.get(n) for n in ("optprobe_template_entry",
                                                          "optprobe_template_call"))
            self._tmpl_call = call.addr - entry.addr if entry and call else 0
        if not self._tmpl_call:
            return {}
        out = {}
        for addr, probes in self._aggr.items():
            if any(p.flags & ProbeFlags.FTRACE for p in probes):
                continue
            try:
                head = self.stub.read_memory(addr, 5)
            except HarnessError:
                continue
            if len(head) == 5 and head[0] == _JMP32_OPCODE:
                slot = addr + 5 + int.from_bytes(head[1:], "little", signed=True)
                out[addr] = (slot, slot + self._tmpl_call + _CALL_INSN_SIZE)
        return out

    def _stacks_of(self, th: int, sp: int) -> list[tuple[int, int]]:
        """``(from, to)`` of each stack to scan for vCPU ``th`` at ``sp``: its own, and
        when that is the CPU's hardirq stack (arch/x86/kernel/irq_64.c:
        map_irq_stack(): ``hardirq_stack_ptr`` is its top minus 8, where
        ``call_on_stack()`` keeps the interrupted stack pointer), the interrupted one."""
        top = (sp | (_STACK_SIZE - 1)) + 1
        tos = self._hardirq_tos(th)
        if tos is None or not tos - _STACK_SIZE < sp <= tos:
            return [(sp, top)]
        out = [(sp, tos)]
        try:
            old = int.from_bytes(self.stub.read_memory(tos, 8), "little")
        except HarnessError:
            return out
        if old >= _KERNEL_SPACE and not tos - _STACK_SIZE < old <= tos:
            out.append((old, (old | (_STACK_SIZE - 1)) + 1))
        return out

    def _hardirq_tos(self, th: int) -> int | None:
        """``this_cpu_read(hardirq_stack_ptr)`` on vCPU ``th``: a per-cpu variable on 6.1
        and 7.3 (arch/x86/include/asm/processor.h), ``pcpu_hot.hardirq_stack_ptr`` on 6.2
        to 6.14 (arch/x86/include/asm/current.h); None when the kernel has neither."""
        off = self._percpu_off("hardirq_stack_ptr", "hardirq_stack_ptr")
        if off is None:
            return None
        try:
            return self.percpu_read_at(self._regs(th, {}), off)
        except HarnessError:
            return None

    def list(self) -> str:
        """The registered probes as ``/sys/kernel/debug/kprobes/list`` prints them."""
        lines = []
        for addr in sorted(self._aggr):
            for p in self._aggr[addr]:
                if getattr(p, "_kph_internal", False):
                    continue        # the engine's own (rethook_flush_task), not the user's
                kind = "r" if hasattr(p, "_kph_rp") else "k"
                hit = self.symbols.symbolize(addr)
                where = f"{hit[0].name}+{hit[1]:#x}" if hit else f"{addr:#x}"
                mod = hit[0].module if hit and hit[0].module else " "
                flags = "[DISABLED]" if p.disabled else ""
                lines.append(f"{addr:016x}  {kind}  {where}  {mod} {flags}")
        return "\n".join(lines) + ("\n" if lines else "")

    def check_emulation(self, p: Kprobe, code: bytes | None = None) -> list[Any]:
        """Arm ``p`` so that at each hit emulation is compared with a real single-step
        (``harness.kernel.emucheck``); returns the list the ``EmulationCheck`` results go to.
        With ``code``, those bytes are checked at a scratch address instead of the probed
        instruction, which then runs as usual."""
        results: list[Any] = []
        user_pre = p.pre_handler

        def pre(kp: Kprobe, regs: PtRegs) -> int:
            results.append(emucheck.check(self, regs.cpu + 1, kp.addr or 0, code))
            return user_pre(kp, regs) if user_pre else 0
        p.pre_handler = pre
        self.register_kprobe(p)
        return results

    @property
    def closed(self) -> bool:
        return self._closing

    def _shutdown(self, closing: bool = True) -> None:
        """With the guest halted: every hijacked return address put back, every
        breakpoint removed, every probe unregistered (``closing``: and the dispatcher
        told to end after this call, leaving the guest halted for ``close()``)."""
        if self._uprobes is not None:
            self._uprobes.close()
        restored = 0
        for slot, chain in list(self._live.items()):
            try:
                cur = int.from_bytes(self.stub.read_memory(slot, 8), "little")
            except HarnessError:
                continue    # a dead task's stack, freed before rethook_flush_task()
            if cur == self.trampoline:
                self.stub.write_memory(slot, chain[0].ret_addr.to_bytes(8, "little"))
                restored += 1
        self._live.clear()
        self._flush_kp = None
        for a, num in list(self._bp.items()):
            self._remove_bp(a, num)
        self._bp.clear()
        for probes in self._aggr.values():
            for p in probes:
                p.registered = False
        self._aggr.clear()
        self._closing = closing
        log.debug("host-side probes closed; %d return addresses restored", restored)

    def close(self) -> None:
        """Put back every hijacked return address, remove every breakpoint, resume the guest.

        :raise HandlerError: handlers raised and the errors were neither raised nor taken
            (after everything is closed).
        """
        if self._closing:
            return
        self.vm.remove_stop_holder(self._holding)
        if getattr(self.vm, "aborting", False):
            # The process is being interrupted and the machine is about to be killed:
            # clean nothing in the guest, wait for nothing.
            self._closing = True
            os.write(self._wake_w, b"!")
            return

        if self._thread.is_alive() and self._fatal is None:
            try:
                self._call(self._shutdown, timeout=15, errors="none")
            except HarnessError as exc:
                log.warning("host-side probes could not shut down cleanly: %s", exc)
        self._closing = True
        os.write(self._wake_w, b"!")
        self._thread.join(5)
        if self._fatal is None and self.stub.proc.poll() is None and self.stub.halted():
            try:
                self.stub.resume(self._final_resume)
                self.stub.poll_stop()
            except HarnessError:
                pass
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.raise_handler_errors()


register_host_engine("gdbstub", HostEngine)
