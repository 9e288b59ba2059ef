"""harness/machine/replay.py without QEMU: the script's initramfs, the machine's arguments, the
checks on a recording's directory."""
from __future__ import annotations

import gzip
import json
import zlib

import pytest

from harness.machine import replay as rr
from harness.errors import SetupError


def _gzip_members(data: bytes) -> list[bytes]:
    """Decompress each member of a concatenation of gzip streams."""
    out = []
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out.append(d.decompress(data))
        data = d.unused_data.lstrip(b"\0")
    return out


def _newc_names(archive: bytes) -> dict[str, bytes]:
    files, pos = {}, 0
    while True:
        hdr = archive[pos:pos + 110]
        assert hdr[:6] == b"070701"
        size, namesize = int(hdr[54:62], 16), int(hdr[94:102], 16)
        name = archive[pos + 110:pos + 110 + namesize - 1].decode()
        pos = (pos + 110 + namesize + 3) & ~3
        files[name] = archive[pos:pos + size]
        pos = (pos + size + 3) & ~3
        if name == "TRAILER!!!":
            return files


def test_script_initrd_appends_a_second_archive(tmp_path):
    base = tmp_path / "base.img"
    base.write_bytes(gzip.compress(b"not inspected"))
    dst = rr.script_initrd(base, "echo hi\nexit 3", tmp_path / "out.img")
    data = dst.read_bytes()
    assert data.startswith(base.read_bytes())  # the image's archive, untouched
    first, second = _gzip_members(data)
    assert first == b"not inspected"
    files = _newc_names(second)
    assert files[rr.SCRIPT_PATH] == b"echo hi\nexit 3\n"
    assert set(files) == {".", "etc", "etc/kph", rr.SCRIPT_PATH, "TRAILER!!!"}


def test_guest_args_are_one_cpu_icount_and_no_snapshot_option():
    args = rr._guest_args("console=ttyS0", "record", True, rr.QCOW2, rr.CONSOLE)
    assert args[args.index("-smp") + 1] == "1"
    assert "-snapshot" not in args
    icount = args[args.index("-icount") + 1]
    assert icount == "shift=auto,sleep=off,rr=record,rrfile=replay.bin,rrsnapshot=init"
    assert "if=none,id=kphsnap,format=qcow2,file=snapshots.qcow2" in args
    # Paths are relative: QEMU runs in the recording's directory.
    assert args[args.index("-kernel") + 1] == rr.KERNEL
    assert args[args.index("-initrd") + 1] == rr.INITRD
    bare = rr._guest_args("x", "replay", False, "", "replay-console.log")
    assert "-drive" not in bare
    assert bare[bare.index("-icount") + 1].endswith("rr=replay,rrfile=replay.bin")
    # Everything the guest can see is the same in both modes.
    strip = lambda a: [x for x in a if not any(k in x for k in ("rr=", "file", "panic="))]  # noqa: E731
    assert "panic=none,shutdown=pause" in bare
    assert strip(rr._guest_args("x", "record", False, "", "c")) == strip(bare)


def test_log_complete_needs_the_header(tmp_path):
    log = tmp_path / "replay.bin"
    log.write_bytes(b"\0" * 12 + b"events")
    assert not rr._log_complete(log)  # what a killed recorder leaves
    log.write_bytes(b"\x02\x20\xe0\x00" + b"\0" * 8 + b"events")
    assert rr._log_complete(log)
    assert not rr._log_complete(tmp_path / "missing")


def test_load_recording_refuses_other_directories(tmp_path):
    with pytest.raises(SetupError, match="no recording in"):
        rr.load_recording(tmp_path)
    (tmp_path / rr.CONSOLE).write_text("hello\r\n")
    (tmp_path / rr.LOG).write_bytes(b"x")
    meta = {"end": "exit", "exit_code": 0, "icount": 5, "seconds": 1.0,
            "files": {rr.CONSOLE: rr.sha256_file(tmp_path / rr.CONSOLE),
                      rr.LOG: rr.sha256_file(tmp_path / rr.LOG)}}
    (tmp_path / rr.META).write_text(json.dumps(meta))
    res = rr.load_recording(tmp_path)
    assert res.end is rr.End.EXIT and res.console == "hello\n" and res.icount == 5
    (tmp_path / rr.LOG).write_bytes(b"y")
    with pytest.raises(SetupError, match="changed since it was recorded"):
        rr.load_recording(tmp_path)


def test_record_refuses_a_used_directory(tmp_path):
    (tmp_path / rr.LOG).write_bytes(b"x")
    with pytest.raises(SetupError, match="already holds a recording"):
        rr.record("true", tmp_path)
