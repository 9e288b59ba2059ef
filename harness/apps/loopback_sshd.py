"""A private sshd on 127.0.0.1, for trying remote workers (``kph worker``, pytest-xdist's
SSH gateways) on one machine: the tests of issue 18 and ``bench/xdist.py``.

Nothing is installed and no system service is touched: Debian's ``openssh-server`` (and
the ``libwrap0`` it links) are downloaded with ``apt-get download`` into
``$KPH_CACHE/sshd/`` and unpacked there; sshd runs with a throwaway host key, one
authorized key, ``ListenAddress 127.0.0.1`` and a random port; the client's ssh_config pins
that host key (its own known_hosts file, ``StrictHostKeyChecking yes``), so whatever else
answers on the port is refused. As root, sshd insists on
its privilege-separation user and ``/run/sshd``; neither exists on a host without
openssh-server, so it runs in a private mount namespace (``unshare --mount``) in which
``/etc/passwd`` has an ``sshd`` line and ``/run`` is a fresh tmpfs: nothing changes
outside. Sessions inherit that namespace (their ``/run`` is the tmpfs). It is stopped by
its pid.

It runs as root, so nothing it reads or writes may be planted: its directory is a fresh
``mkdtemp`` (0700) that must still be empty at the start, every file is created with
``O_EXCL|O_NOFOLLOW``, and the start script gets its paths as arguments, not as text.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from ..constants import cache_dir
from ..errors import SetupError
from ..procs import lock_file

PACKAGES = ("openssh-server", "libwrap0")
HOST_ALIAS = "kph-loopback"
START_TIMEOUT = 10.0
#: seconds to wait for another process downloading sshd into the cache
DOWNLOAD_TIMEOUT = 600.0


def _tree() -> Path:
    """sshd unpacked in the cache (downloaded once). Under a lock: two processes with an
    empty cache (both xdist workers of a test run) each downloaded into one directory and
    removed it when done, under the other's ``dpkg-deb -x``."""
    root = cache_dir() / "sshd"
    tree = root / "tree"
    if (tree / "usr/sbin/sshd").exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    fd = lock_file(root / ".lock", DOWNLOAD_TIMEOUT,
                   f"another kph is downloading sshd into {root}: wait, or remove the directory")
    try:
        if (tree / "usr/sbin/sshd").exists():
            return tree
        with tempfile.TemporaryDirectory(prefix=".debs-", dir=root) as work:
            out = subprocess.run(["apt-get", "download", "-q", *PACKAGES], cwd=work,
                                 capture_output=True, text=True, timeout=300, check=False)
            if out.returncode != 0:
                raise SetupError(f"apt-get download {' '.join(PACKAGES)} failed: "
                                 f"{out.stderr.strip()[-200:]}", "check apt's access to the mirror")
            unpacked = Path(work) / "tree"
            for deb in sorted(Path(work).glob("*.deb")):
                r = subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)],
                                   capture_output=True, text=True, timeout=120, check=False)
                if r.returncode != 0:
                    raise SetupError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()[-200:]}",
                                     f"remove {root} and try again")
            shutil.rmtree(tree, ignore_errors=True)         # a partial one of an older kph
            unpacked.rename(tree)
        return tree
    finally:
        os.close(fd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _safe_parent(parent: Path) -> Path:
    """``parent`` if only its owner (us or root) can add or swap entries in it, or it is
    sticky like ``/tmp`` (others cannot rename what is ours there): the private directory
    made in it cannot be replaced under sshd.

    :raise SetupError: a symbolic link, not a directory, or writable by others."""
    try:
        st = os.lstat(parent)
    except OSError as exc:
        raise SetupError(f"the loopback sshd's parent directory {parent}: {exc.strerror}",
                         "pass an existing directory (default: the system's temporary one)") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"the loopback sshd's parent directory {parent} is "
                         f"{'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'}",
                         "pass a real directory (default: the system's temporary one)")
    if not st.st_mode & stat.S_ISVTX and (st.st_uid not in (0, os.geteuid())
                                         or st.st_mode & 0o022):
        raise SetupError(f"the loopback sshd's parent directory {parent} can be written by "
                         "others (not sticky)", "pass a directory only root writes to "
                         "(default: the system's temporary one)")
    if not re.fullmatch(r"[\w./+-]+", str(parent)):
        raise SetupError(f"the loopback sshd's parent directory {str(parent)!r} has characters "
                         "sshd_config and ssh_config would read as syntax",
                         "pass a path of letters, digits and ._/+-")
    return parent


