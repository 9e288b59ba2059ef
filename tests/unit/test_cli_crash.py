"""An exception no rule knows is one line and exit 2 (never 1, the status of a
divergence), its traceback behind --log-level DEBUG; the plugin backend's records that do
not decode are engine errors naming the record (issue 36)."""
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

import importlib

cli_main = importlib.import_module("harness.cli.main")
from harness.errors import EngineReadError, GuestLossError
from harness.machine.pluginlink import lean


@pytest.mark.parametrize("exc", [TypeError("unsupported operand"), KeyError("x"),
                                 struct.error("unpack requires a buffer of 8 bytes")])
def test_an_unexpected_exception_is_one_line_and_exit_2(monkeypatch, capsys, exc):
    def boom(args, out):
        raise exc
    monkeypatch.setitem(cli_main.COMMANDS, "doctor", boom)
    code = cli_main.main(["doctor"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: internal error: "), err
    assert type(exc).__name__ in lines[0] and "Traceback" not in err


def test_the_traceback_is_there_at_debug():
    code = ("import sys, importlib; m = importlib.import_module('harness.cli.main')\n"
            "def boom(args, out): 1 / 0\n"
            "m.COMMANDS['doctor'] = boom\n"
            "sys.exit(m.main(sys.argv[1:]))")
    for argv, traceback in ((["doctor"], False), (["--log-level", "DEBUG", "doctor"], True)):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, r.stderr
        assert ("Traceback" in r.stderr) == traceback, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(
            "error: internal error: ZeroDivisionError"), r.stderr


def test_a_guest_loss_is_one_line_and_exit_2(monkeypatch, capsys):
    def lost(args, out):
        raise GuestLossError("module", 17, "17 record(s) dropped: the module's buffer was "
                             "full (kph_kprobes stats: dropped)")
    monkeypatch.setitem(cli_main.COMMANDS, "doctor", lost)
    assert cli_main.main(["doctor"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "module: 17 record(s) dropped" in lines[0], lines


def test_usage_errors_still_exit_through_argparse(capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main.main(["--version"])
    assert ei.value.code == 0


def _backend(records, hit):
    from harness.backends.plugin import PluginBackend
    from harness.machine.pluginlink import REC_HDR, REC_HIT

    be = PluginBackend(SimpleNamespace(host=SimpleNamespace(kind="plugin",
                                                            lean_records=records), name="t"))
    be._specs = {7: (None, "kprobes/open")}
    be._hit = hit
    # a hit of probe 7 as the plugin's ring holds it: kph_rec_hdr, no body
    rec = REC_HDR.pack(REC_HDR.size, REC_HIT, 0, 7, 0, 1, *(0,) * 21, 0, 0, 0, 0, 0, b"")
    return be, rec


@pytest.mark.parametrize("exc", [ValueError("bad length"), struct.error("unpack requires 8"),
                                 "fault"])
def test_a_record_that_does_not_decode_is_an_engine_error(exc):
    from harness.kernel.grammar.fetch import FaultError

    err = FaultError(0xffff888000001000, 8) if exc == "fault" else exc

    def hit(rec, seq, raw):
        raise err
    holder = []
    be, rec = _backend(lambda: lean(holder), hit)
    holder.append(rec)
    be._take()
    assert len(be.engine_errors) == 1
    name, e = be.engine_errors[0]
    assert name == "kprobes/open" and isinstance(e, EngineReadError)
    assert "hit record (probe 7) could not be decoded" in str(e)
    assert type(err).__name__ in str(e)
    with pytest.raises(EngineReadError, match="1 host hit"):
        be._check()


def test_a_ring_that_does_not_decode_is_an_engine_error():
    def records():
        raise struct.error("unpack_from requires a buffer of at least 24 bytes")
    be, _ = _backend(records, None)
    with pytest.raises(EngineReadError, match="ring could not be decoded: error: unpack_from"):
        be._take()


def test_an_interruption_prints_no_warning_for_a_coroutine_it_left_unscheduled(monkeypatch):
    """SIGTERM between making a coroutine and scheduling it (``Machine.start``'s QMP
    connect; CI's run of b24a38e): collected later, Python would print "coroutine ... was
    never awaited" under the interruption's one line."""
    import gc
    import logging
    import signal
    import warnings

    m = importlib.import_module("harness.cli.main")

    async def connect() -> None:
        pass

    monkeypatch.setattr(m, "_interrupted", [])
    monkeypatch.setattr(signal, "signal", lambda *a: None)     # the test's handlers stay
    monkeypatch.delitem(sys.modules, "harness.vmctl", raising=False)   # no machine to abort
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            coro = connect()
            with pytest.raises(KeyboardInterrupt):
                m._on_signal(signal.SIGTERM, None)
            del coro
            gc.collect()
    finally:
        logging.disable(logging.NOTSET)
    assert not [w for w in seen if "never awaited" in str(w.message)], seen
