"""Kernels built from source: Debian's ``linux-source-X.Y`` fetched and unpacked, or any tree
(a git checkout, a stable tree, a bisect step), configured small and built out of tree.

``kph kernel fetch 6.12`` unpacks Debian's ``linux-source-6.12`` (the source of Debian's own
6.12 kernels, Debian's patches applied) into ``$KPH_CACHE/src/linux-source-<version>/``.

``kph kernel build SRC`` configures the way virtme-ng does, not with Debian's full config:
``make tinyconfig``, then the fragment ``images/kernel.config`` merged over it
(``scripts/kconfig/merge_config.sh``), then ``make olddefconfig``; every ``=y`` of the
fragment must survive (a dependency the tree lacks is named). Then ``make bzImage modules``
in a build directory of its own (``O=``), with ``-j`` the host's CPUs, ``ccache`` when it is
there, the build's progress on stderr, and on failure the first compiler error. A build
directory that is configured and built already is built incrementally (make decides).

The result boots with ``kph boot --kernel OUT`` (``arch/x86/boot/bzImage``, with ``vmlinux``
for symbols). Host tools the build needs: gcc, make, flex, bison, bc, libelf-dev, libssl-dev
and pahole (dwarves, for BTF); ``./setup.sh`` installs them.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ...constants import cache_dir
from ...errors import SetupError
from ...procs import lock_file, pdeathsig, stop_process
from .debian import TRIXIE, PrivateApt, run, unpack
from .store import RECIPE_DIR

Progress = Callable[[str], None]

#: The config fragment merged over tinyconfig.
FRAGMENT = RECIPE_DIR / "kernel.config"
#: Host programs a kernel build runs (and the package that brings each).
BUILD_TOOLS = {"gcc": "gcc", "make": "make", "flex": "flex", "bison": "bison", "bc": "bc",
               "pahole": "dwarves"}
#: Host headers the build compiles against (objtool needs libelf; certificates, libssl).
BUILD_HEADERS = {"/usr/include/gelf.h": "libelf-dev", "/usr/include/openssl/ssl.h": "libssl-dev"}
#: A cold build of the minimal config takes ~8 min on 2 CPUs; a stuck one ends here.
BUILD_TIMEOUT = 3600.0
#: The build directory records the fragment it was configured with.
STAMP = ".kph-fragment"
#: How long a second fetch or build of the same tree waits for the first.
LOCK_TIMEOUT = 3600.0


def sources_dir() -> Path:
    return cache_dir() / "src"


def builds_dir() -> Path:
    return cache_dir() / "kbuild"


@dataclass(frozen=True)
class KernelBuild:
    """A configured and built kernel tree."""

    src: Path
    out: Path
    version: str                # ``make kernelversion``: 6.12.117
    config_sha256: str

    @property
    def bzimage(self) -> Path:
        return self.out / "arch/x86/boot/bzImage"

    @property
    def vmlinux(self) -> Path:
        return self.out / "vmlinux"


# ---------------------------------------------------------------- sources

def is_series(text: str) -> bool:
    """``6.12``, ``7.3``: a kernel series, not a path (``./6.12`` is a path)."""
    return re.fullmatch(r"\d+\.\d+", str(text)) is not None


def fetch_source(series: str, progress: Progress | None = None) -> Path:
    """Debian's ``linux-source-<series>``, unpacked once into
    ``$KPH_CACHE/src/linux-source-<version>/``; the tree's path.

    :raise SetupError: not a series, no such source package, or the download failed.
    """
    if not is_series(series):
        raise SetupError(f"not a kernel series: {series!r}", "name one like 6.12 or 7.3")
    say = progress or (lambda s: None)
    apt = PrivateApt(TRIXIE)
    apt.update(progress)
    pkg = f"linux-source-{series}"
    m = re.search(r"^\s*Candidate:\s*(\S+)", apt.cache("policy", pkg), re.M)
    if not m or m[1] == "(none)":
        have = sorted(set(re.findall(r"^linux-source-(\d+\.\d+)$",
                                     apt.cache("pkgnames", "linux-source-"), re.M)),
                      key=lambda s: tuple(int(x) for x in s.split(".")))
        raise SetupError(f"Debian has no {pkg}",
                         f"series with sources: {', '.join(have) or 'none'}")
    version = m[1]
    dest = sources_dir() / f"linux-source-{version}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(dest.parent / f".{dest.name}.lock", LOCK_TIMEOUT,
                   "another kph is fetching the same source: wait for it")
    try:
        return _fetch_locked(apt, pkg, version, dest, say)
    finally:
        os.close(fd)


def _fetch_locked(apt: PrivateApt, pkg: str, version: str, dest: Path, say: Progress) -> Path:
    if (dest / "Makefile").is_file():
        say(f"kernel: {pkg} {version} is unpacked in {dest}")
        return dest
    say(f"kernel: downloading {pkg} {version} (about 150 MB)")
    debs = apt.fetch_only([pkg])
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        unpack(debs, tmp / "deb")
        tarballs = sorted((tmp / "deb" / "usr/src").glob("linux-source-*.tar.*"))
        if not tarballs:
            raise SetupError(f"{pkg} {version} holds no source tarball under usr/src",
                             "report it; the package layout changed")
        say(f"kernel: unpacking {tarballs[0].name} (about 1.7 GB)")
        run(["tar", "-xf", str(tarballs[0]), "-C", str(tmp)], f"unpacking {tarballs[0].name}")
        top = [d for d in tmp.iterdir() if d.is_dir() and d.name != "deb"]
        if len(top) != 1 or not (top[0] / "Makefile").is_file():
            raise SetupError(f"{tarballs[0].name} did not unpack into one kernel tree",
                             "report it; the package layout changed")
        top[0].rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    apt.discard(debs)
    say(f"kernel: {pkg} {version} unpacked in {dest}")
    return dest


# ---------------------------------------------------------------- configuring

def required_options(fragment: Path = FRAGMENT) -> dict[str, str]:
    """``CONFIG_NAME -> value`` of every line of ``fragment``."""
    out = {}
    for ln in fragment.read_text().splitlines():
        m = re.fullmatch(r"\s*(CONFIG_\w+)=(\S+)\s*", ln)
        if m:
            out[m[1]] = m[2]
    return out


#: What a kernel needs, built in, to boot with the default image's initramfs and answer
#: through its guest agent; why each.
BOOT_NEEDS = {
    "CONFIG_64BIT": "the initramfs's busybox is a 64-bit program",
    "CONFIG_BLK_DEV_INITRD": "the root is an initramfs",
    "CONFIG_RD_GZIP": "the initramfs is gzip-compressed",
    "CONFIG_BINFMT_ELF": "busybox is an ELF program",
    "CONFIG_BINFMT_SCRIPT": "init is a shell script",
    "CONFIG_DEVTMPFS": "init mounts devtmpfs",
    "CONFIG_VIRTIO_PCI": "the guest agent's port is a virtio PCI device",
    "CONFIG_VIRTIO_CONSOLE": "the guest agent talks over virtio-serial",
}


def boot_refusal(config: str) -> str | None:
    """Why a kernel of ``config`` (a ``.config``'s text) cannot boot the default initramfs
    to its guest agent, naming each option not built in; None when it can."""
    gone = missing_options(config, {k: "y" for k in BOOT_NEEDS})
    if not gone:
        return None
    return "; ".join(f"{k} is not built in ({BOOT_NEEDS[k]})" for k in gone)


def missing_options(config: str, want: dict[str, str]) -> list[str]:
    """The options of ``want`` that ``config`` (a ``.config``'s text) does not set so."""
    have = dict(re.findall(r"^(CONFIG_\w+)=(.*)$", config, re.M))
    return [k for k, v in want.items() if have.get(k) != v]


#: What an image's kernel needs beyond booting (``BOOT_NEEDS``): the harness's module, its
#: probes and its kernel facts; why each. A build directory made by hand is checked for these.
IMAGE_NEEDS = {
    "CONFIG_MODULES": "kph_kprobes.ko is a module built against the tree",
    "CONFIG_KALLSYMS_ALL": "the host side reads every symbol from /proc/kallsyms",
    "CONFIG_KPROBES": "the guest's kprobes",
    "CONFIG_KPROBE_EVENTS": "the guest's kprobe_events",
    "CONFIG_DEBUG_INFO_BTF": "the kernel facts include /sys/kernel/btf/vmlinux",
}


def image_refusal(config: str) -> str | None:
    """Why a build of ``config`` cannot become an image (``BOOT_NEEDS`` and
    ``IMAGE_NEEDS``), naming each option not built in; None when it can."""
    needs = {**BOOT_NEEDS, **IMAGE_NEEDS}
    gone = missing_options(config, {k: "y" for k in needs})
    return "; ".join(f"{k} is not set (y) ({needs[k]})" for k in gone) or None


def check_tree(src: Path) -> Path:
    """``src`` resolved, if it is a kernel source tree; else a SetupError saying what it is."""
    src = Path(src).expanduser().resolve()
    if not src.is_dir():
        raise SetupError(f"no kernel source tree at {src}",
                         "pass a kernel tree, or fetch one: `kph kernel fetch 6.12`")
    if not (src / "Makefile").is_file() or not (src / "Kconfig").is_file() \
            or not (src / "arch/x86").is_dir():
        raise SetupError(f"{src} is not a kernel source tree (no Makefile, Kconfig and arch/x86)",
                         "pass the top of a Linux tree, or fetch one: `kph kernel fetch 6.12`")
    return src


def check_host_tools() -> None:
    """The programs and headers a kernel build needs, each named with its package."""
    missing = [pkg for tool, pkg in BUILD_TOOLS.items() if shutil.which(tool) is None]
    missing += [pkg for hdr, pkg in BUILD_HEADERS.items() if not Path(hdr).exists()]
    if missing:
        raise SetupError(f"building a kernel needs {', '.join(sorted(set(missing)))}",
                         f"apt-get install {' '.join(sorted(set(missing)))} (./setup.sh does)")


def tree_version(src: Path) -> str:
    """``VERSION.PATCHLEVEL.SUBLEVEL`` from the top Makefile (``make kernelversion``)."""
    head = (src / "Makefile").read_text(errors="replace")[:4096]
    parts = [re.search(rf"^{k}\s*=\s*(\d*)", head, re.M) for k in ("VERSION", "PATCHLEVEL",
                                                                     "SUBLEVEL")]
    if not all(parts):
        raise SetupError(f"{src}/Makefile names no VERSION, PATCHLEVEL and SUBLEVEL",
                         "pass the top of a Linux tree")
    return ".".join(p[1] or "0" for p in parts)  # type: ignore[index]


def kernel_release(out: Path) -> str:
    """What ``uname -r`` says on a built kernel: ``include/config/kernel.release``."""
    f = out / "include/config/kernel.release"
    if not f.is_file():
        raise SetupError(f"{out} has no include/config/kernel.release", "build it first")
    return f.read_text().strip()


def tree_commit(src: Path) -> str | None:
    """The git commit of a checkout (``+dirty`` when it has changes), None for a tree
    that is not one (Debian's linux-source)."""
    if not (src / ".git").exists() or shutil.which("git") is None:
        return None
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=60, check=False)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "-uno"],
                           capture_output=True, text=True, timeout=300, check=False).stdout
    return head.stdout.strip() + ("+dirty" if dirty.strip() else "")


