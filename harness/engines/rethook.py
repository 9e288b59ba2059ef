"""The gdbstub engine's return probes: kretprobe instance pools, the frames they hooked, and
the trampoline the hooked returns come back through.

6.1 runs kretprobes on rethook (kernel/trace/rethook.c, ``arch/x86/kernel/rethook.c``): at the
function's entry ``pre_handler_kretprobe()`` (kernel/kprobes.c) takes an instance from the
kretprobe's pool (none left: ``nmissed``), and ``arch_rethook_prepare()`` swaps the return
address at ``[sp]`` for the trampoline; at the trampoline ``rethook_trampoline_handler()``
puts the real address back and runs the frame's handlers. Here the pools and the hooked
frames (by stack slot) are kept on the host, the trampoline is a host breakpoint on a
never-executed kernel address (``_etext`` by default), and a host kprobe on
``rethook_flush_task()`` recycles a dead task's instances as the kernel does. The handler
chains themselves are the engines' shared core (:class:`harness.engines.base.EngineCore`).

The plugin engine keeps its pools in the plugin (C), so this is the gdbstub engine's alone.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from ..errors import VMLostError
from ..kernel.kprobes import (Kprobe, Kretprobe, KretprobeInstance, PtRegs,
                              kernel_rethook_trampoline)


class Rethook:
    """Return probes for :class:`harness.engines.gdbstub_engine.HostEngine` (a mixin: it uses
    the engine's ``stub``, ``symbols``, ``stats``, ``vm``, breakpoints and request calls)."""

    # what the engine provides
    stub: Any
    symbols: Any
    stats: Any
    vm: Any
    trampoline: int
    _bp: dict[int, int]
    _aggr: dict[int, list[Kprobe]]
    _call: Callable[..., Any]
    _register: Callable[..., None]
    _unregister: Callable[[Kprobe], None]
    _fresh_module_symbols: Callable[[Iterable[Any]], None]
    _regs: Callable[..., PtRegs]
    _flush: Callable[..., None]
    _current_task: Callable[[PtRegs], int | None]
    _register_all: Callable[..., None]
    kretprobe_entry: Callable[..., bool]
    return_handlers: Callable[..., None]

    def _init_rethook(self) -> None:
        #: a kretprobe's free instances (id(rp) -> pool), maxactive of them
        self._free: dict[int, list[KretprobeInstance]] = {}
        #: stack slot -> the instances hooked on that frame's return, in hook order: the
        #: first holds the real return address (two kretprobes on one function share it)
        self._live: dict[int, list[KretprobeInstance]] = {}
        self._flush_kp: Kprobe | None = None

    def _kretprobe_entry(self, rp: Kretprobe) -> Callable[[Kprobe, PtRegs], int]:
        def pre_handler_kretprobe(p: Kprobe, regs: PtRegs) -> int:
            free = self._free[id(rp)]
            if not free:
                rp.nmissed += 1
                return 0
            ri = free.pop()
            if not self.kretprobe_entry(ri, regs, regs.cpu, self._current_task(regs)):
                free.append(ri)
                return 0
            slot = regs.sp
            cur = int.from_bytes(self.stub.read_memory(slot, 8), "little")
            chain = self._live.get(slot)
            if chain and cur != self.trampoline:
                # A frame that is gone left these (its task died and its stack was reused
                # before rethook_flush_task() ran): one slot holds one live return address.
                self._recycle(self._live.pop(slot))
                chain = None
            ri.stack_slot = slot
            # Another kretprobe hooked this very return already: share its real address, as
            # rethook_trampoline_handler() hands every handler of the frame the correct one.
            ri.ret_addr = chain[0].ret_addr if chain else cur
            # ...while its own node saved what it found in the slot: the kernel's own
            # trampoline once another kretprobe hooked the call (arch_prepare_kretprobe()
            # / arch_rethook_prepare() read the stack slot), which get_kretprobe_retaddr()
            # returns and a return event prints
            ri.node_ret_addr = self._node_ret_addr(rp, chain, cur)
            if not chain:
                self.stub.write_memory(slot, self.trampoline.to_bytes(8, "little"))
            self._live.setdefault(slot, []).append(ri)
            rp.nhit += 1
            return 0
        return pre_handler_kretprobe

    def kernel_rethook_trampoline(self) -> int:
        """The guest kernel's own return trampoline (:func:`harness.kernel.kprobes.kernel_rethook_trampoline`)."""
        return kernel_rethook_trampoline(self.symbols)

    def _on_trampoline(self, th: int) -> int:
        regs = self._regs(th, {})
        chain = self._live.pop((regs.sp - 8) & ((1 << 64) - 1), None)
        if not chain:
            raise VMLostError(f"the guest reached the kretprobe trampoline {self.trampoline:#x} "
                              f"with sp={regs.sp:#x}, which matches no pending return")
        self.stats["returns"] += 1
        # rethook_trampoline_handler() sets ip to the real return address before calling
        # handlers ("if the user handler calls stack_trace_save_regs() with this regs").
        regs.set("ip", chain[0].ret_addr)
        regs.clear_dirty()
        self.return_handlers(chain, regs)
        self._flush(regs, th, keep_ip=False)
        self._recycle(chain)
        self._sync_flush_hook()
        if not self._live and not any(r.registered for r in self._kretprobes()):
            self._drop_trampoline()
        return chain[0].ret_addr

    def _recycle(self, chain: list[KretprobeInstance]) -> None:
        """Give instances back to their kretprobe's pool (``rethook_recycle()``); those of
        an unregistered kretprobe are dropped."""
        for ri in chain:
            if not ri.orphan:
                self._free[id(ri.rp)].append(ri)

    def _sync_flush_hook(self) -> None:
        """A host kprobe on ``rethook_flush_task(tk)`` while return instances may be pending.

        6.1 recycles a dead task's instances there (``delayed_put_task_struct()``,
        kernel/exit.c): a probed function that never returns (``do_exit``) does not drain
        the pool, and the instances of a freed stack are never read again."""
        need = bool(self._live) or any(r.registered for r in self._kretprobes())
        if need and self._flush_kp is None:
            sym = self.symbols.get("rethook_flush_task")
            if sym is None:
                return
            kp = Kprobe(addr=sym.addr, pre_handler=lambda p, regs: self._on_flush_task(regs.di))
            kp._kph_internal = True  # type: ignore[attr-defined]
            self._register(kp)
            self._flush_kp = kp
        elif not need and self._flush_kp is not None:
            self._unregister(self._flush_kp)
            self._flush_kp = None

    def _on_flush_task(self, task: int) -> int:
        for slot, chain in list(self._live.items()):
            if chain[0].task == task:
                del self._live[slot]
                self._recycle(chain)
                self.stats["kretprobe_flushed"] += len(chain)
        return 0

    def kernel_slot_values(self, addr: int, size: int) -> dict[int, int]:
        """The hooked return-address slots in ``[addr, addr + size)`` and what the guest
        kernel would hold in each, had its own return probes hooked them instead of the host:
        the trampoline of the last hook (``arch_rethook_prepare()`` writes
        ``arch_rethook_trampoline``, 6.1+ kretprobes and 6.12 fprobes; 7.3's fprobe exits
        go through the function graph, ``prepare_ftrace_return()`` writes
        ``return_to_handler``). A fetch of the slot after a return probe at the same place
        hooked it (``$stack0`` at the entry) reads that."""
        out = {}
        for slot, chain in self._live.items():
            if slot + 8 <= addr or slot >= addr + size:
                continue
            value = self._kernel_trampoline(chain[-1].rp)
            if value:
                out[slot] = value
        return out

    def _node_ret_addr(self, rp: Kretprobe, chain: list[KretprobeInstance] | None,
                       cur: int) -> int:
        """What a return event of ``rp``'s call shows, had the guest kernel hooked it:
        the previous hook's trampoline for a kretprobe (``get_kretprobe_retaddr()``); for a
        7.3 fprobe exit, the trampoline of the newest earlier hook that is not the function
        graph's (all fprobe exits of a call are one graph hook), else the real address."""
        if not chain:
            return cur
        if self._fgraph(rp):
            older = [ri for ri in chain if not self._fgraph(ri.rp)]
            return self._kernel_trampoline(older[-1].rp) if older else chain[0].ret_addr
        return self._kernel_trampoline(chain[-1].rp)

    def _fgraph(self, rp: Kretprobe) -> bool:
        rules = getattr(getattr(self.vm, "facts", None), "rules", None)
        return rp.ftrace_ops and getattr(rules, "fprobe", "") == "fgraph"

    def _kernel_trampoline(self, rp: Kretprobe) -> int:
        """What the guest kernel writes in a return-address slot when ``rp``'s counterpart
        hooks it: ``return_to_handler`` for a 7.3 fprobe exit (the function graph,
        ``prepare_ftrace_return()``), else ``arch_rethook_trampoline``."""
        if self._fgraph(rp):
            sym = self.symbols.get("return_to_handler")
            if sym is not None:
                return sym.addr
        return self.kernel_rethook_trampoline()

    def arrange(self, addr: int, key: Callable[[Kprobe], Any]) -> None:
        """Order the probes of one address by ``key`` (a stable sort of the newest-first
        list), for handler orders other than ``add_new_kprobe()``'s (fprobes on 7.3)."""
        self._call(lambda: self._aggr.get(addr, []).sort(key=key))

    def kretprobe_find_ret_addr(self, slot: int) -> int | None:
        """The real return address hijacked at stack ``slot`` (``kretprobe_find_ret_addr()``,
        what unwinders call when they meet the trampoline), or None."""
        chain = self._live.get(slot)
        return chain[0].ret_addr if chain else None

    def _kretprobes(self) -> Iterable[Kretprobe]:
        seen = {}
        for chain in list(self._live.values()):
            for ri in chain:
                seen[id(ri.rp)] = ri.rp
        for probes in self._aggr.values():
            for p in probes:
                rp = getattr(p, "_kph_rp", None)
                if rp is not None:
                    seen[id(rp)] = rp
        return seen.values()

    def _ensure_trampoline(self) -> None:
        if self.trampoline not in self._bp:
            self._bp[self.trampoline] = self.stub.insert_breakpoint(self.trampoline)

    def _drop_trampoline(self) -> None:
        num = self._bp.pop(self.trampoline, None)
        if num is not None:
            self.stub.delete_breakpoint(num)

    def register_kretprobe(self, rp: Kretprobe) -> Kretprobe:
        """Arm a return probe at a function entry (offset 0, as the kernel requires)."""
        self._fresh_module_symbols([rp])
        self._call(lambda: self._register_kretprobe(rp))
        return rp

    def _register_kretprobe(self, rp: Kretprobe) -> None:
        if rp.maxactive <= 0:
            rp.maxactive = max(10, 2 * self.vm.smp)
        kp = Kprobe(symbol_name=rp.symbol_name, offset=rp.offset,
                    addr=rp.addr if rp.symbol_name is None else None,
                    pre_handler=self._kretprobe_entry(rp), flags=rp.flags,
                    ftrace_ops=rp.ftrace_ops)
        kp._kph_rp = rp  # type: ignore[attr-defined]
        self._free[id(rp)] = [KretprobeInstance(rp) for _ in range(rp.maxactive)]
        self._register(kp, kretprobe=True)
        rp.kp, rp.addr, rp.registered = kp, kp.addr, True
        self._ensure_trampoline()
        self._sync_flush_hook()

    def register_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        """Register all or none (``register_kretprobes()``): a failure unregisters those
        already done, then raises."""
        rps = list(rps)
        self._fresh_module_symbols(rps)
        self._call(lambda: self._register_all(rps, self._register_kretprobe,
                                              self._unregister_kretprobe))

    def unregister_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        self._call(lambda: [self._unregister_kretprobe(rp) for rp in list(rps)], errors="after")

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        """Disarm ``rp``; calls in flight still return through the trampoline, without the handler."""
        self._call(lambda: self._unregister_kretprobe(rp), errors="after")

    def _unregister_kretprobe(self, rp: Kretprobe) -> None:
        if rp.kp is not None:
            self._unregister(rp.kp)
        rp.registered = False
        for chain in self._live.values():
            for ri in chain:
                if ri.rp is rp:
                    ri.orphan = True
        if not self._live and not any(r.registered for r in self._kretprobes()):
            self._drop_trampoline()
        self._sync_flush_hook()
