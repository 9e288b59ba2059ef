"""What both host engines share (the gdbstub engine, ``harness.engines.gdbstub_engine``, and the plugin
engine, ``harness.engines.plugin_engine``): the kprobes API calls built on ``register_kprobe``,
the handler chains of one probed address and of one return (what the kernel runs between
the trap and the resume), the x86_64 calling convention, the kernel's exception table and
vectors. Each engine keeps only what is its own: GDB's stops and single-steps, or the
plugin's rings and round trips, and where a return instance lives (the gdbstub engine
keeps its pool in Python, the plugin in C).

An engine using :class:`EngineCore` provides ``register_kprobe``, ``unregister_kprobe``,
``_register``, ``_unregister``, ``_handler`` (run one user handler in the handler context),
``read``, ``stats`` and ``symbols``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

from ..errors import ProbeRejectedError
from ..kernel.kprobes import Jprobe, Kprobe, KretprobeInstance, PtRegs
from ..kernel.symbols import ReservedText, check_probe_address, is_ftrace_site, kprobe_addr

EINVAL, ENOENT = 22, 2
#: x86 exception entry points of Linux 6.1 and their vectors (arch/x86/include/asm/trapnr.h).
EXCEPTION_ENTRIES = {
    "asm_exc_divide_error": 0, "asm_exc_debug": 1, "asm_exc_nmi": 2, "asm_exc_int3": 3,
    "asm_exc_overflow": 4, "asm_exc_bounds": 5, "asm_exc_invalid_op": 6,
    "asm_exc_device_not_available": 7, "asm_exc_double_fault": 8,
    "asm_exc_invalid_tss": 10, "asm_exc_segment_not_present": 11,
    "asm_exc_stack_segment": 12, "asm_exc_general_protection": 13,
    "asm_exc_page_fault": 14, "asm_exc_spurious_interrupt_bug": 15,
    "asm_exc_coprocessor_error": 16, "asm_exc_alignment_check": 17,
    "asm_exc_machine_check": 18, "asm_exc_simd_coprocessor_error": 19,
    "asm_exc_control_protection": 21,
}
#: Vectors whose exception frame starts with an error code (arch/x86/include/asm/idtentry.h:
#: the ``DECLARE_IDTENTRY_ERRORCODE`` ones).
ERROR_CODE_VECTORS = {8, 10, 11, 12, 13, 14, 17, 21}
#: The first six integer arguments' registers (x86_64 SysV ABI), as pt_regs names.
ARG_REGS = ("di", "si", "dx", "cx", "r8", "r9")


def arity(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` takes (6 when it takes ``*args`` or cannot
    be inspected): a jprobe's entry gets that many of the function's arguments."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 6
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 6
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def read_cstring(read: Callable[[int, int], bytes], addr: int, maxlen: int,
                 fault: type[BaseException] | tuple[type[BaseException], ...]) -> bytes | None:
    """A NUL-terminated string through ``read``, a page at a time as
    ``strncpy_from_user`` does; None when its first byte cannot be read (``fault``)."""
    out, a = b"", addr
    while len(out) < maxlen:
        n = min(maxlen - len(out), 4096 - (a & 4095))
        try:
            chunk = read(a, n)
        except fault:
            return out if out else None
        end = chunk.find(b"\0")
        if end >= 0:
            return out + chunk[:end]
        out, a = out + chunk, a + n
    return out


class EngineCore:
    """The host engines' shared kprobes API (see the module docstring)."""

    symbols: Any

    def register_kprobe(self, p: Kprobe) -> Kprobe:
        raise NotImplementedError

    def unregister_kprobe(self, p: Kprobe) -> None:
        raise NotImplementedError

    def _register(self, p: Kprobe) -> None:
        raise NotImplementedError

    def _unregister(self, p: Kprobe) -> None:
        raise NotImplementedError

    def read(self, addr: int, n: int) -> bytes:
        raise NotImplementedError

    #: run one user handler in the handler context (each engine's own: an annotation, not a
    #: method, so that a mixin after this class in the bases provides it)
    _handler: Callable[..., Any]
    stats: dict[str, int]

    # -- handler chains: what the kernel runs between the trap and the resume ----------------
    def pre_handlers(self, probes: list[Kprobe], regs: PtRegs) -> bool:
        """``aggr_pre_handler()`` (kernel/kprobes.c) over the enabled probes of one address,
        after ``kprobe_int3_handler()`` counted the hit on each (``kprobes_inc_nmissed``
        aside, every probe of the address counts ``nhit``). True when a pre_handler returned
        non-zero: it changed the path, so neither the probed instruction nor any post_handler
        runs, and the guest resumes at whatever ``regs.ip`` it left."""
        for p in probes:
            p.nhit += 1
        for p in probes:
            if p.pre_handler is not None and self._handler(p.pre_handler, p, regs):
                return True
        return False

    def post_handlers(self, probes: list[Kprobe], regs: PtRegs) -> None:
        """``aggr_post_handler()``: each post_handler, with the registers after the probed
        instruction ran (``kprobe_post_process()``, arch/x86/kernel/kprobes/core.c), flags 0."""
        for p in probes:
            if p.post_handler is not None:
                self._handler(p.post_handler, p, regs, 0)

    def fault_handlers(self, probes: list[Kprobe], regs: PtRegs,
                       vector: int) -> dict[str, int] | None:
        """The probed instruction raised ``vector`` (``kprobe_fault_handler()``,
        arch/x86/kernel/kprobes/core.c): the first fault_handler that returns non-zero
        handled it. Returns the registers to write back then (the handler's changes, and
        ``ip``, ``sp``, ``flags`` of ``regs``, the exception frame), or None: the kernel's own
        exception handling goes on."""
        for p in probes:
            if p.fault_handler is not None and self._handler(p.fault_handler, p, regs, vector):
                self.stats["faults_handled"] += 1
                return {"ip": regs.ip, "sp": regs.sp, "flags": regs.flags, **regs.dirty}
        return None

    def kretprobe_entry(self, ri: KretprobeInstance, regs: PtRegs, cpu: int,
                        task: int | None) -> bool:
        """``pre_handler_kretprobe()`` (kernel/kprobes.c) once an instance was taken from
        the pool: fresh per-instance data, then the entry_handler. False when the
        entry_handler returned non-zero: the instance goes back to the pool and the return
        is not hooked (nor counted)."""
        rp = ri.rp
        ri.data = bytearray(rp.data_size)
        ri.cpu, ri.task, ri.orphan = cpu, task, False
        return not (rp.entry_handler is not None and self._handler(rp.entry_handler, ri, regs))

    def return_handlers(self, chain: list[KretprobeInstance], regs: PtRegs) -> None:
        """``rethook_trampoline_handler()`` (kernel/trace/rethook.c, 6.1): ``regs.ip`` is
        already the real return address; the handlers of one frame run from the last hooked
        (the top of the task's list) down to the first; an instance whose kretprobe was
        unregistered meanwhile runs none."""
        for ri in reversed(chain):
            if not ri.orphan and ri.rp.handler is not None:
                self._handler(ri.rp.handler, ri, regs)

    def uprobe_handlers(self, probes: list[Any], regs: PtRegs) -> None:
        """``handler_chain()`` (kernel/events/uprobes.c, 6.1) over the consumers of one
        user address that target this process (``harness.engines.uprobes``), newest
        first: every one counts the hit, then each handler runs with ``regs.ip`` the
        probed address (``handle_swbp()``). A handler's return value is not acted on
        (``UPROBE_HANDLER_REMOVE`` is not mirrored) and a change of ``ip`` is dropped:
        the probed instruction runs next."""
        for up in probes:
            up.nhit += 1
        for up in probes:
            if up.handler is not None:
                self._handler(up.handler, up, regs)

    def uretprobe_handlers(self, ri: Any, regs: PtRegs) -> None:
        """``handle_uretprobe_chain()``: ``regs.ip`` is already the real return address;
        each consumer of the return instance that is still registered and enabled runs
        its ret_handler, in consumer order (a consumer unregistered while the call was
        in flight runs none)."""
        for up in ri.probes:
            if up.registered and not up.disabled and up.ret_handler is not None:
                self._handler(up.ret_handler, ri, regs)

    # -- registration rules (kernel/kprobes.c: register_kprobe()) ---------------------------
    blacklist: Any
    trampoline: int
    #: what the engine's kretprobe trampoline is called in a refusal
    TRAMPOLINE_NAME = "the host-side kretprobe trampoline"
    _reserved: ReservedText | None = None

    def _read_now(self, addr: int, n: int) -> bytes:
        """Guest memory, read at once by the caller (registration runs with the guest held)."""
        return self.read(addr, n)

    def kprobe_addr(self, symbol_name: str | None, offset: int,
                    addr: int | None) -> tuple[int, bool]:
        """``_kprobe_addr()`` (kernel/kprobes.c): ``symbol_name`` + ``offset``, or ``addr`` +
        ``offset``, then ``arch_adjust_kprobe_addr()`` (arch/x86/kernel/kprobes/core.c): on
        IBT kernels (6.12, 7.3) a function starts with ENDBR64, and sym+0 is placed at +4.
        Returns the address and whether it is a function's entry."""
        if symbol_name and addr is not None:
            raise ProbeRejectedError("give either symbol_name or addr, not both (-EINVAL)", EINVAL)
        if symbol_name:
            try:
                where = self.symbols.lookup(symbol_name).addr + offset
            except KeyError as exc:
                raise ProbeRejectedError(f"{exc} (-ENOENT)", ENOENT) from None
        elif addr is None:
            raise ProbeRejectedError("a probe needs symbol_name or addr (-EINVAL)", EINVAL)
        else:
            where = addr + offset
        return kprobe_addr(where, symbols=self.symbols, read=self._read_now)

    def ftrace_location(self, symbol_name: str | None, addr: int | None) -> int:
        """Where an ftrace_ops callback of a function runs (``ftrace_location()``,
        kernel/trace/ftrace.c): its ``__fentry__`` call site, past the ENDBR on IBT kernels
        (6.12, 7.3: sym+4), as ``available_filter_functions_addrs`` lists it. An fprobe
        goes there (kernel/trace/fprobe.c: ``register_fprobe_ips()``), whatever the kprobe
        blacklist says.

        :raise ProbeRejectedError: -ENOENT when the place is not an ftrace location."""
        where, _ = self.kprobe_addr(symbol_name, 0, addr)
        if not is_ftrace_site(self._read_now(where, 5)):
            raise ProbeRejectedError(f"{where:#x} is no ftrace location (-ENOENT)", ENOENT, where)
        if where == self.trampoline:
            raise ProbeRejectedError(f"{where:#x} is {self.TRAMPOLINE_NAME} (-EINVAL)",
                                     EINVAL, where)
        return where

    def check_address(self, addr: int, *, kretprobe: bool = False) -> None:
        """``register_kprobe()``'s rules with its errnos (``check_kprobe_address_safe()``,
        the blacklist, instruction boundaries, jump label, static call and BUG() sites), and
        the engine's own trampoline, which no probe may take."""
        if self._reserved is None:
            self._reserved = self._reserved_text()
        rules = getattr(getattr(self.vm, "facts", None), "rules", None)
        check_probe_address(addr, symbols=self.symbols, blacklist=self.blacklist,
                            read=self._read_now, kretprobe=kretprobe, reserved=self._reserved,
                            exception_insns=getattr(rules, "can_probe_exception_insns", False))
        if addr == self.trampoline:
            raise ProbeRejectedError(f"{addr:#x} is {self.TRAMPOLINE_NAME} (-EINVAL)",
                                     EINVAL, addr)

    def _reserved_text(self) -> ReservedText:
        """vmlinux's jump label, static call and BUG() sites, read from the guest once per
        snapshot (``Machine.kept``: 26 reads, ~0.3 s of every ``kph`` process that
        registers a probe, measured on 6.1 with the plugin engine, 2026-11-30)."""
        state = ReservedText.state(self.symbols)
        kept = getattr(getattr(self, "vm", None), "kept", None)
        data = kept("reserved-text", state) if kept is not None else None
        if data is not None:
            try:
                return ReservedText.from_bytes(data)
            except ValueError:
                pass                    # a cache that does not decode is read again
        reserved = ReservedText.from_memory(self.symbols, self._read_now)
        keep = getattr(getattr(self, "vm", None), "keep", None)
        if keep is not None:
            keep("reserved-text", state, reserved.to_bytes())
        return reserved

    def _register_all(self, ps: Iterable[Any],
                      register: Callable[[Any], Any] | None = None,
                      unregister: Callable[[Any], Any] | None = None) -> None:
        """``register_kprobes()`` / ``register_kretprobes()``: all or none; a failure
        unregisters those already done, then raises (default: the kprobe calls)."""
        register = register or self._register
        unregister = unregister or self._unregister
        done: list[Any] = []
        try:
            for p in ps:
                register(p)
                done.append(p)
        except BaseException:
            for p in done:
                unregister(p)
            raise

    def register_jprobe(self, jp: Jprobe) -> Jprobe:
        """Call ``jp.entry`` with the function's arguments at its entry (host-side only)."""
        if jp.entry is None:
            raise ProbeRejectedError("a jprobe needs an entry function (-EINVAL)", EINVAL)
        entry = jp.entry
        n = jp.nargs if jp.nargs is not None else arity(entry)

        def pre(p: Kprobe, regs: PtRegs) -> int:
            entry(*self.function_args(regs, n))
            return 0
        jp.kp = self.register_kprobe(Kprobe(symbol_name=jp.symbol_name, offset=jp.offset,
                                            addr=jp.addr, pre_handler=pre))
        return jp

    def unregister_jprobe(self, jp: Jprobe) -> None:
        if jp.kp is not None:
            self.unregister_kprobe(jp.kp)

    def function_args(self, regs: PtRegs, n: int) -> list[int]:
        """The first ``n`` integer arguments at a function entry (x86_64 SysV ABI)."""
        args = [regs.get(r) for r in ARG_REGS[:n]]
        for i in range(6, n):  # [sp] is the return address; the 7th argument follows it
            args.append(int.from_bytes(self.read(regs.sp + 8 * (i - 5), 8), "little"))
        return args

    def exception_table(self) -> list[tuple[int, int]]:
        """``(insn, fixup)`` of every ``__ex_table`` entry: the kernel's user-access sites."""
        a = self.symbols.lookup("__start___ex_table").addr
        b = self.symbols.lookup("__stop___ex_table").addr
        data = self.read(a, b - a)
        out = []
        for i in range(0, len(data) - 11, 12):  # struct exception_table_entry {int insn, fixup, data}
            insn = a + i + int.from_bytes(data[i:i + 4], "little", signed=True)
            fixup = a + i + 4 + int.from_bytes(data[i + 4:i + 8], "little", signed=True)
            out.append((insn & (1 << 64) - 1, fixup & (1 << 64) - 1))
        return out