def is_build_dir(d: Path) -> bool:
    """A configured kernel build directory (``O=``, or a tree built in place)."""
    return (d / ".config").is_file() and (d / "Makefile").is_file()


def use_built(out: Path) -> KernelBuild:
    """A build directory someone built already, used as it is (no make is run).

    :raise SetupError: not built yet (the build command), or its config lacks what an
        image needs (each option named).
    """
    out = Path(out).expanduser().resolve()
    src = (out / "source").resolve() if (out / "source").exists() else out
    text = (out / ".config").read_text(errors="replace")
    why = image_refusal(text)
    if why:
        raise SetupError(f"{out} cannot make an image: {why}",
                         f"build it with `kph kernel build {src}` (images/kernel.config has them)")
    missing = [f for f in ("arch/x86/boot/bzImage", "vmlinux", "include/config/kernel.release")
               if not (out / f).is_file()]
    if missing:
        cmd = f"make -C {src} O={out} -j{os.cpu_count() or 1} bzImage modules" if src != out \
            else f"make -C {out} -j{os.cpu_count() or 1} bzImage modules"
        raise SetupError(f"{out} is configured but not built (no {', '.join(missing)})",
                         f"build it: {cmd}")
    return KernelBuild(src, out, tree_version(src), hashlib.sha256(text.encode()).hexdigest())


