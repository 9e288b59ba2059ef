"""Locate, verify and assemble the embedded default image (kernel, initramfs, kernel facts).

``images/`` in the source tree is the recipe; this module holds what turns it into files
(the initramfs, the test programs, the module) and what finds and checks a built image in
the cache, keyed by the kernel ABI that Debian's ``linux-image-cloud-amd64`` points to
*today* (Debian bumps it with security updates and drops old ones from the mirror, so
nothing here names a version). Building an image boots it once to harvest its kernel
facts (``harness.machine.image.facts``): that part, which needs a Machine, is ``harness.machine.image.build``;
this module never starts a guest.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...constants import cache_dir
from ...errors import SetupError, StaleImageError
from .facts import KEPT, KernelFacts
from .kernels import KernelRelease
from .toolchain import build_module, for_kernel

#: Bump when the build steps change in a way the recipe files do not show.
BUILD_FORMAT = 3
RECIPE_DIR = Path(__file__).resolve().parents[3] / "images"
#: Small static test programs shipped in the image as /usr/bin/kph-<name>.
PROGS_DIR = RECIPE_DIR.parent / "probes" / "progs"
#: The kprobes module shipped (not loaded) in the image as /lib/modules/kph_kprobes.ko.
KMOD_DIR = RECIPE_DIR.parent / "probes" / "kmod"
KMOD_NAME = "kph_kprobes"
HOST_BUSYBOX = "/bin/busybox"
HOST_QEMU_GA = "/usr/sbin/qemu-ga"
#: Every file a complete image has; all but the first two are its kernel facts.
ARTIFACTS = ("vmlinuz", "initrd.img", "kallsyms", "kprobes_blacklist", "btf", "modules",
             "release", "config")

Progress = Callable[[str], None]
#: A kernel selector that names a kernel tree: ``tree:6.12``, ``tree:PATH+FIX.patch``
#: (``harness.machine.image.build.image_for``).
TREE_PREFIX = "tree:"


@dataclass(frozen=True)
class Image:
    """A built image in the cache. Paths are absolute; ``manifest`` is manifest.json."""

    dir: Path
    manifest: dict[str, Any]

    @property
    def version(self) -> str:
        return str(self.manifest["kernel_version"])

    @property
    def series(self) -> str:
        """The kernel series, ``6.1``, ``6.12``, ``7.3``."""
        return series_of(self.version)

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    @property
    def kallsyms(self) -> Path:
        return self.dir / "kallsyms"

    @property
    def blacklist(self) -> Path:
        return self.dir / "kprobes_blacklist"

    @property
    def config(self) -> Path:
        return self.dir / "config"

    @functools.cached_property
    def facts(self) -> KernelFacts:
        """What the host side knows about this image's kernel (``harness.machine.image.facts``),
        harvested at build time and checked with the other artifacts."""
        return KernelFacts(self.dir)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def kmod_sources() -> list[Path]:
    """The module's sources; a local ``make`` leaves .o/.ko/.cmd files next to them,
    which must not change the hash."""
    return sorted(f for f in KMOD_DIR.glob("*")
                  if f.is_file() and (f.suffix in (".c", ".h") or f.name in ("Makefile", "Kbuild")))


#: the config fragments of kernels built from source (harness.machine.image.kbuild)
FRAGMENTS = ("kernel.config", "kernel-debug.config")


def recipe_hash() -> str:
    h = hashlib.sha256(f"format {BUILD_FORMAT}\n".encode())
    for d in (RECIPE_DIR, PROGS_DIR):
        for f in sorted(d.rglob("*")):
            # kernel.config (and kernel-debug.config, kph kernel build --debug) are the
            # fragments of kernels built from source (kbuild): they key those builds
            # (their config's sha256), not the Debian kernels' images
            if f.is_file() and f.suffix != ".md" and f.name not in FRAGMENTS:
                h.update(f.relative_to(d.parent).as_posix().encode() + b"\0" + f.read_bytes())
    for f in kmod_sources():
        h.update(f.relative_to(KMOD_DIR.parent).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def read_default() -> str | None:
    f = cache_dir() / "default"
    return f.read_text().strip() if f.exists() else None


def load_image(directory: Path) -> Image:
    mf = directory / "manifest.json"
    if not mf.exists():
        raise SetupError(f"no image in {directory}", "run `kph image build`")
    return Image(directory, json.loads(mf.read_text()))


def built_images() -> list[Image]:
    """Every image in the cache (complete or not), oldest kernel first."""
    out = []
    root = cache_dir()
    for mf in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        try:
            out.append(Image(mf.parent, json.loads(mf.read_text())))
        except ValueError:
            continue
    return sorted(out, key=lambda i: _version_key(i.version))


def _version_key(abi: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", abi.split("-cloud")[0]))


def series_of(abi: str) -> str:
    """``6.12`` of ``6.12.117+deb13-cloud-amd64``, ``6.1`` of ``6.1.0-56-cloud-amd64``."""
    m = re.match(r"(\d+)\.(\d+)", abi)
    return f"{m[1]}.{m[2]}" if m else abi


def default_image(name: str | os.PathLike[str] | None = None) -> Image:
    """The image to boot: ``name`` (a kernel series such as ``6.12``, a full ABI, or an
    image directory), else the default one (the host suite's kernel, which a plain
    ``kph image build`` makes).

    :raise SetupError: no such image in the cache; the message lists what is built.
    """
    if name is not None:
        p = Path(name)
        if p.is_dir():
            return load_image(p)
        sel = str(name)
        if (cache_dir() / sel / "manifest.json").exists():
            return load_image(cache_dir() / sel)
        if sel.startswith(TREE_PREFIX):
            raise SetupError(f"{sel!r} is a kernel tree, and this command takes a built image",
                             f"build it first: kph image build --tree {sel[len(TREE_PREFIX):]}")
        # a series names Debian's kernel of it; a tree's image is named by its directory
        matches = [i for i in built_images() if series_of(i.version) == sel
                   and i.manifest.get("kernel_origin") != "tree"]
        if matches:
            return matches[-1]
        built = ", ".join(f"{series_of(i.version)} ({i.version})" for i in built_images())
        raise SetupError(f"no image for kernel {sel!r} in {cache_dir()}",
                         f"run `kph image build --kernel {sel}`"
                         + (f"; built: {built}" if built else ""))
    version = read_default()
    if not version:
        raise SetupError(f"no default image in {cache_dir()}",
                         "run `kph image build` (or ./setup.sh) first")
    return load_image(cache_dir() / version)


def check_recipe(img: Image) -> None:
    """Refuse an image made from another recipe than this checkout's: its guest programs
    (``kph-reader``, ``kph-resync``, ...), its kernel module or its initramfs recipe are
    not the ones the host side speaks to (an image built before a ``git pull``). A
    kph-reader without a request the host now sends answers nothing: the run ended as a
    guest HANG, the harness's own mismatch taken for the kernel's (6.12, 2026-12-01).

    :raise StaleImageError: the image is stale, with the command that rebuilds it."""
    if img.manifest.get("recipe") == recipe_hash():
        return
    fix = ("rebuild it with the `kph image build --tree ...` that made it"
           if img.manifest.get("kernel_origin") == "tree"
           else "rebuild it: kph image build (or ./setup.sh)" if img.dir.name == read_default()
           else f"rebuild it: kph image build --kernel {series_of(img.version)}")
    raise StaleImageError(f"image {img.dir.name} was built from another recipe than this "
                          "kph's (its guest programs, kernel module or initramfs changed "
                          "since)", fix)


def image_is_current(img: Image) -> bool:
    """True when every artifact exists with the hash the manifest records."""
    if img.manifest.get("recipe") != recipe_hash():
        return False
    for name, meta in img.manifest.get("artifacts", {}).items():
        p = img.dir / name
        if not p.exists() or p.stat().st_size != meta["size"] or sha256_file(p) != meta["sha256"]:
            return False
    return all(n in img.manifest.get("artifacts", {}) for n in ARTIFACTS)


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    manifest["artifacts"] = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(out.iterdir())
        # what processes keep of the facts (facts._derived) is not the image
        if p.is_file() and p.name != "manifest.json" and not p.name.endswith((KEPT, ".tmp"))}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _modinfo_depends(ko: Path) -> list[str]:
    m = re.search(rb"\0depends=([^\0]*)\0", b"\0" + ko.read_bytes())
    return [d for d in m[1].decode().split(",") if d] if m else []


def assemble_root(root: Path, moddir: Path,
                   build_kmod: Callable[[Path], None] | None = None) -> list[str]:
    """The initramfs tree: busybox, qemu-ga, the test programs, the harness's module
    (``build_kmod(dest)`` builds it, default: with the host's headers for ``moddir``'s
    kernel), init, and the modules of ``images/modules.txt`` with their dependencies
    (those the kernel has built in, ``modules.builtin``, are skipped)."""
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc/kph", "lib/modules", "proc", "sys",
              "dev", "tmp", "run", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(HOST_BUSYBOX, root / "bin/busybox")
    applets = subprocess.run([HOST_BUSYBOX, "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for a in applets:
        if not (root / "bin" / a).exists():
            os.symlink("busybox", root / "bin" / a)
    _copy_with_libs(HOST_QEMU_GA, root, "usr/sbin/qemu-ga")
    _build_progs(root / "usr/bin")
    if build_kmod is None:
        _build_kmod(root / "lib/modules", moddir.name)
    else:
        build_kmod(root / "lib/modules" / f"{KMOD_NAME}.ko")
    shutil.copy(RECIPE_DIR / "init", root / "init")
    os.chmod(root / "init", 0o755)
    # Module index: name (with - and _ equal) -> path; then a dependency-ordered list.
    index = {}
    for ko in moddir.rglob("*.ko*"):
        index[ko.name.split(".ko")[0].replace("-", "_")] = ko
    order: list[str] = []
    builtin = set()
    if (moddir / "modules.builtin").exists():
        builtin = {Path(ln.strip()).name.split(".ko")[0].replace("-", "_")
                   for ln in (moddir / "modules.builtin").read_text().splitlines() if ln.strip()}

    def add(name: str) -> None:
        key = name.replace("-", "_")
        if key in order or (key in builtin and key not in index):
            return
        if key not in index:
            raise SetupError(f"module {name} is not in this kernel package",
                             f"edit {RECIPE_DIR / 'modules.txt'}")
        for dep in _modinfo_depends(_plain_ko(index[key], root)):
            add(dep)
        order.append(key)

    wanted = [ln.split("#")[0].strip() for ln in (RECIPE_DIR / "modules.txt").read_text().splitlines()]
    for w in filter(None, wanted):
        add(w)
    (root / "etc/kph/modules.load").write_text("".join(f"{k}.ko\n" for k in order))
    return order


#: Static (the initramfs has no libc) and not PIE: a static-pie program is loaded at a
#: random base, so the same file offset would be a different address in every process;
#: no-pie keeps ELF address == user address for all of them (uprobes, harness.engines.uprobes).
#: Symbols are kept (-g0 drops only DWARF) and nothing is inlined, so every probed
#: function is a real call with its own return address.
PROG_CFLAGS = ("-static", "-no-pie", "-O2", "-fno-inline", "-fno-omit-frame-pointer", "-g0",
               "-Wall", "-pthread")


def _build_progs(dest: Path) -> None:
    """Compile ``probes/progs/*.c`` (``PROG_CFLAGS``) as ``kph-<name>``."""
    dest.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise SetupError("no C compiler for the image's test programs", "apt-get install gcc libc6-dev")
    for src in sorted(PROGS_DIR.glob("*.c")):
        out = dest / f"kph-{src.stem}"
        proc = subprocess.run([cc, *PROG_CFLAGS, "-o", str(out), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SetupError(f"building {src.name} failed: {proc.stderr.strip()[-300:]}",
                             "apt-get install gcc libc6-dev (./setup.sh does)")


def _build_kmod(dest: Path, abi: str) -> None:
    """Build ``probes/kmod`` against the host's headers of ``abi`` as
    ``dest/kph_kprobes.ko``. Not listed in modules.load: ``ModuleBackend`` loads it."""
    build_module(for_kernel(KernelRelease(abi, "host")), kmod_sources(), KMOD_NAME,
                 dest / f"{KMOD_NAME}.ko")


def _plain_ko(src: Path, root: Path) -> Path:
    """Copy a module into the initramfs, decompressed (busybox insmod reads plain ELF)."""
    name = src.name.split(".ko")[0].replace("-", "_") + ".ko"
    dst = root / "lib/modules" / name
    if dst.exists():
        return dst
    if src.name.endswith(".ko"):
        shutil.copy(src, dst)
    elif src.name.endswith(".ko.xz"):
        import lzma
        dst.write_bytes(lzma.decompress(src.read_bytes()))
    elif src.name.endswith(".ko.gz"):
        dst.write_bytes(gzip.decompress(src.read_bytes()))
    else:
        _sh(["zstd", "-dq", str(src), "-o", str(dst)], what="zstd")
    return dst


def _copy_with_libs(binary: str, root: Path, rel: str) -> None:
    """Copy a dynamic binary and every library ``ldd`` resolves (with the loader)."""
    dst = root / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(binary, dst)
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if not m:
            continue
        lib = Path(m[1])
        target = root / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy(lib.resolve(), target)
    # The loader path the binary asks for (PT_INTERP) must exist even on a merged /usr.
    for interp in ("lib64/ld-linux-x86-64.so.2",):
        if not (root / interp).exists() and Path("/" + interp).exists():
            (root / interp).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path("/" + interp).resolve(), root / interp)


def pack_cpio(root: Path, dst: Path) -> None:
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    proc = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"], cwd=root,
                          input=("\n".join(["."] + files) + "\n").encode(),
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise SetupError(f"cpio failed: {proc.stderr.decode()[-200:]}")
    dst.write_bytes(gzip.compress(proc.stdout, compresslevel=6, mtime=0))


def _sh(cmd: list[str], *, what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SetupError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-300:]}",
                         "check apt's configuration and network access to the Debian mirror")
