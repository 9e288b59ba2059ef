"""A stack trace of a stopped vCPU, for host-side handlers (``stack_trace_save_regs()``).

What the kernel guarantees, and lib/test_kprobes.c's ``test_stacktrace_on_kretprobe`` and
``test_stacktrace_on_nested_kretprobe`` check: a stack trace taken in a kretprobe handler
starts at the real return address (``rethook_trampoline_handler()`` set ``regs->ip``), and a
return address the trampoline replaced is shown as the real one, because every x86
unwinder asks ``unwind_recover_ret_addr()`` -> ``kretprobe_find_ret_addr()`` /
``rethook_find_ret_addr()`` (arch/x86/include/asm/unwind.h) when it meets the trampoline.
Here the trampoline is the host's (``vm.host.trampoline``) and the real address comes from
the engine's pending instances (``HostEngine.kretprobe_find_ret_addr``).

How frames are found: the frame-pointer chain (``[bp]`` the caller's bp, ``[bp + 8]`` the
return address), while it stays inside the task's stack (THREAD_SIZE, as
``on_stack()``) and yields kernel text. Debian's 6.1 is built with the ORC unwinder and
no frame pointers, so the chain is only complete through code built with them (such as
``probes/kunit/``, built ``-fno-omit-frame-pointer``); elsewhere it stops early. ORC
tables are not read.
"""
from __future__ import annotations

from typing import Any

__all__ = ["stack_trace", "THREAD_SIZE"]

THREAD_SIZE = 16384
_M = (1 << 64) - 1


def stack_trace(host: Any, regs: Any, max_entries: int = 16) -> list[int]:
    """Return addresses from ``regs`` outwards: ``regs.ip`` first, then each frame's return
    address, a hijacked one recovered as the kernel's unwinders recover it.

    :param host: the ``HostEngine`` (``vm.host``); call this from a handler, where the vCPU
        is stopped, or with the guest halted.
    """
    out = [regs.ip]
    base = regs.sp & ~(THREAD_SIZE - 1)
    bp = regs.bp
    while len(out) < max_entries and base <= bp and bp + 16 <= base + THREAD_SIZE:
        try:
            data = host.read(bp, 16)
        except Exception:  # noqa: BLE001 - an unreadable frame ends the walk
            break
        nxt, ret = int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")
        if ret == host.trampoline:
            ret = host.kretprobe_find_ret_addr(bp + 8) or ret
        if not host.symbols.is_text(ret):
            break
        out.append(ret & _M)
        if nxt <= bp:                     # frames only go up the stack
            break
        bp = nxt
    return out