# ---------------------------------------------------------------- patches

def check_patches(patches: list[str | os.PathLike[str]]) -> list[Path]:
    """Each ``--patch`` resolved, if it is a readable file that looks like a diff and
    changes only files inside the tree (``patch_targets``), before anything is fetched,
    copied or built.

    :raise SetupError: the first bad patch, in one line (a missing file, no hunk, a path
        outside the tree).
    """
    out = []
    for p in patches:
        path = Path(p).expanduser().resolve()
        if not path.is_file():
            raise SetupError(f"--patch {p}: no such file", "pass a patch file (git format-patch, diff -u)")
        text = path.read_text(errors="replace")
        if not re.search(r"^@@ -\d+", text, re.M):
            raise SetupError(f"--patch {p}: not a unified diff (no @@ hunk)",
                             "make it with `git format-patch` or `diff -u`")
        patch_targets(path, text)
        out.append(path)
    return out


#: The lines a patch names files on (GNU patch reads names from all of them; git's own
#: headers carry the rename/copy names without the a/ b/ prefix).
_NAME_LINE = re.compile(r"^(?:(?P<pfx>--- |\+\+\+ |\*\*\* |Index: )|(?P<git>diff --git )|"
                        r"(?P<bare>(?:rename|copy) (?:from|to) ))(?P<rest>.*)$")
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def _unquote(name: str) -> str:
    """A name as git writes one with unusual bytes: ``"b/\\303\\251t\\303\\251.c"``
    (C escapes, octal bytes). An escaped ``/`` or ``.`` is a ``/`` or ``.`` to patch,
    so the confinement check looks at the decoded name."""
    if not (len(name) >= 2 and name.startswith('"') and name.endswith('"')):
        return name
    out, i, body = bytearray(), 0, name[1:-1]
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            if m:
                out.append(int(m[0], 8) & 0xFF)
                i += 1 + len(m[0])
                continue
            out.append(_C_ESCAPES.get(nxt, ord(nxt) & 0xFF))
            i += 2
            continue
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    return out.decode("utf-8", "surrogateescape")


