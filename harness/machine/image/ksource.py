"""Kernel source trees: Debian's ``linux-source-X.Y`` fetched and unpacked once into
``$KPH_CACHE/src/linux-source-<version>/``, and the copies kph makes of a tree (hard links)
with patches applied: each patch's paths checked as GNU patch would take them (confined
to the tree, no symbolic link on the way) before ``patch`` runs, the first rejected hunk
named when one does not apply. Building them is :mod:`harness.machine.image.kbuild`'s.

``kph kernel fetch 6.12`` unpacks Debian's ``linux-source-6.12`` (the source of Debian's own
6.12 kernels, Debian's patches applied) into ``$KPH_CACHE/src/linux-source-<version>/``.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Callable

from ...constants import cache_dir
from ...errors import SetupError
from ...procs import lock_file
from .debian import TRIXIE, PrivateApt, run, unpack

Progress = Callable[[str], None]

#: How long a second fetch or build of the same tree waits for the first.
LOCK_TIMEOUT = 3600.0
#: A tree's default build directory, inside it (see the module docstring).
BUILD_SUBDIR = ".kph-build"
#: The variant tree records the patches it holds now and the files they changed.
VARIANT_STAMP = ".kph-variant"


def sources_dir() -> Path:
    return cache_dir() / "src"


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


def unpacked_sources(series: str) -> list[Path]:
    """Debian's ``linux-source-<series>`` trees unpacked in the cache, oldest first: not
    the patched copies (``.kph-patches``) nor the variant trees (``.kph-variant``) kph
    makes of them, whose files are not Debian's."""
    return sorted((d for d in sources_dir().glob(f"linux-source-{series}.*")
                   if (d / "Makefile").is_file() and not (d / ".kph-patches").exists()
                   and not (d / VARIANT_STAMP).exists()), key=lambda d: d.name)


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


def link_copy(src: Path, dest: Path) -> None:
    """``dest``: a copy of the tree ``src`` made of hard links, without its build
    directory (whose files a build in the copy would otherwise write through)."""
    dest.mkdir()
    entries = [str(e) for e in src.iterdir() if e.name != BUILD_SUBDIR]
    if entries:
        run(["cp", "-al", *entries, str(dest)], "copying the tree", timeout=900)


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


def read_patches(src: Path, patches: list[Path]) -> tuple[list[bytes], list[list[str]]]:
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


def patch_copy(src: Path, tree: Path, patches: list[Path], datas: list[bytes],
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


def patch_list(patches: list[Path], datas: list[bytes]) -> str:
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
    datas, targets = read_patches(src, patches)
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
            link_copy(src, tmp)
            patch_copy(src, tmp, patches, datas, targets, say)
            (tmp / ".kph-patches").write_text(patch_list(patches, datas))
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest
    finally:
        os.close(fd)
