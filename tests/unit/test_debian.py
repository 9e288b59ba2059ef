"""harness.machine.image.debian: a .deb is checked against the SHA256 of apt's package index before it
is used, wherever it came from ($KPH_DOWNLOADS keeps them across caches)."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from harness.machine.image import debian
from harness.constants import DOWNLOADS_ENV
from harness.errors import SetupError

NAME, VERSION = "kph-test", "1:1.0-1"


def build_deb(where: Path, content: str = "hello") -> Path:
    """A real, tiny .deb named as apt names its archives (the epoch's colon as %3a), its
    ``usr/share/kph/hello`` holding ``content``."""
    tree = where / f"pkg-{content}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "usr/share/kph").mkdir(parents=True)
    (tree / "usr/share/kph/hello").write_text(f"{content}\n")
    (tree / "DEBIAN/control").write_text(
        f"Package: {NAME}\nVersion: {VERSION}\nArchitecture: all\n"
        "Maintainer: kph <kph@localhost>\nDescription: a test package\n")
    deb = where / f"{NAME}_{VERSION.replace(':', '%3a')}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
                   check=True, capture_output=True, timeout=60)
    return deb


def stanza(deb: Path) -> str:
    """What ``apt-cache show`` prints for it (the Packages file's stanza)."""
    sha = hashlib.sha256(deb.read_bytes()).hexdigest()
    return (f"Package: {NAME}\nVersion: {VERSION}\nArchitecture: all\nSize: {deb.stat().st_size}\n"
            f"SHA256: {sha}\nFilename: pool/main/k/{NAME}/{deb.name}\n\n"
            f"Package: {NAME}\nVersion: 0.9-1\nArchitecture: all\nSHA256: {'0' * 64}\n")


def corrupt(deb: Path) -> None:
    data = bytearray(deb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    deb.write_bytes(bytes(data))


def test_the_index_names_each_version_and_its_hash(tmp_path):
    deb = build_deb(tmp_path)
    index = debian.index_sha256(stanza(deb))
    assert debian.deb_identity(deb) == (NAME, VERSION, "all")
    assert index[(NAME, VERSION, "all")] == {hashlib.sha256(deb.read_bytes()).hexdigest()}
    assert index[(NAME, "0.9-1", "all")] == {"0" * 64}
    debian.check_debs([deb], index)                       # the right file passes


def test_a_corrupt_deb_is_one_line_naming_it_and_the_fix(tmp_path):
    deb = build_deb(tmp_path)
    index = debian.index_sha256(stanza(deb))
    corrupt(deb)
    with pytest.raises(SetupError) as err:
        debian.check_debs([deb], index)
    msg = str(err.value)
    assert f"{deb} is not the package apt knows: its SHA256" in msg
    assert f"delete {deb} and run again" in msg and "\n" not in msg


def test_a_deb_the_index_does_not_list_is_refused(tmp_path):
    deb = build_deb(tmp_path)
    with pytest.raises(SetupError, match=f"apt's package index lists no {NAME} {VERSION} \\(all\\)"):
        debian.check_debs([deb], {})


def test_a_corrupt_deb_in_kph_downloads_is_refused_before_it_is_unpacked(tmp_path, monkeypatch):
    """fetch_only() finds the .deb in $KPH_DOWNLOADS and asks apt for nothing: the check
    is all that stands between a corrupt file and dpkg-deb -x."""
    monkeypatch.setenv(DOWNLOADS_ENV, str(tmp_path / "dl"))
    apt = debian.PrivateApt(root=tmp_path / "apt")
    assert apt.archives == tmp_path / "dl" / "debs"
    deb = build_deb(apt.archives)
    index = stanza(deb)
    monkeypatch.setattr(apt, "cache", lambda *args: index)   # apt-cache show, offline
    ran = []
    monkeypatch.setattr(debian, "run", lambda cmd, what, **kw: ran.append(cmd))
    assert apt.fetch_only([NAME]) == [deb]
    corrupt(deb)
    with pytest.raises(SetupError, match=f"{deb} is not the package apt knows"):
        apt.fetch_only([NAME])
    assert ran == []                                        # nothing downloaded, nothing unpacked


def _shared_deb(tmp_path: Path, monkeypatch) -> tuple[debian.PrivateApt, Path, Path]:
    """The good .deb in a shared ``$KPH_DOWNLOADS``, fetched (hash-checked) offline, and an
    evil one of the same package and version, ready to be swapped in."""
    monkeypatch.setenv(DOWNLOADS_ENV, str(tmp_path / "dl"))
    apt = debian.PrivateApt(root=tmp_path / "apt")
    shared = build_deb(apt.archives, "good")
    (tmp_path / "evil").mkdir()
    evil = build_deb(tmp_path / "evil", "evil")
    index = stanza(shared)
    monkeypatch.setattr(apt, "cache", lambda *args: index)
    return apt, shared, evil


def test_a_deb_swapped_after_its_check_is_refused_at_unpacking(tmp_path, monkeypatch):
    """Issue 36: another user of ``$KPH_DOWNLOADS`` replaces the file after fetch_only
    checked it; unpack hashes its own copy and refuses, nothing is unpacked."""
    apt, shared, evil = _shared_deb(tmp_path, monkeypatch)
    debs = apt.fetch_only([NAME])
    assert debs == [shared]
    shutil.copy(evil, shared)
    with pytest.raises(SetupError, match=f"{shared} is not the package apt knows"):
        debian.unpack(debs, tmp_path / "tree")
    assert not (tmp_path / "tree/usr").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".kph-deb-")] == []


def test_what_is_hashed_is_what_is_unpacked(tmp_path, monkeypatch):
    """The swap comes after unpack checked its copy, just before dpkg-deb: dpkg-deb reads
    the private copy (in a 0700 directory, removed after), so the good package is
    unpacked and the evil bytes never are."""
    apt, shared, evil = _shared_deb(tmp_path, monkeypatch)
    debs = apt.fetch_only([NAME])
    real_run, seen = debian.run, []

    def swap_then_run(cmd, what, **kw):
        if cmd[:2] == ["dpkg-deb", "-x"]:
            shutil.copy(evil, shared)
            private = Path(cmd[2]).parent
            seen.append((private, stat.S_IMODE(os.lstat(private).st_mode)))
        return real_run(cmd, what, **kw)
    monkeypatch.setattr(debian, "run", swap_then_run)
    debian.unpack(debs, tmp_path / "tree")
    assert (tmp_path / "tree/usr/share/kph/hello").read_text() == "good\n"
    (private, mode), = seen
    assert private != shared.parent and mode == 0o700 and not private.exists()
