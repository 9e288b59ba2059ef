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
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from . import facts as F, kbuild, kernels, ksource, toolchain
from ... import constants as C
from ...constants import cache_dir
from ...procs import lock_file
from ...errors import SetupError
from ...kernel.rules import rules_for
from .debian import run
from .store import (HOST_BUSYBOX, HOST_QEMU_GA, KMOD_NAME, TREE_PREFIX, Image, Progress,
                     assemble_root, default_image, kmod_sources, pack_cpio, image_is_current,
                     load_image, recipe_hash, series_of, sha256_file, write_manifest)
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
    fd = lock_file(cache_dir() / f".build-{rel.abi}.lock", C.IMAGE_LOCK_TIMEOUT,
                   f"another kph builds the {rel.abi} image; let it finish, or end it")
    try:
        return _build_locked(rel, force=force, progress=progress, qemu=qemu, snapshot=snapshot)
    finally:
        os.close(fd)


def _build_locked(rel: kernels.KernelRelease, *, force: bool, progress: Progress,
                  qemu: str | None, snapshot: bool) -> Image:
    is_default = rel.abi == kernels.default_abi()
    abi = rel.abi
    dest = cache_dir() / abi
    img = None if force else _cached(dest, progress)
    if img is not None:
        if is_default:
            (cache_dir() / "default").write_text(abi + "\n")
        if snapshot:
            ensure_snapshot(img, qemu, progress)
        return img
    _check_image_tools()
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


def _cached(dest: Path, progress: Progress, same: Any = None) -> Image | None:
    """The image in ``dest`` when it is complete and current (and ``same(img)``: still
    the build's), else None (saying why when there is one to rebuild)."""
    if not (dest / "manifest.json").exists():
        return None
    img = load_image(dest)
    if image_is_current(img) and (same is None or same(img)):
        progress(f"image: {dest.name} is up to date in {dest}")
        return img
    progress(f"image: {dest.name} in the cache is stale or incomplete; rebuilding")
    return None


def _check_image_tools() -> None:
    for tool, hint in ((HOST_BUSYBOX, "apt-get install busybox-static"),
                       (HOST_QEMU_GA, "apt-get install qemu-guest-agent")):
        if not Path(tool).exists():
            raise SetupError(f"{tool} is missing", f"{hint} (./setup.sh does)")
    if not shutil.which("cpio"):
        raise SetupError("cpio is missing", "apt-get install cpio (./setup.sh does)")


# ---------------------------------------------------------------- images of kernel trees

def parse_tree_selector(selector: str) -> tuple[str, list[str]] | None:
    """``tree:TREE[+PATCH...]`` as (TREE, [PATCH, ...]); None for any other selector.
    TREE is a series (Debian's source of it), a source tree or a build directory."""
    if not str(selector).startswith(TREE_PREFIX):
        return None
    tree, *patches = str(selector)[len(TREE_PREFIX):].split("+")
    if not tree:
        raise SetupError(f"{selector!r} names no tree",
                         "write tree:6.12, tree:PATH or tree:6.12+FIX.patch")
    return tree, patches


def image_for(selector: str | None, *, qemu: str | None = None, progress: Progress = print,
              snapshot: bool = True) -> Image:
    """The image a kernel selector names, built when missing: ``tree:...`` (a kernel tree,
    ``build_tree_image``), an image in the cache (``store.default_image``: a series, an
    ABI, an image's name or directory), or a Debian kernel to build (``build_image``)."""
    tree = parse_tree_selector(selector) if selector else None
    if tree is not None:
        return build_tree_image(tree[0], patches=tree[1], qemu=qemu, progress=progress,
                                snapshot=snapshot)
    try:
        return default_image(selector)
    except SetupError:
        if selector and Path(selector).exists():
            raise
        return build_image(kernel=selector, qemu=qemu, progress=progress, snapshot=snapshot)


