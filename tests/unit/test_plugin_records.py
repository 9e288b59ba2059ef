"""harness.backends.plugin: a plugin record whose read failed where the memory maps is an
engine error, never a fault value (issue 36)."""
from __future__ import annotations

import pytest

from harness.backends.plugin import PluginBackend
from harness.errors import EngineReadError
from harness.kernel.grammar import parse
from harness.machine.pluginlink import (REC_HDR, REC_HIT, RF_TASK, RF_UNCONFIRMED, PluginRecord,
                                        decode, lean)


def _backend(spec):
    be = PluginBackend.__new__(PluginBackend)      # no machine: _hit reads no guest
    be._specs = {7: (spec, "kprobes/o")}
    be._uprobes, be._eprobes = {}, {}
    return be


def _record(flags: int) -> PluginRecord:
    return PluginRecord(REC_HIT, 0, 7, 0, 1, (0,) * 21, 0xffff888000001000, 0xffffffff81000000,
                        0, 1, flags, b"cat", b"")


def test_an_unconfirmed_fault_is_an_engine_error():
    """RF_UNCONFIRMED: the plugin's read failed twice where every page translates (its
    failure, not the guest's fault). The hit raises EngineReadError (the run fails, as the
    gdbstub engine's unconfirmed fault does) before anything is evaluated: no (unknown)
    'stale' value, which would match whatever the guest printed."""
    be = _backend(parse("p:o do_sys_openat2 j=@jiffies:u64"))
    with pytest.raises(EngineReadError, match="kprobes/o.*failed where the guest's memory maps"):
        be._hit(_record(RF_TASK | RF_UNCONFIRMED), 0)


class _Engine:
    """What PluginBackend reads of the plugin engine while it decodes: batches of records."""

    kind = "plugin"
    trampoline = 0xffffffff8fffffff

    def __init__(self, symbols, batches):
        self.symbols, self.batches = symbols, list(batches)

    def lean_records(self):
        return lean([_packed(r) for r in self.batches.pop(0)] if self.batches else [])


def _packed(r: PluginRecord) -> bytes:
    """The record as the plugin writes it to its ring (kph_rec_hdr, then its body)."""
    return REC_HDR.pack(REC_HDR.size + len(r.body), r.type, r.vcpu, r.probe_id, r.nblocks,
                        r.seq, *r.regs, r.task, r.func, r.ret_addr, r.pid, r.flags,
                        r.comm) + r.body


def test_a_record_packed_as_the_plugin_writes_it_decodes_to_itself():
    """The test's records reach the backend as bytes (:func:`_packed`): what the ring
    holds decodes back to the record, and its lean header (the registers skipped) has
    the same fields but them."""
    r = PluginRecord(REC_HIT, 1, 7, 0, 42, tuple(range(21)), 0xffff888000001000,
                     0xffffffff81000000, 0xffffffff81000100, 100, RF_TASK, b"cat", b"xy")
    raw = _packed(r)
    assert decode(raw) == r
    (f, got), = lean([raw])
    assert got is raw and f == (len(raw), REC_HIT, 1, 7, 0, 42, r.task, r.func, r.ret_addr,
                                100, RF_TASK, b"cat".ljust(16, b"\0"))


def _at(seq: int, func: int, vcpu: int = 0) -> PluginRecord:
    from harness.kernel.grammar.program import REGS

    regs = tuple(seq if r == "di" else 0 for r in REGS)
    return PluginRecord(REC_HIT, vcpu, 7, 0, seq, regs, 0, func, 0, 100 + vcpu, 0, b"", b"")