def _names(line: str) -> tuple[list[str], bool] | None:
    """``(names, prefixed)`` a header line names (``prefixed``: -p1 strips a leading
    component), or None for any other line. Every whitespace-separated word of the name
    is a candidate too: which one GNU patch takes from ``+++ b/x y`` is its heuristic, not
    ours, so all of them must pass."""
    m = _NAME_LINE.match(line)
    if not m:
        return None
    rest = m["rest"]
    if m["git"]:
        words = rest.split()
        return [_unquote(w) for w in words], True
    name = rest.split("\t", 1)[0].strip()
    if not name:
        return [], False
    names = [_unquote(name)] + [_unquote(w) for w in name.split()]
    return list(dict.fromkeys(names)), not m["bare"]


def _outside(name: str, prefixed: bool) -> str | None:
    """Why ``name`` reaches outside the tree (None: it does not)."""
    if name in ("/dev/null", ""):
        return None
    if name.startswith("/"):
        return "an absolute path"
    if ".." in name.split("/"):
        return "a .. component"
    if prefixed and "/" in name and name.split("/", 1)[1].startswith("/"):
        return "an absolute path once -p1 strips its a/ or b/"
    return None


def patch_targets(patch: Path, text: str) -> list[str]:
    """The tree-relative paths ``patch`` (applied with ``-p1``) names, each checked to stay
    inside the tree: kph itself writes to them (the hard-linked copy's file is replaced by
    a copy of its own) and GNU patch opens them, so ``+++ b//etc/shadow`` or
    ``+++ b/../../x`` would reach a file outside the copy; such a patch is refused
    whole. Every line that could be a header is looked at, hunk bodies included (a
    removed line ``-- /x`` reads as ``--- /x``): a false alarm costs a rebased patch, a
    missed header a file outside the tree.

    :raise SetupError: a name is absolute or has a ``..`` component (the patch, its line
        and the name in one line).
    """
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        got = _names(line)
        if got is None:
            continue
        names, prefixed = got
        for name in names:
            why = _outside(name, prefixed)
            if why:
                raise SetupError(f"--patch {patch}: line {n} names {name!r}, outside the tree "
                                 f"({why})", "a patch may change only files inside the tree: "
                                 "make it with `git format-patch` or `diff -u` from the tree's "
                                 "top (a/ and b/ prefixes, no ..)")
        for name in names:
            if name in ("/dev/null", "") or (prefixed and "/" not in name):
                continue
            out.append(name.split("/", 1)[1] if prefixed else name)
    return list(dict.fromkeys(rel for rel in out if rel))


