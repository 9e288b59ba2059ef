"""Which Debian cloud kernel a selector names, and fetching its packages.

Selectors (``kph image build --kernel SEL``, ``--image SEL``, ``--kph-kernels``):

- ``6.1``, ``6.12``, ``7.3``, ... (a series): the release that the suite's
  ``linux-image-cloud-amd64`` points to **today**: the host's own apt (Debian 12,
  bookworm: 6.1), Debian 13 (trixie: 6.12) or Debian 13 backports (7.3); any other series
  the archives hold (6.16, 7.2, ...) resolves to its newest build there;
- a full ABI as Debian names it: ``6.1.0-56-cloud-amd64``, ``6.12.117+deb13-cloud-amd64``;
- nothing: the default, the host suite's current cloud kernel (bookworm's 6.1).

Debian bumps ABIs with security updates and drops old ones from the mirror, so nothing
here names a version; everything is resolved at build time. The Debian 13 archives are
read through a private apt configuration (``harness.machine.image.debian``); the host's apt is used as
it is for its own suite.

Package layouts differ by version, and ``fetch`` hides that: 6.1 ships one
``linux-image-<abi>`` with ``boot/vmlinuz-<abi>``, ``boot/config-<abi>`` and
``lib/modules/<abi>``; trixie's 6.12 moves modules to ``usr/lib/modules``; 7.3's
``linux-image-<abi>`` is empty and depends on ``linux-binary-<abi>`` (the kernel at
``usr/lib/modules/<abi>/vmlinuz``), ``linux-modules-<abi>`` and ``linux-base-<abi>``
(``usr/lib/modules/<abi>/config``).
"""
from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...constants import KERNEL_META_PACKAGE
from ...errors import SetupError
from .debian import PrivateApt, TRIXIE, run, unpack

Progress = Callable[[str], None]
#: Where each origin's ``linux-image-cloud-amd64`` is read: the host's apt (None: its own
#: configuration) or a suite of the private Debian 13 apt.
META_ORIGINS = (("host", None), ("trixie", "trixie"), ("trixie-backports", "trixie-backports"))
_ABI_RE = re.compile(r"^(\d+)\.(\d+)[.\d]*(?:-\d+)?(?:\+deb\d+)?-cloud-amd64$")


@dataclass(frozen=True)
class KernelRelease:
    """One Debian cloud kernel build: ``abi`` names its packages (linux-image-<abi>)."""

    abi: str
    origin: str            # "host" (the system's apt) or "trixie" (the private apt)

    @property
    def series(self) -> str:
        """``6.1``, ``6.12``, ``7.3``: major.minor."""
        m = _ABI_RE.match(self.abi)
        return f"{m[1]}.{m[2]}" if m else self.abi

    @property
    def version_key(self) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", self.abi.split("-cloud")[0]))


def series_of(abi: str) -> str:
    return KernelRelease(abi, "host").series


@functools.lru_cache(maxsize=None)
def _host_cache(*args: str) -> str:
    try:
        out = subprocess.run(["apt-cache", *args], capture_output=True, text=True, timeout=120,
                             check=False)
    except OSError as exc:
        raise SetupError("apt-cache is not available", "build on Debian 12 or pass --kernel FILE") from exc
    return out.stdout


@functools.lru_cache(maxsize=1)
def _private():
    apt = PrivateApt(TRIXIE)
    apt.update()
    return apt


def _meta_target(text: str) -> str | None:
    m = re.search(r"Depends:\s*linux-image-(\S+)", text)
    return m[1] if m else None


def default_abi() -> str:
    """The ABI the host suite's ``linux-image-cloud-amd64`` depends on today."""
    abi = _meta_target(_host_cache("depends", KERNEL_META_PACKAGE))
    if not abi:
        raise SetupError(f"apt knows no {KERNEL_META_PACKAGE}",
                         "run `apt-get update` (./setup.sh does) and try again")
    return abi


@functools.lru_cache(maxsize=1)
def _metas() -> list[KernelRelease]:
    """What each suite's meta package points to today (host first)."""
    out = [KernelRelease(default_abi(), "host")]
    apt = _private()
    for suite in ("trixie", "trixie-backports"):
        text = apt.cache("-t", suite, "depends", KERNEL_META_PACKAGE) if suite != "trixie" else \
            apt.cache("depends", KERNEL_META_PACKAGE)
        # apt-cache depends shows the candidate; -t raises the backports one.
        abi = _meta_target(text)
        if abi:
            out.append(KernelRelease(abi, "trixie"))
    return out


