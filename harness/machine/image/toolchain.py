"""Building the in-guest module (``kph_kprobes.ko``) with each kernel's own compiler.

A kernel module must be built with the headers of its kernel, and kbuild wants the
compiler the kernel was built with. The host's own suite (Debian 12) is easy: its
``linux-headers-<abi>`` install with apt and use the host's gcc-12. Debian 13's kernels
(6.12, 7.3) want gcc-14, and their kbuild helpers (``fixdep``, ``modpost``) are linked
against Debian 13's glibc, so they cannot run on the host at all.

So, as for QEMU, a private Debian 13 tree: ``$KPH_CACHE/toolchain/trixie/tree``, the
dependency closure of ``linux-headers-<abi>`` (which brings gcc-14, binutils and the
kbuild package) plus make and the shell tools kbuild calls, unpacked with ``dpkg-deb -x``
(no maintainer scripts: the ``awk`` alternative is linked by hand). Headers of further
Debian 13 kernels are unpacked into the same tree. The build runs ``make`` inside it with
``chroot``, in a private mount namespace (``unshare --mount``) that has ``/dev`` and
``/proc`` bound: nothing is mounted on the host and nothing outlives the build. That
needs root (or unprivileged user namespaces, tried with ``unshare --user
--map-root-user`` otherwise).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ... import constants as C
from ...constants import cache_dir
from ...procs import lock_file
from ...errors import SetupError
from .kernels import KernelRelease
from .debian import TRIXIE, PrivateApt, unpack

Progress = Callable[[str], None]
#: Tools kbuild runs besides the compiler. The headers package brings the compiler, but
#: not always the assembler under the name gcc calls: 7.3's ``linux-headers`` depends on
#: ``gcc-14-for-host`` (``x86_64-linux-gnu-gcc-14`` and ``x86_64-linux-gnu-as`` only), and
#: gcc then fails with "cannot execute 'as'" (seen by kbuild as "Compiler does not support
#: fentry?"); 6.12's depends on ``gcc-14``, which pulls ``binutils``. So ``binutils`` is
#: named here, whatever the headers bring.
TOOLS = ("make", "dash", "bash", "coreutils", "sed", "grep", "mawk", "findutils", "diffutils",
         "xz-utils", "kmod", "binutils")
#: Links that Debian's maintainer scripts (update-alternatives) would make.
ALTERNATIVES = {"usr/bin/awk": "mawk"}
BUILD_TIMEOUT = 600


@dataclass(frozen=True)
class Toolchain:
    """Where and how a kernel's modules get built."""

    kind: str                   # "host" or "chroot"
    headers: Path               # the headers directory, as the build sees it
    root: Path | None = None    # the chroot tree (kind "chroot")

    def describe(self) -> str:
        if self.kind == "host":
            return f"host gcc with {self.headers}"
        return f"{compiler_version(self.root) or 'gcc'} in {self.root} (chroot) with {self.headers}"


def tree_dir() -> Path:
    return cache_dir() / "toolchain" / "trixie"


def compiler_version(root: Path | None) -> str | None:
    """``gcc-14 14.2.0`` (the first line of ``gcc --version``) of a toolchain tree."""
    if root is None:
        return None
    meta = root.parent / "toolchain.json"
    try:
        return json.loads(meta.read_text()).get("gcc")
    except (OSError, ValueError):
        return None


def for_kernel(rel: KernelRelease, progress: Progress | None = None) -> Toolchain:
    """The toolchain that builds modules for ``rel``, provisioned if needed.

    :raise SetupError: host headers missing (with the apt command), or the private tree
        could not be made.
    """
    if rel.origin == "host":
        headers = Path(f"/usr/src/linux-headers-{rel.abi}")
        if not (headers / "Makefile").exists():
            raise SetupError(f"kernel headers for {rel.abi} are missing ({headers})",
                             f"apt-get install linux-headers-{rel.abi} (./setup.sh does it "
                             "for the default kernel)")
        return Toolchain("host", headers)
    return _chroot_toolchain(rel, progress)


