"""Issue 36 item 7: inputs that would reach outside what kph means to touch, each tried for
real and refused: a patch naming a file outside the kernel tree, an ssh target that is an
option, a planted key or link in the loopback sshd's directory, a path with shell syntax
in a root ``sh -c``. (A .deb swapped between its hash check and its unpacking:
tests/unit/test_debian.py.)

Every attack aims at a file of the test's own (never a system one) and the test checks
that file afterwards, byte and inode: the attack did not happen, not only that an error
was raised.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness.apps import loopback_sshd, remote
from harness.errors import SetupError
from harness.machine.image import ksource, toolchain

ROOT = Path(__file__).resolve().parents[2]


def _kph(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def _victim(path: Path) -> tuple[Path, tuple[int, int, bytes]]:
    """A file outside the tree the attack aims at, and its (inode, mtime, bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("line 1\nline 2\nline 3\nline 4\n")
    return path, _state(path)


def _state(path: Path) -> tuple[int, int, bytes]:
    st = os.lstat(path)
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


# ---------------------------------------------------------------- --patch paths

def _tree(root: Path) -> Path:
    """A kernel tree as far as apply_patches cares: a Makefile and one source file."""
    (root / "kernel").mkdir(parents=True)
    (root / "Makefile").write_text("VERSION = 6\n")
    (root / "kernel/fork.c").write_text("line 1\nline 2\nline 3\nline 4\n")
    return root


def _evil_patch(path: Path, new_name: str, old_name: str | None = None) -> Path:
    """A patch that changes ``line 2`` of the file its ``+++`` line names."""
    path.write_text(f"--- {old_name or 'a/kernel/fork.c'}\n+++ {new_name}\n"
                    "@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line two\n line 3\n")
    return path


@pytest.mark.parametrize("name, why", [
    ("b/{victim}", "an absolute path once -p1 strips its a/ or b/"),     # b//tmp/.../victim
    ("{victim}", "an absolute path"),
    ("b/../../../outside/victim.c", "a .. component"),
    ('"b/\\056\\056/\\056\\056/\\056\\056/outside/victim.c"', "a .. component"),  # git's quoting
])
def test_a_patch_naming_a_file_outside_the_tree_is_refused_and_the_file_untouched(
        tmp_path, monkeypatch, name, why):
    """``+++ b//etc/shadow`` made kph read, unlink and rewrite that file (breaking the
    hard link it assumed) before GNU patch even ran; here the target is a file of the
    test's, reachable from the copy ``$KPH_CACHE/src/.tmp-linux+.../``."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    victim, before = _victim(tmp_path / "outside/victim.c")
    src = _tree(tmp_path / "linux")
    p = _evil_patch(tmp_path / "evil.patch", name.format(victim=victim))
    with pytest.raises(SetupError) as e:
        ksource.check_patches([p])
    msg = str(e.value)
    assert "\n" not in msg and f"--patch {p}: line 2 names" in msg and f"({why})" in msg
    assert "inside the tree" in e.value.hint and "a/ and b/ prefixes" in e.value.hint
    # apply_patches checks again on its own (a caller may skip check_patches)
    with pytest.raises(SetupError, match="outside the tree"):
        ksource.apply_patches(src, [p])
    assert _state(victim) == before
    assert "line two" not in (src / "kernel/fork.c").read_text()
    assert not (tmp_path / "cache/src").exists() or \
        [d.name for d in (tmp_path / "cache/src").iterdir()] == []


def test_a_patch_through_a_symbolic_link_in_the_tree_is_refused(tmp_path, monkeypatch):
    """``drivers -> /elsewhere`` in the tree: ``+++ b/drivers/victim.c`` is a confined
    name, yet the copy's ``drivers/victim.c`` is the file outside (``cp -al`` keeps the
    link); kph rewrote it through the link."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    victim, before = _victim(tmp_path / "outside/victim.c")
    src = _tree(tmp_path / "linux")
    (src / "drivers").symlink_to(victim.parent)
    p = _evil_patch(tmp_path / "link.patch", "b/drivers/victim.c", "a/drivers/victim.c")
    ksource.check_patches([p])                  # the names themselves are inside the tree
    with pytest.raises(SetupError) as e:
        ksource.apply_patches(src, [p])
    assert str(e.value).startswith(f"--patch {p}: drivers/victim.c goes through the symbolic "
                                   "link drivers in the tree")
    assert "\n" not in str(e.value) and "points to" in e.value.hint
    assert _state(victim) == before


