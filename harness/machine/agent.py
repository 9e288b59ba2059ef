"""A minimal, correct qemu-ga client over the virtio-serial channel.

Why not ``qemu.qmp``: the agent's resynchronisation (``guest-sync-delimited``) answers
with a 0xFF byte before its JSON, which QMPClient's decoder rejects. The protocol is
line-based JSON, so a raw socket with ``select`` timeouts is both simpler and exact:
send 0xFF, send ``guest-sync-delimited`` with a random id, drop everything up to the
0xFF the agent sends back, then read lines until that id returns. After that each
request gets exactly one reply line. Any client-side timeout leaves the stream in an
unknown state, so the next call resynchronises first.

``check`` (given by the Machine) is called while waiting, so a guest panic or a dead
QEMU surfaces at once instead of as a timeout; ``stalled`` is called whenever a reply is
overdue by ``STALL_AFTER`` seconds, so a guest that cannot run at all (stopped in a probe
handler or a debugger) surfaces as the Machine's error within a second or two. No
request waits longer than ``AGENT_REPLY_TIMEOUT`` for its reply, whatever the command's
own timeout: a live agent answers each request in milliseconds (a long command is
polled with ``guest-exec-status``), so a longer silence means a stuck agent. Except
while a host engine's probe stops hold the guest most of the time (``stalled`` then
returns the time): each stop halts the guest for a host round trip, thousands of them can
starve the agent for longer, and that guest is running; the wait then lasts until
``AGENT_REPLY_TIMEOUT`` after the stops ease, within the command's own timeout.

One request at a time: a lock serialises threads, and a request abandoned half way (an
exception, Ctrl-C) leaves the stream to be resynchronised by the next one.
"""
from __future__ import annotations

import base64
import json
import logging
import random
import select
import socket
import threading
import time
from typing import Any, Callable

from ..constants import AGENT_REPLY_TIMEOUT
from ..errors import GuestAgentError, VMLostError

log = logging.getLogger(__name__)


_SLICE = 0.05  # how often ``check`` runs while waiting
STALL_AFTER = 0.5  # how long a reply may be late before ``stalled`` is asked
#: A pipeline is sent in waves of at most this many bytes, each once the last is
#: answered. Sent whole, 1,000 requests (~110 KB: enabling 1,000 kprobe events) lost
#: answers in about one run of five on this machine (2026-11-30): qemu-ga had run every
#: request, some answers never reached the host, and the channel took no more requests
#: until a resync (0xFF); sent while answers were flowing back (a window refilled as
#: they came), it failed every time. One wave fits one of QEMU's 4 KiB reads.
PIPELINE_WAVE = 4000
#: How often a running command's status is asked for (``GuestAgent.exec``): from 1 ms,
#: doubling, at most every POLL_SHORT while the command is younger than POLL_SHORT_FOR,
#: then at most every POLL_LONG. Each ask costs the guest ~0.4 ms of its CPU under TCG
#: (qemu-ga wakes to answer it) and a late one adds up to the wait to the command: a
#: short command is asked often, a long one seldom. Measured 2026-11-30 (one vCPU): kph
#: fuzz's workload 44.6 -> 33.8 ms with 5 ms instead of 20 ms; a 90 ms CPU-bound loop
#: 87 -> 92 ms with 5 ms throughout, 114 ms with 2 ms.
POLL_SHORT, POLL_SHORT_FOR, POLL_LONG = 0.005, 0.1, 0.02


def _named(req: tuple[str, dict[str, Any] | None], paths: dict[int, str] | None = None) -> str:
    """A request as an error names it: its command and what it acts on (a file's path,
    also for a handle ``paths`` maps, or a process's pid)."""
    cmd, args = req
    args = args or {}
    if "path" in args:
        return f"{cmd} of {args['path']}"
    if "handle" in args:
        path = (paths or {}).get(args["handle"])
        return f"{cmd} of {path}" if path else f"{cmd} (handle {args['handle']})"
    if "pid" in args:
        return f"{cmd} (pid {args['pid']})"
    return cmd


