import pytest

from harness.kernel.emulate import decode

A = 0xFFFFFFFF81000000


def regs(**kw):
    base = {n: 0x1000 * (i + 1) for i, n in enumerate(
        ("ax", "cx", "dx", "bx", "sp", "bp", "si", "di", "r8", "r9", "r10", "r11", "r12",
         "r13", "r14", "r15"))}
    base.update(kw)
    return base.__getitem__


@pytest.mark.parametrize("hexcode,length", [
    ("0f1f440000", 5), ("90", 1), ("660f1f440000", 6), ("0f1f00", 3), ("0f1f4000", 4),
    ("0f1f8000000000", 7), ("0f1f840000000000", 8), ("660f1f840000000000", 9),
    ("f30f1efa", 4)])
def test_nops(hexcode, length):
    e = decode(bytes.fromhex(hexcode) + b"\xcc" * 8, A)
    assert e is not None and e.kind == "nop" and e.length == length
    assert e.apply(regs(), None).next_ip == A + length


def test_push_r12_and_rbp():
    e = decode(bytes.fromhex("4154"), A)
    eff = e.apply(regs(r12=0xdead, sp=0x8000), None)
    assert eff.regs == {"sp": 0x7FF8}
    assert eff.mem == ((0x7FF8, (0xdead).to_bytes(8, "little")),)
    assert eff.next_ip == A + 2
    assert decode(b"\x55", A).src == "bp"


def test_pop():
    e = decode(bytes.fromhex("415c"), A)
    mem = {0x8000: (0xbeef).to_bytes(8, "little")}
    eff = e.apply(regs(sp=0x8000), lambda a, n: mem[a])
    assert eff.regs == {"r12": 0xbeef, "sp": 0x8008}
    assert decode(b"\x5c", A) is None  # pop rsp: single-stepped


def test_mov_forms():
    e = decode(bytes.fromhex("4989f4"), A)  # mov r12, rsi
    assert (e.dst, e.src, e.width) == ("r12", "si", 64)
    assert e.apply(regs(si=0x1234), None).regs == {"r12": 0x1234}
    e = decode(bytes.fromhex("89fd"), A)    # mov ebp, edi: zero-extends
    assert (e.dst, e.src, e.width) == ("bp", "di", 32)
    assert e.apply(regs(di=0xFFFFFFFF_FFFFFF9C), None).regs == {"bp": 0xFFFFFF9C}
    e = decode(bytes.fromhex("4c8be6"), A)  # mov r12, rsi (8b form)
    assert (e.dst, e.src) == ("r12", "si")


def test_call_rel32_pushes_the_next_ip_and_jumps():
    e = decode(bytes.fromhex("e8f7ffffff"), A)      # call A + 5 - 9
    assert (e.kind, e.length, e.rel) == ("call", 5, -9)
    eff = e.apply(regs(sp=0x1000), None)
    assert eff.regs == {"sp": 0xFF8} and eff.next_ip == A + 5 - 9
    assert eff.mem == ((0xFF8, (A + 5).to_bytes(8, "little")),)
    assert decode(bytes.fromhex("e800000000"), A).apply(regs(sp=0x1000), None).next_ip == A + 5
    assert decode(bytes.fromhex("48e800000000"), A) is None    # REX: stepped
    assert decode(bytes.fromhex("e80000"), A) is None          # cut short


@pytest.mark.parametrize("hexcode", ["488b07", "e900000000", "c3", "4883ec08", "418b07",
                                     "6689c8", "4190", "cc"])
def test_everything_else_is_stepped(hexcode):
    assert decode(bytes.fromhex(hexcode), A) is None