def test_kph_image_build_refuses_the_patch_in_one_line_before_fetching(tmp_path):
    """The CLI: exit 2, one line naming the patch, the path and the fix; nothing fetched
    (the cache stays empty although 6.12's source is not in it)."""
    victim, before = _victim(tmp_path / "outside/victim.c")
    p = _evil_patch(tmp_path / "shadow.patch", f"b/{victim}")
    r = _kph("image", "build", "--tree", "6.12", "--patch", str(p),
             env={"KPH_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --patch {p}: line 2 names "
                                                   f"'b/{victim}', outside the tree"), r.stderr
    assert "a/ and b/ prefixes" in lines[0]
    assert _state(victim) == before
    assert not (tmp_path / "cache/src").exists()


def test_a_patch_inside_the_tree_still_applies_and_keeps_the_file_mode(tmp_path, monkeypatch):
    """The checks refuse nothing legitimate: a patch of an executable script applies to
    the copy, the script stays executable there, the original tree is untouched."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    src = _tree(tmp_path / "linux")
    (src / "scripts").mkdir()
    (src / "scripts/gen.sh").write_text("line 1\nline 2\nline 3\nline 4\n")
    (src / "scripts/gen.sh").chmod(0o755)
    p = _evil_patch(tmp_path / "ok.patch", "b/scripts/gen.sh", "a/scripts/gen.sh")
    assert ksource.patch_targets(p, p.read_text()) == ["scripts/gen.sh"]
    copy = ksource.apply_patches(src, ksource.check_patches([p]))
    assert "line two" in (copy / "scripts/gen.sh").read_text()
    assert os.stat(copy / "scripts/gen.sh").st_mode & 0o777 == 0o755
    assert "line two" not in (src / "scripts/gen.sh").read_text()


# ---------------------------------------------------------------- ssh targets

def test_an_ssh_target_that_is_an_option_is_refused_before_ssh_runs(tmp_path, monkeypatch):
    proof = tmp_path / "proxy-ran"
    started = []
    monkeypatch.setattr(remote.subprocess, "Popen", lambda *a, **k: started.append(a))
    for target in (f"-oProxyCommand=touch {proof}", "-F/dev/null", "", "host name"):
        with pytest.raises(SetupError) as e:
            remote.Ssh(target).run("true")
        assert str(e.value).startswith(f"ssh target {target!r} ") and "\n" not in str(e.value)
        assert "[USER@]HOST" in e.value.hint
    assert started == [] and not proof.exists()


def test_kph_worker_prepare_refuses_an_option_target_in_one_line(tmp_path):
    """The report of issue 36: this ended in "error: [Errno 32] Broken pipe" after ssh had
    taken the target as an option."""
    proof = tmp_path / "proxy-ran"
    r = _kph("worker", "prepare", "--dir", str(tmp_path / "w"), "--",
             f"-oProxyCommand=touch {proof}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: ssh target '-oProxyCommand=touch {proof}' starts with '-': ssh would read it "
        "as an option; name a host: [USER@]HOST, or a Host of --ssh-config"]
    assert not proof.exists() and not (tmp_path / "w").exists()


def _fake_ssh(bindir: Path, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    (bindir / "ssh").write_text(f"#!/bin/sh\n{body}\n")
    (bindir / "ssh").chmod(0o755)


def test_ssh_gets_double_dash_before_the_target_and_a_dead_ssh_is_its_own_error(tmp_path,
                                                                              monkeypatch):
    """``--`` ends ssh's options whatever the target; and ssh ending before it read the
    upload is reported with ssh's own words, not as a broken pipe."""
    argv = tmp_path / "argv"
    _fake_ssh(tmp_path / "bin", f'printf "%s\\n" "$@" > {argv}; echo "ssh: connect to host '
              'build2: Connection refused" >&2; exit 255')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with pytest.raises(SetupError) as e:
        remote.Ssh("build2").run("cat > x", stdin=b"x" * (4 << 20), what="upload")
    args = argv.read_text().splitlines()
    assert args[args.index("--") + 1] == "build2" and args.index("--") < args.index("build2")
    assert "build2: upload failed: ssh: connect to host build2: Connection refused" in str(e.value)
    # and ssh itself, given an option-shaped host after --, runs no ProxyCommand
    proof = tmp_path / "proxy-ran"
    r = subprocess.run(["ssh", "-o", "BatchMode=yes", "--", f"-oProxyCommand=touch {proof}",
                        "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and not proof.exists()


def test_a_worker_directory_that_is_an_option_is_refused(monkeypatch):
    started = []
    monkeypatch.setattr(remote.subprocess, "Popen", lambda *a, **k: started.append(a))
    for d in ("-rf", "a//b", "x=y", ""):
        with pytest.raises(SetupError, match=r"--dir .* is not a plain path"):
            remote.prepare("build2", directory=d)
    assert started == []


# ---------------------------------------------------------------- the loopback sshd

def test_the_loopback_sshd_directory_is_new_private_and_never_the_predictable_one(tmp_path):
    """The old ``/tmp/kph-sshd-<pid>`` was taken as it was found: planted there, a
    directory with a ``userkey`` became root's ``authorized_keys``."""
    planted = Path(f"/tmp/kph-sshd-{os.getpid()}")
    a, b = loopback_sshd.LoopbackSshd(), loopback_sshd.LoopbackSshd(tmp_path)
    try:
        for s in (a, b):
            st = os.lstat(s.dir)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
            assert list(s.dir.iterdir()) == [] and s.dir != planted
        assert a.dir.parent == Path("/tmp") and b.dir.parent == tmp_path and a.dir != b.dir
    finally:
        shutil.rmtree(a.dir), shutil.rmtree(b.dir)


def test_an_unsafe_parent_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)                       # anyone may swap the private dir in it
    (tmp_path / "a b").mkdir()
    for parent, why in ((tmp_path / "link", "is a symbolic link"),
                        (open_dir, "can be written by others"),
                        (tmp_path / "a b", "has characters")):
        with pytest.raises(SetupError, match=why):
            loopback_sshd.LoopbackSshd(parent)
    assert list((tmp_path / "real").iterdir()) == [] and list(open_dir.iterdir()) == []


def test_a_planted_key_is_refused_not_authorized(tmp_path):
    """A key put in the directory before ``start`` is never taken (it would be root's
    authorized key); refused before sshd or ssh-keygen runs."""
    s = loopback_sshd.LoopbackSshd(tmp_path)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(s.dir / "userkey")],
                   check=True, timeout=60)
    planted = _state(s.dir / "userkey.pub")
    with pytest.raises(SetupError, match=r"userkey exists before the loopback sshd made it"):
        s.start()
    assert s.proc is None and not (s.dir / "authorized_keys").exists()
    assert not (s.dir / "hostkey").exists() and _state(s.dir / "userkey.pub") == planted


