"""Kernels built from source: Debian's ``linux-source-X.Y`` (fetched by
:mod:`harness.machine.image.ksource`), or any tree (a git checkout, a stable tree, a
bisect step), configured small and built out of tree.

``kph kernel build SRC`` configures the way virtme-ng does, not with Debian's full config:
``make tinyconfig``, then the fragment ``images/kernel.config`` merged over it
(``scripts/kconfig/merge_config.sh``), then ``make olddefconfig``; every ``=y`` of the
fragment must survive (a dependency the tree lacks is named). Then ``make bzImage modules``
in a build directory of its own (``O=``), with ``-j`` the host's CPUs, ``ccache`` when it is
there, the build's progress on stderr, and on failure the first compiler error. A build
directory that is configured and built already is built incrementally (make decides).

The default build directory is ``SRC/.kph-build`` (the kernel's own ``.gitignore`` ignores
it, as every dot-name): kbuild then names the tree ``..`` (the top Makefile's
``srctree := ..`` for a direct subdirectory) instead of its absolute path, so the same
file of two trees compiles with the same command, and ``ccache`` (its cache in
``$KPH_CACHE/ccache``, the build directory left out of its hash) turns a second tree's
cold build into cache hits: Debian's source, its patched variants and a bisect's
commits share what did not change. A tree kph cannot write to is built in
``$KPH_CACHE/kbuild/`` as before.

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
from .debian import run
from .ksource import (BUILD_SUBDIR, LOCK_TIMEOUT, VARIANT_STAMP, apply_patches, check_patches,
                      fetch_source, is_series, link_copy, patch_copy, patch_list, read_patches,
                      sources_dir)
from .store import RECIPE_DIR

Progress = Callable[[str], None]

#: The config fragment merged over tinyconfig.
FRAGMENT = RECIPE_DIR / "kernel.config"
#: the debug options ``--debug`` merges after :data:`FRAGMENT` (lockdep, PROVE_RCU,
#: DEBUG_ATOMIC_SLEEP, KASAN)
DEBUG_FRAGMENT = RECIPE_DIR / "kernel-debug.config"
#: a debug build's directory in a tree, beside :data:`BUILD_SUBDIR`
DEBUG_SUFFIX = "-debug"
#: Host programs a kernel build runs (and the package that brings each).
BUILD_TOOLS = {"gcc": "gcc", "make": "make", "flex": "flex", "bison": "bison", "bc": "bc",
               "pahole": "dwarves"}
#: Host headers the build compiles against (objtool needs libelf; certificates, libssl).
BUILD_HEADERS = {"/usr/include/gelf.h": "libelf-dev", "/usr/include/openssl/ssl.h": "libssl-dev"}
#: A cold build of the minimal config takes ~8 min on 2 CPUs; a stuck one ends here.
BUILD_TIMEOUT = 3600.0
#: The build directory records the fragment it was configured with.
STAMP = ".kph-fragment"


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


# ---------------------------------------------------------------- variants of one tree



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
            jobs: int | None = None, debug: bool = False) -> Iterator[KernelBuild]:
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
    datas, targets = read_patches(src, patches)
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
            link_copy(src, tmp)
            (tmp / VARIANT_STAMP).write_text("")
            tmp.rename(tree)
        want = patch_list(patches, datas)
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
                patch_copy(src, tree, patches, datas, targets, say)
            except BaseException:
                for rel in {r for rels in targets for r in rels}:
                    _restore(src, tree, rel)
                raise
            rels = sorted({r for t in targets for r in t})
            stamp.write_text(hashlib.sha256(want.encode()).hexdigest() + "\n"
                             + "".join(f"{r}\n" for r in rels))
        else:
            say(f"kernel: {tree.name} holds these patches already")
        yield build(tree, default_out(tree, debug), jobs=jobs, progress=progress,
                    fragment=fragment_for(debug))
    finally:
        os.close(fd)


def default_out(src: Path, debug: bool = False) -> Path:
    """``SRC/.kph-build`` (:data:`BUILD_SUBDIR`), or for a tree kph cannot write to
    ``$KPH_CACHE/kbuild/<tree name>-<hash of its path>``: one build directory a tree (and
    one more for its ``--debug`` build, ``-debug`` after the name: switching one
    directory between two configs would rebuild the tree each time)."""
    tail = DEBUG_SUFFIX if debug else ""
    if os.access(src, os.W_OK):
        return src / (BUILD_SUBDIR + tail)
    return builds_dir() / f"{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}{tail}"


def fragment_for(debug: bool) -> Path:
    """The fragment a build merges: :data:`FRAGMENT`, or with ``debug`` it and
    :data:`DEBUG_FRAGMENT` in one file (``$KPH_CACHE/kbuild/kernel+debug.config``, written
    when its text changes)."""
    if not debug:
        return FRAGMENT
    text = FRAGMENT.read_text() + "\n" + DEBUG_FRAGMENT.read_text()
    f = builds_dir() / "kernel+debug.config"
    if not f.is_file() or f.read_text() != text:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f".{f.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(f)
    return f


def ccache_env() -> dict[str, str]:
    """The environment a build's ``ccache`` runs in: its cache in ``$KPH_CACHE/ccache``
    (unless ``CCACHE_DIR`` says otherwise) and the build directory left out of the hash
    (``-g`` would put it in), so that trees built in ``SRC/.kph-build`` share hits. The
    debug info of a hit names the build directory of the compile that filled it, whose
    tree had the very same file.

    And ccache's depend mode (unless ``CCACHE_NODEPEND`` is set): a miss compiles once and
    takes its manifest from the ``-Wp,-MMD`` file kbuild has gcc write, where the default
    mode first runs the preprocessor to hash its output, then compiles: a cold build of
    6.12's ``kernel/`` and ``mm/`` took 67 s against 84-87 (2026-12-01, this machine, 2
    jobs, twice each). Hits are unchanged: the kernel's were all direct-mode ones (the
    source and its headers hashed), which depend mode keeps; a second tree's build of the
    same objects took 6.5 s."""
    if not shutil.which("ccache"):
        return {}
    env = {"CCACHE_DIR": os.environ.get("CCACHE_DIR") or str(cache_dir() / "ccache"),
           "CCACHE_NOHASHDIR": "1"}
    if "CCACHE_NODEPEND" not in os.environ:
        env["CCACHE_DEPEND"] = "1"
    return env


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
                                env={**os.environ, **ccache_env(),
                                     "LC_ALL": "C"},                  # plain quotes in errors
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
                 progress: Progress | None = None, debug: bool = False) -> Iterator[KernelBuild]:
    """The built kernel of ``tree`` (``kph image build --tree``), held while the caller
    uses its build directory (with ``debug``, its debug build: :data:`DEBUG_FRAGMENT`,
    in a build directory of its own):

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
            if debug:
                raise SetupError(f"--debug configures a build, and {p} is a build directory "
                                 "(built already)", "pass its source tree")
            if pats:
                raise SetupError(f"--patch needs a source tree, and {p} is a build directory "
                                 "(built already)", f"pass its source tree: --tree {(p / 'source').resolve()}"
                                 if (p / "source").exists() else "pass the source tree")
            yield use_built(p)
            return
        src = check_tree(p)
    if pats and out is None:
        with variant(src, pats, progress, jobs, debug) as kb:
            yield kb
        return
    if pats:
        src = apply_patches(src, pats, progress)
    yield build(src, out if out is not None else default_out(src, debug), jobs=jobs,
                progress=progress, fragment=fragment_for(debug))
