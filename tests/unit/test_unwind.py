"""The ORC unwinder on recorded pieces: each series' ``struct orc_entry`` packing, and a
walk over a made-up stack (the real one against the guest's own ``stack_trace_save()`` is
tests/vm/test_stacktrace.py)."""
from __future__ import annotations

import struct
from types import SimpleNamespace

from harness.kernel.kprobes import PtRegs
from harness.kernel.unwind import ORC_LAYOUTS, OrcEntry, OrcTable, orc_unwind


def _raw(sp_off: int, bp_off: int, bits: int) -> bytes:
    return struct.pack("<hhH", sp_off, bp_off, bits)


def test_each_series_packs_its_own_way():
    # 6.12: sp_reg SP (5), bp_reg PREV_SP (1), type CALL (2), signal 0
    e = OrcEntry.unpack(_raw(8, -16, 5 | 1 << 4 | 2 << 8), ORC_LAYOUTS["6.12"])
    assert (e.sp_reg, e.bp_reg, e.type, e.signal) == ("sp", "prev_sp", "call", False)
    # 7.3 renumbered the registers: SP is 3, PREV_SP 8
    e = OrcEntry.unpack(_raw(8, -16, 3 | 8 << 4 | 2 << 8 | 1 << 11), ORC_LAYOUTS["7.3"])
    assert (e.sp_reg, e.bp_reg, e.type, e.signal) == ("sp", "prev_sp", "call", True)
    # 6.1: type:2 (REGS 1) and end:1; a REGS frame is a signal frame
    e = OrcEntry.unpack(_raw(0, 0, 5 | 0 << 4 | 1 << 8), ORC_LAYOUTS["6.1"])
    assert (e.type, e.signal) == ("regs", True)
    e = OrcEntry.unpack(_raw(0, 0, 0 | 1 << 10), ORC_LAYOUTS["6.1"])
    assert e.type == "end_of_stack"
    assert OrcEntry.unpack(_raw(0, 0, 0), ORC_LAYOUTS["6.1"]).type == "undefined"


class _Host:
    """Memory, symbols and a trampoline, as an engine gives them."""

    def __init__(self, mem: dict[int, int], text: tuple[int, int]) -> None:
        self.mem, self.trampoline = mem, 0xFFFFFFFF82000000
        lo, hi = text
        self.symbols = SimpleNamespace(is_text=lambda a: lo <= a < hi)
        self.hooked: dict[int, int] = {}

    def read(self, addr: int, n: int) -> bytes:
        return b"".join(self.mem.get(addr + i, 0).to_bytes(8, "little") for i in range(0, n, 8))

    def kretprobe_find_ret_addr(self, slot: int) -> int | None:
        return self.hooked.get(slot)


def test_a_walk_over_call_frames_recovers_a_hooked_return():
    """f (sp+8 frame) called by g (sp+24 frame) called by h, whose return slot the host's
    trampoline took: the trace shows h's real caller."""
    text = (0xFFFFFFFF81000000, 0xFFFFFFFF81100000)
    f, g, h, caller = (0xFFFFFFFF81000100, 0xFFFFFFFF81000200, 0xFFFFFFFF81000300,
                       0xFFFFFFFF81000400)
    lay = ORC_LAYOUTS["6.12"]
    call = lambda off: _raw(off, 0, 5 | 0 << 4 | 2 << 8)      # noqa: E731 - CALL, sp+off
    ips = [f, g, h, caller]
    table = OrcTable(ips, call(8) + call(24) + call(8) + _raw(0, 0, 1 << 8), text, lay)
    sp = 0xFFFFC90000010F00                                  # inside one 16 KiB stack
    mem = {sp: g + 0x10,                                     # f's return into g
           sp + 8 + 16: h + 0x20,                            # g's frame: 24 bytes
           sp + 32: 0xFFFFFFFF82000000}                      # h's slot: the trampoline
    host = _Host(mem, text)
    host.hooked[sp + 32] = caller + 0x8
    regs = PtRegs({"ip": f + 4, "sp": sp, "bp": 0, "cs": 0x10})
    assert orc_unwind(host, regs, table, 8) == [f + 4, g + 0x10, h + 0x20, caller + 0x8]


