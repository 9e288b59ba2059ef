"""The guest agent client against a scripted peer on a socketpair (no QEMU)."""
import json
import socket
import threading

import pytest

from harness.agent import GuestAgent
from harness.errors import GuestAgentError, VMLostError


def _peer(sock, script):
    """Answer each request line with script(request) -> bytes."""
    buf = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.lstrip(b"\xff")
            if line:
                sock.sendall(script(json.loads(line)))


def _agent(script):
    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, script), daemon=True).start()
    return GuestAgent(a)


def test_sync_skips_stale_replies_and_junk():
    def script(req):
        if req["execute"] == "guest-sync-delimited":
            stale = b'\xff{"return": 1}\n'
            return b"garbage\n" + stale + b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        return b'{"return": {"ok": 1}}\n'
    ag = _agent(script)
    ag.sync(2)
    assert ag.execute("guest-ping", timeout=2) == {"ok": 1}


def test_error_reply_is_typed():
    def script(req):
        if req["execute"] == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        return b'{"error": {"class": "GenericError", "desc": "no such file"}}\n'
    ag = _agent(script)
    with pytest.raises(GuestAgentError, match="no such file") as ei:
        ag.execute("guest-file-open", {"path": "/x"}, timeout=2)
    assert ei.value.error_class == "GenericError"


def test_silence_is_a_timeout_not_a_hang():
    ag = _agent(lambda req: b"")
    with pytest.raises(VMLostError):
        ag.sync(0.3)


def test_check_callback_interrupts_a_wait():
    class Boom(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise Boom

    a, b = socket.socketpair()
    ag = GuestAgent(a, check=check)
    with pytest.raises(Boom):
        ag.sync(30)
    b.close()


def test_exec_decodes_output_and_status():
    import base64

    def script(req):
        cmd = req["execute"]
        if cmd == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        if cmd == "guest-exec":
            return b'{"return": {"pid": 42}}\n'
        return json.dumps({"return": {"exited": True, "exitcode": 3,
                                      "out-data": base64.b64encode(b"hi\n").decode()}}).encode() + b"\n"
    ag = _agent(script)
    assert ag.exec(["/bin/sh", "-c", "x"], timeout=2) == (3, b"hi\n", b"")
