"""Deterministic record and replay of one guest run (QEMU's ``-icount rr=record|replay``).

``record(script, out_dir)`` boots the default image (or ``kernel``/``initrd``) under
``rr=record`` with ``script`` appended to the initramfs as ``/etc/kph/script.sh``; the
image's init runs it on the console, prints ``kph: script exit N`` and powers off.
``replay(out_dir)`` runs the very same machine under ``rr=replay``: every instruction,
interrupt, timer and console byte comes back identical, and with ``gdb=True`` QEMU
stays stopped at the recorded end with its gdbstub on a UNIX socket, so
``gdb -ex 'target remote SOCK'`` can ``reverse-stepi`` and ``reverse-continue``.

What QEMU requires, and why the machine looks the way it does (each checked with
QEMU 11.1.3, TCG):

- ``-icount`` with one vCPU: ``-smp 2``, ``-snapshot`` and ``-rtc base=localtime`` are
  refused ("Record/replay is not supported with ...").
- Only ``-serial``-style chardevs are part of the recording; ``-chardev`` ones (QMP, the
  gdbstub, the guest agent's virtio-serial port) are not, so nothing from outside may
  feed the guest: the workload is a script *inside* the initramfs and the guest agent
  is not started (init skips it when a script is present).
- ``rrsnapshot=init`` (a snapshot at instruction 0, which reverse debugging starts
  from) needs a qcow2 to hold it: an unattached ``-drive if=none``. QEMU rewrites it
  when it loads it, so every replay works on a copy.
- ``sleep=off``: an idle guest jumps to its next timer instead of waiting in real
  time; the replay then runs ~2x faster and the log is ~20x smaller (measured here).
- The log's header is written when QEMU exits cleanly; a killed recorder leaves a log
  no replay accepts, so the recording is always ended with QMP ``quit``.
- A replay that diverges (a guest-state change the log does not contain) does not
  fail: it stalls. ``replay`` reports that as ``End.STALLED`` after its timeout.

Why this module builds its own command line (STYLE: ``vmctl`` is the only module that
does): a recorded machine shares no plumbing with ``Machine`` (no agent, no
virtio-serial, icount, a snapshot drive, a fixed end), and ``Machine``'s lifecycle
waits for the agent. The QEMU process is handled the same way: a private 0700 run
directory, sockets created by the harness and passed by fd (nothing listens on TCP),
``PR_SET_PDEATHSIG``, and the process ended by its pid on every path.

Directory of a recording (``out_dir``; QEMU runs there, so every path in its argv is
relative and the directory can be moved or copied as a whole):

==================  ================================================================
``replay.bin``      the record/replay log (the non-deterministic inputs)
``argv.json``       the exact argv of the recording QEMU, and the guest-visible part
``record.json``     how it ended, instruction count, QEMU version, file hashes
``script.sh``       the script, as run
``initrd.img``      the image's initramfs with the script's cpio appended
``vmlinuz``         the kernel, copied (a replay needs the very same bytes)
``snapshots.qcow2`` holds the ``init`` snapshot (``snapshot=True``)
``console.log``     the serial console of the recording (the first ``console_bytes``
                    of ``record.json``: a panic or a timeout is followed by a short
                    tail, see ``_run_on``)
``qemu.log``        QEMU's own messages while recording
==================  ================================================================

``replay`` adds ``replay-console.log``, ``replay-argv.json`` and ``replay-qemu.log``.
"""
from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import constants as C
from ..aio import LoopThread, qmp_connect
from ..errors import SetupError, VMError
from .image.store import Image, default_image, pack_cpio, sha256_file
from .qemu import QemuBinary, find_qemu
from ..procs import drain_fd, listen_unix, make_run_dir, pdeathsig, stop_process
from ..vmctl import check_kernel_format

log = logging.getLogger(__name__)

__all__ = ["record", "replay", "RecordResult", "ReplayResult", "End", "script_initrd",
           "SCRIPT_PATH"]

#: Where the image's init looks for a script (images/init).
SCRIPT_PATH = "etc/kph/script.sh"
LOG, ARGV, META, SCRIPT, INITRD, KERNEL, QCOW2, CONSOLE, QEMU_LOG = (
    "replay.bin", "argv.json", "record.json", "script.sh", "initrd.img", "vmlinuz",
    "snapshots.qcow2", "console.log", "qemu.log")
