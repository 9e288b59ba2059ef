"""harness.kernel.emulate.next_ip: where an instruction hands control, the address a
kprobe's post_handler sees (the module backend's ``post-ip`` check)."""
from __future__ import annotations

import itertools

import pytest

from harness.kernel.emulate import CF, OF, PF, SF, ZF, jcc_name, jcc_taken, next_ip

# Intel SDM Vol. 2A "Jcc", each condition as the manual words it
SDM = {
    "jo": lambda f: f["OF"], "jno": lambda f: not f["OF"],
    "jb": lambda f: f["CF"], "jnb": lambda f: not f["CF"],
    "je": lambda f: f["ZF"], "jne": lambda f: not f["ZF"],
    "jbe": lambda f: f["CF"] or f["ZF"], "jnbe": lambda f: not f["CF"] and not f["ZF"],
    "js": lambda f: f["SF"], "jns": lambda f: not f["SF"],
    "jp": lambda f: f["PF"], "jnp": lambda f: not f["PF"],
    "jl": lambda f: f["SF"] != f["OF"], "jnl": lambda f: f["SF"] == f["OF"],
    # JLE/JNG: ZF = 1 or SF != OF; JG/JNLE: ZF = 0 and SF = OF (the pair 8924779df820
    # fixed in the kernel's emulation)
    "jle": lambda f: f["ZF"] or f["SF"] != f["OF"],
    "jnle": lambda f: not f["ZF"] and f["SF"] == f["OF"],
}
BITS = {"CF": CF, "PF": PF, "ZF": ZF, "SF": SF, "OF": OF}


@pytest.mark.parametrize("cc", range(16))
def test_every_condition_under_every_flag_combination(cc):
    name = jcc_name(cc)
    for combo in itertools.product((0, 1), repeat=5):
        f = dict(zip(BITS, combo))
        flags = sum(BITS[k] for k, v in f.items() if v) | 0x202   # IF and bit 1 set too
        assert jcc_taken(cc, flags) == bool(SDM[name](f)), (name, f)


def test_short_and_near_jcc_targets():
    assert next_ip(bytes([0x7E, 0x10]), 0x1000, ZF) == ("jle", 0x1012)
    assert next_ip(bytes([0x7E, 0x10]), 0x1000, 0) == ("jle", 0x1002)
    assert next_ip(bytes([0x7F, 0xF0]), 0x1000, 0) == ("jnle", 0x1002 - 0x10)
    assert next_ip(bytes.fromhex("0f8f10000000"), 0x1000, ZF) == ("jnle", 0x1006)
    assert next_ip(bytes.fromhex("0f8ef0ffffff"), 0x1000, SF) == ("jle", 0x1006 - 0x10)
    # a branch hint prefix (2e/3e) is part of the instruction
    assert next_ip(bytes([0x3E, 0x74, 0x04]), 0x1000, ZF) == ("je", 0x1007)


def test_jmp_call_and_straight_line():
    assert next_ip(bytes.fromhex("e9fbffffff"), 0xFFFFFFFF81000000, 0) == \
        ("jmp", 0xFFFFFFFF81000000)
    assert next_ip(bytes.fromhex("eb00"), 0x10, 0) == ("jmp", 0x12)
    assert next_ip(bytes.fromhex("e800000000"), 0x10, 0) == ("call", 0x15)
    assert next_ip(bytes.fromhex("4889e5"), 0x10, 0) == ("insn", 0x13)
    assert next_ip(bytes.fromhex("0f1f440000"), 0x10, 0) == ("insn", 0x15)


@pytest.mark.parametrize("code", ["c3", "f3c3", "c20800", "ffd0", "41ffe3", "ff2500000000",
                                  "0f0b", "0f05", "48cf", "cc", "e2fe", "e3fe", "f4",
                                  "660f8e1000", "66e91000", "7e", "0f8e1000"])
def test_what_the_bytes_and_flags_do_not_tell(code):
    """ret, indirect and far branches, traps, loop/jcxz, 16-bit and truncated branches."""
    assert next_ip(bytes.fromhex(code), 0x1000, ZF) is None
