"""Kernel selectors and package layouts, without the archives (recorded apt answers)."""
import pytest

from harness.machine.image import kernels as K
from harness.errors import SetupError


def test_series_of_debian_abis():
    assert K.KernelRelease("6.1.0-56-cloud-amd64", "host").series == "6.1"
    assert K.KernelRelease("6.12.117+deb13-cloud-amd64", "trixie").series == "6.12"
    assert K.KernelRelease("7.3.4+deb13-cloud-amd64", "trixie").series == "7.3"
    assert K.KernelRelease("7.3.4+deb13-cloud-amd64", "trixie").version_key[:3] == (7, 3, 4)


@pytest.mark.parametrize("layout,abi", [
    ({"boot/vmlinuz-A": "", "boot/config-A": "", "lib/modules/A/kernel/x.ko": ""}, "6.1"),
    ({"boot/vmlinuz-A": "", "boot/config-A": "", "usr/lib/modules/A/kernel/x.ko": ""}, "6.12"),
    ({"usr/lib/modules/A/vmlinuz": "", "usr/lib/modules/A/config": "",
      "usr/lib/modules/A/kernel/x.ko.xz": ""}, "7.3"),
])
def test_locate_finds_each_debian_layout(tmp_path, layout, abi):
    for rel, text in layout.items():
        p = tmp_path / rel.replace("A", "abi")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    t = K.locate(tmp_path, "abi")
    assert t.vmlinuz.is_file() and t.config.is_file() and t.modules.is_dir()


def test_locate_names_what_is_missing(tmp_path):
    with pytest.raises(SetupError, match="vmlinuz"):
        K.locate(tmp_path, "abi")


@pytest.fixture
def archives(monkeypatch):
    host = K.KernelRelease("6.1.0-56-cloud-amd64", "host")
    builds = [host, K.KernelRelease("6.12.117+deb12-cloud-amd64", "host"),
              K.KernelRelease("6.12.117+deb13-cloud-amd64", "trixie"),
              K.KernelRelease("7.2.12+deb13-cloud-amd64", "trixie"),
              K.KernelRelease("7.3.4+deb13-cloud-amd64", "trixie")]
    monkeypatch.setattr(K, "default_abi", lambda: host.abi)
    monkeypatch.setattr(K, "_metas", lambda: [host, builds[2], builds[4]])
    monkeypatch.setattr(K, "_all_builds", lambda: builds)


def test_a_series_is_what_its_suite_points_to_today(archives):
    assert K.resolve(None).abi == "6.1.0-56-cloud-amd64"
    assert K.resolve("6.1").abi == "6.1.0-56-cloud-amd64"
    assert K.resolve("6.12").abi == "6.12.117+deb13-cloud-amd64"    # trixie's, not bookworm's
    assert K.resolve("7.3").abi == "7.3.4+deb13-cloud-amd64"
    assert K.resolve("7.2").abi == "7.2.12+deb13-cloud-amd64"       # newest of a series
    assert K.resolve("6.12.117+deb12-cloud-amd64").origin == "host"
    assert K.resolve("linux-image-7.3.4+deb13-cloud-amd64").series == "7.3"


@pytest.mark.parametrize("bad", ["5.4", "6.1.0-1-cloud-amd64", "latest"])
def test_an_unknown_kernel_lists_what_there_is(archives, bad):
    with pytest.raises(SetupError) as ei:
        K.resolve(bad)
    msg = str(ei.value)
    assert repr(bad) in msg and "available: 6.1, 6.12, 7.2, 7.3" in msg and "\n" not in msg


def test_kph_matrix_checks_every_kernel_before_it_boots_one(archives, monkeypatch, tmp_path):
    """``kph matrix --kernels 6.1,9.9`` once ran 6.1 and only then named 9.9 unknown."""
    import argparse

    from harness.diff import runner
    from harness.cli import matrix

    monkeypatch.setenv("KPH_CACHE", str(tmp_path))           # no image is built here
    monkeypatch.setattr(runner, "run_matrix", lambda *a, **k: pytest.fail("booted first"))
    args = argparse.Namespace(kernels="6.1,9.9", specs=["p do_sys_openat2"], spec_file=None,
                              run="true", html=None)
    out = argparse.Namespace(json_file=None)
    with pytest.raises(SetupError) as ei:
        matrix.run(args, out)
    assert "'9.9'" in str(ei.value) and "available: 6.1, 6.12, 7.2, 7.3" in str(ei.value)
