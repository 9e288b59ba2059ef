"""harness.machine.image.debian: a .deb is checked against the SHA256 of apt's package index before it
is used, wherever it came from ($KPH_DOWNLOADS keeps them across caches)."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from harness.machine.image import debian
from harness.constants import DOWNLOADS_ENV
from harness.errors import SetupError

NAME, VERSION = "kph-test", "1:1.0-1"


def build_deb(where: Path) -> Path:
    """A real, tiny .deb named as apt names its archives (the epoch's colon as %3a)."""
    tree = where / "pkg"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "usr/share/kph").mkdir(parents=True)
    (tree / "usr/share/kph/hello").write_text("hello\n")
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