class GuestAgent:
    """Synchronous client for one guest agent socket (QEMU's chardev end)."""

    def __init__(self, sock: socket.socket, check: Callable[[], None] = lambda: None,
                 stalled: Callable[[], float | None] = lambda: None) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self._buf = b""
        self._check = check
        self._stalled = stalled
        self._synced = False
        self._mutex = threading.RLock()
        self._paths: dict[int, str] = {}   # open file handles' paths, for errors
        self._unread: set[int] = set()  # guest-exec pids whose exited status is unread

    def close(self) -> None:
        self._sock.close()

    # -- wire ----------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self._sock.setblocking(True)
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._lost(exc)
        finally:
            self._sock.setblocking(False)

    def _lost(self, exc: OSError) -> None:
        """The channel broke: let the owner name the cause (panic, QEMU exit) first."""
        self._synced = False
        self._check()
        raise VMLostError(f"guest agent channel broke: {exc}") from exc

    def _fill(self, deadline: float,
              pending: tuple[str, dict[str, Any] | None] | None = None) -> None:
        """Read more bytes into the buffer, or raise VMLostError at the deadline or after
        ``AGENT_REPLY_TIMEOUT`` seconds of silence (naming the ``pending`` request)."""
        t0 = time.monotonic()
        cap = t0 + AGENT_REPLY_TIMEOUT
        while True:
            self._check()
            now = time.monotonic()
            if now - t0 >= STALL_AFTER:
                # set while the host's probe stops hold the guest most of the time
                # (Machine.host_busy): it runs, slowed by them, and its agent gets the time
                # it needs
                busy = self._stalled()
                if busy is not None:
                    cap = max(cap, busy + AGENT_REPLY_TIMEOUT)
            left = min(deadline, cap) - now
            if left <= 0:
                self._synced = False
                what = "" if pending is None else f" {_named(pending, self._paths)}"
                raise VMLostError(f"guest agent did not answer{what} in time ({now - t0:.0f} s)")
            r, _, _ = select.select([self._sock], [], [], min(left, _SLICE))
            if r:
                try:
                    chunk = self._sock.recv(1 << 20)
                except OSError as exc:
                    self._lost(exc)
                if not chunk:
                    self._check()
                    self._synced = False
                    raise VMLostError("guest agent channel closed")
                self._buf += chunk
                return

    def _line(self, deadline: float,
              pending: tuple[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
        while b"\n" not in self._buf:
            self._fill(deadline, pending)
        line, self._buf = self._buf.split(b"\n", 1)
        line = line.strip(b"\xff \r")
        if not line:
            return {}
        try:
            return json.loads(line)
        except ValueError:
            log.debug("<-- unparsable agent line %r", line[:200])
            return {}

    # -- protocol ------------------------------------------------------------------------
    def _request(self, fn: Callable[[], Any]) -> Any:
        """Run one exchange under the lock; one abandoned half way desynchronises."""
        with self._mutex:
            try:
                return fn()
            except BaseException:
                self._synced = False
                raise

    def sync(self, timeout: float) -> None:
        """Resynchronise the stream; raise VMLostError if the agent stays silent."""
        self._request(lambda: self._sync(timeout))

    def _sync(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ident = random.randrange(1, 2**31)
        self._buf = b""
        self._send(b"\xff" + json.dumps({"execute": "guest-sync-delimited",
                                         "arguments": {"id": ident}}).encode() + b"\n")
        while b"\xff" not in self._buf:
            self._fill(deadline)
        self._buf = self._buf.split(b"\xff")[-1]
        while True:
            msg = self._line(deadline)
            if msg.get("return") == ident:
                self._synced = True
                return

    def wait_ready(self, timeout: float) -> None:
        """Retry ``sync`` until the agent inside the booting guest answers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._request(lambda: self._sync(min(0.5, max(0.01, deadline - time.monotonic()))))
                return
            except VMLostError:
                if time.monotonic() >= deadline:
                    raise VMLostError(f"guest agent not ready after {timeout:.0f} s") from None

    def execute(self, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = 10.0) -> Any:
        """Send one command and return its ``return`` value.

        :raise GuestAgentError: when the agent answers with an error.
        :raise VMLostError: when it does not answer within ``timeout``.
        """
        return self._request(lambda: self._execute(cmd, args, timeout))

    def _execute(self, cmd: str, args: dict[str, Any] | None, timeout: float) -> Any:
        (answer,) = self._pipeline([(cmd, args)], timeout)
        if isinstance(answer, GuestAgentError):
            raise answer
        return answer

    def pipeline(self, requests: list[tuple[str, dict[str, Any] | None]], *,
                 timeout: float = 10.0) -> list[Any]:
        """Send the requests in waves and return their answers in order: each its
        ``return`` value, or a :class:`GuestAgentError` (returned, not raised) for one the
        agent refused. qemu-ga runs the requests of its channel one after the other and
        answers each with one line (qga/main.c: process_event), so one round trip carries
        a whole wave (up to ``PIPELINE_WAVE`` bytes of requests, ~35 file opens or ~55
        reads; on this machine a round trip is ~0.3 ms: reading 210 ring-buffer pages in
        12 round trips instead of 210 saved 0.06 s).

        :raise VMLostError: when the answers are not all in within ``timeout``.
        """
        return self._request(lambda: self._pipeline(requests, timeout))

    def _pipeline(self, requests: list[tuple[str, dict[str, Any] | None]],
                  timeout: float) -> list[Any]:
        if not requests:
            return []
        if not self._synced:
            self._sync(timeout)
        deadline = time.monotonic() + timeout
        wire = []
        for cmd, args in requests:
            req: dict[str, Any] = {"execute": cmd}
            if args is not None:
                req["arguments"] = args
            wire.append(json.dumps(req).encode() + b"\n")
        log.debug("--> %d requests (%s ...)", len(requests), requests[0][0])
        out: list[Any] = []
        sent = 0
        while len(out) < len(requests):
            if sent == len(out):        # half duplex: a wave only once the last is answered
                size = len(wire[sent])
                upto = sent + 1
                while upto < len(requests) and size + len(wire[upto]) <= PIPELINE_WAVE:
                    size += len(wire[upto])
                    upto += 1
                self._send(b"".join(wire[sent:upto]))
                sent = upto
            msg = self._line(deadline, requests[len(out)])
            if "return" in msg:
                req = requests[len(out)]
                if req[0] == "guest-file-open" and isinstance(msg["return"], int):
                    self._paths[msg["return"]] = (req[1] or {}).get("path", "")
                elif req[0] == "guest-file-close":
                    self._paths.pop((req[1] or {}).get("handle"), None)
                out.append(msg["return"])
            elif "error" in msg:
                err = msg["error"]
                out.append(GuestAgentError(f"{requests[len(out)][0]}: {err.get('desc', err)}",
                                           err.get("class", "")))
        return out

    def execute_noreply(self, cmd: str) -> None:
        """Send a command that never answers (``guest-shutdown``)."""
        self._send(json.dumps({"execute": cmd}).encode() + b"\n")
        self._synced = False

    # -- conveniences ---------------------------------------------------------------------
    def exec(self, argv: list[str], *, stdin: bytes | None = None,
             timeout: float) -> tuple[int, bytes, bytes]:
        """Run ``argv`` in the guest; return (exit status, stdout, stderr).

        A command killed by a signal reports 128 + signal, as a shell does.

        qemu-ga keeps each started process in a list until its exited status is read,
        and ``guest-exec-status`` answers for the first entry with the pid it is given
        (qga/commands.c: guest_exec_info_find). An entry never read (a command given up
        on, the ``kill`` that ended it) would answer for a later process that got the
        same pid: an empty "exit 0" instead of that process's output. So every exited
        status is read on every path, and a pid left unread is drained before a new
        process with that pid is polled.
        """
        deadline = time.monotonic() + timeout
        args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if stdin is not None:
            args["input-data"] = base64.b64encode(stdin).decode()
        pid = self.execute("guest-exec", args, timeout=timeout)["pid"]
        if pid in self._unread:
            self._drain(pid)
        self._unread.add(pid)
        delay, started = 0.001, time.monotonic()
        while True:
            st = self.execute("guest-exec-status", {"pid": pid},
                              timeout=max(0.5, deadline - time.monotonic()))
            if st.get("exited"):
                self._unread.discard(pid)
                out = base64.b64decode(st.get("out-data", ""))
                err = base64.b64decode(st.get("err-data", ""))
                code = st.get("exitcode")
                if code is None:
                    code = 128 + int(st.get("signal", 0))
                return int(code), out, err
            if time.monotonic() + delay > deadline:
                # made before the kill: ``at`` is when the wait ran out
                lost = VMLostError(f"guest command {argv!r} did not finish within {timeout:.0f} s")
                self._kill(pid)
                raise lost
            self._check()
            time.sleep(delay)
            delay = min(delay * 2, POLL_SHORT if time.monotonic() - started < POLL_SHORT_FOR
                        else POLL_LONG)

    def _kill(self, pid: int) -> None:
        """SIGKILL a command given up on, and read both its status and the kill's, so
        neither entry outlives its pid (best effort: this path already failed)."""
        try:
            kill = self.execute("guest-exec", {"path": "/bin/kill", "arg": ["-9", str(pid)]},
                                timeout=2)["pid"]
            self._unread.add(kill)
            for p in (kill, pid):
                self._drain(p, wait=2.0)
        except Exception:  # noqa: BLE001 - best effort on a path that already failed
            pass

    def _drain(self, pid: int, *, wait: float = 0.0) -> None:
        """Read the exited status of an entry left unread, for up to ``wait`` seconds."""
        end = time.monotonic() + wait
        while True:
            try:
                st = self.execute("guest-exec-status", {"pid": pid}, timeout=2)
            except GuestAgentError:     # no such entry (a snapshot restored without it)
                self._unread.discard(pid)
                return
            if st.get("exited"):
                self._unread.discard(pid)
                return
            if time.monotonic() >= end:
                return
            time.sleep(0.01)

    def write_files(self, items: list[tuple[str, bytes]], *, timeout: float,
                    mode: str = "w") -> None:
        """Write several files in two pipelined waves: open them all, then every write
        followed by every close, so the writes reach the files in ``items``' order. An
        open's own side effect (``trace``'s O_TRUNC clears the buffer) comes before any
        write. Every file opened is closed, whatever failed.

        :raise GuestAgentError: the first open, write or close that failed, in order.
        """
        opened = self.pipeline([("guest-file-open", {"path": p, "mode": mode})
                                for p, _ in items], timeout=timeout)
        handles = [h for h in opened if not isinstance(h, GuestAgentError)]
        wave: list[tuple[str, dict[str, Any] | None]] = []
        if len(handles) == len(items):
            for (_, data), h in zip(items, handles):
                wave += [("guest-file-write", {"handle": h, "buf-b64": base64.b64encode(
                    data[i:i + (1 << 20)]).decode()}) for i in range(0, len(data), 1 << 20)]
        wave += [("guest-file-close", {"handle": h}) for h in handles]
        failed = [r for r in opened + self.pipeline(wave, timeout=timeout)
                  if isinstance(r, GuestAgentError)]
        if failed:
            raise failed[0]

    def write_file(self, path: str, data: bytes, *, timeout: float, mode: str = "w") -> None:
        """Write one file (:meth:`write_files`: two round trips)."""
        self.write_files([(path, data)], timeout=timeout, mode=mode)

    def read_files(self, paths: list[str], *, timeout: float) -> list[bytes | GuestAgentError]:
        """Several whole files in three pipelined waves (open all, read all, close all),
        each a file's bytes or the error that opened or read it. A file longer than one
        read (1 MiB) is read on, one read at a time, before the next file's."""
        opened = self.pipeline([("guest-file-open", {"path": p, "mode": "r"}) for p in paths],
                               timeout=timeout)
        handles = [(i, h) for i, h in enumerate(opened) if not isinstance(h, GuestAgentError)]
        out: list[bytes | GuestAgentError] = list(opened)
        try:
            reads = self.pipeline([("guest-file-read", {"handle": h, "count": 1 << 20})
                                   for _, h in handles], timeout=timeout)
            for (i, h), r in zip(handles, reads):
                if isinstance(r, GuestAgentError):
                    out[i] = r
                    continue
                data = base64.b64decode(r.get("buf-b64", ""))
                while not r.get("eof") and r.get("count"):
                    r = self.execute("guest-file-read", {"handle": h, "count": 1 << 20},
                                     timeout=timeout)
                    data += base64.b64decode(r.get("buf-b64", ""))
                out[i] = data
        finally:
            self.pipeline([("guest-file-close", {"handle": h}) for _, h in handles],
                          timeout=timeout)
        return out

    def read_file(self, path: str, *, timeout: float) -> bytes:
        """One whole file's bytes.

        :raise GuestAgentError: when the agent cannot open or read it.
        """
        (data,) = self.read_files([path], timeout=timeout)
        if isinstance(data, GuestAgentError):
            raise data
        return data