def test_under_an_optimized_probe_the_walk_is_the_frame_pointer_guess():
    """The guest's handler under an optprobe walks out of the detour buffer (no ORC data)
    by ``orc_fp_entry`` from the probe's rbp: ip = [bp + 8], sp = bp + 16, bp = [bp];
    then ORC again. The probed function (f) and its ORC-known caller (g) are not in it."""
    text = (0xFFFFFFFF81000000, 0xFFFFFFFF81100000)
    f, g, entry = 0xFFFFFFFF81000100, 0xFFFFFFFF81000200, 0xFFFFFFFF81000300
    lay = ORC_LAYOUTS["6.12"]
    call = lambda off: _raw(off, 0, 5 | 0 << 4 | 2 << 8)      # noqa: E731 - CALL, sp+off
    end = _raw(0, 0, 1 << 8)                                 # END_OF_STACK
    table = OrcTable([f, g, entry], call(8) + call(8) + end, text, lay)
    sp = 0xFFFFC90000010F00
    bp = sp + 0x80                                           # an rbp the caller left
    mem = {sp: g + 0x10, sp + 8: entry + 0x4,                # the ORC walk's slots
           bp: 0, bp + 8: entry + 0x40}                      # the guess's frame
    host = _Host(mem, text)
    regs = PtRegs({"ip": f + 4, "sp": sp, "bp": bp, "cs": 0x10})
    assert orc_unwind(host, regs, table, 8) == [f + 4, g + 0x10, entry + 0x4]
    assert orc_unwind(host, regs, table, 8, optprobe=True) == [entry + 0x40]


def test_a_function_graph_hook_is_recovered_from_the_return_stack():
    """``ftrace_graph_ret_addr()`` of 6.12 and 7.3 over a made-up ``ret_stack``: two
    frames of three words (ret, func, retp), each followed by the word whose low 10 bits
    say how far down its frame starts; searched from ``curr_ret_stack`` down, and on
    from where the last one was found (``graph_idx``)."""
    from harness.kernel.unwind import _GuestRethooks

    rth, base, task = 0xFFFFFFFF81F00000, 0xFFFF888000100000, 0xFFFF888000200000
    slot_a, slot_b = 0xFFFFC90000010F80, 0xFFFFC90000010F40
    real_a, real_b = 0xFFFFFFFF81000400, 0xFFFFFFFF81000500
    words = [real_a, 0, slot_a, 3 | 1 << 10, real_b, 0, slot_b, 3 | 1 << 10]
    mem = {base + 8 * i: w for i, w in enumerate(words)}
    mem[task + 0x100] = base
    mem[task + 0x108] = len(words)                       # curr_ret_stack (an int)
    offsets = {("task_struct", "ret_stack"): 0x100, ("task_struct", "curr_ret_stack"): 0x108,
               ("ftrace_ret_stack", "ret"): 0, ("ftrace_ret_stack", "retp"): 16}
    btf = SimpleNamespace(offset=lambda s, m: offsets[(s, m)])
    host = _Host(mem, (0, 0))
    host.symbols = SimpleNamespace(get=lambda name: SimpleNamespace(addr=rth)
                                   if name == "return_to_handler" else None)
    host.vm = SimpleNamespace(facts=SimpleNamespace(btf=btf, rules=SimpleNamespace(series="7.3")))
    host.current_task = lambda regs: task
    g = _GuestRethooks(host, None)
    assert g.graph_ret_addr(0x1234, slot_b) == 0x1234       # not return_to_handler
    assert g.graph_ret_addr(rth, slot_b) == real_b          # graph_idx: 4
    assert g.graph_ret_addr(rth, slot_b) == rth             # at or above it: not searched
    assert g.graph_ret_addr(rth, slot_a) == real_a          # below it