def _create(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` anew: ``O_EXCL|O_NOFOLLOW``, so neither a planted file nor a
    symbolic link in its place is ever written through (the run ends instead)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise SetupError(f"{path} exists before the loopback sshd wrote it (planted?)",
                         "make a new LoopbackSshd (one per sshd)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class LoopbackSshd:
    """``with LoopbackSshd() as sshd:`` then ``ssh -F sshd.ssh_config kph-loopback``.

    Its files (keys, configs, log) are in ``self.dir``, a directory made for it by
    ``tempfile.mkdtemp`` in ``parent`` (default the system's temporary directory): mode
    0700, a random name, never one that existed before, so no key, ``authorized_keys`` or
    link planted there in advance can be picked up by a root sshd. That is also why
    ``StrictModes no`` is safe: sshd would refuse ``/tmp`` (others may write to it) on the
    way to ``authorized_keys``, and the only writer of the directory is this process.
    The login is root's (the directory is root's, 0700). Leaving the ``with`` block stops
    sshd and removes the directory; ``stop()`` alone keeps it (its log).
    """

    def __init__(self, parent: Path | None = None, user: str = "root") -> None:
        base = _safe_parent(Path(parent) if parent is not None else Path(tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix="kph-sshd-", dir=base))
        self.user = user
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.ssh_config = self.dir / "ssh_config"

    def __enter__(self) -> "LoopbackSshd":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self) -> None:
        """Keys, configs and sshd in ``self.dir``; refused, before sshd runs, when the
        directory is not the private one ``__init__`` made or holds a file it did not
        write (a planted key, a link)."""
        d = self.dir
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise SetupError(f"{d} is no longer the private directory the loopback sshd made",
                             "make a new LoopbackSshd (one per sshd)")
        planted = sorted(p.name for p in d.iterdir())
        if planted:
            raise SetupError(f"{d / planted[0]} exists before the loopback sshd made it",
                             "make a new LoopbackSshd (one per sshd)")
        for key in ("hostkey", "userkey"):
            # made here, never reused: ssh-keygen asks before overwriting, and -q + no
            # stdin answers no, so a key planted meanwhile fails the start
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                           check=True, timeout=60, stdin=subprocess.DEVNULL)
        _create(d / "authorized_keys", (d / "userkey.pub").read_bytes())
        _create(d / "passwd", (Path("/etc/passwd").read_text().rstrip("\n") +
                               "\nsshd:x:65533:65534:sshd privsep:/run/sshd:/usr/sbin/nologin\n"
                               ).encode(), 0o644)
        if os.geteuid() != 0:
            raise SetupError("the loopback sshd runs as root (it needs a mount namespace)",
                             "run the remote-worker tests as root, as CI does")
        tree = _tree()
        libs = ":".join(str(tree / p) for p in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"))
        # paths are arguments ($1, "$@"), never text of the script: a directory or cache
        # path with spaces or shell syntax is a path, not a command
        script = ('set -e; mount -t tmpfs tmpfs /run; mkdir -m 0755 /run/sshd; '
                  'mount --bind "$1" /etc/passwd; export LD_LIBRARY_PATH="$2"; shift 2; exec "$@"')
        for attempt in range(5):
            self.port = _free_port()
            (d / "sshd_config").unlink(missing_ok=True)
            _create(d / "sshd_config", (
                f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\n"
                f"AuthorizedKeysFile {d}/authorized_keys\nPidFile none\nUsePAM no\n"
                "StrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitUserEnvironment no\nMaxStartups 64\n"
                "MaxSessions 64\n").encode())
            log = os.open(d / "sshd.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                          0o600)
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                 str(d / "passwd"), libs, str(tree / "usr/sbin/sshd"),
                 "-D", "-e", "-f", str(d / "sshd_config")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            os.close(log)
            if self._wait_listening():
                break
            self.stop()
        else:
            raise SetupError(f"the loopback sshd did not start: {(d / 'sshd.log').read_text()[-300:]}")
        # The host key is known before the first connection: pin it under the alias (the
        # port changes from run to run), and never learn another.
        key_type, key = (d / "hostkey.pub").read_text().split()[:2]
        _create(d / "known_hosts", f"{HOST_ALIAS} {key_type} {key}\n".encode())
        _create(self.ssh_config, (
            f"Host {HOST_ALIAS}\n  HostName 127.0.0.1\n  Port {self.port}\n  User {self.user}\n"
            f"  IdentityFile {d}/userkey\n  IdentitiesOnly yes\n  HostKeyAlias {HOST_ALIAS}\n"
            f"  StrictHostKeyChecking yes\n  UserKnownHostsFile {d}/known_hosts\n"
            "  GlobalKnownHostsFile /dev/null\n  CheckHostIP no\n  UpdateHostKeys no\n"
            "  LogLevel ERROR\n  BatchMode yes\n").encode())

    def _wait_listening(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if "Server listening" in (self.dir / "sshd.log").read_text(errors="replace"):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """End sshd (its whole process group: the unshare and sshd) by pid."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)