@functools.lru_cache(maxsize=1)
def _all_builds() -> list[KernelRelease]:
    """Every cloud kernel build the archives list (host's apt and the private one)."""
    found: dict[str, KernelRelease] = {}
    for origin, text in (("host", _host_cache("pkgnames", "linux-image-")),
                         ("trixie", _private().cache("pkgnames", "linux-image-"))):
        for name in text.split():
            abi = name[len("linux-image-"):]
            if _ABI_RE.match(abi):
                found.setdefault(abi, KernelRelease(abi, origin))
    return sorted(found.values(), key=lambda r: r.version_key)


def available_series() -> list[str]:
    """The series a selector may name (for the error that lists them)."""
    seen: dict[str, None] = {}
    for r in _all_builds():
        seen.setdefault(r.series, None)
    return sorted(seen, key=lambda s: tuple(int(x) for x in s.split(".")))


def resolve(selector: str | None = None) -> KernelRelease:
    """The kernel ``selector`` names (see the module docstring).

    :raise SetupError: no such series or ABI in the archives; the message lists them.
    """
    if selector in (None, "", "default"):
        return KernelRelease(default_abi(), "host")
    sel = str(selector).strip()
    if sel.startswith("linux-image-"):
        sel = sel[len("linux-image-"):]
    if re.fullmatch(r"\d+\.\d+", sel):
        host = KernelRelease(default_abi(), "host")
        if host.series == sel:
            return host
        for rel in _metas():
            if rel.series == sel:
                return rel
        builds = [r for r in _all_builds() if r.series == sel]
        if builds:
            return builds[-1]
    else:
        for r in _all_builds():
            if r.abi == sel:
                return r
    raise SetupError(f"no Debian cloud kernel {selector!r} in the archives",
                     f"available: {', '.join(available_series())} (a series), or a full ABI "
                     f"such as {default_abi()}")


def fetch(rel: KernelRelease, dest: Path, progress: Progress | None = None) -> Path:
    """Download ``rel``'s packages and unpack them into ``dest``; returns ``dest``.

    Pulls in ``linux-binary/-modules/-base-<abi>`` when ``linux-image-<abi>`` depends on
    them (7.3's split layout).
    """
    pkgs = [f"linux-image-{rel.abi}"]
    if rel.origin == "host":
        deps = _host_cache("depends", pkgs[0])
    else:
        apt = _private()
        deps = apt.cache("depends", pkgs[0])
    pkgs += sorted(set(re.findall(rf"Depends:\s*(linux-(?:binary|modules|base)-{re.escape(rel.abi)})\b",
                                  deps)))
    if progress:
        progress(f"image: fetching {', '.join(pkgs)}")
    if rel.origin == "host":
        work = dest.parent / f".{dest.name}.debs"
        work.mkdir(parents=True, exist_ok=True)
        run(["apt-get", "download", "-q", *pkgs], "apt-get download", cwd=work)
        debs = sorted(work.glob("*.deb"))
    else:
        debs = apt.fetch_only(pkgs)
    unpack(debs, dest)
    if rel.origin == "host":
        for d in debs:
            d.unlink()
        work.rmdir()
    else:
        apt.discard(debs)
    return dest


@dataclass(frozen=True)
class KernelTree:
    """Where the unpacked packages put the kernel, its config and its modules."""

    vmlinuz: Path
    config: Path
    modules: Path


def locate(root: Path, abi: str) -> KernelTree:
    """Find the kernel, config and module directory in an unpacked kernel package."""
    def first(*cands: str) -> Path:
        for c in cands:
            p = root / c
            if p.exists():
                return p
        raise SetupError(f"the kernel packages of {abi} have none of {', '.join(cands)}",
                         "this package layout is new to kph: report it")
    return KernelTree(
        vmlinuz=first(f"boot/vmlinuz-{abi}", f"usr/lib/modules/{abi}/vmlinuz"),
        config=first(f"boot/config-{abi}", f"usr/lib/modules/{abi}/config"),
        modules=first(f"lib/modules/{abi}", f"usr/lib/modules/{abi}"))