def test_records_decoded_in_batches_are_merged_in_the_plugins_order():
    """Decoded while the workload runs (PluginBackend._take every STREAM_INTERVAL): a
    record of vCPU 1 (seq 3) reaches the ring after vCPU 0's seq 4 was taken. The hits
    come out in seq order, numbered by it, comm changes placed among them by seq."""
    from types import SimpleNamespace

    from harness.kernel.symbols import SymbolTable

    syms = SymbolTable.from_kallsyms("ffffffff81000000 T f\nffffffff81001000 T g\n")
    f = 0xffffffff81000000
    eng = _Engine(syms, [[_at(1, f), _at(2, f), _at(4, f)], [_at(3, f, vcpu=1), _at(5, f)]])
    be = PluginBackend(SimpleNamespace(host=eng, name="t"), comm_rule="at_hit")
    be._specs = {7: (parse("p:o f x=%di:u64"), "kprobes/o")}
    be.recording = True
    be._basis = (syms, syms.generation)
    be._take()
    be._take()
    be._comm_changes, be._comm_seqs = [(3, 101, "x")], [4]     # as _decode kept it
    be.recording = False
    hits = be.collect()
    assert [h.arg("x") for h in hits] == ["1", "2", "3", "4", "5"]
    assert [h.seq for h in hits] == [0, 1, 2, 3, 4] and hits[2].cpu == 1
    assert be._comm_changes == [(3, 101, "x")]                  # after seqs 1, 2 and 3


def test_records_decoded_before_the_symbols_changed_are_decoded_again():
    """A symbol table rebuilt while the window was open (module symbols merged) names
    addresses differently: the hits decoded before are dropped and every record of the
    window decoded again from the table as it is."""
    from types import SimpleNamespace

    from harness.kernel.symbols import SymbolTable

    syms = SymbolTable.from_kallsyms("ffffffff81000000 T f\n")
    eng = _Engine(syms, [[_at(1, 0xffffffffc0000010)]])
    be = PluginBackend(SimpleNamespace(host=eng, name="t"), comm_rule="at_hit")
    be._specs = {7: (parse("p:o f x=%di:u64"), "kprobes/o")}
    be.recording = True
    be._basis = (syms, syms.generation)
    be._take()
    before = be._hits[0].ip
    syms.add_module("m", "ffffffffc0000000 t m_fn\t[m]\nffffffffc0000100 t m_g\t[m]\n")
    be.recording = False
    hits = be.collect()
    assert len(hits) == 1 and hits[0].ip != before and hits[0].ip.startswith("m_fn+0x10")


def test_a_register_only_probe_decodes_each_distinct_record_once_and_places_it():
    """A probe whose arguments read registers only keeps what a record decodes to, keyed
    by the record's type, addresses, flags and the registers read: every hit equals what
    decoding its own record alone gives, its place (seq, vCPU, pid, comm) its own."""
    from types import SimpleNamespace

    from harness.backends.plugin import _plan_registers
    from harness.kernel.grammar.program import REGS
    from harness.kernel.symbols import SymbolTable
    from harness.machine.pluginlink import RF_COMM, RF_PID

    syms = SymbolTable.from_kallsyms("ffffffff81000000 T f\nffffffff81001000 T g\n")
    f = 0xffffffff81000000

    def rec(seq, di, si=0, vcpu=0, pid=100, comm=b"cat", func=f, flags=RF_PID | RF_COMM):
        regs = tuple(di if r == "di" else si if r == "si" else 0 for r in REGS)
        return PluginRecord(REC_HIT, vcpu, 7, 0, seq, regs, 0, func, 0, pid, flags, comm, b"")
    recs = [rec(1, 5), rec(2, 5, si=9, vcpu=1, pid=101, comm=b"ls"), rec(3, 6),
            rec(4, 5, func=f + 0x1000), rec(5, 5, flags=RF_PID), rec(6, 5)]
    spec = parse("p:o f x=%di:u64 here=%ip")
    assert _plan_registers(spec) == (REGS.index("di"),)
    assert _plan_registers(parse("p:o f x=+0(%di):u64")) is None

    def decoded(memo: bool):
        eng = _Engine(syms, [recs])
        be = PluginBackend(SimpleNamespace(host=eng, name="t"), comm_rule="at_hit")
        be._specs = {7: (spec, "kprobes/o")}
        if not memo:
            be._plan_regs = {7: None}
        be.recording = True
        be._basis = (syms, syms.generation)
        be._take()
        be.recording = False
        return be, be.collect()
    be, hits = decoded(True)
    assert hits == decoded(False)[1]
    assert len(be._decoded) == 4          # di 5 at f, di 6, at g, without RF_COMM
    assert [(h.seq, h.cpu, h.pid, h.comm, h.arg("x")) for h in hits[:3]] == \
        [(0, 0, 100, "cat", "5"), (1, 1, 101, "ls", "5"), (2, 0, 100, "cat", "6")]
    assert hits[3].ip.startswith("g+0x0") and hits[3].arg("here") != hits[0].arg("here")
    assert hits[4].comm == ""


