"""The plugin engine's uprobe filter and trampoline (harness.engines.plugin_uprobes),
pure logic: what CMD_ADD carries for a Python uprobe."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from harness.engines.plugin_uprobes import user_ext, user_filter, user_trampoline
from harness.engines.uprobes import Uprobe
from harness.errors import ProbeRejectedError

OFFSETS = {("task_struct", "mm"): 0x530, ("mm_struct", "exe_file"): 0x3a8,
           ("file", "f_inode"): 0x20, ("inode", "i_ino"): 0x40}


class Btf:
    def offset(self, struct_name, member):
        return OFFSETS[(struct_name, member)]


def test_ext_is_the_size_the_plugin_reads():
    text = (Path(__file__).resolve().parents[2] / "probes/plugin/kph_proto.h").read_text()
    size = int(re.search(r"#define ADD_EXT_SIZE (\d+)", text)[1])
    ext = user_ext(0x401fff, (1, 2, 3), 77, 0xffff888000000000)
    assert len(ext) == size
    tramp, n, _pad, *chain, expect, direct_map = struct.unpack("<QII4QQQ", ext)
    assert (tramp, n, chain, expect) == (0x401fff, 3, [1, 2, 3, 0], 77)
    assert direct_map == 0xffff888000000000       # control.c cmd_add reads it at +56
    c = (Path(__file__).resolve().parents[2] / "probes/plugin/control.c").read_text()
    assert "memcpy(&dm, x + 56, 8);" in c


def test_one_process_is_its_mm_every_process_the_files_inode():
    one = Uprobe("/usr/bin/kph-loop", 0x1000, pid=42)
    one.mm = 0xffff888004a1c000
    assert user_filter(Btf(), one) == ((0x530,), 0xffff888004a1c000)
    every = Uprobe("/usr/bin/kph-loop", 0x1000)
    every.ino = 1234
    assert user_filter(Btf(), every) == ((0x530, 0x3a8, 0x20, 0x40), 1234)


class Img:
    def __init__(self, end, pie=False):
        self.end, self.pie = end, pie

    def trampoline(self):
        return self.end

    def vaddr(self, offset):
        return 0x1000 + offset


class Mgr:
    def __init__(self, img):
        self.img = img

    def elf(self, path):
        return self.img


def test_trampoline_is_the_byte_after_the_gdbstub_engines():
    up = Uprobe("/usr/bin/kph-loop", 0x10)
    assert user_trampoline(Mgr(Img(0x4a2ffe)), up) == 0x4a2fff
    # a PIE mapped by one process moves with its load bias
    pie = Uprobe("/usr/bin/pie", 0x10, pid=7)
    pie.vaddr = 0x5555_5555_5010
    assert user_trampoline(Mgr(Img(0x2ffe, pie=True)), pie) == 0x5555_5555_4000 + 0x2fff
    with pytest.raises(ProbeRejectedError, match="no room for a uretprobe trampoline"):
        user_trampoline(Mgr(Img(0x4a2fff)), up)


def test_a_programs_elf_is_pulled_again_only_when_its_stat_changes():
    """harness.engines.uprobes.cached_elf: one pull per machine while ``stat -L`` says
    the same (device, inode, size, change and modification times); a file rewritten in
    place (a new ctime) is read again; another machine has its own."""
    from harness.engines.uprobes import GuestFile, cached_elf

    prog = Path("/bin/true").read_bytes()

    class Vm:
        def __init__(self):
            self.pulls = 0

        def pull(self, path):
            self.pulls += 1
            return prog

    a, b = Vm(), Vm()
    f = GuestFile("regular file", 310, ("/usr/bin/x", "2", "310", str(len(prog)),
                                        "2026-11-30 05:05:16.044000014 +0000",
                                        "2026-11-30 05:05:07.000000000 +0000"))
    img = cached_elf(a, f, "/usr/bin/x")
    assert cached_elf(a, f, "/usr/bin/x") is img and a.pulls == 1
    touched = GuestFile(f.kind, f.ino, f.key[:4] + ("2026-11-30 05:05:16.048000014 +0000",
                                                    f.key[5]))
    assert cached_elf(a, touched, "/usr/bin/x") is not img and a.pulls == 2
    cached_elf(b, f, "/usr/bin/x")
    assert b.pulls == 1


def test_within_one_run_each_file_is_stat_ed_once():
    """harness.engines.uprobes.one_stat_each: inside it ``file_stat`` asks the guest once
    per path (a missing file too); outside, and after it, every call asks again."""
    from types import SimpleNamespace

    from harness.engines.uprobes import file_stat, one_stat_each

    class Vm:
        def __init__(self):
            self.asked = []

        def run(self, cmd, **kw):
            self.asked.append(cmd)
            if "/nope" in cmd:
                return SimpleNamespace(status=1, stdout="")
            return SimpleNamespace(status=0, stdout="regular file|2|310|100|c|m\n")

    vm = Vm()
    with one_stat_each(vm):
        assert file_stat(vm, "/bin/x").ino == 310
        with one_stat_each(vm):             # nested: the outer one's
            assert file_stat(vm, "/bin/x").ino == 310
            assert file_stat(vm, "/nope") is None
        assert file_stat(vm, "/nope") is None and file_stat(vm, "/bin/x").ino == 310
        assert len(vm.asked) == 2
    assert file_stat(vm, "/bin/x").ino == 310 and file_stat(vm, "/bin/x").ino == 310
    assert len(vm.asked) == 4
