"""Find the QEMU to use, and provision a private, newer one when the system's is old.

Why a private QEMU: before QEMU 10.2 the gdbstub flushed the whole translation cache at
every debug stop (~70 ms per breakpoint hit under TCG); 10.2 removed that ("gdbstub:
Remove tb_flush uses"), making a host-side probe hit ~1.3 ms. Debian 12 ships 7.2, so
``provision_private_qemu`` unpacks Debian 13's backported QEMU into the cache and runs it
through that tree's own dynamic loader. Nothing on the system is modified.

Order of preference: ``--qemu PATH``, ``$KPH_QEMU``, the private tree, the system's
``qemu-system-x86_64``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..constants import FAST_GDBSTUB_QEMU, cache_dir
from ..errors import SetupError
from .image.debian import TRIXIE, PrivateApt, host_mirror_uri, unpack

log = logging.getLogger(__name__)

#: Debian suites the private QEMU comes from (Debian 13 and its backports).
PRIVATE_SUITES = ("trixie", "trixie-backports")
PRIVATE_TARGET = "trixie-backports"
QEMU_NAME = "qemu-system-x86_64"


@dataclass(frozen=True)
class QemuBinary:
    """How to start one QEMU: the argv prefix, extra environment and data dirs."""

    argv: tuple[str, ...]
    version: tuple[int, int, int]
    source: str  # "--qemu", "KPH_QEMU", "private", "system"
    env: dict[str, str] = field(default_factory=dict)
    data_dirs: tuple[str, ...] = ()

    @property
    def version_str(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def fast_gdbstub(self) -> bool:
        """True when breakpoint hits do not flush the translation cache (QEMU >= 10.2)."""
        return self.version[:2] >= FAST_GDBSTUB_QEMU

    def command(self, args: list[str]) -> list[str]:
        out = list(self.argv)
        for d in self.data_dirs:
            out += ["-L", d]
        return out + args


def qemu_identity(qemu: QemuBinary) -> dict[str, object]:
    """Version plus (path, size, mtime) of every executable file in QEMU's argv: a
    replaced binary or loader counts as a different QEMU even at the same version (the
    key of snapshots and of the plugin's build)."""
    files = []
    for arg in qemu.argv:
        p = Path(arg)
        if arg.startswith("/") and p.is_file():
            st = p.stat()
            files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return {"version": qemu.version_str, "files": files}


def private_dir() -> Path:
    return cache_dir() / "qemu"


def _parse_version(text: str) -> tuple[int, int, int]:
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise SetupError(f"cannot read a QEMU version from {text.strip()[:80]!r}")
    return int(m[1]), int(m[2]), int(m[3])


@functools.lru_cache(maxsize=None)
def _probe(argv: tuple[str, ...], env_items: tuple[tuple[str, str], ...]) -> tuple[int, int, int]:
    env = dict(os.environ, **dict(env_items))
    try:
        out = subprocess.run(list(argv) + ["--version"], capture_output=True, text=True,
                             timeout=20, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"cannot run QEMU {argv[0]}: {exc}",
                         "pass --qemu PATH or run ./setup.sh") from exc
    if out.returncode != 0:
        raise SetupError(f"QEMU {argv[0]} --version failed: {out.stderr.strip()[:200]}",
                         "pass --qemu PATH or run ./setup.sh")
    return _parse_version(out.stdout)


def _from_path(path: str, source: str) -> QemuBinary:
    p = Path(path)
    if not p.exists():
        raise SetupError(f"QEMU not found: {path}", "pass an existing qemu-system-x86_64")
    argv = (str(p),)
    return QemuBinary(argv=argv, version=_probe(argv, ()), source=source)


def private_qemu() -> QemuBinary | None:
    """The provisioned private QEMU, or None when there is none."""
    root = private_dir()
    meta = root / "qemu.json"
    if not meta.exists():
        return None
    info = json.loads(meta.read_text())
    tree = root / "tree"
    libdirs = ":".join(str(tree / d) for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"))
    # bin/qemu-system-x86_64 is a symlink to the tree's ld.so, so ps shows "qemu-system-x86".
    argv = (str(root / "bin" / QEMU_NAME), "--library-path", libdirs,
            str(tree / "usr/bin" / QEMU_NAME))
    env = {"QEMU_MODULE_DIR": str(tree / "usr/lib/x86_64-linux-gnu/qemu")}
    data = (str(tree / "usr/share/qemu"), str(tree / "usr/share/seabios"))
    version = tuple(info["version"])
    return QemuBinary(argv=argv, version=version, source="private", env=env,  # type: ignore[arg-type]
                      data_dirs=data)


def system_qemu() -> QemuBinary | None:
    path = shutil.which(QEMU_NAME)
    if not path:
        return None
    return _from_path(path, "system")


def find_qemu(override: str | None = None) -> QemuBinary:
    """Pick the QEMU to run, in the documented order of preference.

    :raise SetupError: when none is usable.
    """
    if override:
        return _from_path(override, "--qemu")
    env = os.environ.get("KPH_QEMU")
    if env:
        return _from_path(env, "KPH_QEMU")
    sysq = system_qemu()
    if sysq and sysq.fast_gdbstub:
        return sysq
    priv = private_qemu()
    if priv:
        return priv
    if sysq:
        return sysq
    raise SetupError("no qemu-system-x86_64 found", "run ./setup.sh (or apt-get install qemu-system-x86)")


def why_chosen(q: QemuBinary) -> str:
    return {
        "--qemu": "given with --qemu",
        "KPH_QEMU": "given in $KPH_QEMU",
        "private": "private tree from Debian 13 backports (the system QEMU is older than 10.2)",
        "system": "system QEMU" + ("" if q.fast_gdbstub else
                                   " (older than 10.2: every breakpoint hit flushes the "
                                   "translation cache, ~70 ms; run ./setup.sh to provision a newer one)"),
    }[q.source]


# --- provisioning -------------------------------------------------------------------------

def provision_private_qemu(progress: Callable[[str], None] = print, force: bool = False) -> QemuBinary:
    """Unpack QEMU from Debian 13 backports into the cache, with its whole library closure.

    A private apt configuration (``harness.machine.image.debian.PrivateApt``: its own sources, lists,
    cache and an empty dpkg status) resolves ``qemu-system-x86`` and everything it depends
    on; each package is unpacked with ``dpkg-deb -x``. Needs no chroot and changes nothing
    outside the cache. With ``$KPH_DOWNLOADS`` set, the .deb files are kept there.
    """
    root = private_dir()
    if not force:
        existing = private_qemu()
        if existing:
            return existing
    apt = PrivateApt(TRIXIE)
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="qemu.tmp-", dir=root.parent))
    try:
        apt.update(progress, force=True)
        progress("qemu: downloading qemu-system-x86 and its libraries")
        debs = apt.fetch(["qemu-system-x86"], PRIVATE_TARGET)
        progress(f"qemu: unpacking {len(debs)} packages")
        tree = work / "tree"
        unpack(debs, tree)
        apt.discard(debs)
        ldso = tree / "usr/lib64/ld-linux-x86-64.so.2"
        if not ldso.exists():
            raise SetupError(f"no dynamic loader in the private tree ({ldso})")
        (work / "bin").mkdir()
        os.symlink(os.path.relpath(ldso, work / "bin"), work / "bin" / QEMU_NAME)
        (work / "qemu.json").write_text(json.dumps({"version": [0, 0, 0], "suites": PRIVATE_SUITES}))
        # Probe the version through the real invocation before moving it into place.
        staged = QemuBinary(argv=(str(work / "bin" / QEMU_NAME), "--library-path",
                                  f"{tree}/usr/lib/x86_64-linux-gnu:{tree}/lib/x86_64-linux-gnu",
                                  str(tree / "usr/bin" / QEMU_NAME)),
                            version=(0, 0, 0), source="private",
                            env={"QEMU_MODULE_DIR": str(tree / "usr/lib/x86_64-linux-gnu/qemu")})
        version = _probe(staged.argv, tuple(staged.env.items()))
        (work / "qemu.json").write_text(json.dumps(
            {"version": list(version), "suites": list(PRIVATE_SUITES), "mirror": host_mirror_uri()}))
        if root.exists():
            shutil.rmtree(root)
        # The tree's paths are absolute in nothing we rely on, so a rename is safe.
        work.rename(root)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    _probe.cache_clear()
    q = private_qemu()
    assert q is not None
    progress(f"qemu: private QEMU {q.version_str} ready in {root}")
    return q
