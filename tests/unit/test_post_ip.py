"""The module backend's post-ip check (``ModuleBackend._post_ip``, docs/diff.md: where a
post_handler saw the instruction go) and the hunt's instruction probes (``insn_lines``),
on recorded module output."""
from __future__ import annotations

import random

from harness.apps.hunt import insn_lines
from harness.backends.module import ModuleBackend, parse_events_line

ADDR = 0xFFFFFFFF811C88B3
# kph_kprobes' list line of a kprobe on that jle (7e 2b), and its post record with the
# flags 0x246 (ZF=1, SF=OF=0: the jump is taken)
LIST = (f"7 p {ADDR:x} registered 0 int3 maxactive 0 flags 1 nargs 0 "
        f"slot ffffffffa0001000 opcode 7e insn 7e2b\n"
        f"8 p ffffffff81000000 registered 0 ftrace maxactive 0 flags 1 nargs 0 "
        f"slot 0000000000000000 opcode 00 insn -\n")


def _backend(listing: str = LIST) -> ModuleBackend:
    mb = ModuleBackend.__new__(ModuleBackend)
    mb.insns, mb.posts_checked = {}, 0
    mb._read = lambda path: listing            # type: ignore[method-assign]
    return mb


def _post(ip: int, flags: int = 0x246, pid: int = 7, addr: int = ADDR):
    return parse_events_line(f"3 {pid} post int3:task 0 42 6b7068 {addr:x} {ip:x} "
                             f"{flags:x} 0")


def test_list_keeps_each_probes_instruction():
    mb = _backend()
    assert mb.list() == {7: ("registered", 0, "int3"), 8: ("registered", 0, "ftrace")}
    assert mb.insns == {7: bytes([0x7E, 0x2B])}      # an ftrace probe has no slot


def test_a_post_handler_at_the_branch_target_agrees():
    mb = _backend()
    mb.list()
    assert mb._post_ip(_post(ADDR + 2 + 0x2B)) == ""
    assert mb.posts_checked == 1


def test_a_jcc_emulated_the_wrong_way_is_named():
    mb = _backend()
    mb.list()
    got = mb._post_ip(_post(ADDR + 2))                 # fell through: the 8924779df820 bug
    assert got.startswith(f"jle (7e2b) at {ADDR:#x} with flags 0x246: the post_handler saw "
                          f"ip {ADDR + 2:#x}, the instruction goes to {ADDR + 0x2D:#x}"), got
    # with ZF=0 and SF=OF the same fall-through is right
    assert mb._post_ip(_post(ADDR + 2, flags=0x202)) == ""


def test_nothing_is_checked_without_the_instruction():
    mb = _backend()
    mb.list()
    assert mb._post_ip(_post(0x1234, pid=8, addr=0xFFFFFFFF81000000)) == ""
    assert mb._post_ip(_post(0x1234, pid=9)) == ""
    assert mb.posts_checked == 0


def test_insn_lines_put_the_branches_first():
    addr = 0xFFFFFFFF81000000
    sites = [(0, bytes.fromhex("4889e5")), (3, bytes.fromhex("7e10")),
             (5, bytes.fromhex("e800000000")), (10, bytes.fromhex("c3")),
             (11, bytes.fromhex("31c0"))]
    lines = insn_lines("f", addr, sites, random.Random(0), n=2)
    assert lines == ("p:kph/i3 f+0x3", "p:kph/i5 f+0x5")
    every = insn_lines("f", addr, sites, random.Random(0))
    # all that fit, in address order; the ret (its next address is on the stack) never
    assert every == ("p:kph/i0 f+0x0", "p:kph/i3 f+0x3", "p:kph/i5 f+0x5", "p:kph/ib f+0xb")
    assert insn_lines("f", addr, [(10, bytes.fromhex("c3"))], random.Random(0)) == ()
