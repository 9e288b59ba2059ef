"""``kph demo trap-flow``: watch a real in-guest kprobe fire, step by step, from the host.

The probe is a real kprobe registered by the harness's module inside the guest. The host
only *observes*: QEMU gdbstub breakpoints (which do not modify guest memory under TCG) at
the addresses on the kernel's path, each recorded and passed through by a single-step, so
the guest runs exactly as it would unobserved. What each flow shows (Linux 6.1, x86_64):

- ``int3``: a probe that is neither at a function entry (ftrace) nor optimizable (it has
  a post_handler). The probed address holds 0xcc over the instruction's first byte; the
  int3 enters ``asm_exc_int3`` -> ``exc_int3`` -> ``kprobe_int3_handler`` -> the module's
  pre_handler; the kernel then returns from the exception into the *instruction slot*,
  where a copy of the original instruction runs, followed by another int3 (since 5.14,
  "x86/kprobes: Use int3 instead of debug trap for single-step": not the TF debug trap the
  2005 texts describe) whose handler runs the post_handler; the exception returns to the
  instruction after the probe.
- ``ftrace``: a probe at a function entry: the 5-byte nop is a call into
  ``ftrace_regs_caller``, ``kprobe_ftrace_handler`` calls the pre_handler; no trap at all.
- ``optimized``: a mid-function probe without post_handler, jump-optimized: a ``jmp`` to a
  detour buffer that calls ``optimized_callback`` and jumps back.
- ``kretprobe``: the return through ``arch_rethook_trampoline``, the return handler, and
  the ``ret`` to the real return address.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import HarnessError
from .symbols import instruction_at

LANES = ("user task", "CPU", "exception entry", "kprobes core", "probe handler",
         "instruction slot")
SHOWN = ("rip", "rsp", "eflags", "cs")
IF, TF = 1 << 9, 1 << 8


@dataclass(frozen=True)
class Step:
    n: int
    lane: str
    title: str
    where: str                 # sym+off/size
    addr: int
    insn: str
    regs: dict[str, int]
    changed: tuple[str, ...]
    note: str = ""

    def flags_text(self) -> str:
        f = self.regs.get("eflags", 0)
        return f"IF={int(bool(f & IF))} TF={int(bool(f & TF))}"


@dataclass
class Flow:
    kind: str
    probe: str
    steps: list[Step] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)


class _Observer:
    """Breakpoints as silent observers: record, single-step past, continue."""

    def __init__(self, vm: Any) -> None:
        self.vm = vm
        self.stub = vm.gdbstub(resume=False)
        if self.stub.running:
            self.stub.interrupt()
        self.sym = vm.symbols
        self.bps: dict[int, int] = {}

    def arm(self, addrs: dict[int, tuple[str, str]]) -> None:
        for a in addrs:
            if a not in self.bps:
                self.bps[a] = self.stub.insert_breakpoint(a)

    def disarm(self) -> None:
        for num in self.bps.values():
            self.stub.delete_breakpoint(num)
        self.bps.clear()

    def insn(self, addr: int) -> str:
        try:
            i = instruction_at(self.stub.read_memory(addr, 16), addr)
        except HarnessError:
            return "(unreadable)"
        return f"{i.bytes.hex(' ')}  {i.mnemonic} {i.op_str}".strip() if i else "(undecodable)"

    def run(self, workload: str, observers: dict[int, tuple[str, str]], start: int,
            end: int | None = None, *, notes: dict[int, str] | None = None,
            after_lane: str | None = None, until: Callable[[int, int], bool] | None = None,
            final: str = "back in the caller", timeout: float = 60.0,
            max_steps: int = 64) -> list[Step]:
        """Record the observed path from the first stop at ``start`` to the stop at ``end``.

        Or, with ``after_lane``/``until``: once a step in ``after_lane`` is recorded,
        single-step until ``until(previous_pc, pc)`` and record that last place (for
        paths without a fixed end address, such as a ``ret`` out of a trampoline).
        """
        stub, steps, prev = self.stub, [], {}
        self.arm(observers)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("r", self.vm.run(workload, timeout=timeout)))
        stub.cont()
        t.start()
        deadline = time.monotonic() + timeout
        started = False

        def record(pc: int, th: int, lane: str, title: str) -> None:
            nonlocal prev
            regs = stub.read_registers(SHOWN + ("rdi", "rax"), thread=th)
            changed = tuple(k for k in SHOWN if k in prev and prev[k] != regs[k])
            steps.append(Step(len(steps) + 1, lane, title, self.sym.format(pc), pc,
                              self.insn(pc), regs, changed, (notes or {}).get(pc, "")))
            prev = regs

        try:
            while time.monotonic() < deadline and len(steps) < max_steps:
                try:
                    stop = stub.wait_stop(timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    break
                pc, th = stop.addr, stop.thread
                while True:
                    started = started or pc == start
                    if started and pc in observers:
                        record(pc, th, *observers[pc])
                        if pc == end:
                            return steps
                    last = pc
                    st, num = stub.step_over(pc, self.bps.get(pc), thread=th)
                    if pc in self.bps and num is None:
                        self.bps[pc] = stub._last_reinserted
                    pc = st.addr
                    if started and until is not None and any(x.lane == after_lane for x in steps):
                        n = 0
                        while not until(last, pc) and n < 20000:
                            last, pc, n = pc, stub.step(thread=th).addr, n + 1
                        record(pc, th, "CPU", final)
                        return steps
                    if pc not in observers:
                        break
                stub.cont()
            return steps
        finally:
            if stub.running:
                stub.interrupt()
            self.disarm()
            stub.cont()
            t.join(timeout)


def _module(vm: Any, post: bool) -> Any:
    from .backends.module import ModuleBackend
    return ModuleBackend(vm, post_handler=post)


def _slot_info(mb: Any) -> tuple[int, int]:
    """(slot address, original first byte) of the single probe the module holds."""
    from .backends.module import KPH_DIR
    line = mb._sh(f"cat {KPH_DIR}/list").split()
    i = line.index("slot")
    return int(line[i + 1], 16), int(line[line.index("opcode") + 1], 16)


def _sym(vm: Any, name: str) -> int | None:
    s = vm.symbols.get(name)
    return s.addr if s is not None else None


def int3_flow(vm: Any, target: str, workload: str) -> Flow:
    from .probespec import parse

    mb = _module(vm, post=True)
    spec = parse(f"p:kph/trapflow {target}")
    try:
        (o,) = mb.register([spec])
        if not o.accepted:
            raise HarnessError(f"the guest refused a kprobe at {target}: errno {o.errno} ({o.message})")
        vm.refresh_module_symbols()
        mb.enable()
        p = vm.symbols.resolve(target)
        slot, opcode = _slot_info(mb)    # through the agent: before the stub halts the guest
        obs = _Observer(vm)
        code = obs.stub.read_memory(p, 16)
        orig = bytes([opcode]) + code[1:]
        ins = instruction_at(orig, p)
        if ins is None:
            raise HarnessError(f"cannot decode the instruction at {target}")
        after = p + ins.size
        lanes = {p: ("CPU", "the probed instruction: int3 over its first byte"),
                 slot: ("instruction slot", "the copied instruction runs out of line"),
                 slot + ins.size: ("instruction slot", "int3 after the copy: back to kprobes"),
                 after: ("CPU", "resumed at the next instruction")}
        for name, lane, title in (
                ("asm_exc_int3", "exception entry", "#BP exception entry (IDT vector 3)"),
                ("exc_int3", "exception entry", "exc_int3(): the C handler"),
                ("kprobe_int3_handler", "kprobes core", "kprobe_int3_handler(): whose int3?"),
                ("kph_pre", "probe handler", "the module's pre_handler"),
                ("kph_post", "probe handler", "the module's post_handler")):
            a = _sym(vm, name)
            if a is not None:
                lanes[a] = (lane, title)
        notes = {p: f"guest bytes at the probe: {code[:ins.size].hex(' ')} (0xcc = int3); "
                    f"original instruction: {orig[:ins.size].hex(' ')} {ins.mnemonic} {ins.op_str}",
                 slot: f"slot {slot:#x} holds the copy: "
                       f"{obs.stub.read_memory(slot, ins.size + 1).hex(' ')} (copy, then int3)"}
        steps = obs.run(workload, lanes, p, after, notes=notes)
        flow = Flow("int3", f"p {target} (module kprobe with pre and post handlers)", steps)
        flow.facts = [notes[p], notes[slot],
                      "6.1 runs the copied instruction in the slot and returns through a second "
                      "int3 (kprobe_post_process), not the TF debug trap of the 2005 texts"]
        return flow
    finally:
        mb.close()


def ftrace_flow(vm: Any, func: str, workload: str) -> Flow:
    from .probespec import parse

    mb = _module(vm, post=False)
    try:
        (o,) = mb.register([parse(f"p:kph/trapflow_ft {func}")])
        if not o.accepted:
            raise HarnessError(f"the guest refused a kprobe at {func}: errno {o.errno}")
        vm.refresh_module_symbols()
        mb.enable()
        p = vm.symbols.resolve(func)
        obs = _Observer(vm)
        lanes = {p: ("CPU", f"function entry: the ftrace call site ({o.mode})"),
                 p + 5: ("CPU", "back after the 5-byte call site")}
        for name, lane, title in (("ftrace_regs_caller", "kprobes core", "ftrace_regs_caller: saves pt_regs"),
                                  ("kprobe_ftrace_handler", "kprobes core", "kprobe_ftrace_handler()"),
                                  ("kph_pre", "probe handler", "the module's pre_handler")):
            a = _sym(vm, name)
            if a is not None:
                lanes[a] = (lane, title)
        steps = obs.run(workload, lanes, p, p + 5,
                        notes={p: f"bytes at the entry: {obs.insn(p)} (a call, no trap)"})
        return Flow("ftrace", f"p {func} (function entry: ftrace-based)", steps)
    finally:
        mb.close()


def optimized_flow(vm: Any, target: str, workload: str, *, wait: float = 5.0) -> Flow:
    from .probespec import parse

    mb = _module(vm, post=False)
    try:
        (o,) = mb.register([parse(f"p:kph/trapflow_opt {target}")])
        if not o.accepted:
            raise HarnessError(f"the guest refused a kprobe at {target}: errno {o.errno}")
        mode, deadline = o.mode, time.monotonic() + wait
        while mode != "optimized" and time.monotonic() < deadline:
            time.sleep(0.3)  # the kprobe optimizer runs deferred (kprobe_optimizer work)
            mode = next(iter(mb.list().values()))[2]
        vm.refresh_module_symbols()
        mb.enable()
        p = vm.symbols.resolve(target)
        obs = _Observer(vm)
        code = obs.stub.read_memory(p, 5)
        lanes: dict[int, tuple[str, str]] = {p: ("CPU", f"the probed address ({mode})")}
        if code[0] == 0xE9:
            detour = (p + 5 + int.from_bytes(code[1:5], "little", signed=True)) & ((1 << 64) - 1)
            lanes[detour] = ("instruction slot", "the detour buffer (optprobe template)")
        for name, lane, title in (("optimized_callback", "kprobes core", "optimized_callback()"),
                                  ("kph_pre", "probe handler", "the module's pre_handler")):
            a_ = _sym(vm, name)
            if a_ is not None:
                lanes[a_] = (lane, title)
        steps = obs.run(workload, lanes, p, notes={p: f"bytes at the probe: {obs.insn(p)}"},
                        after_lane="probe handler", until=lambda last, pc: p < pc < p + 32,
                        final="back in the function after the detour (copied instructions ran there)")
        return Flow("optimized", f"p {target} (no post_handler: {mode})", steps)
    finally:
        mb.close()


def kretprobe_flow(vm: Any, func: str, workload: str) -> Flow:
    from .probespec import parse

    mb = _module(vm, post=False)
    try:
        (o,) = mb.register([parse(f"r:kph/trapflow_ret {func}")])
        vm.refresh_module_symbols()
        mb.enable()
        obs = _Observer(vm)
        tramp = _sym(vm, "arch_rethook_trampoline")
        if tramp is None:
            raise HarnessError("this kernel has no arch_rethook_trampoline")
        lanes = {tramp: ("kprobes core", "the function returned into arch_rethook_trampoline")}
        for name, lane, title in (
                ("arch_rethook_trampoline_callback", "kprobes core", "arch_rethook_trampoline_callback()"),
                ("rethook_trampoline_handler", "kprobes core", "rethook_trampoline_handler(): finds the real return address"),
                ("kph_ret", "probe handler", "the module's return handler")):
            a = _sym(vm, name)
            if a is not None:
                lanes[a] = (lane, title)
        t_end = tramp + max(1, vm.symbols.symbolize(tramp)[0].size)
        steps = obs.run(workload, lanes, tramp, after_lane="probe handler",
                        until=lambda last, pc: tramp <= last < t_end and not tramp <= pc < t_end,
                        final="ret from the trampoline: back at the real return address")
        return Flow("kretprobe", f"r {func} (return through the rethook trampoline)", steps)
    finally:
        mb.close()


def demo(vm: Any, *, target: str = "do_sys_openat2+5", workload: str = "cat /proc/version",
         variants: tuple[str, ...] = ("int3", "ftrace", "optimized", "kretprobe")) -> list[Flow]:
    func = target.split("+")[0]
    flows = []
    for v in variants:
        if v == "int3":
            flows.append(int3_flow(vm, target, workload))
        elif v == "ftrace":
            flows.append(ftrace_flow(vm, func, workload))
        elif v == "optimized":
            flows.append(optimized_flow(vm, target, workload))
        elif v == "kretprobe":
            flows.append(kretprobe_flow(vm, func, workload))
    return flows
