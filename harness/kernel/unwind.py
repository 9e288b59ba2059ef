"""A stack trace of a stopped vCPU, for host-side handlers (``stack_trace_save_regs()``).

What the kernel guarantees, and lib/test_kprobes.c's ``test_stacktrace_on_kretprobe`` and
``test_stacktrace_on_nested_kretprobe`` check: a stack trace taken in a kretprobe handler
starts at the real return address (``rethook_trampoline_handler()`` set ``regs->ip``), and a
return address the trampoline replaced is shown as the real one, because every x86
unwinder asks ``unwind_recover_ret_addr()`` -> ``kretprobe_find_ret_addr()`` /
``rethook_find_ret_addr()`` (arch/x86/include/asm/unwind.h) when it meets the trampoline.
Here the trampoline is the host's (``vm.host.trampoline``) and the real address comes from
the engine's pending instances (``kretprobe_find_ret_addr``).

Two unwinders, as the kernel's configuration says (``CONFIG_UNWINDER_ORC`` or
``CONFIG_UNWINDER_FRAME_POINTER``):

- **ORC** (Debian's 6.1, 6.12 and 7.3; :class:`OrcTable`, :func:`orc_unwind`): the
  kernel's own tables, ``.orc_unwind_ip`` and ``.orc_unwind``, read from guest memory
  between ``__start_orc_unwind_ip`` and ``__stop_orc_unwind`` once per machine, and
  ``unwind_next_frame()`` of arch/x86/kernel/unwind_orc.c frame by frame: CALL, REGS and
  REGS_PARTIAL frames, every SP and BP rule. Each series packs ``struct orc_entry``
  its own way (:data:`ORC_LAYOUTS`: 6.1's ``type:2``/``end:1`` without a signal bit,
  6.3+'s ``type:3``/``signal:1``, 7.3's renumbered registers with ``ORC_REG_AX``). An address ORC does
  not cover falls back to the frame-pointer entry (``orc_fp_entry``), as the kernel does
  for code it has no data for. Modules' own ORC tables (``orc_module_find()``) and ftrace
  trampolines' (``orc_ftrace_find()``) are not read: a module's frames unwind by frame
  pointer (``probes/kunit`` builds its module with them);
- **frame pointers** (:func:`fp_unwind`): ``[bp]`` the caller's bp, ``[bp + 8]`` the return
  address, while it stays inside the task's stack and yields kernel text.
"""
from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["stack_trace", "fp_unwind", "orc_unwind", "OrcTable", "OrcEntry", "THREAD_SIZE"]

THREAD_SIZE = 16384
_M = (1 << 64) - 1

# arch/x86/include/asm/orc_types.h: the numbers differ by version, the names do not
#: register numbers: 6.1 and 6.12 (``ORC_REG_PREV_SP`` 1 ... ``ORC_REG_SP_INDIRECT`` 9)
_REGS_OLD = {0: "undefined", 1: "prev_sp", 2: "dx", 3: "di", 4: "bp", 5: "sp", 6: "r10",
             7: "r13", 8: "bp_indirect", 9: "sp_indirect"}
#: 7.3 (``ORC_REG_AX`` 1, ``ORC_REG_SP`` 3, ``ORC_REG_PREV_SP`` 8, the indirect ones 9, 10)
_REGS_NEW = {0: "undefined", 1: "ax", 2: "dx", 3: "sp", 4: "bp", 5: "di", 6: "r10", 7: "r13",
             8: "prev_sp", 9: "sp_indirect", 10: "bp_indirect"}


@dataclass(frozen=True)
class OrcLayout:
    """How one kernel series packs ``struct orc_entry``'s bitfields after the two s16s."""

    regs: dict[int, str]
    #: 6.1: ``type:2`` (CALL 0, REGS 1, REGS_PARTIAL 2) and ``end:1``, no ``signal`` (a
    #: frame is a signal frame when it is not CALL); 6.3+: ``type:3`` (UNDEFINED 0,
    #: END_OF_STACK 1, CALL 2, REGS 3, REGS_PARTIAL 4) and ``signal:1``
    old_types: bool


