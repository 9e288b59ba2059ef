"""Debian's archive through a private apt configuration: package lists, downloads and
unpacked trees from suites the host does not run (Debian 13 and its backports, on a
Debian 12 host), without touching the system's apt, dpkg or root filesystem.

Used for the private QEMU (``harness.machine.qemu``), for the kernels of the kernel matrix and
for the toolchain that builds their modules (``harness.machine.image.kernels``, ``harness.machine.image.toolchain``).

The mirror is the one the host's own ``/etc/apt`` uses (no address is written here).
``$KPH_DOWNLOADS``, when set, keeps the downloaded .deb files for other caches. apt does
not look again at a .deb it finds there (``fetch_only`` does not even ask it), so every
.deb is checked against the SHA256 of apt's package index before it is used: once when
it is fetched (an early, clear error), and again by ``unpack`` on a private copy, the very
bytes ``dpkg-deb -x`` then reads. A shared directory can have its file swapped after the
first check; the private copy cannot be.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable
from urllib.parse import unquote

from ...constants import DOWNLOADS_ENV, cache_dir
from ...errors import SetupError

#: Debian 13 and its backports: where the private QEMU and the newer kernels come from.
TRIXIE = ("trixie", "trixie-backports")
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
#: Package lists younger than this are not fetched again.
LISTS_MAX_AGE = 3600.0

Progress = Callable[[str], None]


def host_mirror_uri() -> str:
    """The Debian mirror URI from the host's own apt configuration."""
    src = Path("/etc/apt/sources.list.d")
    for f in sorted(src.glob("*.sources")) if src.is_dir() else []:
        for block in f.read_text().split("\n\n"):
            if re.search(r"^Suites:.*\b(bookworm|trixie)\b(?!-security)", block, re.M):
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m and "security" not in m[1]:
                    return m[1]
    lst = Path("/etc/apt/sources.list")
    if lst.exists():
        for line in lst.read_text().splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(bookworm|trixie)\s", line)
            if m:
                return m[1]
    raise SetupError("no Debian mirror found in /etc/apt/sources.list{,.d}",
                     "configure apt for Debian, or pass --qemu PATH to a QEMU >= 10.2")


def run(cmd: list[str], what: str, *, cwd: Path | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run an apt/dpkg command; a failure is a one-line SetupError naming it."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                             cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{what} failed: {exc}",
                         "check apt's configuration and access to the Debian mirror") from exc
    if out.returncode != 0:
        raise SetupError(f"{what} failed: {(out.stderr or out.stdout).strip()[-300:]}",
                         "check apt's configuration and access to the Debian mirror")
    return out