def _chroot_toolchain(rel: KernelRelease, progress: Progress | None) -> Toolchain:
    base = tree_dir()
    base.mkdir(parents=True, exist_ok=True)
    tree = base / "tree"
    meta_path = base / "toolchain.json"
    headers = f"usr/src/linux-headers-{rel.abi}"
    fd = lock_file(base / ".lock", C.TOOLCHAIN_LOCK_TIMEOUT,
                   "another kph provisions the kernel-build toolchain; let it finish, or end it")
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"debs": []}
        have = {d.split("_", 1)[0] for d in meta["debs"]}
        # A tree made before a tool joined TOOLS gets it now (a tree from an older kph
        # would otherwise fail the same way on every build).
        if (tree / headers / "Makefile").exists() and have.issuperset(TOOLS):
            return Toolchain("chroot", Path("/") / headers, tree)
        apt = PrivateApt(TRIXIE)
        apt.update(progress)
        pkg = f"linux-headers-{rel.abi}"
        target = "trixie-backports" if "bpo" in apt.cache("policy", pkg) else None
        debs = apt.fetch([pkg, *TOOLS], target, progress)
        new = [d for d in debs if d.name not in set(meta["debs"])]
        if progress:
            progress(f"toolchain: unpacking {len(new)} packages into {tree}")
        unpack(new, tree)
        apt.discard(debs)
        for link, target_name in ALTERNATIVES.items():
            p = tree / link
            if not p.exists():
                p.symlink_to(target_name)
        meta["debs"] = sorted(set(meta["debs"]) | {d.name for d in debs})
        meta["gcc"] = _gcc_version(tree)
        meta_path.write_text(json.dumps(meta, indent=1))
        if not (tree / headers / "Makefile").exists():
            raise SetupError(f"{pkg} unpacked without {headers}/Makefile",
                             "this package layout is new to kph: report it")
        return Toolchain("chroot", Path("/") / headers, tree)
    finally:
        os.close(fd)


#: The root shell's script: the tree and the command are its arguments ($1, "$@"), never
#: its text, so a cache path with spaces or ``;`` is a path, not a command run as root.
CHROOT_SCRIPT = ('mount --rbind /dev "$1/dev" && mount -t proc proc "$1/proc" && '
                 'exec chroot "$@"')


def _chroot_cmd(tree: Path, argv: list[str]) -> list[str]:
    """``argv`` run inside ``tree`` with /dev and /proc, in a private mount namespace."""
    ns = ["unshare", "--mount", "--fork"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount", "--fork"]
    return [*ns, "sh", "-c", CHROOT_SCRIPT, "sh", os.path.abspath(tree), *argv]


def _gcc_version(tree: Path) -> str | None:
    for d in ("dev", "proc"):
        (tree / d).mkdir(exist_ok=True)
    # gcc-14 from ``gcc-14``; only x86_64-linux-gnu-gcc-14 when the headers bring
    # ``gcc-14-for-host`` alone (7.3): kbuild calls the latter (.kernelvariables' CC)
    bindir = tree / "usr/bin"
    gccs = sorted(bindir.glob("gcc-[0-9]*")) or sorted(bindir.glob("x86_64-linux-gnu-gcc-[0-9]*"))
    if not gccs:
        return None
    out = subprocess.run(_chroot_cmd(tree, [f"/usr/bin/{gccs[-1].name}", "--version"]),
                         capture_output=True, text=True, timeout=60, check=False)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return f"{gccs[-1].name} {first.split()[-1]}" if first else gccs[-1].name


def build_module(tc: Toolchain, sources: list[Path], name: str, dest: Path) -> None:
    """``make -C <headers> M=<scratch> modules`` with ``sources``; copy ``name.ko`` to
    ``dest``.

    :raise SetupError: the build failed (the compiler's last lines are in the message).
    """
    if tc.kind == "host":
        scratch_parent = None
    else:
        assert tc.root is not None
        scratch_parent = tc.root / "tmp"
        scratch_parent.mkdir(parents=True, exist_ok=True)
        for d in ("dev", "proc"):
            (tc.root / d).mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kph-kmod-", dir=scratch_parent) as tmp:
        for f in sources:
            shutil.copy(f, tmp)
        if tc.kind == "host":
            if not shutil.which("make"):
                raise SetupError("make is missing", "apt-get install make (./setup.sh does)")
            cmd = ["make", "-C", str(tc.headers), f"M={tmp}", "modules"]
        else:
            assert tc.root is not None
            inside = "/" + str(Path(tmp).relative_to(tc.root))
            cmd = _chroot_cmd(tc.root, ["/usr/bin/make", "-C", str(tc.headers), f"M={inside}",
                                        "modules"])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise SetupError(f"building {name}.ko took more than {BUILD_TIMEOUT} s") from exc
        ko = Path(tmp) / f"{name}.ko"
        if proc.returncode != 0 or not ko.exists():
            text = (proc.stderr or proc.stdout).strip()
            # the compiler's first error names the cause; make's last lines only say "Error 1"
            first = next((ln.strip() for ln in text.splitlines() if " error: " in ln
                          or ln.startswith("error:")), "")
            why = (first + " ... " if first else "") + text[-300:]
            hint = f"check {sources[0].parent} and {tc.describe()}"
            if tc.kind == "chroot" and ("unshare" in why or "Operation not permitted" in why):
                hint = ("building for this kernel needs a chroot: run as root, or allow "
                        "unprivileged user namespaces")
            raise SetupError(f"building {name}.ko failed: {why}", hint)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ko, dest)