def test_a_planted_link_is_not_written_through(tmp_path, monkeypatch):
    """``authorized_keys`` planted as a link to a file elsewhere, before ``start`` or while
    it makes the keys: the key is never written there (``O_EXCL|O_NOFOLLOW``), the start
    is refused."""
    victim, before = _victim(tmp_path / "outside/authorized_keys")
    s = loopback_sshd.LoopbackSshd(tmp_path)
    (s.dir / "authorized_keys").symlink_to(victim)
    with pytest.raises(SetupError, match=r"authorized_keys exists before the loopback sshd "
                                         r"made it"):
        s.start()
    assert s.proc is None and _state(victim) == before
    s = loopback_sshd.LoopbackSshd(tmp_path)
    real_run = subprocess.run

    def keygen_then_plant(argv, **kw):
        out = real_run(argv, **kw)
        if argv[0] == "ssh-keygen" and argv[-1].endswith("userkey"):
            (s.dir / "authorized_keys").symlink_to(victim)
        return out
    monkeypatch.setattr(loopback_sshd.subprocess, "run", keygen_then_plant)
    with pytest.raises(SetupError, match=r"authorized_keys exists before the loopback sshd "
                                         r"wrote it"):
        s.start()
    assert s.proc is None and _state(victim) == before


def _recorders(bindir: Path, log: Path, *names: str) -> None:
    """Stand-ins for ``names`` that log their argv, one line each, and succeed."""
    bindir.mkdir(exist_ok=True)
    for n in names:
        (bindir / n).write_text(f'#!/bin/sh\nprintf "{n}" >> {log}\n'
                                f'for a in "$@"; do printf " [%s]" "$a" >> {log}; done\n'
                                f'echo >> {log}\n')
        (bindir / n).chmod(0o755)


