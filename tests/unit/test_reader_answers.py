"""Machine's side of kph-reader's port (harness/vmctl.py: ``Machine._reader_answer``):
each answer is ``KPH ID LEN`` and LEN bytes; an answer to a request a call gave up on
(a guest that could not run) comes before the next one's and is dropped, whole or in
pieces, across calls; anything else is the reader out of step."""
from __future__ import annotations

import socket
import threading
import types

import pytest

from harness.errors import VMLostError
from harness.vmctl import Machine


def _machine():
    return types.SimpleNamespace(name="fake", _reader_buf=bytearray(), _reader_skip=0,
                                 _check=lambda: None, _stall_check=lambda: None,
                                 console_tail=lambda *a: "")


def _ask(m, sock, ident, timeout=2.0):
    return Machine._reader_answer(m, sock, ident, f"n {ident}", (), timeout)


def _answer(ident, body):
    return b"KPH %d %d\n" % (ident, len(body)) + body


def test_an_answer_is_read_whole_and_earlier_ones_are_dropped_in_any_pieces():
    a, b = socket.socketpair()
    m = _machine()
    b.sendall(_answer(1, b"one\n"))
    assert _ask(m, a, 1) == b"one\n" and b.recv(100) == b"n 1\n"
    # request 2 given up on: its answer and 3's come together, split anywhere
    stream = _answer(2, b"x" * 5000) + _answer(3, b"three")
    for cut in (3, 10, 4000, len(stream) - 2):
        m = _machine()
        m._reader_buf += stream[:cut]           # what the call that gave up had read
        threading.Timer(0.05, b.sendall, (stream[cut:],)).start()
        assert _ask(m, a, 3) == b"three"
        assert not m._reader_buf and not m._reader_skip
        b.recv(100)


def test_an_answer_to_a_later_request_or_not_an_answer_is_the_reader_out_of_step():
    a, b = socket.socketpair()
    for junk in (_answer(9, b""), b"garbage\n", b"KPH 1 x\n"):
        b.sendall(junk)
        with pytest.raises(VMLostError, match="the reader answered"):
            _ask(_machine(), a, 1)
        b.recv(100)


def test_no_answer_is_a_vmlosterror_within_the_timeout():
    a, b = socket.socketpair()
    with pytest.raises(VMLostError, match="did not answer in 0 s"):
        _ask(_machine(), a, 1, timeout=0.2)
    b.close()
    with pytest.raises(VMLostError, match="port (closed|broke)"):
        _ask(_machine(), a, 2)
