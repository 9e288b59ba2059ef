"""harness.machine.pluginlink: building the QEMU plugin on demand, cached per sources and QEMU."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess

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


# -- the wire protocol: probes/plugin/kph_proto.h against pluginlink's constants ----------

#: C names whose Python spelling differs (the sizes of the two headers are the structs')
_PY_NAME = {"REC_HDR": "REC_HDR_SIZE", "EV_HDR": "EV_SIZE"}
#: (struct, Python layout, its fields in order with their counts)
_LAYOUTS = (
    ("kph_rec_hdr", plugin.REC_HDR,
     (("size", 1), ("type", 1), ("vcpu", 1), ("probe_id", 1), ("nblocks", 1), ("seq", 1),
      ("regs", 21), ("task", 1), ("func", 1), ("ret_addr", 1), ("pid", 1), ("flags", 1),
      ("comm", 1))),
    ("kph_ev_hdr", plugin.EV_HDR,
     (("type", 1), ("vcpu", 1), ("n", 1), ("extra", 1), ("addr", 1), ("regs", 21),
      ("task", 1), ("pid", 1), ("tflags", 1), ("comm", 1), ("a", 1), ("b", 1))),
)


def _proto_names() -> list[str]:
    """Every constant kph_proto.h defines (enumerators and object-like macros)."""
    text = (plugin.PLUGIN_DIR / "kph_proto.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    names = re.findall(r"^#define\s+([A-Z_][A-Z0-9_]*)\s+\S", text, flags=re.M)
    for body in re.findall(r"enum\s*\{(.*?)\}", text, flags=re.S):
        names += re.findall(r"([A-Z_][A-Z0-9_]*)\s*=", body)
    return [n for n in names if n != "KPH_PROTO_H"]


def _py_offsets(layout: struct.Struct, fields) -> dict[str, int]:
    fmt = layout.format.lstrip("<")
    items = re.findall(r"(\d*)([a-zA-Z])", fmt)
    codes = [(int(n) if n else 1, c) for n, c in items]
    out, off, i = {}, 0, 0
    for name, count in fields:
        out[name] = off
        n, c = codes[i]
        if c == "s":
            off += struct.calcsize(f"<{n}s")
            i += 1
            continue
        assert n >= count, (name, n, count)
        off += struct.calcsize(f"<{count}{c}")
        codes[i] = (n - count, c)
        if codes[i][0] == 0:
            i += 1
    return out


def test_wire_protocol_is_the_headers(tmp_path):
    """Each constant of kph_proto.h, and each field offset and size of the record and event
    headers, as the C compiler sees them, is pluginlink's (a hand copy that drifts fails)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.fail("no C compiler: apt-get install gcc (./setup.sh installs it)")
    names = _proto_names()
    assert {"CMD_ARRANGE", "PK_FLUSH", "RF_UNCONFIRMED", "KPH_MAX_PER_SITE"} <= set(names)
    lines = [f'    printf("{n} %llu\\n", (unsigned long long)({n}));' for n in names]
    for struct_name, _layout, fields in _LAYOUTS:
        lines += [f'    printf("{struct_name}.{f} %zu\\n", offsetof({struct_name}, {f}));'
                  for f, _ in fields]
        lines.append(f'    printf("{struct_name} %zu\\n", sizeof({struct_name}));')
    src = tmp_path / "proto.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "kph_proto.h"\n'
                   "int main(void)\n{\n" + "\n".join(lines) + "\n    return 0;\n}\n")
    exe = tmp_path / "proto"
    subprocess.run([cc, "-Wall", "-Werror", "-I", str(plugin.PLUGIN_DIR), "-o", str(exe),
                    str(src)], check=True)
    got = dict(ln.rsplit(" ", 1) for ln in subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True).stdout.splitlines())
    want = {}
    for n in names:
        py = _PY_NAME.get(n, n.removeprefix("KPH_"))
        value = plugin.REC_HDR.size if py == "REC_HDR_SIZE" else getattr(plugin, py, None)
        assert value is not None, f"pluginlink has no {py} (kph_proto.h: {n})"
        want[n] = value
    for struct_name, layout, fields in _LAYOUTS:
        for f, off in _py_offsets(layout, fields).items():
            want[f"{struct_name}.{f}"] = off
        want[struct_name] = layout.size + (16 if struct_name == "kph_ev_hdr" else 0)
    assert {k: int(v) for k, v in got.items()} == want


def test_the_waiter_is_built_beside_the_plugin_and_waits_spinning_then_sleeping(env):
    """probes/plugin/waiter.c: readable once data is there (found while spinning, and
    after it sleeps), and when the peer closes; the GIL is released while it waits."""
    import socket
    import threading
    import time

    src, q = env
    wait = plugin.host_waiter(plugin.build_plugin(q))
    assert wait is not None
    a, b = socket.socketpair()
    try:
        b.send(b"x")
        assert wait(a.fileno(), 10**9) == 1 and a.recv(1) == b"x"
        t = threading.Timer(0.2, lambda: b.send(b"y"))      # arrives after the spin
        t.start()
        t0 = time.monotonic()
        assert wait(a.fileno(), 1000) == 1 and a.recv(1) == b"y"
        assert time.monotonic() - t0 >= 0.15
        ticks = []                                   # another Python thread runs meanwhile
        ticker = threading.Thread(target=lambda: [ticks.append(time.sleep(0.01)) for _ in range(5)])
        ticker.start()
        threading.Timer(0.6, b.close).start()    # the ticks need 50 ms of it
        assert wait(a.fileno(), 8 * 10**8) == 1
        during = len(ticks)             # the ticks the other thread made while it spun
        assert a.recv(1) == b""
        ticker.join()
        assert during == 5
    finally:
        a.close()
        b.close()


def test_a_plugin_without_its_waiter_is_no_error(env, tmp_path):
    assert plugin.host_waiter(tmp_path / "kph_plugin.so") is None