FORMAT = 1
_MARK_RE = re.compile(rb"^kph: script exit (\d+)\r?$", re.M)
_PANIC = b"Kernel panic - not syncing"
_GRACE = 5.0        # after the end marker or a panic line, wait this long for QEMU's event
_POLL = 0.05
_live: "weakref.WeakSet[_Run]" = weakref.WeakSet()


class End(enum.Enum):
    """How a recorded or replayed run ended."""

    EXIT = "exit"          # the script ended: ``kph: script exit N`` on the console
    PANIC = "panic"        # the guest kernel panicked (pvpanic, or the panic line)
    SHUTDOWN = "shutdown"  # the guest powered off or reset without the end marker
    TIMEOUT = "timeout"    # record: stopped by the harness at the timeout (the recording ends
                           # there); replay: the recording's end was reached
    STALLED = "stalled"    # replay only: the recorded end was not reached within the timeout


@dataclass(frozen=True)
class RecordResult:
    """One recorded run. ``exit_code`` is the script's status when ``end`` is EXIT."""

    out_dir: Path
    end: End
    exit_code: int | None
    console: str
    icount: int | None     # guest instructions executed when the recording stopped
    seconds: float         # QEMU start to the end, wall time
    panic_line: str | None = None

    def path(self, name: str) -> Path:
        """A file of the recording by its name (``replay.LOG``, ``replay.CONSOLE``, ...)."""
        return self.out_dir / name


@dataclass(frozen=True)
class ReplayResult:
    """One replay. Use as a context manager when ``gdb_socket`` is set: QEMU is still
    running then, stopped for gdb, until ``close()``."""

    out_dir: Path
    end: End | None        # None: kept at the start for gdb, not run yet
    exit_code: int | None
    console: str
    icount: int | None
    seconds: float
    recorded: RecordResult
    gdb_socket: Path | None = None
    pid: int | None = None
    _run: Any = field(default=None, repr=False, compare=False)

    @property
    def matches(self) -> bool:
        """Same end and a byte-identical console (nothing is normalized)."""
        return self.end is self.recorded.end and self.console == self.recorded.console

    def wait(self, timeout: float | None = None) -> None:
        """Block until the QEMU kept for gdb exits (``monitor quit`` in gdb, or ``close``)."""
        if self._run is not None:
            self._run.wait(timeout)

    def close(self) -> None:
        """End the QEMU kept for gdb, by its pid. Idempotent."""
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> "ReplayResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the script's initramfs -----------------------------------------------------------------

def script_initrd(base: Path, script: str, dst: Path) -> Path:
    """Write ``dst``: ``base`` (a gzip'd newc initramfs) followed by a second gzip'd cpio
    holding ``script`` as ``/etc/kph/script.sh``.

    Why concatenation works: the kernel unpacks every archive it finds in the initrd,
    one after the other, into the same rootfs (``init/initramfs.c``, ``unpack_to_rootfs``),
    so the image itself stays untouched and shared.
    """
    with tempfile.TemporaryDirectory(prefix="kph-script-") as tmp:
        root = Path(tmp) / "root"
        (root / SCRIPT_PATH).parent.mkdir(parents=True)
        os.chmod(root, 0o755)  # the archive's "." entry sets the mode of /
        for d in (root / "etc", root / "etc/kph"):
            os.chmod(d, 0o755)
        (root / SCRIPT_PATH).write_text(script if script.endswith("\n") else script + "\n")
        os.chmod(root / SCRIPT_PATH, 0o755)
        extra = Path(tmp) / "script.cpio.gz"
        pack_cpio(root, extra)
        with open(dst, "wb") as out:
            with open(base, "rb") as f:
                shutil.copyfileobj(f, out)
            out.write(extra.read_bytes())
    return dst


# -- one QEMU process ---------------------------------------------------------------------

def _monitor_args(qemu: QemuBinary, fd: int) -> list[str]:
    chardev = ["-chardev", f"socket,id=qmp0,fd={fd},server=on,wait=off"]
    # QEMU 11 deprecates -mon in favour of the monitor-qmp object it is sugar for.
    if qemu.version[:2] >= (11, 0):
        return chardev + ["-object", "monitor-qmp,id=kphqmp,chardev=qmp0"]
    return chardev + ["-mon", "chardev=qmp0,mode=control"]


