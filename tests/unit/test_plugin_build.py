"""harness.machine.pluginlink: building the QEMU plugin on demand, cached per sources and QEMU."""
from __future__ import annotations

import shutil
import struct

import pytest

from harness.machine import pluginlink as plugin
from harness.errors import SetupError
from harness.machine.qemu import QemuBinary


@pytest.fixture
def env(tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(plugin.PLUGIN_DIR, src)
    monkeypatch.setattr(plugin, "PLUGIN_DIR", src)
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    q = QemuBinary(argv=("/bin/true",), version=(11, 1, 3), source="system")
    return src, q


def test_build_is_cached_and_keyed_by_sources_and_qemu(env):
    src, q = env
    so = plugin.build_plugin(q)
    assert so.is_file() and so.name == "kph_plugin.so"
    mtime = so.stat().st_mtime_ns
    assert plugin.build_plugin(q) == so and so.stat().st_mtime_ns == mtime   # not rebuilt
    other = QemuBinary(argv=("/bin/false",), version=(11, 1, 3), source="system")
    assert plugin.plugin_key(other) != plugin.plugin_key(q)
    (src / "fetch.c").write_text((src / "fetch.c").read_text() + "\n/* changed */\n")
    assert plugin.build_plugin(q) != so


def test_build_exports_the_plugin_entry_points(env):
    src, q = env
    so = plugin.build_plugin(q).read_bytes()
    for name in (b"qemu_plugin_install", b"qemu_plugin_version"):
        assert name in so


def test_failed_build_is_one_setup_error_naming_the_fix(env):
    src, q = env
    (src / "kph_plugin.c").write_text("this is not C;\n")
    with pytest.raises(SetupError) as err:
        plugin.build_plugin(q)
    msg = str(err.value)
    assert "building the QEMU plugin failed" in msg and "kph_plugin.c" in msg
    assert "install gcc" in msg and "\n" not in msg


def test_no_compiler_is_a_setup_error(env, monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(plugin.shutil, "which", lambda name: None)
    with pytest.raises(SetupError, match="no C compiler"):
        plugin.build_plugin(env[1])


def test_qemu_args_escape_commas(tmp_path):
    assert plugin.qemu_args(tmp_path / "a,b.so", 7) == ["-plugin", f"{tmp_path}/a,,b.so,ctl=7"]


def test_record_header_layout_matches_the_plugin():
    rec = struct.pack("<IHHIIQ", 240, plugin.REC_HIT, 1, 9, 0, 77) + \
        struct.pack("<21Q", *range(21)) + struct.pack("<QQQiI16s", 0xabc, 0xf00, 0, 42,
                                                       plugin.RF_PID | plugin.RF_COMM, b"cat")
    r = plugin.decode(rec)
    assert (r.type, r.vcpu, r.probe_id, r.seq, r.regs[16], r.task, r.func, r.pid, r.comm) == \
        (plugin.REC_HIT, 1, 9, 77, 16, 0xabc, 0xf00, 42, b"cat")


def test_old_qemu_is_a_setup_error_before_building(env):
    old = QemuBinary(argv=("/bin/true",), version=(7, 2, 22), source="system")
    with pytest.raises(SetupError, match="needs QEMU >= 11.1.*7.2.22"):
        plugin.build_plugin(old)
