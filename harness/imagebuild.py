"""``kph image build``: turn the recipe into a complete image, booting it once.

Building is the one step of an image that needs a running guest: its kernel facts
(``harness.facts``: kallsyms, the kprobe blacklist, BTF, the loaded modules, the
release) are harvested on a first cold boot, before anything else uses the image, and
recorded in ``manifest.json`` with a sha256 each, like the kernel and the initramfs.
Then the image's ready snapshot is made (``harness.snapshot``). This module sits above
``harness.vmctl``; ``harness.images`` (locating and checking images) sits below it.

Downloads: with ``$KPH_DOWNLOADS`` set, the kernel package is looked for there first and
kept there after downloading (a cache of *inputs* that a newcomer's machine may share
with CI; nothing derived is kept there).
"""
from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import facts as F
from .constants import DOWNLOADS_ENV, cache_dir
from .errors import SetupError
from .images import (HOST_BUSYBOX, HOST_QEMU_GA, Image, Progress, _assemble_root, _pack_cpio,
                     _sh, image_is_current, load_image, recipe_hash, resolve_kernel_abi,
                     write_manifest)


def build_image(*, force: bool = False, progress: Progress = print, qemu: str | None = None,
                snapshot: bool = True) -> Image:
    """Provision the default image; idempotent (a warm cache returns in well under a second).

    With ``snapshot`` it also makes sure the image has a ready snapshot for the default
    machine options and this QEMU (``harness.snapshot``), so the first ``Machine.boot()``
    is already fast.

    :raise SetupError: apt, dpkg-deb, cpio, busybox or qemu-ga missing, or the download failed.
    """
    abi = resolve_kernel_abi()
    dest = cache_dir() / abi
    if not force and (dest / "manifest.json").exists():
        img = load_image(dest)
        if image_is_current(img):
            (cache_dir() / "default").write_text(abi + "\n")
            progress(f"image: {abi} is up to date in {dest}")
            if snapshot:
                ensure_snapshot(img, qemu, progress)
            return img
        progress(f"image: {abi} in the cache is stale or incomplete; rebuilding")
    for tool, hint in ((HOST_BUSYBOX, "apt-get install busybox-static"),
                       (HOST_QEMU_GA, "apt-get install qemu-guest-agent")):
        if not Path(tool).exists():
            raise SetupError(f"{tool} is missing", f"{hint} (./setup.sh does)")
    if not shutil.which("cpio"):
        raise SetupError("cpio is missing", "apt-get install cpio (./setup.sh does)")
    cache_dir().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{abi}.tmp-", dir=cache_dir()))
    try:
        out = work / "out"
        out.mkdir()
        deb = _kernel_deb(abi, work, progress)
        pkg_version = deb.name.split("_")[1]
        progress(f"image: unpacking {deb.name}")
        kdir = work / "kernel"
        _sh(["dpkg-deb", "-x", str(deb), str(kdir)], what="dpkg-deb -x")
        shutil.copy(kdir / f"boot/vmlinuz-{abi}", out / "vmlinuz")
        shutil.copy(kdir / f"boot/config-{abi}", out / "config")
        progress("image: assembling the initramfs (busybox, qemu-ga, modules, init)")
        root = work / "root"
        mods = _assemble_root(root, kdir / "lib/modules" / abi)
        shutil.rmtree(kdir)
        _pack_cpio(root, out / "initrd.img")
        progress(f"image: initramfs {(out / 'initrd.img').stat().st_size // 1024} KiB, "
                 f"modules: {', '.join(mods)}")
        manifest: dict[str, Any] = {
            "kernel_version": abi, "kernel_package": f"linux-image-{abi}",
            "kernel_package_version": pkg_version, "recipe": recipe_hash(),
            "modules": mods, "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        progress("image: first boot, harvesting the kernel facts "
                 "(kallsyms, kprobes blacklist, BTF, modules)")
        _harvest(out, manifest, qemu)
        write_manifest(out, manifest)
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (cache_dir() / "default").write_text(abi + "\n")
    img = load_image(dest)
    progress(f"image: {abi} ready in {dest}")
    if snapshot:
        ensure_snapshot(img, qemu, progress)
    return img


def _kernel_deb(abi: str, work: Path, progress: Progress) -> Path:
    """The kernel package: from ``$KPH_DOWNLOADS`` when it holds it, else downloaded
    (and kept there when that is set)."""
    downloads = os.environ.get(DOWNLOADS_ENV)
    pattern = f"linux-image-{abi}_*.deb"
    if downloads:
        have = sorted(Path(downloads).glob(pattern))
        if have:
            progress(f"image: using {have[-1]}")
            return have[-1]
    progress(f"image: fetching linux-image-{abi}")
    _sh(["apt-get", "download", "-q", f"linux-image-{abi}"], cwd=work, what="apt-get download")
    deb = next(work.glob(pattern))
    if downloads:
        Path(downloads).mkdir(parents=True, exist_ok=True)
        kept = Path(downloads) / deb.name
        shutil.copy(deb, kept)
        return kept
    return deb


def ensure_snapshot(img: Image, qemu: str | None, progress: Progress) -> None:
    """Build the image's ready snapshot for the default machine options unless current."""
    from .snapshot import ensure
    from .vmctl import Machine

    snap, why = ensure(Machine.prepare(img, qemu=qemu), progress)
    progress(f"snapshot: {snap.dir} is current" if snap is not None else f"snapshot: none ({why})")


def _harvest(out: Path, manifest: dict[str, Any], qemu: str | None) -> None:
    """Boot the new image cold once and copy its kernel facts into ``out``."""
    from .vmctl import Machine

    vm = Machine.prepare(kernel=out / "vmlinuz", initrd=out / "initrd.img", qemu=qemu,
                         name=f"kph-build-{os.getpid()}")
    with vm:
        vm.start()
        F.harvest(vm, out)
        release = F.KernelFacts(out).release
        if release != manifest["kernel_version"]:
            raise SetupError(f"the image booted kernel {release}, expected {manifest['kernel_version']}")
        manifest["boot_seconds"] = round(vm.boot_seconds, 2)
        manifest["qemu"] = vm.qemu.version_str