def _no_symlink_on_the_way(patch: Path, tree: Path, rel: str) -> None:
    """Each existing component of ``tree/rel`` is a real directory or file, not a symbolic
    link: a link (``drivers -> /etc``) would take the write out of the tree however
    confined the name is.

    :raise SetupError: the first link, named with the patch."""
    cur = tree
    for part in Path(rel).parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return                          # a new file (or directory): patch creates it
        if stat.S_ISLNK(st.st_mode):
            raise SetupError(f"--patch {patch}: {rel} goes through the symbolic link "
                             f"{cur.relative_to(tree)} in the tree",
                             "kph does not patch through links: patch the file the link "
                             "points to, inside the tree")


def _own_copy(f: Path) -> None:
    """Replace the hard link ``f`` (shared with the original tree) by a copy of its own,
    with its mode (a script stays executable); the new file is created with
    ``O_EXCL|O_NOFOLLOW``, so nothing planted in its place is followed."""
    st = os.lstat(f)
    if not stat.S_ISREG(st.st_mode):
        return
    with open(f, "rb") as fh:
        data = fh.read()
    f.unlink()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IMODE(st.st_mode))
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def first_rejected_hunk(patch: Path, output: str, text: str | None = None) -> str:
    """``FILE hunk #N (@@ -L,n +L,n @@ CONTEXT)`` of the first hunk ``patch`` rejected,
    from GNU patch's ``output`` and the patch's ``text`` (default: the file's)."""
    current, failed = None, None
    for ln in output.splitlines():
        m = re.match(r"(?:checking|patching) file '?([^']+?)'?$", ln.strip())
        if m:
            current = m[1]
        m = re.match(r"Hunk #(\d+) FAILED at (\d+)", ln.strip())
        if m and current:
            failed = (current, int(m[1]), m[2])
            break
        if ln.startswith("can't find file to patch") or "No file to patch" in ln:
            return f"{current or 'a file'}: no such file in the tree"
    if failed is None:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()]
        return tail[-1] if tail else "patch failed"
    name, n, line = failed
    hunks: list[str] = []
    in_file = False
    for ln in (text if text is not None else patch.read_text(errors="replace")).splitlines():
        if ln.startswith("+++ "):
            in_file = ln[4:].split("\t")[0].endswith(name)
        elif in_file and ln.startswith("@@"):
            hunks.append(ln)
    header = hunks[n - 1] if 0 < n <= len(hunks) else ""
    return f"{name} hunk #{n} {header} (the tree differs at line {line})".replace("  ", " ")


def _read_patches(src: Path, patches: list[Path]) -> tuple[list[bytes], list[list[str]]]:
    """Each patch's bytes (read once: what is checked is what GNU patch gets) and the
    files it changes, none of them through a link in ``src``."""
    if shutil.which("patch") is None:
        raise SetupError("--patch needs GNU patch", "apt-get install patch (./setup.sh does)")
    datas = [p.read_bytes() for p in patches]
    targets = []
    for p, data in zip(patches, datas):
        rels = patch_targets(p, data.decode(errors="replace"))
        for rel in rels:
            _no_symlink_on_the_way(p, src, rel)
        targets.append(rels)
    return datas, targets


def _patch_copy(src: Path, tree: Path, patches: list[Path], datas: list[bytes],
                targets: list[list[str]], say: Progress) -> None:
    """Apply ``patches`` in order to ``tree``, a hard-linked copy of ``src``: each target
    becomes a file of the copy's own first, so ``src`` is never written.

    :raise SetupError: a patch that does not apply (its first rejected hunk)."""
    for p, data, rels in zip(patches, datas, targets):
        for rel in rels:                    # the copy's own file, not src's
            _no_symlink_on_the_way(p, tree, rel)     # the copy, as it is now
            if (tree / rel).is_file():
                _own_copy(tree / rel)
        proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-r", "-",
                               "--no-backup-if-mismatch", "-d", str(tree)],
                              input=data, capture_output=True, timeout=300,
                              check=False, env={**os.environ, "LC_ALL": "C"})
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr).decode(errors="replace")
            raise SetupError(f"{p.name} does not apply to {src.name}: "
                             f"{first_rejected_hunk(p, output, data.decode(errors='replace'))}",
                             "rebase the patch on this tree")
        say(f"kernel: applied {p.name}")


