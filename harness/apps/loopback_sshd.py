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
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ..constants import cache_dir
from ..errors import SetupError

PACKAGES = ("openssh-server", "libwrap0")
HOST_ALIAS = "kph-loopback"
START_TIMEOUT = 10.0


def _tree() -> Path:
    """sshd unpacked in the cache (downloaded once)."""
    root = cache_dir() / "sshd"
    sshd = root / "tree/usr/sbin/sshd"
    if sshd.exists():
        return root / "tree"
    work = root / "debs"
    work.mkdir(parents=True, exist_ok=True)
    for cmd in (["apt-get", "download", "-q", *PACKAGES],):
        out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300, check=False)
        if out.returncode != 0:
            raise SetupError(f"apt-get download {' '.join(PACKAGES)} failed: "
                             f"{out.stderr.strip()[-200:]}", "check apt's access to the mirror")
    for deb in work.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "tree")], check=True, timeout=120)
    shutil.rmtree(work)
    return root / "tree"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackSshd:
    """``with LoopbackSshd(dir) as sshd:`` then ``ssh -F sshd.ssh_config kph-loopback``."""

    def __init__(self, workdir: Path, user: str = "root") -> None:
        self.dir = Path(workdir)
        self.user = user
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.ssh_config = self.dir / "ssh_config"

    def __enter__(self) -> "LoopbackSshd":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SetupError("the loopback sshd runs as root (it needs a mount namespace)",
                             "run the remote-worker tests as root, as CI does")
        tree = _tree()
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        for key in ("hostkey", "userkey"):
            if not (d / key).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                               check=True, timeout=60)
        shutil.copy(d / "userkey.pub", d / "authorized_keys")
        os.chmod(d / "authorized_keys", 0o600)
        (d / "passwd").write_text(Path("/etc/passwd").read_text().rstrip("\n") +
                                  "\nsshd:x:65533:65534:sshd privsep:/run/sshd:/usr/sbin/nologin\n")
        libs = ":".join(str(tree / p) for p in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"))
        for attempt in range(5):
            self.port = _free_port()
            (d / "sshd_config").write_text(
                f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\n"
                f"AuthorizedKeysFile {d}/authorized_keys\nPidFile none\nUsePAM no\n"
                "StrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitUserEnvironment no\nMaxStartups 64\n"
                "MaxSessions 64\n")
            script = (f"set -e; mount -t tmpfs tmpfs /run; mkdir -m 0755 /run/sshd; "
                      f"mount --bind {d}/passwd /etc/passwd; "
                      f"exec env LD_LIBRARY_PATH={libs} {tree}/usr/sbin/sshd -D -e "
                      f"-f {d}/sshd_config")
            log = open(d / "sshd.log", "ab")
            self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private",
                                          "sh", "-c", script], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
            log.close()
            if self._wait_listening():
                break
            self.stop()
        else:
            raise SetupError(f"the loopback sshd did not start: {(d / 'sshd.log').read_text()[-300:]}")
        # The host key is known before the first connection: pin it under the alias (the
        # port changes from run to run), and never learn another.
        key_type, key = (d / "hostkey.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(f"{HOST_ALIAS} {key_type} {key}\n")
        self.ssh_config.write_text(
            f"Host {HOST_ALIAS}\n  HostName 127.0.0.1\n  Port {self.port}\n  User {self.user}\n"
            f"  IdentityFile {d}/userkey\n  IdentitiesOnly yes\n  HostKeyAlias {HOST_ALIAS}\n"
            f"  StrictHostKeyChecking yes\n  UserKnownHostsFile {d}/known_hosts\n"
            "  GlobalKnownHostsFile /dev/null\n  CheckHostIP no\n  UpdateHostKeys no\n"
            "  LogLevel ERROR\n  BatchMode yes\n")

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
