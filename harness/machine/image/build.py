"""``kph image build``: turn the recipe into a complete image, booting it once.

Building is the one step of an image that needs a running guest: its kernel facts
(``harness.machine.image.facts``: kallsyms, the kprobe blacklist, BTF, the loaded modules, the
release) are harvested on a first cold boot, before anything else uses the image, and
recorded in ``manifest.json`` with a sha256 each, like the kernel and the initramfs.
Then the image's ready snapshot is made (``harness.machine.snapshot``). This module sits above
``harness.vmctl``; ``harness.machine.image.store`` (locating and checking images) sits below it.

Every Debian cloud kernel the archives hold can be an image (``harness.machine.image.kernels``: 6.1
from the host's own suite, 6.12 and 7.3 from Debian 13 and its backports); its module is
built with that kernel's own compiler (``harness.machine.image.toolchain``). Downloads: with
``$KPH_DOWNLOADS`` set, the .deb files of Debian 13 are kept there (a cache of *inputs*
that a newcomer's machine may share with CI; nothing derived is kept there).
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import facts as F, kernels, toolchain
from ...constants import cache_dir
from ...errors import SetupError
from .store import (HOST_BUSYBOX, HOST_QEMU_GA, KMOD_NAME, Image, Progress, assemble_root,
                     kmod_sources, pack_cpio, image_is_current, load_image, recipe_hash,
                     write_manifest)
from ..snapshot import ensure
from ...vmctl import Machine


def build_image(*, kernel: str | None = None, force: bool = False, progress: Progress = print,
                qemu: str | None = None, snapshot: bool = True) -> Image:
    """Provision the image of ``kernel`` (a selector, ``harness.machine.image.kernels``; default: the
    host suite's current cloud kernel, which also becomes the default image); idempotent
    (a warm cache returns in well under a second).

    With ``snapshot`` it also makes sure the image has a ready snapshot for the default
    machine options and this QEMU (``harness.machine.snapshot``), so the first ``Machine.boot()``
    is already fast.

    :raise SetupError: an unknown kernel (the message lists the available ones), apt,
        dpkg-deb, cpio, busybox or qemu-ga missing, a download or a module build failed.
    """
    rel = kernels.resolve(kernel)
    cache_dir().mkdir(parents=True, exist_ok=True)
    # One build of an image at a time (xdist workers may all want the same one); the
    # second finds the first's result.
    with open(cache_dir() / f".build-{rel.abi}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(rel, force=force, progress=progress, qemu=qemu, snapshot=snapshot)


def _build_locked(rel: kernels.KernelRelease, *, force: bool, progress: Progress,
                  qemu: str | None, snapshot: bool) -> Image:
    is_default = rel.abi == kernels.default_abi()
    abi = rel.abi
    dest = cache_dir() / abi
    if not force and (dest / "manifest.json").exists():
        img = load_image(dest)
        if image_is_current(img):
            if is_default:
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
        kdir = kernels.fetch(rel, work / "kernel", progress)
        tree = kernels.locate(kdir, abi)
        shutil.copy(tree.vmlinuz, out / "vmlinuz")
        shutil.copy(tree.config, out / "config")
        tc = toolchain.for_kernel(rel, progress)
        progress(f"image: assembling the initramfs (busybox, qemu-ga, modules, init; "
                 f"{KMOD_NAME}.ko with {tc.describe()})")
        root = work / "root"
        mods = assemble_root(root, tree.modules, lambda dest: toolchain.build_module(
            tc, kmod_sources(), KMOD_NAME, dest))
        shutil.rmtree(kdir)
        pack_cpio(root, out / "initrd.img")
        progress(f"image: initramfs {(out / 'initrd.img').stat().st_size // 1024} KiB, "
                 f"modules: {', '.join(mods) or '(all built in)'}")
        manifest: dict[str, Any] = {
            "kernel_version": abi, "kernel_series": rel.series, "kernel_origin": rel.origin,
            "kernel_package": f"linux-image-{abi}", "recipe": recipe_hash(),
            "modules": mods, "module_toolchain": tc.describe(),
            "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
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
    if is_default:
        (cache_dir() / "default").write_text(abi + "\n")
    img = load_image(dest)
    progress(f"image: {abi} ready in {dest}")
    if snapshot:
        ensure_snapshot(img, qemu, progress)
    return img


def ensure_snapshot(img: Image, qemu: str | None, progress: Progress) -> None:
    """Build the image's ready snapshot for the default machine options unless current."""
    snap, why = ensure(Machine.prepare(img, qemu=qemu), progress)
    progress(f"snapshot: {snap.dir} is current" if snap is not None else f"snapshot: none ({why})")


def _harvest(out: Path, manifest: dict[str, Any], qemu: str | None) -> None:
    """Boot the new image cold once and copy its kernel facts into ``out``."""
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
