"""What a vCPU waiting in a handler round trip gets: the plugin engine's hit flow.

The event side of ``harness.engines.plugin_engine`` (split out to keep that module about the
API): each vCPU's channel thread hands events here; the answer says what the vCPU does
next. The flow is ``harness.engines.gdbstub_engine``'s, which follows kprobe_int3_handler(),
aggr_pre_handler(), kprobe_post_process() and the kretprobe handlers of Linux 6.1
(kernel/kprobes.c, arch/x86/kernel/kprobes/core.c, kernel/trace/rethook.c):

- ``EV_PRE``: pre_handlers newest first; non-zero ends the chain and the vCPU resumes at
  ``regs.ip`` (no instruction, no post_handler); with 0 an ip change is dropped
  (setup_singlestep() overwrites it), the rest carries over; a post or fault handler
  makes the plugin call back after the instruction;
- ``EV_POST``: after the instruction (``extra == 1``: an interrupt came first, ip, cs,
  flags, sp and ss are in its frame, changes to them are written there);
- ``EV_FAULT``: the probed instruction raised an exception and the vCPU is at its entry;
  fault_handlers with the faulting registers from the frame, 1 = handled: undone;
- ``EV_RET_ENTRY`` / ``EV_RET``: pre_handler_kretprobe() took instance ``extra`` /
  the function returned through the trampoline (ip = the real return address, as
  rethook_trampoline_handler() sets it);
- ``EV_MISS``: nmissed, counted where the kernel counts it.
"""
from __future__ import annotations

import logging
import time
import struct
from typing import Any

from .base import ERROR_CODE_VECTORS
from ..errors import HarnessError
from ..kernel.grammar.program import REG_INDEX, REGS
from ..kernel.kprobes import INT3_INSN_SIZE, Kprobe, Kretprobe, PtRegs
from ..kernel.unwind import stack_trace
from ..machine.pluginlink import (ACT_CONTINUE, ACT_DISCARD, ACT_HANDLED, ACT_POST, ACT_SETPC, EV_FAULT,
                     EV_MISS, EV_POST, EV_PRE, EV_RET, EV_RET_ENTRY, Channel, Event)

from ..machine.handlerctx import mark_thread

log = logging.getLogger(__name__)


