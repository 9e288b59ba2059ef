"""A raw GDB remote-serial-protocol client: the floor GdbStub is measured against.

Just enough RSP to stop at a breakpoint and resume: no-ack mode, Z0/z0, ``c``, ``p``/``P``
(one register), ``g``, ``D``. QEMU before 8.2 answers ``P`` only after the client has
read ``target.xml``, so ``connect`` reads it as GDB does.
"""
from __future__ import annotations

import select
import socket
import struct
import time


class RawStub:
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(path)
        self.timeout = timeout
        self.buf = b""
        self.ack = True
        self.cmd("QStartNoAckMode")
        self.ack = False
        self.cmd("qXfer:features:read:target.xml:0,ffff")
        self.cmd("?")  # QEMU stopped the guest when we connected

    def _send(self, body: str) -> None:
        pkt = f"${body}#{sum(body.encode()) & 0xff:02x}".encode()
        self.s.sendall(pkt)

    def _recv(self, timeout: float | None = None) -> str:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            start = self.buf.find(b"$")
            end = self.buf.find(b"#", start)
            if start >= 0 and end >= 0 and len(self.buf) >= end + 3:
                body = self.buf[start + 1:end].decode("latin-1")
                self.buf = self.buf[end + 3:]
                if self.ack:
                    self.s.sendall(b"+")
                return body
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("stub did not answer")
            if select.select([self.s], [], [], left)[0]:
                chunk = self.s.recv(65536)
                if not chunk:
                    raise EOFError("stub closed the connection")
                self.buf += chunk

    def cmd(self, body: str) -> str:
        """Send a packet and return its reply, skipping stop replies it cannot have caused
        (QEMU 7.2 sends one unasked when a client connects)."""
        self._send(body)
        while True:
            reply = self._recv()
            if body == "?" or not (reply[:1] in ("T", "S") and len(reply) >= 3
                                   and all(c in "0123456789abcdef" for c in reply[1:3])):
                return reply

    def read_reg(self, n: int) -> int:
        return struct.unpack("<Q", bytes.fromhex(self.cmd(f"p{n:x}")[:16]))[0]

    def write_reg(self, n: int, value: int) -> None:
        assert self.cmd(f"P{n:x}={struct.pack('<Q', value).hex()}") == "OK"

    def cont(self) -> None:
        self._send("c")

    def interrupt(self) -> str:
        self.s.sendall(b"\x03")
        return self._recv()

    def wait_stop(self, timeout: float) -> str:
        return self._recv(timeout)

    def close(self) -> None:
        try:
            self._send("D")
            self._recv(2)
        except Exception:  # noqa: BLE001
            pass
        self.s.close()