def _patch_list(patches: list[Path], datas: list[bytes]) -> str:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {p}\n" for p, d in zip(patches, datas))


def apply_patches(src: Path, patches: list[Path], progress: Progress | None = None) -> Path:
    """A copy of ``src`` with ``patches`` applied in order:
    ``$KPH_CACHE/src/<tree>+<digest>/`` (hard links to ``src``'s files, except the patched
    ones, which are copies of their own), made once; its path. ``src`` is never changed.

    Each patch is read once: those bytes are checked (``patch_targets``, no symbolic link
    on a target's way), hashed and given to GNU patch on its stdin, so a patch file
    changed meanwhile cannot slip another target past the check.

    :raise SetupError: a patch names a path outside the tree or through a link, or does
        not apply (its first rejected hunk); nothing is left behind.
    """
    say = progress or (lambda s: None)
    datas, targets = _read_patches(src, patches)
    h = hashlib.sha256()
    for data in datas:
        h.update(hashlib.sha256(data).digest())
    dest = sources_dir() / f"{src.name}+{h.hexdigest()[:12]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(dest.parent / f".{dest.name}.lock", LOCK_TIMEOUT,
                   "another kph is patching the same tree: wait for it")
    try:
        stamp = dest / ".kph-patches"
        if stamp.is_file():
            say(f"kernel: {dest.name} is patched already")
            return dest
        tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            say(f"kernel: copying {src.name} (hard links) to apply {len(patches)} patch(es)")
            run(["cp", "-al", str(src), str(tmp)], "copying the tree", timeout=900)
            _patch_copy(src, tmp, patches, datas, targets, say)
            (tmp / ".kph-patches").write_text(_patch_list(patches, datas))
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest
    finally:
        os.close(fd)


# ---------------------------------------------------------------- variants of one tree

#: The variant tree records the patches it holds now and the files they changed.
VARIANT_STAMP = ".kph-variant"


def variant_dir(src: Path) -> Path:
    """``$KPH_CACHE/src/<tree>+variants``: the one copy of ``src`` that every patched
    variant of it is built in, one at a time."""
    return sources_dir() / f"{src.name}+variants"


def _restore(src: Path, tree: Path, rel: str) -> None:
    """Put ``src``'s ``rel`` back in ``tree`` as a new file (a new mtime, so make rebuilds
    what depends on it), or remove it where ``src`` has none (a file a patch created)."""
    orig, dest = src / rel, tree / rel
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    if orig.is_file() and not orig.is_symlink():
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     stat.S_IMODE(orig.stat().st_mode))
        with os.fdopen(fd, "wb") as out, open(orig, "rb") as fh:
            shutil.copyfileobj(fh, out)


