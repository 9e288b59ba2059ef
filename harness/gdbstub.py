"""``GdbStub``: one GDB/MI session on a Machine's gdbstub, fast and token-matched.

Why GDB at all (not a raw RSP client): GDB knows QEMU's target description, threads
(vCPUs), memory caching and breakpoint shadowing (reads at a breakpoint return the
original bytes, not 0xcc); the harness gets all of that through one small MI protocol.

Why not ``pygdbmi.GdbController.write``: it waits 0.2 s for "more output" after every
command. Here each command carries a token, is written without waiting, and the reader
returns the moment the ``^result`` record with that token arrives (select on gdb's
stdout; records parsed by ``pygdbmi.gdbmiparser``). ``*stopped`` records that arrive
meanwhile are queued for ``wait_stop``. Nothing sleeps a fixed time.

GDB runs in all-stop mode with ``mi-async on`` (so ``-exec-interrupt`` works while the
guest runs) and ``breakpoint always-inserted on`` (breakpoints stay in guest memory
across stops: no z/Z packets per hit). GDB knows nothing about kprobes; this module
knows nothing about them either (see ``harness.engines.gdbstub_engine``).

Connection: GDB 13 connects to a UNIX socket by plain path
(``-target-select remote /run/dir/gdb.sock``); the socket is the one the Machine created
and handed to QEMU, in its 0700 run directory. Connecting pauses the guest.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pygdbmi.gdbmiparser import parse_response

from .errors import GdbMIError, MemoryFaultError, SetupError, VMLostError
from .procs import pdeathsig

log = logging.getLogger(__name__)
#: Registers only the guest's own execution changes (swapgs, wrmsr), read once per stop
_SEGMENT_BASES = ("gs_base", "fs_base", "k_gs_base")
#: GDB's answer (gdb/mi/mi-main.c, mi_cmd_data_read_memory_bytes) when no byte of the
#: range could be read: the target's memory read failed (QEMU: its page walk did).
_UNREADABLE = "Unable to read memory."

#: Registers a kprobe handler may want, by GDB's names for QEMU's x86_64 target.
GENERAL_REGS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10",
                "r11", "r12", "r13", "r14", "r15", "rip", "eflags", "cs", "ss", "ds", "es",
                "fs", "gs")
SYSTEM_REGS = ("fs_base", "gs_base", "k_gs_base", "cr0", "cr2", "cr3", "cr4", "cr8", "efer")
COMMAND_TIMEOUT = 10.0
_VALUE_RE = re.compile(r'number="(\d+)",value="(0x[0-9a-f]+|-?\d+)"')
_RESULT_RE = re.compile(r"^(\d*)\^(done|running|connected|error|exit)(?:,(.*))?$")
_STOP_FIELDS = re.compile(r'(reason|bkptno|thread-id|signal-name)="([^"]*)"|frame=\{addr="(0x[0-9a-f]+)"')


def parse_record(line: str) -> dict[str, Any]:
    """Parse one MI line into pygdbmi's record shape (type, message, payload, token).

    Why not always ``pygdbmi.gdbmiparser.parse_response``: it is a general recursive
    parser and costs ~0.1 ms per record in CPython; a breakpoint hit produces several
    records, all of a few fixed shapes. Those shapes are matched with regexes here; every
    other record goes to pygdbmi.
    """
    head = line[:1]
    if head.isdigit() or head == "^":
        m = _RESULT_RE.match(line)
        if m:
            token = int(m[1]) if m[1] else None
            rest = m[3]
            if not rest:
                return {"type": "result", "message": m[2], "payload": None, "token": token}
            if rest.startswith("register-values="):
                vals = [{"number": n, "value": v} for n, v in _VALUE_RE.findall(rest)]
                return {"type": "result", "message": m[2], "token": token,
                        "payload": {"register-values": vals}}
    elif head == "*":
        if line.startswith("*running"):
            return {"type": "notify", "message": "running", "payload": None, "token": None}
        if line.startswith("*stopped"):
            payload: dict[str, Any] = {}
            for key, val, addr in _STOP_FIELDS.findall(line):
                if addr:
                    payload["frame"] = {"addr": addr}
                else:
                    payload[key] = val
            return {"type": "notify", "message": "stopped", "payload": payload, "token": None}
    elif head == "=" and line.startswith(("=breakpoint-modified", "=thread-selected")):
        return {"type": "notify", "message": line[1:].split(",", 1)[0], "payload": None,
                "token": None}
    return parse_response(line)


@dataclass(frozen=True)
class Stop:
    """Why and where the guest stopped (one ``*stopped`` record)."""

    reason: str           # breakpoint-hit, end-stepping-range, signal-received, ...
    addr: int             # pc of the stopping thread
    thread: int           # GDB thread id = vCPU index + 1
    bkptno: int | None = None
    signal: str | None = None
    when: float = 0.0     # time.monotonic() when the record was read


class GdbStub:
    """A GDB/MI session attached to one QEMU gdbstub socket.

    Use as a context manager or call ``close()``; the gdb process is ended by its pid.
    """

    def __init__(self, target: str | os.PathLike[str], *, gdb: str | None = None,
                 log_path: str | os.PathLike[str] | None = None,
                 timeout: float = COMMAND_TIMEOUT, pre_connect: Iterable[str] = (),
                 proc: "subprocess.Popen[bytes] | None" = None) -> None:
        """``proc``: a gdb :func:`spawn` started already (its start, ~50-70 ms, then
        overlaps the caller's other work: ``Machine.boot(early_gdb=True)``); it is this
        session's to end from here on, whatever happens."""
        self.target = str(target)
        self.timeout = timeout
        self._tokens = itertools.count(1)
        self._buf = b""
        self._stops: collections.deque[Stop] = collections.deque()
        self.running = False
        self.current_thread: int | None = None  # GDB's selected thread (a vCPU)
        #: Why the remote target is gone (``=thread-group-exited``), "" while it is there
        self.gone = ""
        #: (vCPU, register) -> value of the segment bases read since the last stop
        self._segments: dict[tuple[int | None, str], int] = {}
        self.stats = collections.Counter()
        self.proc = proc if proc is not None else spawn(gdb=gdb, log_path=log_path)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin
        self._fd = self.proc.stdout.fileno()
        self._regnum: dict[str, int] = {}
        self._pending: set[int] = set()  # tokens of commands whose result is not read yet
        self._pending_error: GdbMIError | None = None
        self._pre_connect = tuple(pre_connect)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    # -- setup ----------------------------------------------------------------------------
    def _connect(self) -> None:
        for opt in ("mi-async on", "pagination off", "confirm off", "height 0", "width 0",
                    "breakpoint always-inserted on", "displaced-stepping off",
                    "print thread-events off", "step-mode on", *self._pre_connect):
            self.command(f"-gdb-set {opt}")
        self.command(f"-target-select remote {self.target}", timeout=30)
        self._stops.clear()  # the reason-less *stopped GDB reports on connect
        # A single-step runs only the stepping vCPU, so no other hit can interleave.
        self.command("-gdb-set scheduler-locking step")
        cur = self.command("-thread-info").get("current-thread-id")
        self.current_thread = int(cur) if cur else None
        names = self.command("-data-list-register-names")["register-names"]
        self._regnum = {n: i for i, n in enumerate(names) if n}
        self.available_regs = tuple(r for r in GENERAL_REGS + SYSTEM_REGS if r in self._regnum)

    def __enter__(self) -> "GdbStub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill(self) -> None:
        """End gdb by its pid at once (SIGKILL), without a word to it: for an interrupted
        process, whose other threads may be in the middle of talking to gdb."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Detach (the guest keeps running) and end gdb by its pid. Idempotent."""
        if self.proc.poll() is None:
            try:
                if self.running:
                    self.interrupt()
                self.command("-target-detach", timeout=2)
            except Exception:  # noqa: BLE001 - ending gdb anyway
                pass
            try:
                self._in.write(b"-gdb-exit\n")
            except OSError:
                pass
            for sig, wait in ((None, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    try:
                        os.kill(self.proc.pid, sig)
                    except ProcessLookupError:
                        pass
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    # -- MI core --------------------------------------------------------------------------
    def _read_records(self, deadline: float,
                      wake_fd: int | None = None) -> list[dict[str, Any]] | None:
        """Block until at least one complete line is available; parse all complete lines.

        Returns None at once if ``wake_fd`` becomes readable first.
        """
        fds = [self._fd] if wake_fd is None else [self._fd, wake_fd]
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select(fds, [], [], left)
            if not r:
                continue
            if self._fd not in r:
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise VMLostError(f"gdb exited (status {self.proc.poll()})")
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        trace = log.isEnabledFor(logging.DEBUG)
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            if not line or line.startswith("(gdb)"):
                continue
            if trace:
                log.debug("<-- %s", line[:300])
            out.append(parse_record(line))
        return out

    def _dispatch(self, rec: dict[str, Any]) -> None:
        kind, msg = rec["type"], rec["message"]
        if kind == "result":
            tok = rec.get("token")
            if tok in self._pending:
                self._pending.discard(tok)
                if msg == "error" and self._pending_error is None:
                    self._pending_error = GdbMIError(
                        f"resume: {(rec['payload'] or {}).get('msg', 'error')}", tok)
                elif msg == "running":
                    self.running = True
            return
        if kind == "notify":
            if msg == "stopped":
                self.running = False
                self._segments.clear()       # the target ran: its segment bases may differ
                p = rec["payload"] or {}
                if "reason" not in p and "frame" in p and not self._expect_reasonless:
                    return
                frame = p.get("frame") or {}
                if "thread-id" in p:
                    self.current_thread = int(p["thread-id"])
                self._stops.append(Stop(
                    reason=p.get("reason", "unknown"), addr=int(frame.get("addr", "0"), 16),
                    thread=int(p.get("thread-id", 1)),
                    bkptno=int(p["bkptno"]) if "bkptno" in p else None,
                    signal=p.get("signal-name"), when=time.monotonic()))
            elif msg == "running":
                self.running = True
                self._segments.clear()
            elif msg == "thread-group-exited":
                # The remote target went away (a panicked guest reset, QEMU quit): no stop
                # will ever come, so waiting for one would only run out its timeout.
                self.gone = "GDB lost the guest's gdbstub (the guest reset or QEMU exited)"
        elif kind == "console" and self._console_capture is not None:
            self._console_capture.append(str(rec.get("payload") or ""))
        elif kind in ("console", "log", "target", "output") and rec.get("payload"):
            log.debug("gdb %s: %s", kind, str(rec["payload"]).rstrip())

    _expect_reasonless = False
    _console_capture: list[str] | None = None

    def _raise_pending(self) -> None:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err

    def send(self, cmd: str) -> int:
        """Send a command without waiting for its result (checked on the next call)."""
        self._raise_pending()
        tok = next(self._tokens)
        log.debug("--> %d%s (answer not awaited)", tok, cmd)
        try:
            self._in.write(f"{tok}{cmd}\n".encode())
        except OSError as exc:
            raise VMLostError(f"gdb is gone: {exc}") from exc
        self._pending.add(tok)
        self.stats["commands"] += 1
        return tok

    def command(self, cmd: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Send one MI command and return the payload of its result record.

        :raise GdbMIError: GDB answered ``^error`` (to this or an earlier ``send``).
        :raise VMLostError: no answer within ``timeout`` or gdb died.
        """
        self._raise_pending()
        tok = next(self._tokens)
        deadline = time.monotonic() + (timeout or self.timeout)
        log.debug("--> %d%s", tok, cmd)
        try:
            self._in.write(f"{tok}{cmd}\n".encode())
        except OSError as exc:
            raise VMLostError(f"gdb is gone: {exc}") from exc
        self.stats["commands"] += 1
        while True:
            try:
                recs = self._read_records(deadline) or []
            except TimeoutError:
                raise VMLostError(f"gdb did not answer {cmd!r} within {timeout or self.timeout} s") from None
            result = None
            for rec in recs:
                if rec["type"] == "result" and rec["token"] == tok:
                    result = rec
                    if rec["message"] == "running":
                        # In its place among the records: a *stopped read in the same
                        # batch after it is newer (a step's ^running, *running and
                        # *stopped came in one read under load, and a flag set after
                        # the batch left the stub "running" on a halted guest, which
                        # the engine's close() then never resumed: CI, 2026-12-03).
                        self.running = True
                else:
                    self._dispatch(rec)
            if result is not None:
                if result["message"] == "error":
                    msg = (result["payload"] or {}).get("msg", "error")
                    raise GdbMIError(f"{cmd}: {msg}", tok)
                return result["payload"] or {}

    # -- execution control ----------------------------------------------------------------
    def cont(self) -> None:
        """Resume all vCPUs (returns at once; see ``wait_stop``)."""
        self.command("-exec-continue")

    def resume(self, addr: int | None = None) -> None:
        """Resume all vCPUs, at ``addr`` if given, without waiting for GDB's answer.

        The hot path of a probe hit: ``-exec-jump *ADDR`` sets pc and continues in one
        command, and the ``^running`` is consumed later by ``wait_stop``; an error
        surfaces on the next call.
        """
        self._drop_queued("resuming")
        self.running = True
        self.send(f"-exec-jump *{addr:#x}" if addr is not None else "-exec-continue")

    def step(self, *, thread: int | None = None, timeout: float | None = None) -> Stop:
        """Execute one instruction on ``thread`` (default: the current one) and return the stop."""
        self._drop_queued("stepping")     # the step's own stop is the one to wait for
        self.command("-exec-step-instruction" + self._th(thread))
        return self.wait_stop(timeout=timeout or self.timeout)

    def step_over(self, addr: int, bpnum: int | None, *, thread: int | None = None,
                  always: bool = False) -> tuple[Stop, int | None]:
        """Single-step the instruction at ``addr`` where our breakpoint ``bpnum`` sits.

        Why not just ``step``: when the guest's own memory holds 0xcc there (an in-guest
        int3 kprobe), GDB takes the location for a permanent breakpoint and its step does
        not execute anything. Removing ours for the step lets the int3 run (into
        ``asm_exc_int3``). Returns the stop and the breakpoint's new number.
        """
        try:
            plain = bpnum is None or self.read_memory(addr, 1) != b"\xcc"
        except MemoryFaultError:     # a user page not present yet: lift ours, to be safe
            plain = bpnum is None
        if plain:
            return self.step(thread=thread), bpnum
        self.delete_breakpoint(bpnum)
        try:
            return self.step(thread=thread), None
        finally:
            bpnum = self.insert_breakpoint(addr)
            self._last_reinserted = bpnum

    def interrupt(self, *, timeout: float | None = None) -> Stop:
        """Stop a running guest (a halted one is left as it is and its position returned).

        When the guest turns out to be halted, the stop returned is this halt's own, and
        no stop stays queued: a queued one would be taken as the answer to the next
        command that resumes (a step returned at once with it while GDB was still
        stepping, and the next read met "the target is running").
        """
        if self.gone:
            raise VMLostError(self.gone)
        # Our flag is only a cache of GDB's view: seen stale under load (a stop already
        # consumed, the flag still set), and an -exec-interrupt to a halted target never
        # produces the *stopped that wait_stop would wait for.
        if self.halted():
            # A stop still in the pipe, or dispatched while asking (a breakpoint hit that
            # raced -thread-info), is this halt's: the newest one is where the vCPU is.
            self.poll_stop(keep=True)
            if self._stops:
                stop = self._stops.pop()
                self._drop_queued("an interrupt found the guest halted")
                return stop
            pc = self.read_registers(("rip",))["rip"]
            return Stop(reason="already-stopped", addr=pc, thread=self.current_thread or 1,
                        when=time.monotonic())
        self._expect_reasonless = True
        try:
            self.command("-exec-interrupt")
            stop = self.wait_stop(timeout=timeout or self.timeout)
        finally:
            self._expect_reasonless = False
        if stop is not None and stop.signal != "SIGINT":
            self._drain_interrupt_stop()
        return stop

    def _drain_interrupt_stop(self, wait: float = 0.05) -> None:
        """The guest stopped on its own (a breakpoint hit read after -thread-info's
        refusal) before -exec-interrupt reached it. The interrupt's own ``*stopped``
        (SIGINT), when GDB sends one, comes after: it belongs to this halt, never to the
        next step or resume (a step once returned it at once while GDB was stepping)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self.poll_stop(keep=True)
            if any(s.signal == "SIGINT" for s in self._stops):
                break
            time.sleep(0.002)
        self._drop_queued("the interrupt's own stop, after the guest had stopped on its own")

    def halted(self) -> bool:
        """The guest is halted: our flag says so, or GDB's own view does (the flag is a
        cache; a halted guest nobody resumes stays halted for good)."""
        if self.running and self._all_stopped():
            self.running = False
        return not self.running

    def _all_stopped(self) -> bool:
        """GDB's own view: every thread it knows is stopped (``-thread-info``)."""
        try:
            threads = self.command("-thread-info").get("threads") or []
        except GdbMIError:  # "Cannot execute this command while the target is running."
            return False
        return bool(threads) and all(t.get("state") == "stopped" for t in threads)

    def wait_stop(self, *, timeout: float, wake_fd: int | None = None) -> Stop | None:
        """The next stop; raise TimeoutError if the guest keeps running past ``timeout``.

        With ``wake_fd``, return None as soon as that descriptor is readable (another
        thread wants the guest halted; see ``harness.engines.gdbstub_engine``).
        """
        deadline = time.monotonic() + timeout
        while not self._stops:
            self._raise_pending()
            if self.gone:
                raise VMLostError(self.gone)
            recs = self._read_records(deadline, wake_fd)
            if recs is None:
                return None
            for rec in recs:
                self._dispatch(rec)
        self._raise_pending()
        return self._stops.popleft()

    def poll_stop(self, *, keep: bool = False) -> Stop | None:
        """A stop that already arrived, without blocking (``keep``: read what GDB sent,
        leave the stops queued, return None)."""
        if not self._stops or keep:
            try:
                while b"\n" in self._buf or readable(self._fd):
                    for rec in self._read_records(time.monotonic() + 0.05) or []:
                        self._dispatch(rec)
            except TimeoutError:
                pass
        if keep:
            return None
        return self._stops.popleft() if self._stops else None

    def _drop_queued(self, why: str) -> None:
        """Forget queued stops: they belong to a halt already being handled."""
        for st in self._stops:
            log.debug("dropping a queued stop at %#x (%s): %s", st.addr, st.reason, why)
            self.stats["stale_stops"] += 1
        self._stops.clear()

    # -- breakpoints ----------------------------------------------------------------------
    def insert_breakpoint(self, addr: int) -> int:
        """A software breakpoint at ``addr`` that stays inserted; returns its number."""
        r = self.command(f"-break-insert *{addr:#x}")
        return int(r["bkpt"]["number"])

    def delete_breakpoint(self, number: int) -> None:
        self.command(f"-break-delete {number}")

    # -- registers ------------------------------------------------------------------------
    def read_registers(self, names: Iterable[str] | None = None, *,
                       thread: int | None = None) -> dict[str, int]:
        """Register values as unsigned ints (general + system registers by default)."""
        names = tuple(names) if names is not None else self.available_regs
        if len(names) == 1 and names[0] in _SEGMENT_BASES:
            # A handler asks for gs_base several times a hit (current, preempt_count,
            # per-cpu reads): one read per vCPU and stop.
            key = (thread or self.current_thread, names[0])
            if key not in self._segments:
                self._segments[key] = self._read_registers(names, thread)[names[0]]
            return {names[0]: self._segments[key]}
        return self._read_registers(names, thread)

    def _read_registers(self, names: tuple[str, ...], thread: int | None) -> dict[str, int]:
        nums = " ".join(str(self._num(n)) for n in names)
        th = self._th(thread)
        # Hot path: a regex over the raw result avoids the generic MI parser's cost.
        r = self.command(f"-data-list-register-values{th} --skip-unavailable x {nums}")
        byname = {i: n for n, i in ((n, self._num(n)) for n in names)}
        out = {}
        for v in r.get("register-values", []):
            out[byname[int(v["number"])]] = int(v["value"], 0) & 0xFFFFFFFFFFFFFFFF
        return out

    def write_register(self, name: str, value: int, *, thread: int | None = None) -> None:
        self._segments.clear()
        th = self._th(thread)
        self.command(f"-data-write-register-values{th} x {self._num(name)} {value & 0xFFFFFFFFFFFFFFFF:#x}")

    def write_registers(self, values: dict[str, int], *, thread: int | None = None) -> None:
        """Write several registers in one MI command."""
        if not values:
            return
        if any(n in _SEGMENT_BASES for n in values):
            self._segments.clear()
        th = self._th(thread)
        pairs = " ".join(f"{self._num(n)} {v & 0xFFFFFFFFFFFFFFFF:#x}" for n, v in values.items())
        self.command(f"-data-write-register-values{th} x {pairs}")

    def _th(self, thread: int | None) -> str:
        """``--thread N`` only when N is not GDB's current thread (switching costs a frame rebuild)."""
        return f" --thread {thread}" if thread and thread != self.current_thread else ""

    def _num(self, name: str) -> int:
        try:
            return self._regnum[name]
        except KeyError:
            raise GdbMIError(f"no register {name!r} on this target") from None

    # -- memory ---------------------------------------------------------------------------
    def read_memory(self, addr: int, size: int) -> bytes:
        """Guest virtual memory as the current vCPU sees it (breakpoints shadowed).

        :raise MemoryFaultError: the guest does not map (all of) it: GDB's "Unable to read
            memory." (QEMU's stub answered ``E14``), or fewer bytes than asked.
        :raise GdbMIError: any other refusal; ``HarnessError`` subclasses for a timeout or
            a lost VM. Only the first is a fault the guest's own read would take.
        """
        try:
            r = self.command(f"-data-read-memory-bytes {addr:#x} {size}")
        except GdbMIError as exc:
            if exc.msg.endswith(_UNREADABLE):
                raise MemoryFaultError(exc.msg, addr, exc.token) from None
            raise
        data = b"".join(bytes.fromhex(m["contents"]) for m in r["memory"])
        if len(data) != size:
            raise MemoryFaultError(f"short read at {addr:#x}: {len(data)} of {size} bytes", addr)
        return data

    def write_memory(self, addr: int, data: bytes) -> None:
        self.command(f"-data-write-memory-bytes {addr:#x} {data.hex()}")

    # -- threads (vCPUs) ------------------------------------------------------------------
    def threads(self) -> list[int]:
        r = self.command("-thread-list-ids")
        ids = r.get("thread-ids") or {}
        vals = ids.get("thread-id", [])
        return sorted(int(v) for v in ([vals] if isinstance(vals, str) else vals))

    def select_thread(self, thread: int) -> None:
        self.command(f"-thread-select {thread}")
        self.current_thread = thread

    def raw(self, packet: str) -> str:
        """Send a raw remote packet (``maint packet``) and return the stub's reply."""
        self._console_capture = []
        try:
            self.command(f'-interpreter-exec console "maint packet {packet}"')
            text = "".join(self._console_capture)
        finally:
            self._console_capture = None
        m = re.search(r'received: "(.*)"', text)
        return m.group(1) if m else ""

    def read_memory_raw(self, addr: int, size: int) -> bytes:
        """Guest memory as it really is, past GDB's breakpoint shadows.

        Why: GDB answers reads at its own breakpoint addresses with the bytes it saw when it
        inserted them. QEMU's breakpoints do not modify guest memory, so a raw ``m`` packet
        returns the truth, including code the guest patched later (its own kprobes' int3
        or the optimizer's jmp).
        """
        reply = self.raw(f"m{addr:x},{size:x}")
        try:
            data = bytes.fromhex(reply)
        except ValueError:
            data = b""
        if len(data) != size:
            if reply == "E14":          # gdb_target_memory_rw_debug() failed: not mapped
                raise MemoryFaultError(f"raw read at {addr:#x} failed: {reply!r}", addr)
            raise GdbMIError(f"raw read at {addr:#x} failed: {reply[:40]!r}")
        return data


def spawn(*, gdb: str | None = None,
          log_path: str | os.PathLike[str] | None = None) -> "subprocess.Popen[bytes]":
    """A gdb process for a :class:`GdbStub` (GDB/MI on its stdin and stdout, its stderr to
    ``log_path``), in a session of its own, ended with its parent (``pdeathsig``).

    :raise SetupError: no gdb."""
    exe = gdb or shutil.which("gdb")
    if not exe:
        raise SetupError("gdb not found", "apt-get install gdb (./setup.sh does)")
    stderr = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen([exe, "--nx", "--quiet", "--interpreter=mi3"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, bufsize=0, start_new_session=True,
                                preexec_fn=pdeathsig)
    finally:
        if log_path:
            stderr.close()  # type: ignore[union-attr]


def readable(fd: int) -> bool:
    """``fd`` has data (or EOF) to read now."""
    return bool(select.select([fd], [], [], 0)[0])


def attach(vm: Any, *, resume: bool = True,
           proc: "subprocess.Popen[bytes] | None" = None) -> GdbStub:
    """A GdbStub on ``vm``'s stub socket (through ``proc``, a gdb :func:`spawn` started
    already, if given); the guest is resumed unless ``resume`` is False."""
    logp = Path(vm.rundir) / "gdb.log" if vm.rundir else None
    stub = GdbStub(vm.gdb_socket, log_path=logp, proc=proc)
    if resume:
        stub.cont()
    return stub