def build_tree_image(tree: str | os.PathLike[str], *, patches: Sequence[str | os.PathLike[str]] = (),
                     out: str | os.PathLike[str] | None = None, jobs: int | None = None,
                     force: bool = False, progress: Progress = print, qemu: str | None = None,
                     snapshot: bool = True, debug: bool = False) -> Image:
    """The image of a kernel tree (``kph image build --tree``): ``tree`` built
    (``kbuild.prepare_tree``: a series, a source tree with ``patches`` applied in its
    variant tree, or a build directory built already), then its bzImage, its vmlinux (symbols, BTF and ORC;
    the DWARF stripped), its modules if any and ``kph_kprobes.ko`` built against it, the
    kernel facts of a first boot, and a ready snapshot.

    The image is ``$KPH_CACHE/tree-<release>-<key>``; the key hashes the tree's version and
    git commit, the config, the patches and the image recipe. A cached image is current
    while its bzImage is the build's (a rebuilt tree makes a new image in place).

    With ``debug``, the tree's debug build (``kbuild.DEBUG_FRAGMENT``), an image of its own.

    :raise SetupError: every bad input and failed step, in one line.
    """
    pats = ksource.check_patches(list(patches))
    with kbuild.prepare_tree(tree, pats, out=out, jobs=jobs, progress=progress,
                             debug=debug) as kb:
        # held until the image is made: the build directory of a tree's patched
        # variants is shared, and the next variant would rebuild it
        release = kbuild.kernel_release(kb.out)
        origin = Path(str(tree)).expanduser().resolve() if not ksource.is_series(str(tree)) else kb.src
        if origin.is_dir() and (origin / "source").exists():
            origin = (origin / "source").resolve()
        info = {"version": kb.version, "release": release,
                "commit": kbuild.tree_commit(origin) if origin.is_dir() else None,
                "config_sha256": kb.config_sha256,
                "patches": [{"file": str(p), "name": p.name, "sha256": sha256_file(p)} for p in pats]}
        # the patches by content: the same fix from another checkout is the same image
        keyed = dict(info, patches=[p["sha256"] for p in info["patches"]])
        key = hashlib.sha256(json.dumps([keyed, recipe_hash()], sort_keys=True).encode()).hexdigest()[:12]
        name = f"tree-{release}-{key}"
        info.update(src=str(origin), build=str(kb.out), bzimage_sha256=sha256_file(kb.bzimage),
                    debug=debug)
        cache_dir().mkdir(parents=True, exist_ok=True)
        fd = lock_file(cache_dir() / f".build-{name}.lock", C.IMAGE_LOCK_TIMEOUT,
                       f"another kph makes the {name} image; let it finish, or end it")
        try:
            dest = cache_dir() / name
            img = None if force else _cached(dest, progress, lambda i: i.manifest.get(
                "tree", {}).get("bzimage_sha256") == info["bzimage_sha256"])
            if img is None:
                _check_image_tools()
                work = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=cache_dir()))
                try:
                    img_dir = _assemble_tree(kb, work, release, info, progress, qemu)
                    if dest.exists():
                        shutil.rmtree(dest)
                    img_dir.rename(dest)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                img = load_image(dest)
                progress(f"image: {name} ready in {dest} (kernel-series rules: "
                         f"{img.manifest['rules']})")
        finally:
            os.close(fd)
    if snapshot:
        ensure_snapshot(img, qemu, progress)
    return img


def _assemble_tree(kb: kbuild.KernelBuild, work: Path, release: str, info: dict[str, Any],
                   progress: Progress, qemu: str | None) -> Path:
    out = work / "out"
    out.mkdir()
    shutil.copy(kb.bzimage, out / "vmlinuz")
    shutil.copy(kb.out / ".config", out / "config")
    run(["objcopy", "--strip-debug", str(kb.vmlinux), str(out / "vmlinux")],
        "stripping the vmlinux's DWARF", timeout=300)
    mods = work / "mods"
    run(["make", "-C", str(kb.out), f"INSTALL_MOD_PATH={mods}", "modules_install"],
        "make modules_install", timeout=600)
    moddir = mods / "lib/modules" / release
    tc = toolchain.Toolchain("host", kb.out)
    progress(f"image: assembling the initramfs (busybox, qemu-ga, init; {KMOD_NAME}.ko with "
             f"{tc.describe()})")
    root = work / "root"
    modules = assemble_root(root, moddir, lambda dest: toolchain.build_module(
        tc, kmod_sources(), KMOD_NAME, dest))
    pack_cpio(root, out / "initrd.img")
    rules = rules_for(release).series
    manifest: dict[str, Any] = {
        "kernel_version": release, "kernel_series": series_of(release), "kernel_origin": "tree",
        "rules": rules, "tree": info, "recipe": recipe_hash(), "modules": modules,
        "module_toolchain": tc.describe(),
        "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    progress(f"image: first boot of {release}, harvesting the kernel facts "
             f"(kallsyms, kprobes blacklist, BTF, modules)")
    _harvest(out, manifest, qemu)
    write_manifest(out, manifest)
    return out


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
