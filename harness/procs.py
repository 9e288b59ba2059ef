"""Child processes and run directories: what makes sure nothing the harness starts outlives it.

A leaf module (imports nothing of the package) so that ``vmctl``, ``gdbstub`` and
``replay`` share it without importing each other.

- ``pdeathsig``: run in a child between fork and exec (``preexec_fn``), so the kernel
  kills QEMU or gdb when the harness dies, even by SIGKILL.
- ``make_run_dir``: a private 0700 directory for one machine's sockets and logs, with an
  ``owner`` file naming the process (pid and its start time, so a reused pid is not
  taken for the owner).
- ``reap_stale_run_dirs``: removes the run directories whose owner is gone (a harness
  that was SIGKILLed cannot remove its own); called by every ``Machine.start``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import SetupError

log = logging.getLogger(__name__)

#: Every run directory's name starts with this (``<prefix><machine name>.<random>``).
RUN_DIR_PREFIX = "kph"
OWNER_FILE = "owner"
PR_SET_PDEATHSIG = 1


def pdeathsig() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``; for ``subprocess.Popen(preexec_fn=...)``.

    The signal comes when the *thread* that forked the child ends; every Popen of the
    harness runs on a thread that lives as long as the process it serves.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


#: sun_path is 108 bytes; a run directory's sockets must fit with their names.
SOCKET_PATH_MAX = 107
_SOCKET_ROOM = len("/.XXXXXXXX/qmp.sock") + 8


def run_dir_base(name_len: int = 32) -> str:
    """Where run directories go: ``$XDG_RUNTIME_DIR``, else the system temp directory,
    whichever leaves room for a UNIX socket path (108 bytes) inside it."""
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if base and len(base) + name_len + _SOCKET_ROOM <= SOCKET_PATH_MAX:
            return base
    return "/tmp"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat),
    or None when there is no such process (or it has ended and is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # a zombie has ended; only its parent has not looked yet
        return None
    return fields[19]


def make_run_dir(name: str) -> Path:
    """A new 0700 directory ``<base>/<name>.XXXXXX`` owned by this process."""
    d = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=run_dir_base(len(name))))
    os.chmod(d, 0o700)
    (d / OWNER_FILE).write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    return d


def _owner_alive(d: Path) -> bool:
    try:
        pid_s, started = (d / OWNER_FILE).read_text().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return True  # not ours to judge (no owner file yet, or someone else's format)
    return start_time(pid) == started


def reap_stale_run_dirs() -> list[Path]:
    """Remove run directories whose owning process is gone; return what was removed."""
    removed: list[Path] = []
    entries: list[Path] = []
    for base in {os.environ.get("XDG_RUNTIME_DIR") or "/tmp", tempfile.gettempdir()}:
        try:
            entries += Path(base).glob(f"{RUN_DIR_PREFIX}*")
        except OSError:
            continue
    uid = os.getuid()
    for d in entries:
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if (d / OWNER_FILE).exists() and not _owner_alive(d):
            shutil.rmtree(d, ignore_errors=True)
            log.info("removed %s, left by a process that is gone", d)
            removed.append(d)
    return removed


def listen_unix(path: Path) -> socket.socket:
    """A listening UNIX stream socket at ``path`` (handed to QEMU by descriptor).

    :raise OSError: the path cannot be bound (``run_dir_base`` keeps it short enough).
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        s.listen(1)
    except OSError:
        s.close()
        raise
    return s


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` if it still exists."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_process(proc: "subprocess.Popen[Any]", waits: Sequence[tuple[int | None, float]],
                 log: logging.Logger | None = None) -> None:
    """End ``proc`` by its pid, escalating: for each ``(signal, seconds)`` send the signal
    (None: send nothing, the process was asked to quit already) and wait that long; stop
    at the first wait that sees it gone. Never raises for a process already gone."""
    for sig, wait in waits:
        if sig is not None:
            if log is not None:
                log.debug("process %d still running; sending %s", proc.pid,
                          signal.Signals(sig).name)
            kill_pid(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def drain_fd(fd: int) -> bytes:
    """Everything a non-blocking ``fd`` holds now (b"" at EOF or when nothing waits)."""
    new = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        new += chunk
    return new


def lock_file(path: Path, timeout: float, hint: str) -> int:
    """An exclusive ``flock`` on ``path`` (created), waited for at most ``timeout`` seconds;
    the fd, to ``os.close`` when done (which releases it, as the end of the process does).

    :raise SetupError: another process held it longer; ``hint`` says what to do.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
        if time.monotonic() > deadline:
            os.close(fd)
            raise SetupError(f"another process holds {path} for more than {timeout:.0f} s", hint)
        time.sleep(0.1)

