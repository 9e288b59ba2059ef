

def test_a_return_address_on_the_kernel_trampoline_prints_as_kretprobed():
    from harness.kernel.grammar.fetch import format_ip

    names = {0x1000: "arch_rethook_trampoline+0x0/0x60", 0x2000: "__x64_sys_openat+0x6a/0xa0",
             0x3000: "do_sys_openat2+0x0/0x170"}
    sym = names.get
    assert format_ip(0x1000, sym, 0x3000, kretprobe_trampoline=0x1000) == \
        "[unknown/kretprobe'd] <- do_sys_openat2"
    assert format_ip(0x2000, sym, 0x3000, kretprobe_trampoline=0x1000) == \
        "__x64_sys_openat+0x6a/0xa0 <- do_sys_openat2"
    assert format_ip(0x1000, sym) == "arch_rethook_trampoline+0x0/0x60"   # not told: a symbol