class PrivateApt:
    """apt for ``suites`` with its own sources, lists, cache and an empty dpkg status,
    rooted at ``root`` (default ``$KPH_CACHE/apt/<suites>``)."""

    def __init__(self, suites: tuple[str, ...] = TRIXIE, root: Path | None = None) -> None:
        if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
            raise SetupError("apt-get and dpkg-deb are needed for Debian 13 packages",
                             "run on Debian (./setup.sh), or pass --qemu PATH / --kernel FILE")
        self.suites = suites
        self.root = root or cache_dir() / "apt" / "+".join(suites)
        downloads = os.environ.get(DOWNLOADS_ENV)
        self.archives = Path(downloads) / "debs" if downloads else self.root / "cache/archives"
        for d in ("etc/apt.conf.d", "etc/preferences.d", "state/lists/partial",
                  "cache/archives/partial"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.archives / "partial").mkdir(parents=True, exist_ok=True)
        status = self.root / "state/status"
        if not status.exists():
            status.touch()
        sources = "".join(f"deb [signed-by={KEYRING}] {host_mirror_uri()} {s} main\n"
                          for s in suites)
        lst = self.root / "etc/sources.list"
        if not lst.exists() or lst.read_text() != sources:
            lst.write_text(sources)
            (self.root / "state/updated").unlink(missing_ok=True)

    @property
    def opts(self) -> list[str]:
        r = self.root
        return [f"-oDir::Etc={r}/etc", f"-oDir::Etc::SourceList={r}/etc/sources.list",
                "-oDir::Etc::SourceParts=/nonexistent", f"-oDir::State={r}/state",
                f"-oDir::State::status={r}/state/status", f"-oDir::Cache={r}/cache",
                f"-oDir::Cache::Archives={self.archives}",
                "-oDebug::NoLocking=1", "-oAPT::Architecture=amd64",
                "-oAPT::Sandbox::User=root", "-qq"]

    def update(self, progress: Progress | None = None, *, force: bool = False) -> None:
        """Fetch the package lists unless they are younger than ``LISTS_MAX_AGE``."""
        stamp = self.root / "state/updated"
        if not force and stamp.exists() and time.time() - stamp.stat().st_mtime < LISTS_MAX_AGE:
            return
        if progress:
            progress(f"apt: reading Debian package lists ({', '.join(self.suites)})")
        run(["apt-get", *self.opts, "update"], "apt-get update (private)")
        stamp.touch()

    def cache(self, *args: str) -> str:
        """``apt-cache`` with this configuration; its stdout."""
        return run(["apt-cache", *self.opts, *args], f"apt-cache {args[0]}").stdout

    def plan(self, pkgs: list[str], target: str | None = None) -> list[str]:
        """``name_version_`` prefixes of every .deb that installing ``pkgs`` needs (their
        whole dependency closure: the dpkg status is empty), from apt's simulation."""
        t = ["-t", target] if target else []
        out = run(["apt-get", *self.opts, "install", "-s", "--no-install-recommends", *t, *pkgs],
                  f"planning {' '.join(pkgs)}").stdout
        want = [f"{m[1]}_{m[2].replace(':', '%3a')}_"
                for m in re.finditer(r"^Inst (\S+) \((\S+)", out, re.M)]
        if not want:
            raise SetupError(f"apt found nothing to fetch for {' '.join(pkgs)}",
                             "check the package names and the mirror")
        return want

    def fetch(self, pkgs: list[str], target: str | None = None,
              progress: Progress | None = None) -> list[Path]:
        """Download ``pkgs`` with their dependency closure; the .deb files."""
        want = self.plan(pkgs, target)
        if progress:
            progress(f"apt: downloading {' '.join(pkgs)} ({len(want)} packages)")
        t = ["-t", target] if target else []
        run(["apt-get", *self.opts, "install", "-y", "--download-only",
             "--no-install-recommends", *t, *pkgs], "apt-get install --download-only")
        return self._debs(want)

    def fetch_only(self, pkgs: list[str]) -> list[Path]:
        """Download exactly ``pkgs`` (no dependencies) into the archive; the .deb files."""
        want = []
        for p in pkgs:
            m = re.search(r"^Version: (\S+)", self.cache("show", p), re.M)
            if not m:
                raise SetupError(f"apt knows no package {p}")
            want.append(f"{p}_{m[1].replace(':', '%3a')}_")
        missing = [p for p, w in zip(pkgs, want) if not any(self.archives.glob(f"{w}*.deb"))]
        if missing:
            run(["apt-get", *self.opts, "download", *missing], "apt-get download",
                cwd=self.archives)
        return self._debs(want)

    def discard(self, debs: list[Path]) -> None:
        """Delete downloaded .deb files once unpacked, unless they are kept for other
        caches (``$KPH_DOWNLOADS``)."""
        if os.environ.get(DOWNLOADS_ENV):
            return
        for d in debs:
            d.unlink(missing_ok=True)

    def _debs(self, want: list[str]) -> list[Path]:
        debs = sorted(p for p in self.archives.glob("*.deb") if p.name[:p.name.rindex("_") + 1] in want)
        if len(debs) != len(set(want)):
            have = {p.name[:p.name.rindex("_") + 1] for p in debs}
            raise SetupError(f"apt did not download {', '.join(sorted(set(want) - have))[:200]}",
                             "try again (the mirror may have changed meanwhile)")
        names = sorted({deb_identity(d)[0] for d in debs})
        check_debs(debs, index_sha256(self.cache("show", *names)))
        return debs


