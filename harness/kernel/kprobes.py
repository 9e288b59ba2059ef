"""The kprobes API as plain Python values: ``Kprobe``, ``Kretprobe``, ``Jprobe``, ``PtRegs``.

Names and meanings are the kernel's (``include/linux/kprobes.h``, shared/seeds/002):
``symbol_name``, ``offset``, ``addr``, ``pre_handler``, ``post_handler``, ``maxactive``,
``nmissed``, ``data_size``, ``KPROBE_FLAG_DISABLED``... so a kprobes module's logic ports to
Python unchanged. Handlers run on the host while the guest vCPU is stopped at the probe
(see ``harness.engines.gdbstub_engine``); return values mean what they mean in the kernel.

Two things the 6.1 kernel no longer has are kept host-side, as the 2005 texts describe
them (shared/seeds/000, 001): ``fault_handler`` (removed in 5.14, "kprobes: Remove
kprobe::fault_handler") and ``Jprobe`` (removed in 4.15). Both are documented where
they are defined.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

#: ``struct pt_regs`` field -> the name GDB uses for that register on QEMU's x86_64 target.
PT_REGS_FIELDS: dict[str, str] = {
    "r15": "r15", "r14": "r14", "r13": "r13", "r12": "r12", "bp": "rbp", "bx": "rbx",
    "r11": "r11", "r10": "r10", "r9": "r9", "r8": "r8", "ax": "rax", "cx": "rcx",
    "dx": "rdx", "si": "rsi", "di": "rdi", "ip": "rip", "cs": "cs", "flags": "eflags",
    "sp": "rsp", "ss": "ss",
}
GDB_TO_FIELD = {v: k for k, v in PT_REGS_FIELDS.items()}
#: The int3 a kprobe plants (arch/x86/include/asm/text-patching.h): the pre_handler sees
#: ``regs->ip`` = the probed address + this.
INT3_INSN_SIZE = 1
MASK64 = (1 << 64) - 1
#: arch/x86/include/uapi/asm/processor-flags.h: the resume and virtual-8086 flags, which
#: PUSHF leaves out of the image it pushes (cleared there)
X86_EFLAGS_RF = 1 << 16
X86_EFLAGS_VM = 1 << 17


class ProbeFlags(enum.IntFlag):
    """``KPROBE_FLAG_*``: GONE (the probed code went away), DISABLED, OPTIMIZED, FTRACE."""

    GONE = 1
    DISABLED = 2
    OPTIMIZED = 4
    FTRACE = 8


KPROBE_FLAG_GONE = ProbeFlags.GONE
KPROBE_FLAG_DISABLED = ProbeFlags.DISABLED
KPROBE_FLAG_OPTIMIZED = ProbeFlags.OPTIMIZED
KPROBE_FLAG_FTRACE = ProbeFlags.FTRACE
_DISABLED = int(ProbeFlags.DISABLED)


class PtRegs:
    """The registers of the stopped vCPU with ``struct pt_regs`` field names.

    Values are unsigned 64-bit ints. A field is fetched from the stub when a handler first
    reads it (a probe whose handlers never look costs no register read; ``snapshot()``
    fetches all the rest in one command) and any field a handler assigns is written back
    before the guest resumes. All reads happen with the vCPU still stopped at the probe. ``orig_ax`` is -1 as in an int3
    exception frame. ``cpu`` is the vCPU index; ``read_sys("cr2")`` reads a system register.
    """

    __slots__ = ("_vals", "_dirty", "_loader", "_sys", "_unwinder", "cpu", "orig_ax", "_masks")

    def __init__(self, values: dict[str, int] | None = None, *,
                 loader: Callable[[tuple[str, ...]], dict[str, int]] | None = None,
                 sys_reader: Callable[[str], int] | None = None, cpu: int = 0,
                 unwinder: Callable[["PtRegs", int], list[int]] | None = None) -> None:
        self._vals: dict[str, int] = dict(values or {})
        self._dirty: set[str] = set()
        self._loader = loader
        self._sys = sys_reader
        self._unwinder = unwinder
        self.cpu = cpu
        self.orig_ax = MASK64
        self._masks: dict[str, int] = {}

    def mask_loaded(self, name: str, mask: int) -> None:
        """``name`` as the probed path saved it: the vCPU's value ANDed with ``mask``
        (read now or later; a value a handler sets is its own)."""
        self._masks[name] = mask
        if name in self._vals and name not in self._dirty:
            self._vals[name] &= mask

    def stack_trace(self, max_entries: int = 16) -> list[int]:
        """``stack_trace_save_regs(regs, ...)``: ``ip`` first, then the return addresses
        outwards, as the guest kernel's unwinder finds them (ORC or frame pointers, as its
        configuration says; a return the host's kretprobe trampoline took shows as the
        real address): ``harness.kernel.unwind.stack_trace``. In a handler."""
        if self._unwinder is None:
            raise AttributeError("no stack trace here: these registers are not a stopped "
                                 "vCPU's in a handler")
        return self._unwinder(self, max_entries)

    def _load(self, names: tuple[str, ...] | None = None) -> None:
        if self._loader is None:
            return
        want = tuple(n for n in (names or PT_REGS_FIELDS) if n not in self._vals)
        if want:
            got = self._loader(want)
            for k, m in self._masks.items():
                if k in got:
                    got[k] &= m
            self._vals.update(got)

    def get(self, name: str) -> int:
        if name not in self._vals:
            if name not in PT_REGS_FIELDS:
                raise AttributeError(f"pt_regs has no field {name!r}")
            self._load((name,))
        try:
            return self._vals[name]
        except KeyError:
            raise AttributeError(f"pt_regs field {name!r} is not available here") from None

    def set(self, name: str, value: int) -> None:
        if name not in PT_REGS_FIELDS:
            raise AttributeError(f"pt_regs has no field {name!r}")
        self._vals[name] = value & MASK64
        self._dirty.add(name)

    def read_sys(self, name: str) -> int:
        """A system register (``cr2``, ``cr3``, ``gs_base``, ...), read on demand."""
        if self._sys is None:
            raise AttributeError("no system register access here")
        return self._sys(name)

    @property
    def dirty(self) -> dict[str, int]:
        return {k: self._vals[k] for k in self._dirty}

    def clear_dirty(self) -> None:
        self._dirty.clear()

    def snapshot(self) -> dict[str, int]:
        self._load()
        return {k: self._vals[k] for k in PT_REGS_FIELDS if k in self._vals}

    def signed(self, name: str, bits: int = 64) -> int:
        """A field as a signed integer of ``bits`` bits (``regs.signed('di', 32)`` = AT_FDCWD)."""
        v = self.get(name) & ((1 << bits) - 1)
        return v - (1 << bits) if v >> (bits - 1) else v

    def __repr__(self) -> str:
        shown = " ".join(f"{k}={v:#x}" for k, v in self._vals.items())
        return f"<PtRegs cpu={self.cpu} {shown}>"


def _field(name: str) -> property:
    return property(lambda self: self.get(name), lambda self, v: self.set(name, v),
                    doc=f"``pt_regs->{name}``")


for _f in PT_REGS_FIELDS:
    setattr(PtRegs, _f, _field(_f))

PreHandler = Callable[["Kprobe", PtRegs], Any]
PostHandler = Callable[["Kprobe", PtRegs, int], Any]
FaultHandler = Callable[["Kprobe", PtRegs, int], Any]


@dataclass(eq=False)
class Kprobe:
    """``struct kprobe``: where (``symbol_name`` + ``offset``, or ``addr``) and what to call.

    ``pre_handler(p, regs)`` runs before the probed instruction; non-zero means "I changed
    the execution path": no single-step, no post_handler, resume at ``regs.ip``.
    ``post_handler(p, regs, flags)`` runs after the instruction, with the registers after it.
    ``fault_handler(p, regs, trapnr)`` runs when the probed instruction raises an exception
    (14 page fault, 13 general protection, 6 invalid opcode...); 1 means handled: the
    guest never sees the exception and resumes at ``regs.ip``. The 6.1 kernel removed the
    in-kernel fault_handler (5.14); host-side it keeps its 2005 meaning.
    """

    symbol_name: str | None = None
    offset: int = 0
    addr: int | None = None
    pre_handler: PreHandler | None = None
    post_handler: PostHandler | None = None
    fault_handler: FaultHandler | None = None
    flags: int = 0
    #: called from an ftrace_ops at the function's ftrace location, as an fprobe is
    #: (kernel/trace/fprobe.c), not through ``register_kprobe()``: the kprobe blacklist
    #: and instruction rules do not apply, the place must be an ftrace location, and the
    #: guest's ``kprobe_running()`` does not make it miss
    ftrace_ops: bool = False
    # runtime state, kernel names
    nmissed: int = 0
    nhit: int = field(default=0)
    registered: bool = field(default=False, repr=False)

    @property
    def disabled(self) -> bool:
        return bool(self.flags & _DISABLED)    # a plain int: IntFlag's & costs ~1 us a hit

    @property
    def kind(self) -> str:
        return "k"


@dataclass(eq=False)
class KretprobeInstance:
    """``struct kretprobe_instance``: one pending return of one call.

    ``ret_addr`` is the real return address; ``node_ret_addr`` what the kernel saved for
    this instance (``ri->node.ret_addr``, which ``get_kretprobe_retaddr()`` returns and a
    return event prints): the real address, or the kernel's trampoline for an instance
    taken after another kretprobe on the same call already hooked it (0: not set, the
    real one). ``data`` the per-instance scratch of
    ``data_size`` bytes (a ``bytearray``: entry_handler writes, handler reads),
    ``task`` the ``struct task_struct *`` that made the call (when known), ``stack_slot``
    where the return address lived on the guest stack (how returns are matched to calls).
    """

    rp: "Kretprobe"
    ret_addr: int = 0
    node_ret_addr: int = 0
    stack_slot: int = 0
    task: int | None = None
    cpu: int = 0
    data: bytearray = field(default_factory=bytearray)
    orphan: bool = False


RetHandler = Callable[[KretprobeInstance, PtRegs], Any]


@dataclass(eq=False)
class Kretprobe:
    """``struct kretprobe``: a return probe through a trampoline.

    At function entry an instance is taken from a pool of ``maxactive`` (default, as the
    kernel's: max(10, 2 * ncpus)); an empty pool counts ``nmissed`` and skips
    ``entry_handler``. ``entry_handler(ri, regs)`` returning non-zero means "no return
    probe for this call". ``handler(ri, regs)`` runs when the function returns, with
    ``regs.ax`` the return value and ``regs.ip`` the real return address (6.1's
    ``rethook_trampoline_handler()`` sets it before calling handlers).
    """

    symbol_name: str | None = None
    handler: RetHandler | None = None
    entry_handler: RetHandler | None = None
    maxactive: int = 0
    data_size: int = 0
    offset: int = 0
    addr: int | None = None
    flags: int = 0
    #: an fprobe's exit: its entry is an ftrace_ops callback (:attr:`Kprobe.ftrace_ops`)
    ftrace_ops: bool = False
    nmissed: int = 0
    nhit: int = 0
    registered: bool = field(default=False, repr=False)
    kp: Kprobe | None = field(default=None, repr=False)  # the entry probe, as in the kernel

    @property
    def disabled(self) -> bool:
        return bool(self.flags & _DISABLED)    # a plain int: IntFlag's & costs ~1 us a hit


@dataclass(eq=False)
class Jprobe:
    """A jump probe (removed from the kernel in 4.15; host-side only).

    ``entry`` is called with the probed function's arguments as the x86_64 ABI passes
    them (rdi, rsi, rdx, rcx, r8, r9, then the stack), as many as it declares. Its return
    value is ignored; the function then runs normally, as after ``jprobe_return()``.
    """

    symbol_name: str | None = None
    entry: Callable[..., Any] | None = None
    offset: int = 0
    addr: int | None = None
    nargs: int | None = None
    kp: Kprobe | None = field(default=None, repr=False)


def preempt_context(pc: int, hardirq_shift: int = 16) -> str:
    """The context of a probed call from the caller's ``preempt_count()``, as the guest's
    trace entry records it (``tracing_gen_ctx_irq_test()``, kernel/trace/trace.c, 6.1 to
    7.3: TRACE_FLAG_SOFTIRQ from ``in_serving_softirq()``, TRACE_FLAG_HARDIRQ from
    ``hardirq_count()``, TRACE_FLAG_NMI from ``in_nmi()``): ``irq`` in a softirq, or in a
    hardirq that is not an NMI, else ``task``. include/linux/preempt.h: SOFTIRQ_OFFSET
    0x100; HARDIRQ 4 bits at ``hardirq_shift`` and NMI above them (16 up to 6.x:
    HARDIRQ_MASK 0xf0000, NMI_MASK 0xf00000; 24 in 7.3, after the 8 new HARDIRQ_DISABLE
    bits: ``KernelRules.preempt_hardirq_shift``). An NMI counts as ``task``: an int3-based
    guest kprobe runs its handler in NMI context whatever its caller was, so only the
    caller's softirq bit tells there (``harness.backends.events._context``). The
    PREEMPT_NEED_RESCHED bit x86 folds in (inverted: bit 31 of 6.x's int, bit 63 of
    7.3's unsigned long) and anything above the NMI bits is ignored."""
    pc &= (1 << (hardirq_shift + 8)) - 1
    hard, nmi = 0xF << hardirq_shift, 0xF << (hardirq_shift + 4)
    if pc & 0x100 or (pc & hard and not pc & nmi):
        return "irq"
    return "task"


def preempt_hardirq_only(pc: int, hardirq_shift: int = 16) -> bool:
    """Whether :func:`preempt_context` says ``irq`` for ``pc`` only because the caller is
    in a hardirq (no softirq served, no NMI): what the trace entry of a guest kprobe whose
    handler ran from int3 cannot show, since ``irqentry_nmi_enter()`` (arch/x86/kernel/
    traps.c: exc_int3()) sets NMI and HARDIRQ for every caller alike (rule ``int3-nmi``,
    harness.diff.rules)."""
    pc &= (1 << (hardirq_shift + 8)) - 1
    return bool(pc & (0xF << hardirq_shift)) and not pc & 0x100 and \
        not pc & (0xF << (hardirq_shift + 4))


def kernel_rethook_trampoline(symbols: Any) -> int:
    """The guest kernel's own kretprobe trampoline: ``arch_rethook_trampoline`` where
    kretprobes run on rethook (x86 since 5.19: CONFIG_KRETPROBE_ON_RETHOOK, so 6.1, 6.12
    and 7.3), else ``__kretprobe_trampoline`` (5.11-5.18) or ``kretprobe_trampoline``; 0
    when ``symbols`` has none of them."""
    for name in ("arch_rethook_trampoline", "__kretprobe_trampoline", "kretprobe_trampoline"):
        sym = symbols.get(name)
        if sym is not None:
            return sym.addr
    return 0