class HandlerDispatch:
    """Mixin of ``PluginEngine``: serves the vCPU channels."""

    stats: Any
    handler_errors: list[BaseException]
    _by_id: dict[int, Kprobe | Kretprobe]
    _pending: dict[int, tuple[int, list[Kprobe]]]
    _exc: dict[int, int]
    _uprobes: Any
    _tls: Any
    _held_by: dict[int, tuple[float, str]]
    #: Python kretprobes' instances pending on each stack slot, oldest first
    _hooked: dict[int, list[Any]]
    read: Any

    def _serve(self, ch: Channel) -> None:
        # Handlers run here with this vCPU stopped (harness.machine.handlerctx: no vm.run).
        mark_thread(f"a host-side probe handler (plugin, vCPU {ch.vcpu})")
        held = f"a plugin handler on vCPU {ch.vcpu}"
        while True:
            ev = ch.next_event()
            if ev is None:
                return
            self._tls.ch, self._tls.ev = ch, ev
            got_at = time.monotonic()
            self._held_by[ch.vcpu] = (got_at, held)
            try:
                action, writes = self._dispatch(ch, ev)
            except Exception as exc:  # noqa: BLE001 - the vCPU must go on
                log.exception("plugin event %d failed", ev.type)
                self.handler_errors.append(exc)
                self._pending_errors.append(exc)
                action, writes = ACT_CONTINUE, {}
            finally:
                self._tls.ch = self._tls.ev = None
                self._held_by.pop(ch.vcpu, None)
            try:
                ch.done(action, writes)
            except OSError:
                return
            self.vm.note_host_stop(time.monotonic() - got_at)  # type: ignore[attr-defined]

    def _holding(self) -> tuple[float, str] | None:
        """For the machine's stall check: the longest-running handler, if any."""
        held = list(self._held_by.values())
        return min(held) if held else None

    def _regs(self, ev: Event, ch: Channel, values: dict[str, int] | None = None) -> PtRegs:
        vals = dict(zip(REGS, ev.regs))
        orig_ax = vals.pop("orig_ax", None)     # -1 (int3 frame), 0 at an ftrace site
        vals.update(values or {})
        regs = PtRegs(vals, sys_reader=ch.read_reg, cpu=ev.vcpu,
                      unwinder=lambda r, n: stack_trace(self, r, n))
        if orig_ax is not None:
            regs.orig_ax = orig_ax
        return regs

    @staticmethod
    def _writes(regs: PtRegs, *, keep_ip: bool) -> dict[int, int]:
        return {REG_INDEX[k]: v for k, v in regs.dirty.items() if keep_ip or k != "ip"}

    def _handler(self, fn: Any, *args: Any) -> Any:
        return self._run_handler(fn, *args)  # type: ignore[attr-defined]

    def _dispatch(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        self.stats["round_trips"] += 1
        tables = self.__dict__.get("_on_tables")
        if tables is None:      # made once: a dict of bound methods per hit cost ~1 us
            ups = self._uprobes
            tables = self._on_tables = (
                {EV_PRE: ups.on_pre, EV_RET: ups.on_ret, EV_MISS: ups.on_miss},
                {EV_PRE: self._on_pre, EV_POST: self._on_post, EV_FAULT: self._on_fault,
                 EV_RET_ENTRY: self._on_ret_entry, EV_RET: self._on_ret,
                 EV_MISS: self._on_miss})
        # a Python uprobe's events go to harness.engines.plugin_uprobes
        on = tables[0] if ev.ids and self._uprobes.owns(ev.ids[0]) else tables[1]
        fn = on.get(ev.type)
        if fn is None:
            raise HarnessError(f"unexpected plugin event {ev.type}")
        return fn(ch, ev)

    def _on_miss(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """nmissed, counted where the kernel counts it (the pool was empty, or a hit
        came between a pre and its post_handler)."""
        for i in ev.ids:
            p = self._by_id.get(i)
            if p is not None:
                p.nmissed += 1
        return ACT_CONTINUE, {}

    def _on_pre(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        probes = [p for i in ev.ids if isinstance(p := self._by_id.get(i), Kprobe)
                  and p.registered and not p.disabled]
        self.stats["hits"] += 1
        # regs->ip = addr + 1 on all three x86 paths (kprobe_int3_handler() after the int3,
        # kprobe_ftrace_handler() and optimized_callback() emulating it), as the gdbstub
        # engine hands it (harness.engines.gdbstub_engine); a non-zero return resumes at what it left.
        regs = self._regs(ev, ch, {"ip": ev.addr + INT3_INSN_SIZE})
        if self.pre_handlers(probes, regs):     # the path was changed: no instruction, no post
            return ACT_SETPC, {**self._writes(regs, keep_ip=False), REG_INDEX["ip"]: regs.ip}
        writes = self._writes(regs, keep_ip=False)    # setup_singlestep() overwrites ip
        after = [p for p in probes if p.post_handler is not None or p.fault_handler is not None]
        if after:
            self._pending[ev.vcpu] = (ev.addr, after)
            return ACT_POST, writes
        return ACT_CONTINUE, writes

    def _on_post(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        _, probes = self._pending.pop(ev.vcpu, (ev.addr, []))
        probes = [p for p in probes if p.post_handler is not None and p.registered]
        if not probes:
            return ACT_CONTINUE, {}
        if ev.extra == 1:
            # An interrupt came right after the instruction: ip, cs, flags, sp, ss of the
            # moment after it are in the interrupt frame (no error code).
            sp = ev.regs[REG_INDEX["sp"]]
            frame = ch.read(sp, 40)
            if frame is None:
                return ACT_CONTINUE, {}
            fields = dict(zip(("ip", "cs", "flags", "sp", "ss"), struct.unpack("<5Q", frame)))
            regs = self._regs(ev, ch, fields)
            self.post_handlers(probes, regs)
            for i, name in enumerate(("ip", "cs", "flags", "sp", "ss")):
                if name in regs.dirty:
                    ch.write(sp + 8 * i, struct.pack("<Q", regs.dirty[name]))
            return ACT_CONTINUE, {REG_INDEX[k]: v for k, v in regs.dirty.items() if k not in fields}
        regs = self._regs(ev, ch)
        self.post_handlers(probes, regs)
        if "ip" in regs.dirty:
            return ACT_SETPC, self._writes(regs, keep_ip=True)
        return ACT_CONTINUE, self._writes(regs, keep_ip=False)

    def _on_fault(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """The probed instruction raised an exception; the vCPU sits at its entry."""
        _, probes = self._pending.pop(ev.vcpu, (ev.addr, []))
        vector = self._exc.get(ev.b)
        if vector is None or vector == 3:
            return ACT_CONTINUE, {}
        self.stats["faults"] += 1
        sp = ev.regs[REG_INDEX["sp"]]
        frame = ch.read(sp + (8 if vector in ERROR_CODE_VECTORS else 0), 40)
        if frame is None:
            return ACT_CONTINUE, {}
        rip, cs, rflags, rsp, ss = struct.unpack("<5Q", frame)
        regs = self._regs(ev, ch, {"ip": rip, "cs": cs, "flags": rflags, "sp": rsp, "ss": ss})
        undo = self.fault_handlers([p for p in probes if p.registered], regs, vector)
        if undo is not None:
            return ACT_HANDLED, {REG_INDEX[k]: v for k, v in undo.items()}
        return ACT_CONTINUE, {}

    def _on_ret_entry(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """pre_handler_kretprobe(): the plugin took instance ``ev.extra`` of the pool."""
        rp = self._by_id.get(ev.ids[0]) if ev.ids else None
        if not isinstance(rp, Kretprobe) or not rp.registered:
            return ACT_DISCARD, {}
        ri = rp._kph_insts[ev.extra]  # type: ignore[attr-defined]
        ri.stack_slot = ev.b
        regs = self._regs(ev, ch, {"ip": ev.addr})
        if not self.kretprobe_entry(ri, regs, ev.vcpu, ev.task or None):
            return ACT_DISCARD, self._writes(regs, keep_ip=False)
        rp.nhit += 1
        # what the slot holds before the plugin hooks it (after this round trip): the
        # real return address, unless another return probe of the call hooked it first
        try:
            ri.ret_addr = int.from_bytes(self.read(ev.b, 8), "little")
        except HarnessError:
            ri.ret_addr = 0
        self._hooked.setdefault(ev.b, []).append(ri)
        return ACT_CONTINUE, self._writes(regs, keep_ip=False)

    def kretprobe_find_ret_addr(self, slot: int) -> int | None:
        """The real return address a Python kretprobe's hook replaced at stack ``slot``
        (``kretprobe_find_ret_addr()``, for the unwinder), or None."""
        for ri in self._hooked.get(slot, ()):
            if ri.ret_addr and ri.ret_addr != getattr(self, "trampoline", None):
                return ri.ret_addr
        return None

    def _on_ret(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """The function returned into the trampoline; ``ev.a`` is the real return address
        (rethook_trampoline_handler() sets regs->ip to it before the handlers run)."""
        rp = self._by_id.get(ev.ids[0]) if ev.ids else None
        if not isinstance(rp, Kretprobe):
            return ACT_CONTINUE, {}
        ri = rp._kph_insts[ev.extra]  # type: ignore[attr-defined]
        hooked = self._hooked.get(ev.b, [])
        if ri in hooked:
            hooked.remove(ri)
            if not hooked:
                self._hooked.pop(ev.b, None)
        ri.ret_addr, ri.stack_slot = ev.a, ev.b
        self.stats["returns"] += 1
        regs = self._regs(ev, ch, {"ip": ev.a})
        if rp.registered:
            self.return_handlers([ri], regs)
        return ACT_CONTINUE, self._writes(regs, keep_ip=False)