@contextlib.contextmanager
def variant(src: Path, patches: list[Path], progress: Progress | None = None,
            jobs: int | None = None) -> Iterator[KernelBuild]:
    """``src`` with exactly ``patches`` applied, built, in its variant tree
    (:func:`variant_dir`) and that tree's one build directory, held for the caller (who
    makes an image from the build) and released after.

    A corpus of fixes undone is many small patches on one tree: a cold build for each
    is minutes, so every variant of a tree shares one copy and one build directory. The
    files the previous variant's patches changed are put back as they are in ``src``
    (with a new mtime), this variant's patches are applied, and make rebuilds what
    changed in between (both patches' files and what includes them), not the tree. The
    first variant of a tree is a cold build.

    :raise SetupError: a patch that does not apply (the tree is put back to ``src``'s
        state, with no patch), a failed build.
    """
    say = progress or (lambda s: None)
    datas, targets = _read_patches(src, patches)
    tree = variant_dir(src)
    tree.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(tree.parent / f".{tree.name}.lock", LOCK_TIMEOUT,
                   f"another kph is building a variant of {src.name}: wait for it")
    try:
        stamp = tree / VARIANT_STAMP
        if not stamp.is_file():
            shutil.rmtree(tree, ignore_errors=True)
            say(f"kernel: copying {src.name} (hard links) as the tree of its patched variants")
            tmp = tree.parent / f".tmp-{tree.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            run(["cp", "-al", str(src), str(tmp)], "copying the tree", timeout=900)
            (tmp / VARIANT_STAMP).write_text("")
            tmp.rename(tree)
        want = _patch_list(patches, datas)
        held = stamp.read_text()
        lines = held.split("\n", 1)
        if lines[0] != hashlib.sha256(want.encode()).hexdigest():
            changed = [r for r in (lines[1].split("\n") if len(lines) > 1 else []) if r]
            if changed:
                say(f"kernel: {tree.name}: putting back {len(changed)} file(s) of the "
                    "previous variant")
            for rel in changed:
                _restore(src, tree, rel)
            stamp.write_text("")            # src's state: no patch
            try:
                _patch_copy(src, tree, patches, datas, targets, say)
            except BaseException:
                for rel in {r for rels in targets for r in rels}:
                    _restore(src, tree, rel)
                raise
            rels = sorted({r for t in targets for r in t})
            stamp.write_text(hashlib.sha256(want.encode()).hexdigest() + "\n"
                             + "".join(f"{r}\n" for r in rels))
        else:
            say(f"kernel: {tree.name} holds these patches already")
        yield build(tree, default_out(tree), jobs=jobs, progress=progress)
    finally:
        os.close(fd)


def default_out(src: Path) -> Path:
    """``$KPH_CACHE/kbuild/<tree name>-<hash of its path>``: one build directory a tree."""
    return builds_dir() / f"{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}"


def _make(src: Path, out: Path, *args: str) -> list[str]:
    return ["make", "-C", str(src), f"O={out}", "ARCH=x86_64", *args]


def configure(src: Path, out: Path, fragment: Path = FRAGMENT,
              progress: Progress | None = None) -> str:
    """tinyconfig + ``fragment`` + olddefconfig into ``out/.config``, unless ``out`` was
    configured with this very fragment already; the config's sha256.

    :raise SetupError: an option of the fragment did not survive olddefconfig (named).
    """
    say = progress or (lambda s: None)
    frag = fragment.read_text()
    config = out / ".config"
    stamp = out / STAMP
    if not (config.is_file() and stamp.is_file() and stamp.read_text() == frag):
        out.mkdir(parents=True, exist_ok=True)
        say(f"kernel: configuring {src.name} in {out} (tinyconfig + {fragment.name})")
        run(_make(src, out, "tinyconfig"), "make tinyconfig", timeout=300)
        run([str(src / "scripts/kconfig/merge_config.sh"), "-m", "-O", str(out), str(config),
             str(fragment)], "merging the config fragment", cwd=src, timeout=120)
        run(_make(src, out, "olddefconfig"), "make olddefconfig", timeout=300)
        stamp.write_text(frag)
    text = config.read_text()
    gone = missing_options(text, required_options(fragment))
    if gone:
        stamp.unlink(missing_ok=True)
        raise SetupError(f"{src.name} cannot be configured with {', '.join(gone)}"
                         f" (a dependency this tree lacks, or an option it does not have)",
                         f"see `make -C {src} O={out} menuconfig`, or edit {fragment}")
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- building

_ERROR_RE = re.compile(r"^(?:\S+:\d+:(?:\d+:)? (?:fatal )?error: .*|.*\*\*\* .*|.*: undefined reference to .*)$",
                       re.M)


def first_error(log: str) -> str:
    """The first compiler (or linker, or make) error of a build log, one line."""
    m = _ERROR_RE.search(log)
    if m:
        return m[0].strip()
    tail = [ln for ln in log.strip().splitlines() if ln.strip()]
    return tail[-1].strip() if tail else "no output"


def build(src: Path, out: Path | None = None, *, jobs: int | None = None,
          fragment: Path = FRAGMENT, progress: Progress | None = None,
          timeout: float = BUILD_TIMEOUT) -> KernelBuild:
    """Configure (once) and build ``src`` into ``out``: ``bzImage`` and ``modules``.

    :raise SetupError: not a tree, host tools missing, an option the tree cannot take, or
        the build failed (its first error; the whole log is ``out/kph-build.log``).
    """
    src = check_tree(src)
    check_host_tools()
    out = Path(out).expanduser().resolve() if out is not None else default_out(src)
    say = progress or (lambda s: None)
    out.mkdir(parents=True, exist_ok=True)
    fd = lock_file(out / ".kph-lock", LOCK_TIMEOUT,
                   f"another kph is building in {out}: wait for it, or pass another --out")
    try:
        return _build_locked(src, out, jobs, fragment, say, timeout)
    finally:
        os.close(fd)