@pytest.mark.skipif(os.geteuid() != 0, reason="the loopback sshd starts as root only")
def test_the_sshd_shell_gets_paths_as_arguments_not_as_script(tmp_path, monkeypatch):
    """The sshd tree's path with shell syntax in it (``$KPH_CACHE`` is anyone's choice) is
    handed to the root shell as an argument: nothing in it runs. ``unshare`` is dropped
    and ``mount`` stands in (the host's /run and /etc/passwd stay as they are); a fake
    sshd says it listens."""
    proof = tmp_path / "PWNED"
    tree = tmp_path / f"t;touch {proof};" / "tree"
    (tree / "usr/sbin").mkdir(parents=True)
    (tree / "usr/sbin/sshd").write_text(
        f'#!/bin/sh\nprintf "sshd %s [%s]\\n" "$*" "$LD_LIBRARY_PATH" >> {tmp_path / "log"}\n'
        'echo "Server listening on 127.0.0.1" >&2\nexec sleep 30\n')
    (tree / "usr/sbin/sshd").chmod(0o755)
    _recorders(tmp_path / "bin", tmp_path / "log", "mount", "mkdir")
    monkeypatch.setattr(loopback_sshd, "_tree", lambda: tree)
    real = subprocess.Popen

    def no_unshare(argv, **kw):
        if argv[0] != "unshare":
            return real(argv, **kw)             # ssh-keygen (subprocess.run is Popen)
        assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
        return real(argv[4:], env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"},
                    **kw)
    monkeypatch.setattr(loopback_sshd.subprocess, "Popen", no_unshare)
    with loopback_sshd.LoopbackSshd(tmp_path) as s:
        d = s.dir
        log = (tmp_path / "log").read_text()
    assert not proof.exists()
    assert f"mount [--bind] [{d}/passwd] [/etc/passwd]" in log
    assert f"sshd -D -e -f {d}/sshd_config [{tree}/usr/lib/x86_64-linux-gnu:" in log
    assert not d.exists()                       # the with block removes its directory


# ---------------------------------------------------------------- the chroot's sh -c

def test_the_chroot_shell_gets_the_tree_as_an_argument_not_as_script(tmp_path):
    """``_chroot_cmd``'s root ``sh -c`` with a toolchain tree whose path has ``;`` in it:
    the path reaches mount and chroot whole, and the ``touch`` in it never runs."""
    proof = tmp_path / "PWNED"
    tree = tmp_path / f"x;touch {proof};y" / "tree"
    tree.mkdir(parents=True)
    _recorders(tmp_path / "bin", tmp_path / "log", "mount", "chroot")
    cmd = toolchain._chroot_cmd(tree, ["/usr/bin/make", "-C", "/usr/src/h", "M=/tmp/a b"])
    sh = cmd[cmd.index("sh"):]                  # without unshare: the host's mounts stay
    subprocess.run(sh, check=True, timeout=30,
                   env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert not proof.exists()
    assert (tmp_path / "log").read_text().splitlines() == [
        f"mount [--rbind] [/dev] [{tree}/dev]", f"mount [-t] [proc] [proc] [{tree}/proc]",
        f"chroot [{tree}] [/usr/bin/make] [-C] [/usr/src/h] [M=/tmp/a b]"]
