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