def test_a_record_placed_without_hit_counts_and_refuses_as_one_decoded_alone():
    """PluginBackend._decode places a register-plan probe's record from a decoded one
    before _hit() is called: its nhit counts the same, a truncated or refused record
    among repeats of a decoded one is still counted bad, an unconfirmed one still an
    engine error, a record of another probe ($comm: no plan) still decoded alone."""
    from types import SimpleNamespace

    from harness.kernel.grammar.program import REGS
    from harness.kernel.symbols import SymbolTable
    from harness.machine.pluginlink import RF_BADPROG, RF_COMM, RF_PID, RF_TRUNC

    syms = SymbolTable.from_kallsyms("ffffffff81000000 T f\n")
    f = 0xffffffff81000000

    def rec(seq, di, probe=7, flags=RF_PID | RF_COMM):
        regs = tuple(di if r == "di" else 0 for r in REGS)
        return PluginRecord(REC_HIT, 0, probe, 0, seq, regs, 0, f, 0, 100, flags, b"cat", b"")
    recs = [rec(1, 5), rec(2, 5), rec(3, 5, flags=RF_PID | RF_COMM | RF_TRUNC), rec(4, 5),
            rec(5, 5, flags=RF_PID | RF_COMM | RF_BADPROG), rec(6, 5, probe=8),
            rec(7, 5, flags=RF_PID | RF_COMM | RF_UNCONFIRMED), rec(8, 5), rec(9, 5, probe=8)]

    def decoded(memo: bool):
        be = PluginBackend(SimpleNamespace(host=_Engine(syms, [recs]), name="t"),
                           comm_rule="at_hit")
        be._specs = {7: (parse("p:o f x=%di:u64"), "kprobes/o"),
                     8: (parse("p:m f c=$comm"), "kprobes/m")}
        if not memo:
            be._plan_regs = {7: None, 8: None}
        be.recording = True
        be._basis = (syms, syms.generation)
        be._take()
        return be
    fast, slow = decoded(True), decoded(False)
    assert fast._placeable and not slow._placeable
    assert fast._hits == slow._hits and fast._seqs == slow._seqs == [1, 2, 4, 6, 8, 9]
    assert fast._nhit == slow._nhit == {"kprobes/o": 7, "kprobes/m": 2}
    assert fast.bad_records == slow.bad_records == {"truncated": 1,
                                                    "program refused by the plugin": 1}
    assert [str(e) for _, e in fast.engine_errors] == [str(e) for _, e in slow.engine_errors]
    assert len(fast.engine_errors) == 1     # the unconfirmed one


def test_a_drain_gives_the_ring_back_as_it_copies_not_once_at_its_end():
    """A full ring's drain hands the space it has copied back to the producer every
    DRAIN_RELEASE bytes (the tail moves while records are still being copied), so a long
    drain does not keep the ring full; every record comes out once, in order."""
    import struct

    from harness.machine import pluginlink

    ring = pluginlink._Ring(1, 1 << 20)
    try:
        size, n = 4096, 250                   # 1,000 KiB of records in a 1 MiB ring
        base = ring.data_off
        for i in range(n):
            struct.pack_into("<IHH", ring.map, base + i * size, size, REC_HIT, i)
        ring._heads[0].value = n * size
        tails: list[int] = []

        class Seen(list):
            def append(self, rec: bytes) -> None:
                tails.append(ring._tails[0].value)
                super().append(rec)
        out = Seen()
        assert ring.drain(out) == n
        assert [struct.unpack_from("<H", r, 6)[0] for r in out] == list(range(n))
        assert ring._tails[0].value == n * size
        step = pluginlink.DRAIN_RELEASE
        # before copying record k, the space of every whole DRAIN_RELEASE before it is free
        assert all(t == (k * size) // step * step for k, t in enumerate(tails)), tails[::16]
        assert tails[-1] > 0
    finally:
        ring.close()
