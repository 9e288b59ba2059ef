"""Snapshot keys and the reasons for a cold boot, without QEMU."""
from __future__ import annotations

from pathlib import Path

from harness import constants as C
from harness.machine.image.store import Image
from harness.machine.qemu import QemuBinary
from harness.machine.snapshot import snapshot_key, unsupported, why_changed, _slot
from harness.vmctl import Machine


def _machine(tmp_path: Path, **kw) -> Machine:
    for name, data in (("vmlinuz", b"kernel"), ("initrd.img", b"initrd"), ("qemu", b"qemu")):
        if not (tmp_path / name).exists():
            (tmp_path / name).write_bytes(data)
    img = Image(tmp_path, {"kernel_version": "6.1.0-test"})
    qemu = QemuBinary(argv=(str(tmp_path / "qemu"),), version=kw.pop("version", (11, 1, 3)),
                      source="--qemu")
    opts = dict(kernel=img.kernel, initrd=img.initrd, append="console=ttyS0", qemu=qemu,
                image=img, name=kw.pop("name", "t"))
    opts.update(kw)
    return Machine(**opts)


def test_key_changes_with_what_the_guest_depends_on(tmp_path):
    m = _machine(tmp_path)
    k = snapshot_key(m)
    assert k == snapshot_key(_machine(tmp_path, name="u"))  # the machine's name is not in it
    (tmp_path / "initrd.img").write_bytes(b"initrd 2")
    k2 = snapshot_key(_machine(tmp_path))
    assert why_changed(k, k2) == "initrd changed" and _slot(k) == _slot(k2)
    k3 = snapshot_key(_machine(tmp_path, smp=2))
    assert "machine options changed" in why_changed(k2, k3) and _slot(k2) != _slot(k3)
    k4 = snapshot_key(_machine(tmp_path, version=(11, 2, 0)))
    assert why_changed(k2, k4) == "QEMU 11.1.3 -> 11.2.0"
    assert "-name" not in k["options"]["machine_args"]


def test_reasons_to_boot_cold(tmp_path):
    assert unsupported(_machine(tmp_path)) is None
    assert "TCG only" in unsupported(_machine(tmp_path, accel="kvm"))
    assert "extra QEMU arguments" in unsupported(_machine(tmp_path, extra_args=["-s"]))
    assert "needs >= 8.2" in unsupported(_machine(tmp_path, version=(7, 2, 0)))
    assert "images only" in unsupported(_machine(tmp_path, image=None))
    other = tmp_path / "other.img"
    other.write_bytes(b"x")
    assert "own kernel and initrd" in unsupported(_machine(tmp_path, initrd=other))


def test_restore_command_line_maps_the_ram_file_private_and_read_only(tmp_path):
    from harness.machine.snapshot import Snapshot

    m = _machine(tmp_path)
    m.snapshot = Snapshot(tmp_path / "snap,dir", {"key": {}})
    cmd = m.command_line()
    assert "-incoming" in cmd and cmd[cmd.index("-incoming") + 1] == "defer"
    obj = cmd[cmd.index("-object") + 1]
    assert "mem-path=" + str(tmp_path / "snap,,dir" / "ram") in obj
    assert "share=off,readonly=on,rom=off" in obj
    assert f"{C.MACHINE},memory-backend=kph-ram" in cmd


def test_each_cpu_is_a_socket_of_its_own(tmp_path):
    """SeaBIOS's MP table lists the first CPU of a package only: a kernel without ACPI
    (a tree build) would find one CPU of a -smp 2 of one package."""
    one = _machine(tmp_path).machine_args()
    assert one[one.index("-smp") + 1] == "1"
    two = _machine(tmp_path, smp=2).machine_args()
    assert two[two.index("-smp") + 1] == "2,sockets=2,cores=1,threads=1"
