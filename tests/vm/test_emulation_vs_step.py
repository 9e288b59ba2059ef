"""Every instruction class the host emulates, against a real single-step of the same
instruction from the same state (registers, rip, eflags, stack bytes)."""
from __future__ import annotations

import pytest

from harness.kernel.emulate import decode
from harness.kernel.kprobes import Kprobe

pytestmark = pytest.mark.vm

SYNTHETIC = {
    "endbr64": "f30f1efa",
    "nop": "90",
    "nopw": "660f1f440000",
    "nopl3": "0f1f00",
    "nopl8": "0f1f840000000000",
    "push r9": "4151",
    "push rbx": "53",
    "pop r15": "415f",
    "pop rbx": "5b",
    "mov r8,rax": "4989c0",
    "mov rax,rsp": "4889e0",
    "mov eax,r11d": "4489d8",
    "mov r10,[r] 8b": "4c8bd7",
    "call +0": "e800000000",
    "call +0x10": "e810000000",
    "call -0x20": "e8e0ffffff",
}


def real_sites(vm, host, func="do_sys_openat2"):
    """Offsets in ``func`` whose instruction the engine would emulate, one per class+width."""
    sym = vm.symbols.lookup(func)
    from harness.kernel.symbols import instruction_at

    code = host.read(sym.addr, sym.size)
    sites, kinds, off = {}, set(), 0
    while off < len(code):
        insn = instruction_at(code[off:off + 16], sym.addr + off)
        if insn is None:
            break
        emu = decode(code[off:off + 16], sym.addr + off)
        if emu is not None and (emu.kind, emu.width) not in kinds:
            kinds.add((emu.kind, emu.width))
            sites[f"{emu.kind}{emu.width} at +{off:#x} ({insn.mnemonic} {insn.op_str})"] = off
        off += insn.size
    return sites


def test_real_instructions_emulate_exactly_like_a_step(vm):
    host = vm.host
    try:
        sites = real_sites(vm, host)
        kinds = {name.split(" ")[0] for name in sites}
        assert {"nop64", "push64", "mov64", "mov32", "pop64"} <= kinds, sites
        results = {name: host.check_emulation(Kprobe(symbol_name="do_sys_openat2", offset=off))
                   for name, off in sites.items()}
        vm.run("cat /proc/version; cat /nonexistent; true", timeout=60)
        for name, checks in results.items():
            assert checks, f"{name}: never executed"
            for c in checks:
                assert c.equal, f"{name}: {c.differences()}"
    finally:
        host.close()


def test_synthetic_instructions_emulate_exactly_like_a_step(vm):
    host = vm.host
    try:
        results = {name: host.check_emulation(Kprobe(symbol_name="do_sys_openat2"),
                                              code=bytes.fromhex(code))
                   for name, code in SYNTHETIC.items()}
        vm.run("cat /proc/version", timeout=60)
        for name, checks in results.items():
            assert checks, f"{name}: never checked"
            c = checks[0]
            assert c.code.hex() == SYNTHETIC[name]
            assert c.equal, f"{name}: {c.differences()}"
        assert vm.run("echo fine").stdout == "fine\n"
    finally:
        host.close()