def _build_locked(src: Path, out: Path, jobs: int | None, fragment: Path, say: Progress,
                  timeout: float) -> KernelBuild:
    config_sha = configure(src, out, fragment, say)
    version = tree_version(src)
    jobs = jobs or os.cpu_count() or 1
    args = [f"-j{jobs}", "bzImage", "modules"]
    if shutil.which("ccache"):
        args.append("CC=ccache gcc")
    log_path = out / "kph-build.log"
    say(f"kernel: building {version} in {out} ({jobs} jobs{', ccache' if 'CC=ccache gcc' in args else ''})")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_make(src, out, *args), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                env={**os.environ, "LC_ALL": "C"},   # plain quotes in errors
                                preexec_fn=pdeathsig, start_new_session=True)
        def kill() -> None:             # make and every compiler it started
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        # A build that hangs silently prints nothing: the deadline is a timer, not a line.
        expired = threading.Event()
        watchdog = threading.Timer(timeout, lambda: (expired.set(), kill()))
        watchdog.daemon = True
        watchdog.start()
        compiled, last = 0, t0
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if line.lstrip().startswith(("CC ", "AS ", "LD ", "AR ")):
                    compiled += 1
                now = time.monotonic()
                if now - last >= 15:
                    last = now
                    say(f"kernel: building, {compiled} steps done, {now - t0:.0f} s")
            proc.wait(timeout=10.0)     # its output is closed: make is exiting
        except BaseException:
            if proc.poll() is None:
                kill()
            stop_process(proc, [(None, 5.0), (signal.SIGKILL, 5.0)])
            raise
        finally:
            watchdog.cancel()
    if expired.is_set():
        raise SetupError(f"the kernel build took over {timeout:.0f} s and was stopped",
                         f"see {log_path}")
    if proc.returncode != 0:
        raise SetupError(f"the kernel build failed: {first_error(log_path.read_text(errors='replace'))}",
                         f"the whole log is {log_path}")
    result = KernelBuild(src, out, version, config_sha)
    for f in (result.bzimage, result.vmlinux):
        if not f.is_file():
            raise SetupError(f"the kernel build made no {f}", f"see {log_path}")
    say(f"kernel: built {version} in {time.monotonic() - t0:.0f} s: {result.bzimage}")
    return result


@contextlib.contextmanager
def prepare_tree(tree: str | os.PathLike[str], patches: list[str | os.PathLike[str]] = (),  # type: ignore[assignment]
                 *, out: str | os.PathLike[str] | None = None, jobs: int | None = None,
                 progress: Progress | None = None) -> Iterator[KernelBuild]:
    """The built kernel of ``tree`` (``kph image build --tree``), held while the caller
    uses its build directory:

    - a series (``6.12``): Debian's source of it, fetched when missing, then as a tree;
    - a source tree: built (``build``; incremental when built before); with ``patches``,
      in the tree's variant tree (:func:`variant`: one copy and one build directory for
      every patched variant, rebuilt incrementally), or with ``out``, in a copy of its
      own (``apply_patches``) built there;
    - a build directory built already (``O=``, or a tree built in place): used as it is.

    :raise SetupError: each of the bad inputs, in one line.
    """
    pats = check_patches(list(patches))
    text = str(tree)
    if is_series(text):
        src = fetch_source(text, progress)
    else:
        p = Path(text).expanduser().resolve()
        if p.is_dir() and is_build_dir(p):
            if pats:
                raise SetupError(f"--patch needs a source tree, and {p} is a build directory "
                                 "(built already)", f"pass its source tree: --tree {(p / 'source').resolve()}"
                                 if (p / "source").exists() else "pass the source tree")
            yield use_built(p)
            return
        src = check_tree(p)
    if pats and out is None:
        with variant(src, pats, progress, jobs) as kb:
            yield kb
        return
    if pats:
        src = apply_patches(src, pats, progress)
    yield build(src, out, jobs=jobs, progress=progress)