#: by ``KernelRules.series`` (arch/x86/include/asm/orc_types.h of each linux-source)
ORC_LAYOUTS = {"6.1": OrcLayout(_REGS_OLD, True), "6.12": OrcLayout(_REGS_OLD, False),
               "7.3": OrcLayout(_REGS_NEW, False)}
#: struct pt_regs (arch/x86/include/asm/ptrace.h): each field's offset
PT_REGS_OFFSETS = {name: 8 * i for i, name in enumerate(
    ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
     "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss"))}
IRET_FRAME_OFFSET = PT_REGS_OFFSETS["ip"]
PT_REGS_SIZE = 8 * len(PT_REGS_OFFSETS)


@dataclass(frozen=True)
class OrcEntry:
    """``struct orc_entry``: s16 sp_offset, s16 bp_offset, then sp_reg:4, bp_reg:4 and
    the type and signal bits as the series packs them (:class:`OrcLayout`); registers
    and types by name ("sp", "prev_sp"; "call", "regs", "regs_partial", "undefined",
    "end_of_stack")."""

    sp_offset: int
    bp_offset: int
    sp_reg: str
    bp_reg: str
    type: str
    signal: bool

    @classmethod
    def unpack(cls, raw: bytes, layout: OrcLayout) -> "OrcEntry":
        sp_off, bp_off, bits = struct.unpack("<hhH", raw)
        sp_reg = layout.regs.get(bits & 0xF, "?")
        bp_reg = layout.regs.get((bits >> 4) & 0xF, "?")
        if layout.old_types:
            t = (bits >> 8) & 0x3
            end = bool(bits >> 10 & 1)
            if sp_reg == "undefined":       # 6.1: the end of a kernel thread's stack, or
                kind = "end_of_stack" if end else "undefined"       # no data
            else:
                kind = {0: "call", 1: "regs", 2: "regs_partial"}.get(t, "?")
            return cls(sp_off, bp_off, sp_reg, bp_reg, kind, kind in ("regs", "regs_partial"))
        kind = {0: "undefined", 1: "end_of_stack", 2: "call", 3: "regs",
                4: "regs_partial"}.get((bits >> 8) & 0x7, "?")
        return cls(sp_off, bp_off, sp_reg, bp_reg, kind, bool(bits >> 11 & 1))


#: ``orc_fp_entry``: what an address without ORC data is taken to be (a frame-pointer frame)
ORC_FP_ENTRY = OrcEntry(16, -16, "bp", "prev_sp", "call", False)


class OrcTable:
    """vmlinux's ORC tables as the running guest holds them."""

    def __init__(self, ips: list[int], entries: bytes, text: tuple[int, int] | None = None,
                 layout: OrcLayout = ORC_LAYOUTS["6.12"]) -> None:
        self.ips = ips              # sorted absolute addresses
        self.entries = entries      # 6 bytes each, in the same order
        self.layout = layout
        #: [_stext, _etext): where orc_find() uses these tables (LOOKUP_START_IP ..)
        self.text = text or ((ips[0], ips[-1] + 1) if ips else (0, 0))

    @classmethod
    def from_memory(cls, symbols: Any, read: Callable[[int, int], bytes],
                    layout: OrcLayout = ORC_LAYOUTS["6.12"]) -> "OrcTable | None":
        """``__start_orc_unwind_ip .. __stop_orc_unwind_ip`` (s32, each relative to its own
        address: ``orc_ip()``) and ``__start_orc_unwind .. __stop_orc_unwind``; None when
        the kernel has no ORC tables."""
        names = ("__start_orc_unwind_ip", "__stop_orc_unwind_ip", "__start_orc_unwind",
                 "__stop_orc_unwind")
        syms = [symbols.get(n) for n in names]
        if any(s is None for s in syms):
            return None
        ip0, ip1, u0, u1 = (s.addr for s in syms)
        n = (ip1 - ip0) // 4
        if n <= 0 or (u1 - u0) // 6 != n:
            return None
        raw = _read_all(read, ip0, 4 * n)
        rel = struct.unpack(f"<{n}i", raw)
        ips = [(ip0 + 4 * i + r) & _M for i, r in enumerate(rel)]
        st, et = symbols.get("_stext"), symbols.get("_etext")
        text = (st.addr, et.addr) if st is not None and et is not None else None
        return cls(ips, _read_all(read, u0, 6 * n), text, layout)

    def find(self, ip: int) -> OrcEntry | None:
        """``orc_find()`` for vmlinux: the last entry at or below ``ip`` (``__orc_find()``);
        None outside the table's range."""
        if not self.ips or not self.text[0] <= ip < self.text[1]:
            return None         # a module's or a trampoline's: not read (module docstring)
        i = bisect.bisect_right(self.ips, ip) - 1
        if i < 0:
            return None
        return OrcEntry.unpack(self.entries[6 * i:6 * i + 6], self.layout)


