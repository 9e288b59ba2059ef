"""GdbStub against a scripted GDB (tests/data/mi/fake_gdb.py): races seen with the real
one, replayed in the order GDB sent them."""
import sys
from pathlib import Path

from harness.gdbstub import GdbStub

FAKE = Path(__file__).parents[1] / "data" / "mi" / "fake_gdb.py"


def _stub(tmp_path):
    gdb = tmp_path / "gdb"
    gdb.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE}\n")
    gdb.chmod(0o755)
    return GdbStub(tmp_path / "gdb.sock", gdb=str(gdb), timeout=5)


def test_a_hit_that_races_the_interrupt_is_returned_once_not_queued_for_the_next_step(tmp_path):
    """The dispatcher resumed, a request woke it, and -thread-info was refused (running)
    while the breakpoint's *stopped came in. interrupt() once answered "already stopped"
    and left that *stopped queued; the next step's wait returned it at once while GDB was
    still stepping, and the read after the step met "the target is running" (7.3, module
    side, CI). The halt's own stop comes back, and the step waits for its own."""
    with _stub(tmp_path) as stub:
        stub.resume(0xFFFFFFFFC0405000)
        hit = stub.interrupt()
        assert (hit.reason, hit.addr) == ("breakpoint-hit", 0xFFFFFFFF817B6594)
        assert not stub.running
        step = stub.step()
        assert (step.reason, step.addr) == ("end-stepping-range", 0xFFFFFFFFC0405000)
        assert stub.poll_stop() is None


def test_a_step_whose_stop_comes_in_the_same_read_as_its_answer_leaves_the_stub_halted(
        tmp_path, monkeypatch):
    """Under load GDB's ``^running``, ``*running`` and ``*stopped`` for one step reached
    the reader in one read: the flag was set to running after the whole batch, so the
    stub took the halted guest for a running one, the engine's close() never resumed it,
    and the next test met a guest stopped at a debug event (CI, 2026-12-03). The flag
    follows the records in their order, and ``halted()`` asks GDB when the flag says
    running."""
    monkeypatch.setenv("FAKE_GDB_ONE_READ", "1")
    with _stub(tmp_path) as stub:
        stub.interrupt()
        step = stub.step()
        assert (step.reason, step.addr) == ("end-stepping-range", 0xFFFFFFFFC0405000)
        assert not stub.running
        stub.running = True          # a stale flag: GDB's own view corrects it
        assert stub.halted() and not stub.running