class _Run:
    """One rr QEMU: run dir, sockets, QMP events, console, teardown by pid."""

    def __init__(self, qemu: QemuBinary, out_dir: Path, name: str, gdb: bool) -> None:
        self.qemu, self.out_dir, self.name = qemu, out_dir, name
        self.log = log.getChild(name)
        self.rundir = make_run_dir(name)
        self.socks = {"qmp": listen_unix(self.rundir / "qmp.sock")}
        if gdb:
            self.socks["gdb"] = listen_unix(self.rundir / "gdb.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._loop: LoopThread | None = None
        self._qmp: Any = None
        self._console_fd: int | None = None
        self.console = bytearray()
        self._quitting = False
        self._lock = threading.Lock()
        self.t0 = 0.0
        _live.add(self)

    def plumbing(self) -> list[str]:
        args = _monitor_args(self.qemu, self.socks["qmp"].fileno())
        if "gdb" in self.socks:
            args += ["-chardev", f"socket,id=gdb0,fd={self.socks['gdb'].fileno()},server=on,wait=off",
                     "-gdb", "chardev:gdb0"]
        return args

    def start(self, argv: list[str], console: Path, qemu_log: Path) -> None:
        console.write_bytes(b"")
        self._console_fd = os.open(console, os.O_RDONLY | os.O_NONBLOCK)
        self.log.debug("starting %s", shlex.join(argv))
        with open(qemu_log, "wb") as qlog:
            try:
                self.proc = subprocess.Popen(
                    argv, cwd=self.out_dir, stdin=subprocess.DEVNULL, stdout=qlog,
                    stderr=subprocess.STDOUT, pass_fds=[s.fileno() for s in self.socks.values()],
                    start_new_session=True, preexec_fn=pdeathsig,
                    env=dict(os.environ, **self.qemu.env))
            except OSError as exc:
                raise SetupError(f"cannot start QEMU {self.qemu.argv[0]}: {exc}",
                                 "run `kph doctor`") from exc
        self.t0 = time.monotonic()
        self.qemu_log = qemu_log
        self._loop = LoopThread(f"{self.name}-qmp")
        try:
            self._loop.call(self._connect(), C.QMP_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - turned into a precise error
            raise VMError(f"{self.name}: QEMU did not answer on QMP: {self.qemu_error() or exc}",
                          self.console_tail()) from exc

    async def _connect(self) -> None:
        self._qmp = await qmp_connect(self.name, str(self.rundir / "qmp.sock"), self._on_event)

    def _on_event(self, name: str, data: dict[str, Any]) -> None:
        self.log.debug("<-- event %s %s", name, data)
        self.events.put((name, data))

    def qmp(self, cmd: str, args: dict[str, Any] | None = None, *,
            timeout: float = C.QMP_TIMEOUT) -> Any:
        if self._loop is None or self._qmp is None:
            raise VMError(f"{self.name}: no QMP connection")
        self.log.debug("--> %s %s", cmd, args or "")
        try:
            return self._loop.call(self._qmp.execute(cmd, args), timeout)
        except Exception as exc:  # noqa: BLE001 - one error type for the caller
            raise VMError(f"{self.name}: QMP {cmd} failed: {exc}"
                          + (f" ({self.qemu_error()})" if self.exited() else ""),
                          self.console_tail()) from exc

    def read_console(self) -> bytes:
        new = drain_fd(self._console_fd) if self._console_fd is not None else b""
        self.console += new
        return new

    def console_tail(self, lines: int = C.CONSOLE_TAIL_LINES) -> str:
        self.read_console()
        text = self.console.decode("utf-8", "replace").rstrip("\n")
        return "\n".join(text.splitlines()[-lines:])

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def qemu_error(self) -> str:
        try:
            lines = self.qemu_log.read_text(errors="replace").strip().splitlines()
        except (OSError, AttributeError):
            return ""
        return lines[-1] if lines else ""

    def pause(self) -> int | None:
        """Stop the vCPU (if running) and return the instruction count there."""
        if self.exited():
            return None
        if self.qmp("query-status").get("running"):
            self.qmp("stop")
        return int(self.qmp("query-replay")["icount"])

    def wait(self, timeout: float | None = None) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> int | None:
        """QMP ``quit`` (QEMU then writes the log's header), then SIGTERM, then SIGKILL,
        by pid; remove the run directory. Returns QEMU's exit status. Idempotent."""
        with self._lock:
            proc = self.proc
            if proc is not None and proc.poll() is None:
                self._quitting = True
                try:
                    self.qmp("quit", timeout=2.0)
                except Exception:  # noqa: BLE001 - signals follow
                    pass
                stop_process(proc, ((None, C.QUIT_TIMEOUT), (signal.SIGTERM, 3.0),
                                    (signal.SIGKILL, 5.0)), self.log)
            if self._loop is not None:
                if self._qmp is not None:
                    try:
                        self._loop.call(self._qmp.disconnect(), 1.0)
                    except Exception:  # noqa: BLE001
                        pass
                self._loop.close()
                self._loop = None
            for s in self.socks.values():
                s.close()
            self.read_console()
            if self._console_fd is not None:
                os.close(self._console_fd)
                self._console_fd = None
            shutil.rmtree(self.rundir, ignore_errors=True)
            _live.discard(self)
            return proc.returncode if proc is not None else None


@atexit.register
def _close_all() -> None:
    for r in list(_live):
        try:
            r.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


@dataclass
class _Seen:
    """What the end detector has seen so far."""

    exit_code: int | None = None
    panic_line: str | None = None
    panicked: bool = False        # GUEST_PANICKED
    shutdown: bool = False        # SHUTDOWN caused by the guest (poweroff, or reset: -no-reboot)
    stopped: bool = False         # STOP for any reason
    first: float | None = None    # when the marker or a panic line was first seen

    def end(self) -> End | None:
        if self.panicked or self.panic_line is not None:
            return End.PANIC
        if self.exit_code is not None:
            return End.EXIT
        if self.shutdown:
            return End.SHUTDOWN
        return None


def _watch(run: _Run, seen: _Seen, deadline: float, *, until_stop: bool) -> bool:
    """Follow QMP events and the console until the run ends; False at the deadline.

    ``until_stop`` (a replay that knows where its recording stopped): the end is the
    first STOP, the break at the recorded instruction count or a guest poweroff; only
    that point is exact. Otherwise (recording): QEMU paused for the guest (panic or
    poweroff; both actions are ``pause``), or the end marker or a panic line has been on
    the console for ``_GRACE`` seconds without an event (a script that keeps the guest
    running, a panic without pvpanic). Either way a QEMU that exited ends the watch.
    """
    while True:
        try:
            name, data = run.events.get(timeout=_POLL)
        except queue.Empty:
            name, data = "", {}
        if name == "GUEST_PANICKED":
            seen.panicked = True
        elif name == "SHUTDOWN" and data.get("guest"):
            seen.shutdown = True
        elif name == "STOP":
            seen.stopped = True
        run.read_console()
        if seen.exit_code is None:
            m = _MARK_RE.search(run.console)
            if m:
                seen.exit_code = int(m[1])
        if seen.panic_line is None and _PANIC in run.console:
            at = run.console.index(_PANIC)
            seen.panic_line = run.console[at:].split(b"\n", 1)[0].decode("utf-8", "replace").strip()
        if (seen.exit_code is not None or seen.panic_line) and seen.first is None:
            seen.first = time.monotonic()
        if run.exited() or (seen.stopped if until_stop else seen.panicked or seen.shutdown):
            return True
        if not until_stop and seen.first is not None and time.monotonic() - seen.first > _GRACE:
            return True
        if time.monotonic() > deadline:
            return False


# -- record ---------------------------------------------------------------------------------

def _resolve(image: Any, kernel: Any, initrd: Any) -> tuple[Path, Path, str | None]:
    if kernel is None:
        img = image if isinstance(image, Image) else default_image(image)
        kpath, ipath, version = img.kernel, (Path(initrd) if initrd else img.initrd), img.version
    else:
        kpath, version = Path(kernel), None
        if kpath.is_dir():
            kpath = kpath / "arch/x86/boot/bzImage"
        if initrd is None:
            raise SetupError("a scripted run needs an initramfs whose init runs /etc/kph/script.sh",
                             "pass --initrd (the default image's initrd.img does this)")
        ipath = Path(initrd)
    for what, p in (("kernel", kpath), ("initrd", ipath)):
        if not p.is_file():
            raise SetupError(f"{what} not found: {p}", f"pass an existing file with --{what}")
    check_kernel_format(kpath)
    return kpath, ipath, version


def _guest_args(append: str, mode: str, snapshot: bool, qcow2: str, console: str) -> list[str]:
    """The machine of a recording. Only ``mode``, the snapshot drive's file, the console
    file and the panic action differ between record and replay, and none of them is
    visible to the guest.

    Why a replay does not pause at a panic (``panic=none``): it stops at the recorded
    instruction count instead, exactly there, and in a gdb session executing the panic
    again (a ``stepi`` onto the end) would otherwise move QEMU into the guest-panicked
    run state, from which a later ``reverse-continue`` hung (seen under CPU load)."""
    icount = f"shift=auto,sleep=off,rr={mode},rrfile={LOG}" + (",rrsnapshot=init" if snapshot else "")
    panic = "pause" if mode == "record" else "none"
    args = ["-nodefaults", "-no-user-config", "-display", "none", "-machine", "pc",
            "-m", C.DEFAULT_MEMORY, "-smp", "1", "-accel", "tcg", "-no-reboot",
            "-action", f"panic={panic},shutdown=pause", "-device", "pvpanic-pci",
            "-kernel", KERNEL, "-initrd", INITRD, "-append", append,
            "-icount", icount, "-serial", f"file:{console}"]
    if snapshot:
        args += ["-drive", f"if=none,id=kphsnap,format=qcow2,file={qcow2}"]
    return args


def _make_qcow2(path: Path) -> None:
    exe = shutil.which("qemu-img")
    if not exe:
        raise SetupError("qemu-img is needed for the snapshot that reverse debugging starts from",
                         "apt-get install qemu-utils (./setup.sh does), or pass snapshot=False")
    proc = subprocess.run([exe, "create", "-q", "-f", "qcow2", str(path), "64M"],
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise SetupError(f"qemu-img create failed: {proc.stderr.strip()[-200:]}")


def record(script: str, out_dir: str | os.PathLike[str], *, image: Any = None,
           kernel: str | os.PathLike[str] | None = None,
           initrd: str | os.PathLike[str] | None = None, append_extra: str = "",
           qemu: QemuBinary | str | None = None, timeout: float = C.RR_TIMEOUT,
           snapshot: bool = True, at_end: Callable[[Any], None] | None = None) -> RecordResult:
    """Boot under ``rr=record``, run ``script`` in the guest and keep the recording in ``out_dir``.

    The run ends at the script's end marker (the guest then powers off), a guest panic,
    a poweroff or reset, or ``timeout`` seconds (the recording then ends where the guest
    was stopped, and so does its replay). ``script`` runs as root with ``/bin/sh`` after
    init's mounts and module loading; its stdout and stderr are on the console. It
    keeps the guest running after its end by creating ``/run/kph-keep-running``.

    :param out_dir: created if missing; must not already hold a recording.
    :param image: an ``Image``, a kernel version in the cache or an image directory.
    :param kernel: a bzImage (or build directory) instead of the image's; needs ``initrd``.
    :param append_extra: added to the default kernel command line.
    :param snapshot: keep a snapshot at instruction 0 in a qcow2 (reverse debugging).
    :param at_end: called with the paused run at the recorded end, before anything else
        runs (``hmp(run, ...)`` reads registers and memory there without changing them).
    :raise SetupError: a missing input, qemu-img, or ``out_dir`` already used.
    :raise VMError: QEMU refused to start, died, or left an unfinished log.
    """
    out = Path(out_dir)
    if (out / LOG).exists():
        raise SetupError(f"{out} already holds a recording", "pick a new directory")
    kpath, ipath, version = _resolve(image, kernel, initrd)
    q = qemu if isinstance(qemu, QemuBinary) else find_qemu(qemu)
    out.mkdir(parents=True, exist_ok=True)
    (out / SCRIPT).write_text(script)
    script_initrd(ipath, script, out / INITRD)
    shutil.copyfile(kpath, out / KERNEL)
    if snapshot:
        _make_qcow2(out / QCOW2)
    append = " ".join(filter(None, [C.DEFAULT_APPEND, append_extra.strip()]))
    guest = _guest_args(append, "record", snapshot, QCOW2, CONSOLE)
    run = _Run(q, out, f"kph-rr-{os.getpid()}", gdb=False)
    try:
        argv = q.command(guest + run.plumbing() + ["-S"])
        (out / ARGV).write_text(json.dumps({"argv": argv, "cwd": str(out.resolve()),
                                            "guest": guest}, indent=2) + "\n")
        run.start(argv, out / CONSOLE, out / QEMU_LOG)
        run.qmp("cont")
        seen = _Seen()
        finished = _watch(run, seen, run.t0 + timeout, until_stop=False)
        seconds = time.monotonic() - run.t0
        if run.exited():
            raise VMError(f"QEMU exited while recording (status {run.proc.returncode}"  # type: ignore[union-attr]
                          f"): {run.qemu_error() or 'no message'}", run.console_tail())
        icount = run.pause()
        run.read_console()
        console = bytes(run.console)  # the console at the end; the tail below is not part of it
        end = seen.end() if finished else End.TIMEOUT
        if at_end is not None:
            at_end(run)
        _run_on(run)
        status = run.close()
    finally:
        run.close()
    if status != 0 or not _log_complete(out / LOG):
        raise VMError(f"the recording in {out / LOG} is incomplete (QEMU status {status}): "
                      f"{run.qemu_error() or 'QEMU did not exit cleanly'}", run.console_tail())
    if end is None:  # finished without a reason of its own: only a replay break does that
        end = End.TIMEOUT
    res = RecordResult(out, end, seen.exit_code if end is End.EXIT else None,
                       decode_console(console), icount, round(seconds, 3), seen.panic_line)
    meta = {"format": FORMAT, "end": end.value, "exit_code": res.exit_code, "icount": icount,
            "console_bytes": len(console),
            "seconds": res.seconds, "panic_line": res.panic_line, "append": append,
            "snapshot": snapshot, "image": version, "kernel_source": str(kpath),
            "initrd_source": str(ipath), "qemu": {"version": q.version_str, "source": q.source},
            "files": {n: sha256_file(out / n) for n in (LOG, INITRD, KERNEL, CONSOLE)}}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("recorded %s: %s after %.1f s, %s instructions", out, end.value, seconds, icount)
    return res


def hmp(run: Any, command: str) -> str:
    """A human-monitor command on a run (``ReplayResult._run`` or ``at_end``'s argument).
    ``info registers`` and ``x`` read the stopped guest without changing it, so they are
    safe at a recorded end: the replay still reaches the same state."""
    return str(run.qmp("human-monitor-command", {"command-line": command}))


def decode_console(console: bytes | bytearray) -> str:
    """Console bytes as text, with the UART's CRLF line ends made plain newlines (the
    files keep the raw bytes)."""
    return bytes(console).decode("utf-8", "replace").replace("\r\n", "\n")


def _run_on(run: _Run, seconds: float = 0.5) -> None:
    """Let a guest that can still run go on briefly before the recorder quits.

    Why: the recorder's ``quit`` is the log's last event, and a replay that executes the
    recorded end's instruction consumes it and shuts down: in a gdb session, one
    ``stepi`` back onto the end (after a ``reverse-stepi``) left later reverse commands
    hanging. With a tail of execution after the end, the log's last event lies beyond
    it. A panicked guest goes on into its reboot (``panic=-1``; ``-no-reboot`` pauses
    QEMU there); a guest that powered off cannot run and is left as it is. The
    console's tail is kept in console.log but is not part of the recorded console.
    """
    if run.exited() or run.qmp("query-status")["status"] not in ("paused", "guest-panicked"):
        return
    run.qmp("cont")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            name, data = run.events.get(timeout=_POLL)
        except queue.Empty:
            continue
        if name in ("SHUTDOWN", "GUEST_PANICKED", "STOP"):
            break
    run.pause()


def _log_complete(path: Path) -> bool:
    """QEMU writes the log's version word last, at a clean exit; a zero word means the
    recorder was killed and no replay will accept the file."""
    try:
        with open(path, "rb") as f:
            return f.read(4) not in (b"", b"\0\0\0\0")
    except OSError:
        return False


# -- replay ---------------------------------------------------------------------------------

def load_recording(out_dir: str | os.PathLike[str]) -> RecordResult:
    """The ``RecordResult`` of an existing recording.

    :raise SetupError: not a recording, or a file changed since it was made.
    """
    out = Path(out_dir)
    try:
        meta = json.loads((out / META).read_text())
    except (OSError, ValueError) as exc:
        raise SetupError(f"no recording in {out} ({META} unreadable: {exc})",
                         "pass a directory made by `kph repro --record`") from exc
    for name, digest in meta["files"].items():
        if not (out / name).is_file() or sha256_file(out / name) != digest:
            raise SetupError(f"{out / name} is missing or changed since it was recorded",
                             "restore the recording's files unchanged")
    return RecordResult(out, End(meta["end"]), meta["exit_code"],
                        decode_console((out / CONSOLE).read_bytes()[:meta.get("console_bytes")]), meta["icount"],
                        meta["seconds"], meta.get("panic_line"))


def replay(out_dir: str | os.PathLike[str], *, qemu: QemuBinary | str | None = None,
           timeout: float = C.RR_TIMEOUT, gdb: bool = False, gdb_at: str = "end") -> ReplayResult:
    """Replay the recording in ``out_dir`` under ``rr=replay`` up to where it ended.

    Without ``gdb`` QEMU is ended before returning. With ``gdb`` it is kept, stopped at
    the recorded end (``gdb_at="end"``) or before the first instruction (``"start"``),
    with its gdbstub on ``ReplayResult.gdb_socket``; ``reverse-stepi`` and
    ``reverse-continue`` replay from the snapshot at instruction 0 to the target (one
    reverse step costs about one replay). Close the result to end QEMU.

    :raise SetupError: not a recording, a changed file, or a different QEMU version
        (the log format and the machine are QEMU's own).
    :raise VMError: QEMU refused to start or died.
    """
    if gdb_at not in ("end", "start"):
        raise SetupError(f"gdb_at={gdb_at!r}", "use 'end' or 'start'")
    rec = load_recording(out_dir)
    out = rec.out_dir
    meta = json.loads((out / META).read_text())
    q = qemu if isinstance(qemu, QemuBinary) else find_qemu(qemu)
    if q.version_str != meta["qemu"]["version"]:
        raise SetupError(f"{out} was recorded with QEMU {meta['qemu']['version']}, this is "
                         f"QEMU {q.version_str}", "replay with the recording's QEMU (--qemu PATH)")
    run = _Run(q, out, f"kph-replay-{os.getpid()}", gdb=gdb)
    keep = False
    try:
        qcow2 = ""
        if meta["snapshot"]:
            qcow2 = str(run.rundir / QCOW2)
            shutil.copyfile(out / QCOW2, qcow2)  # QEMU rewrites it when it loads a snapshot
        guest = _guest_args(meta["append"], "replay", meta["snapshot"], qcow2, "replay-console.log")
        argv = q.command(guest + run.plumbing() + ["-S"])
        (out / "replay-argv.json").write_text(json.dumps({"argv": argv, "guest": guest}, indent=2) + "\n")
        run.start(argv, out / "replay-console.log", out / "replay-qemu.log")
        if gdb and gdb_at == "start":
            keep = True
            return ReplayResult(out, None, None, "", 0, 0.0, rec,
                                run.rundir / "gdb.sock", run.proc.pid, run)  # type: ignore[union-attr]
        if rec.icount is not None:
            # Stop exactly where the recording stopped, before the log's last event (the
            # recorder's quit) is consumed: past the end QEMU leaves replay mode, and
            # reverse debugging with it.
            run.qmp("replay-break", {"icount": rec.icount})
        run.qmp("cont")
        seen = _Seen()
        finished = _watch(run, seen, run.t0 + timeout, until_stop=rec.icount is not None)
        seconds = time.monotonic() - run.t0
        if run.exited() and not (seen.shutdown or seen.panicked):
            raise VMError(f"QEMU exited while replaying (status {run.proc.returncode}): "  # type: ignore[union-attr]
                          f"{run.qemu_error() or 'no message'}", run.console_tail())
        icount = run.pause() if not run.exited() else None
        end = (seen.end() or End.TIMEOUT) if finished else End.STALLED
        res = ReplayResult(out, end, seen.exit_code if end is End.EXIT else None,
                           decode_console(run.console), icount, round(seconds, 3), rec,
                           run.rundir / "gdb.sock" if gdb else None,
                           run.proc.pid if gdb else None, run if gdb else None)  # type: ignore[union-attr]
        keep = gdb
        log.info("replayed %s: %s after %.1f s, %s instructions (recorded %s)",
                 out, end.value, seconds, icount, rec.icount)
        return res
    finally:
        if not keep:
            run.close()