def _read_all(read: Callable[[int, int], bytes], addr: int, n: int, chunk: int = 1 << 16) -> bytes:
    out = bytearray()
    for a in range(addr, addr + n, chunk):
        out += read(a, min(chunk, addr + n - a))
    return bytes(out)


def stack_trace(host: Any, regs: Any, max_entries: int = 16, *,
                guest_view: bool = False, optprobe: bool = False) -> list[int]:
    """``stack_trace_save_regs(regs)``: ``regs.ip`` first, then each frame's return
    address outwards, a hijacked one recovered as the kernel's unwinders recover it. The
    unwinder is the kernel's own (:func:`orc_unwind` when the machine's kernel has ORC
    tables, else :func:`fp_unwind`).

    :param host: the host engine (``vm.host``); call this from a handler, where the vCPU
        is stopped, or with the guest halted.
    :param guest_view: the trace the guest kernel's own unwinder makes of this stack
        (a stacktrace trigger's, :mod:`harness.backends.triggers`): a slot the guest's
        rethook hooked is recovered from the task's rethook list as
        ``rethook_find_ret_addr()`` does, and the walk ends at the host's trampoline, a
        return address the guest's unwinder does not know.
    :param optprobe: with ``guest_view``, the guest's probe at ``regs.ip`` is optimized
        (a jump into its detour buffer): its handler's unwinder reaches the buffer, which
        has no ORC data, and goes on by the frame-pointer guess from the probe's ``rbp``
        (``unwind_next_frame()``: ``orc_fp_entry``). The probed context's own frames are
        not in that trace (measured on 6.12): the trace is what that guess finds.
    """
    table = orc_table(host)
    if table is not None:
        return orc_unwind(host, regs, table, max_entries, guest_view=guest_view,
                          optprobe=optprobe)
    return fp_unwind(host, regs, max_entries, guest_view=guest_view)


def orc_table(host: Any) -> OrcTable | None:
    """The machine's ORC tables, read once (kept on the engine)."""
    got = getattr(host, "_kph_orc", False)
    if got is False:
        rules = getattr(getattr(getattr(host, "vm", None), "facts", None), "rules", None)
        layout = ORC_LAYOUTS.get(getattr(rules, "series", "6.1"))
        # a read that fails raises: a trace without the tables would not be the kernel's
        got = OrcTable.from_memory(host.symbols, host.read, layout) if layout else None
        try:
            host._kph_orc = got
        except AttributeError:
            pass
    return got


class _HostTrampoline(Exception):
    """In the guest's view: a return address the guest's unwinder does not know."""


