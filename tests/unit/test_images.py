from pathlib import Path

import pytest

from harness.errors import SetupError
from harness.machine.image.store import _modinfo_depends, recipe_hash
from harness.vmctl import check_kernel_format


def test_modinfo_depends(tmp_path):
    ko = tmp_path / "m.ko"
    ko.write_bytes(b"\x7fELF....\0license=GPL\0depends=virtio,virtio_ring\0vermagic=6.1\0")
    assert _modinfo_depends(ko) == ["virtio", "virtio_ring"]
    ko.write_bytes(b"\x7fELF\0depends=\0name=x\0")
    assert _modinfo_depends(ko) == []


def test_recipe_hash_is_stable():
    assert recipe_hash() == recipe_hash()
    assert len(recipe_hash()) == 16


def test_kernel_format_check(tmp_path):
    bad = tmp_path / "junk"
    bad.write_bytes(b"\0" * 1024)
    with pytest.raises(SetupError, match="not a bootable x86 kernel: .*junk"):
        check_kernel_format(bad)
    bz = tmp_path / "bz"
    bz.write_bytes(b"\0" * 0x202 + b"HdrS" + b"\0" * 10)
    check_kernel_format(bz)
    elf = tmp_path / "vmlinux"
    elf.write_bytes(b"\x7fELF" + b"\0" * 0x300)
    check_kernel_format(elf)


def _image(tmp_path: Path, recipe: str, **manifest) -> "Image":
    from harness.machine.image.store import Image

    for name in ("vmlinuz", "initrd.img"):
        (tmp_path / name).write_bytes(b"x")
    return Image(tmp_path, {"kernel_version": "6.12.9-test", "recipe": recipe, **manifest})


def test_an_image_from_another_recipe_is_refused_with_the_command_that_rebuilds_it(tmp_path):
    """A stale image (built before the guest programs changed) is never booted: its
    kph-reader left a request of today's host unanswered, a guest HANG (6.12, 2026-12-01)."""
    from harness.errors import StaleImageError
    from harness.machine.image.store import check_recipe

    check_recipe(_image(tmp_path, recipe_hash()))           # current: nothing said
    with pytest.raises(StaleImageError) as e:
        check_recipe(_image(tmp_path, "0123456789abcdef"))
    assert str(e.value) == (f"image {tmp_path.name} was built from another recipe than this "
                            "kph's (its guest programs, kernel module or initramfs changed "
                            "since); rebuild it: kph image build --kernel 6.12")
    with pytest.raises(StaleImageError, match=r"the `kph image build --tree \.\.\.` that made"):
        check_recipe(_image(tmp_path, "0123456789abcdef", kernel_origin="tree"))
    from harness.vmctl import Machine
    with pytest.raises(StaleImageError):                    # before anything starts
        Machine.prepare(_image(tmp_path, "0123456789abcdef"))


def test_a_stale_series_is_rebuilt_before_the_verb_runs(tmp_path, monkeypatch):
    """``--image 6.12`` naming a stale image: Debian's current 6.12 built first (as one
    not built yet is), the verb then given the new image's directory."""
    import argparse
    import importlib

    from harness.machine.image import build, store

    cli_main = importlib.import_module("harness.cli.main")

    stale, fresh = tmp_path / "old", tmp_path / "new"
    for d in (stale, fresh):
        d.mkdir()
    monkeypatch.setattr(store, "default_image", lambda sel=None: _image(stale, "0" * 16))
    asked = []

    def fake_build(*, kernel=None, qemu=None, progress=print, snapshot=True):
        asked.append(kernel)
        return _image(fresh, recipe_hash())
    monkeypatch.setattr(build, "build_image", fake_build)
    said = []
    out = argparse.Namespace(progress=type("P", (), {"__call__": lambda s, m: said.append(m),
                                                     "clear": lambda s: None})())
    args = argparse.Namespace(image="6.12", qemu=None)
    cli_main._image_first(args, out)
    assert asked == ["6.12"] and args.image == str(fresh)
    assert said == ["image: the 6.12 image was built from another recipe than this kph's: "
                    "rebuilding"]