def deb_identity(deb: Path) -> tuple[str, str, str]:
    """``(package, version, architecture)`` from apt's archive name
    ``NAME_VERSION_ARCH.deb`` (an epoch's colon written ``%3a``)."""
    name, version, arch = deb.name[:-len(".deb")].split("_")
    return name, unquote(version), arch


def index_sha256(text: str) -> dict[tuple[str, str, str], set[str]]:
    """``(package, version, architecture)`` -> the SHA256 sums apt's package index lists
    (``apt-cache show`` output: the Packages stanzas)."""
    out: dict[tuple[str, str, str], set[str]] = {}
    for stanza in re.split(r"\n\s*\n", text):
        f = dict(re.findall(r"^(Package|Version|Architecture|SHA256): *(\S+)", stanza, re.M))
        if {"Package", "Version", "Architecture", "SHA256"} <= f.keys():
            key = (f["Package"], f["Version"], f["Architecture"])
            out.setdefault(key, set()).add(f["SHA256"].lower())
    return out


#: .deb path -> the SHA256 sums apt's index lists for it, for every .deb ``check_debs``
#: passed: ``unpack`` checks its private copy against them again.
_EXPECTED: dict[Path, frozenset[str]] = {}


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _refuse(deb: Path, digest: str, want: set[str] | frozenset[str]) -> SetupError:
    name, version, arch = deb_identity(deb)
    why = (f"its SHA256 {digest[:16]}... is not the {sorted(want)[0][:16]}... "
           "apt's package index lists" if want else
           f"apt's package index lists no {name} {version} ({arch})")
    return SetupError(f"{deb} is not the package apt knows: {why}",
                      f"delete {deb} and run again (apt downloads it anew)")


def check_debs(debs: list[Path], index: dict[tuple[str, str, str], set[str]]) -> None:
    """Each .deb has a SHA256 apt's package index lists for its package, version and
    architecture; those sums are remembered for ``unpack``.

    :raise SetupError: one that does not (a corrupt or foreign file, in ``$KPH_DOWNLOADS``
        for instance), naming it and the fix.
    """
    for deb in debs:
        want = index.get(deb_identity(deb), set())
        digest = _sha256(deb)
        if digest not in want:
            raise _refuse(deb, digest, want)
        _EXPECTED[Path(os.path.abspath(deb))] = frozenset(want)


def unpack(debs: list[Path], tree: Path) -> None:
    """``dpkg-deb -x`` every .deb into ``tree`` (no maintainer scripts run).

    A .deb that ``check_debs`` passed (every one ``PrivateApt`` fetched) is copied first
    into a private directory (``mkdtemp``, 0700, next to ``tree``), the copy hashed and
    checked again and the copy unpacked: what was hashed is what is unpacked, even when
    the original, in a shared ``$KPH_DOWNLOADS``, is replaced in between. Others (a .deb
    the caller downloaded into its own directory) are unpacked as they are.

    :raise SetupError: a copy does not match apt's index (the original named), or
        dpkg-deb failed.
    """
    tree.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        want = _EXPECTED.get(Path(os.path.abspath(deb)))
        if want is None:
            run(["dpkg-deb", "-x", str(deb), str(tree)], f"dpkg-deb -x {deb.name}")
            continue
        private = Path(tempfile.mkdtemp(prefix=".kph-deb-", dir=tree.parent))
        try:
            copy = private / deb.name
            with open(deb, "rb") as src:
                fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            digest = _sha256(copy)
            if digest not in want:
                raise _refuse(deb, digest, want)
            run(["dpkg-deb", "-x", str(copy), str(tree)], f"dpkg-deb -x {deb.name}")
        finally:
            shutil.rmtree(private, ignore_errors=True)