def _recover(host: Any, ret: int, slot: int, guest: Any = None, *, graph: bool = True) -> int:
    """``unwind_recover_ret_addr()``: the host's trampoline in a return slot is the real
    address its pending instance saved. In the guest's view (``guest``: the task whose
    stack this is) the guest's own hooks are recovered, the function graph's first
    (``ftrace_graph_ret_addr()``; not for a regs frame's ip: ``graph=False``, as
    ``unwind_next_frame()`` calls ``unwind_recover_rethook()`` alone there), then its
    rethook's from its list, and the host's ends the walk (:class:`_HostTrampoline`)."""
    tramp = getattr(host, "trampoline", None)
    if guest is not None:
        if graph:
            ret = guest.graph_ret_addr(ret, slot)
        if ret == guest.rethook_trampoline:
            ret = guest.rethook_ret_addr(slot) or ret
        if ret == tramp:
            raise _HostTrampoline()
        return ret
    if ret == tramp:
        find = getattr(host, "kretprobe_find_ret_addr", None)
        real = find(slot) if find is not None else None
        return real or ret
    return ret


class _GuestRethooks:
    """``rethook_find_ret_addr(current, frame, ...)`` (kernel/trace/rethook.c, 6.12 and
    7.3): the task's ``rethooks`` list, newest first; a node whose ``frame`` is the slot
    and whose ``ret_addr`` is not the trampoline itself holds the real return address."""

    def __init__(self, host: Any, regs: Any) -> None:
        sym = host.symbols.get("arch_rethook_trampoline")
        self.rethook_trampoline = sym.addr if sym is not None else None
        sym = host.symbols.get("return_to_handler")
        self.return_to_handler = sym.addr if sym is not None else None
        self.host, self.regs = host, regs
        self._nodes: list[tuple[int, int]] | None = None
        self._graph_idx = 0            # unwind_state.graph_idx: where the last one was found
        self._task: int | None | bool = False

    def _btf(self) -> Any:
        return getattr(getattr(getattr(self.host, "vm", None), "facts", None), "btf", None)

    def _current(self) -> int | None:
        if self._task is False:
            host = self.host
            self._task = host.current_task(self.regs) if hasattr(host, "current_task") else None
        return self._task or None

    def _u64(self, addr: int) -> int:
        return int.from_bytes(self.host.read(addr, 8), "little")

    def graph_ret_addr(self, ret: int, slot: int) -> int:
        """``ftrace_graph_ret_addr(task, &state->graph_idx, ret, retp)`` (kernel/trace/
        fgraph.c, 6.12 and 7.3): ``return_to_handler`` in a slot is the ``ret`` of the
        task's newest ``ftrace_ret_stack`` at or below the last one found whose ``retp``
        is the slot and whose ``ret`` is not ``return_to_handler`` itself (a tail call's
        frames). ``ret_stack`` holds words; each frame's last word's low
        ``FGRAPH_FRAME_OFFSET_BITS`` (10) give the distance down to the frame
        (``get_ret_stack()``). 6.1's array of frames is searched from the bottom
        (its ``ftrace_graph_ret_addr()`` with ``HAVE_FUNCTION_GRAPH_RET_ADDR_PTR``)."""
        if self.return_to_handler is None or ret != self.return_to_handler:
            return ret
        btf, task = self._btf(), self._current()
        if btf is None or not task:
            return ret
        try:
            base = self._u64(task + btf.offset("task_struct", "ret_stack"))
            raw = self.host.read(task + btf.offset("task_struct", "curr_ret_stack"), 4)
            f_ret, f_retp = (btf.offset("ftrace_ret_stack", m) for m in ("ret", "retp"))
            old = getattr(getattr(getattr(self.host.vm, "facts", None), "rules", None),
                          "series", "") == "6.1"
            size = btf.sizeof("ftrace_ret_stack") if old else 0
        except (KeyError, AttributeError):
            return ret
        curr = int.from_bytes(raw, "little", signed=True)
        if not base:
            return ret
        if old:
            for i in range(0, min(curr, 256) + 1):
                frame = base + i * size
                if self._u64(frame + f_retp) == slot:
                    return self._u64(frame + f_ret)
            return ret
        i = self._graph_idx or curr
        for _ in range(4096):
            if i <= 0:
                break
            offs = self._u64(base + 8 * (i - 1)) & 0x3FF        # FGRAPH_FRAME_OFFSET_MASK
            if offs <= 0 or offs > i - 1:
                break
            i = i - 1 - offs
            frame = base + 8 * i
            found = self._u64(frame + f_ret)
            if self._u64(frame + f_retp) == slot and found != self.return_to_handler:
                self._graph_idx = i
                return found
        return ret

    def rethook_ret_addr(self, slot: int) -> int | None:
        if self._nodes is None:
            self._nodes = self._read()
        for frame, ret in self._nodes:
            if frame == slot and ret != self.rethook_trampoline:
                return ret
        return None

    def _read(self) -> list[tuple[int, int]]:
        host = self.host
        btf, task = self._btf(), self._current()
        if btf is None or not task:
            return []
        try:
            head = btf.offset("task_struct", "rethooks")
            link = btf.offset("rethook_node", "llist")
            f_ret, f_frame = btf.offset("rethook_node", "ret_addr"), btf.offset("rethook_node", "frame")
        except KeyError:
            return []
        out: list[tuple[int, int]] = []
        node = int.from_bytes(host.read(task + head, 8), "little")
        while node and len(out) < 64:
            rh = node - link
            out.append((int.from_bytes(host.read(rh + f_frame, 8), "little"),
                        int.from_bytes(host.read(rh + f_ret, 8), "little")))
            node = int.from_bytes(host.read(node, 8), "little")       # llist_node.next
        return out


