"""harness.backends.plugin: a plugin record whose read failed where the memory maps is an
engine error, never a fault value (issue 36)."""
from __future__ import annotations

import pytest

from harness.backends.plugin import PluginBackend
from harness.errors import EngineReadError
from harness.kernel.grammar import parse
from harness.machine.pluginlink import REC_HIT, RF_TASK, RF_UNCONFIRMED, PluginRecord


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

    def records(self):
        return sorted(self.batches.pop(0), key=lambda r: r.seq) if self.batches else []


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
