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
