import pytest

from harness.errors import SetupError
from harness.machine.qemu import QemuBinary, _parse_version, find_qemu


def test_parse_version_debian_strings():
    assert _parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)") == (7, 2, 22)
    assert _parse_version("QEMU emulator version 11.1.3 (Debian 1:11.1.3+ds-1~bpo13+1)") == (11, 1, 3)
    with pytest.raises(SetupError):
        _parse_version("not qemu")


def test_fast_gdbstub_threshold():
    assert not QemuBinary(("q",), (10, 1, 9), "system").fast_gdbstub
    assert QemuBinary(("q",), (10, 2, 0), "system").fast_gdbstub
    assert QemuBinary(("q",), (11, 1, 3), "private").fast_gdbstub


def test_override_that_does_not_exist_names_the_path():
    with pytest.raises(SetupError, match="/nonexistent/qemu"):
        find_qemu("/nonexistent/qemu")


def test_command_puts_data_dirs_before_args():
    q = QemuBinary(("ld.so", "--library-path", "L", "qemu"), (11, 1, 3), "private",
                   data_dirs=("/a", "/b"))
    assert q.command(["-m", "1G"]) == ["ld.so", "--library-path", "L", "qemu",
                                       "-L", "/a", "-L", "/b", "-m", "1G"]