def orc_unwind(host: Any, regs: Any, table: OrcTable, max_entries: int = 16, *,
               guest_view: bool = False, optprobe: bool = False) -> list[int]:
    """``arch_stack_walk()`` with the ORC unwinder from ``regs``: ``regs->ip``, then
    ``unwind_start()`` (which skips the regs frame) and each ``unwind_next_frame()``'s
    return address while ``__kernel_text_address()`` holds (arch/x86/kernel/stacktrace.c,
    arch/x86/kernel/unwind_orc.c).

    ``optprobe``: the walk of a handler under an optimized probe, from its detour
    buffer's frame on (:func:`stack_trace`): no ``regs->ip``, and the first step is the
    frame-pointer guess from ``regs.bp``, which the optprobe template and
    ``optimized_callback()`` leave as the probe found it."""
    out = [] if optprobe else [regs.ip & _M]
    guest = _GuestRethooks(host, regs) if guest_view else None
    base = regs.sp & ~(THREAD_SIZE - 1)

    def on_stack(addr: int, n: int = 8) -> bool:
        return base <= addr and addr + n <= base + THREAD_SIZE

    def deref(addr: int) -> int | None:
        if not on_stack(addr):
            return None
        try:
            return int.from_bytes(host.read(addr, 8), "little")
        except Exception:  # noqa: BLE001 - unreadable: the walk ends (goto err)
            return None

    # the state: ip, sp, bp, the pt_regs the frame has (the handler's, then in memory)
    ip, sp, bp = regs.ip & _M, regs.sp & _M, regs.bp & _M
    first_regs: Any = regs
    regs_addr: int | None = None
    full_regs, signal = True, True

    def get_reg(name: str) -> int | None:
        """``get_reg()``: a register of the frame's pt_regs (all of them with full regs,
        the iret frame's with partial ones)."""
        if first_regs is not None:
            return first_regs.get(name) & _M
        if regs_addr is None:
            return None
        off = PT_REGS_OFFSETS[name]
        if not full_regs and off < IRET_FRAME_OFFSET:
            return None
        return deref(regs_addr + off)

    def next_frame() -> bool:
        nonlocal ip, sp, bp, first_regs, regs_addr, full_regs, signal
        cs = get_reg("cs") if first_regs is not None or regs_addr is not None else None
        if cs is not None and cs & 3 == 3:
            return False                       # user mode: the end
        orc = table.find(ip if signal else ip - 1)
        if orc is None:
            orc = ORC_FP_ENTRY
        elif orc.type in ("undefined", "end_of_stack", "?"):
            return False
        if not table.layout.old_types:
            signal = orc.signal
        indirect = False
        if orc.sp_reg == "sp":
            new_sp = sp + orc.sp_offset
        elif orc.sp_reg == "bp":
            new_sp = bp + orc.sp_offset
        elif orc.sp_reg == "sp_indirect":
            new_sp, indirect = sp, True
        elif orc.sp_reg == "bp_indirect":
            new_sp, indirect = bp + orc.sp_offset, True
        elif orc.sp_reg in ("ax", "dx", "di", "r10", "r13"):
            v = get_reg(orc.sp_reg)
            if v is None:
                return False
            new_sp = v
        else:
            return False
        new_sp &= _M
        if indirect:
            v = deref(new_sp)
            if v is None:
                return False
            new_sp = v
            if orc.sp_reg == "sp_indirect":
                new_sp = (new_sp + orc.sp_offset) & _M
        prev_sp = sp
        if table.layout.old_types:         # 6.1: a frame's type says whether it is a signal frame
            signal = orc.type != "call"
        if orc.type == "call":
            ip_p = new_sp - 8
            v = deref(ip_p)
            if v is None:
                return False
            ip, sp = _recover(host, v, ip_p, guest), new_sp
            first_regs, regs_addr = None, None
        elif orc.type == "regs":
            v_ip, v_sp = deref(new_sp + PT_REGS_OFFSETS["ip"]), deref(new_sp + PT_REGS_OFFSETS["sp"])
            if v_ip is None or v_sp is None:
                return False
            ip, sp = _recover(host, v_ip, v_sp - 8, guest, graph=False), v_sp
            first_regs, regs_addr, full_regs = None, new_sp, True
        elif orc.type == "regs_partial":
            v_ip, v_sp = deref(new_sp), deref(new_sp + 24)
            if v_ip is None or v_sp is None:
                return False
            ip, sp = _recover(host, v_ip, v_sp - 8, guest, graph=False), v_sp
            first_regs, regs_addr, full_regs = None, new_sp - IRET_FRAME_OFFSET, False
        else:
            return False
        if orc.bp_reg == "undefined":
            v = get_reg("bp")
            if v is not None:
                bp = v
        elif orc.bp_reg == "prev_sp":
            v = deref(new_sp + orc.bp_offset)
            if v is None:
                return False
            bp = v
        elif orc.bp_reg == "bp":
            v = deref(bp + orc.bp_offset)
            if v is None:
                return False
            bp = v
        else:
            return False
        if on_stack(sp) and sp <= prev_sp:     # "stack going in the wrong direction?"
            return False
        return True

    if optprobe:
        # the detour buffer's frame (kprobe_optinsn_page: no ORC entry): its pt_regs lie
        # below the probe's sp, so the guess's sp (bp + 16) is above it
        ip, sp, first_regs = 0, (regs.sp & _M) - PT_REGS_SIZE, None
    # unwind_start(regs): skip the regs frame (the detour buffer's, for an optprobe)
    try:
        if not next_frame():
            return out
        while len(out) < max_entries:
            if not host.symbols.is_text(ip):       # unwind_get_return_address()
                break
            out.append(ip)
            if not next_frame():
                break
    except _HostTrampoline:
        pass
    return out


def fp_unwind(host: Any, regs: Any, max_entries: int = 16, *,
              guest_view: bool = False) -> list[int]:
    """The frame-pointer chain from ``regs`` (``CONFIG_UNWINDER_FRAME_POINTER``)."""
    out = [regs.ip]
    guest = _GuestRethooks(host, regs) if guest_view else None
    base = regs.sp & ~(THREAD_SIZE - 1)
    bp = regs.bp
    while len(out) < max_entries and base <= bp and bp + 16 <= base + THREAD_SIZE:
        try:
            data = host.read(bp, 16)
        except Exception:  # noqa: BLE001 - an unreadable frame ends the walk
            break
        nxt, ret = int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")
        try:
            ret = _recover(host, ret, bp + 8, guest)
        except _HostTrampoline:
            break
        if not host.symbols.is_text(ret):
            break
        out.append(ret & _M)
        if nxt <= bp:                     # frames only go up the stack
            break
        bp = nxt
    return out
