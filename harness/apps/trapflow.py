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
- ``uprobe``: a ``uprobe_events`` probe in a test program (``kph-loop``, on the 3-byte
  ``mov %rsp,%rbp`` after the entry, which x86 uprobes do not emulate): the int3 in the
  process's own copy of the page, ``asm_exc_int3`` -> ``exc_int3`` -> the die notifier
  (``arch_uprobe_exception_notify`` -> ``uprobe_pre_sstep_notifier``, which only sets
  TIF_UPROBE), then on the way back to user mode ``uprobe_notify_resume`` -> handle_swbp
  -> the trace event's ``uprobe_dispatcher``; ``arch_uprobe_pre_xol`` sets TF and the
  task returns into the XOL slot (the ``[uprobes]`` page), runs the copy, traps with #DB
  (``uprobe_post_sstep_notifier``), ``arch_uprobe_post_xol`` fixes ip, and the task goes
  on after the probed instruction.
- ``uretprobe``: at the entry ``arch_uretprobe_hijack_return_addr`` puts the trampoline
  (the first slot of the ``[uprobes]`` page, an int3) on the user stack; the return lands
  there, traps, and ``uprobe_notify_resume`` -> handle_trampoline -> ``uretprobe_dispatcher``
  sends the task to the real return address.
"""
from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import HarnessError
from ..kernel.symbols import instruction_at
from ..backends.module import KPH_DIR, REG_OFFSET, ModuleBackend
from ..kernel.grammar import parse
from ..backends.events import EventsBackend
from ..diff.runner import resolve_uprobes
from ..kernel.elf import ElfImage
from ..vmctl import Machine

LANES = ("user task", "CPU", "exception entry", "kprobes core", "uprobes core",
         "probe handler", "instruction slot")
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

    def __init__(self, vm: Machine) -> None:
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
            max_steps: int = 64, after_addr: int | None = None, final_lane: str = "CPU",
            continue_after: bool = False,
            discover: Callable[[int, dict[str, int]], dict[int, tuple[str, str]]] | None = None,
            run_to: Callable[[int], int | None] | None = None) -> list[Step]:
        """Record the observed path from the first stop at ``start`` to the stop at ``end``.

        Or, with ``after_lane``/``until``: once a step in ``after_lane`` is recorded,
        single-step until ``until(previous_pc, pc)`` and record that last place (for
        paths without a fixed end address, such as a ``ret`` out of a trampoline).
        ``after_addr`` starts that stepping after the step at that address instead;
        ``continue_after`` records the place found, then goes on observing (until ``end``);
        ``discover(pc, regs)`` may return observers learnt at a step (an address in a
        process's own page, such as the uretprobe trampoline), armed at once.
        ``run_to(pc)``: while stepping towards ``until``, an address to run to (a
        breakpoint of its own) instead of stepping on from ``pc``: another task's user
        code, scheduled in before the probed task came back to user mode.
        """
        stub, steps, prev = self.stub, [], {}
        self.arm(observers)
        out: dict[str, Any] = {}
        # The demo holds the guest stopped at each step while it reads registers and code
        # (seconds on a loaded machine): the workload's vm.run must wait, not take that
        # for a stuck guest (Machine's stall check asks the stop holders first).
        def holder() -> None:
            return None
        self.vm.add_stop_holder(holder)
        t = threading.Thread(target=lambda: out.setdefault("r", self.vm.run(workload, timeout=timeout)))
        stub.cont()
        t.start()
        deadline = time.monotonic() + timeout
        started = False

        def record(pc: int, th: int, lane: str, title: str) -> None:
            nonlocal prev
            if steps and steps[-1].addr == pc:
                return    # the same place again after a page fault brought its page in
            regs = stub.read_registers(SHOWN + ("rdi", "rsi", "rax"), thread=th)
            changed = tuple(k for k in SHOWN if k in prev and prev[k] != regs[k])
            steps.append(Step(len(steps) + 1, lane, title, self.sym.format(pc), pc,
                              self.insn(pc), regs, changed, (notes or {}).get(pc, "")))
            prev = regs
            if discover is not None:
                more = discover(pc, regs)
                if more:
                    observers.update(more)
                    self.arm(more)

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
                    if started and until is not None and any(
                            x.lane == after_lane if after_addr is None else x.addr == after_addr
                            for x in steps):
                        n = 0
                        while not until(last, pc) and n < 20000:
                            to = run_to(pc) if run_to is not None else None
                            if to is None:
                                last, pc, n = pc, stub.step(thread=th).addr, n + 1
                            else:
                                last, pc, n = pc, self._run_to(to, deadline), n + 1
                        record(pc, th, final_lane, final)
                        if not continue_after:
                            return steps
                        until = None
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
            self.vm.remove_stop_holder(holder)

    def _run_to(self, addr: int, deadline: float) -> int:
        """Run until a stop at ``addr`` (a breakpoint of its own, removed after), stepping
        over the observers' breakpoints on the way; the stop's pc.

        :raise HarnessError: no stop there before ``deadline``."""
        stub = self.stub
        num = None if addr in self.bps else stub.insert_breakpoint(addr)
        try:
            stub.cont()
            while True:
                try:
                    stop = stub.wait_stop(timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    raise HarnessError(f"trapflow: the guest did not reach {addr:#x} in time") \
                        from None
                if stop.addr == addr:
                    return addr
                st, again = stub.step_over(stop.addr, self.bps.get(stop.addr), thread=stop.thread)
                if stop.addr in self.bps and again is None:
                    self.bps[stop.addr] = stub._last_reinserted
                if st.addr == addr:
                    return addr
                stub.cont()
        finally:
            if num is not None:
                stub.delete_breakpoint(num)


def _module(vm: Machine, post: bool) -> Any:
    return ModuleBackend(vm, post_handler=post)


def _slot_info(mb: Any) -> tuple[int, int]:
    """(slot address, original first byte) of the single probe the module holds."""
    line = mb._sh(f"cat {KPH_DIR}/list").split()
    i = line.index("slot")
    return int(line[i + 1], 16), int(line[line.index("opcode") + 1], 16)


def _sym(vm: Machine, name: str) -> int | None:
    s = vm.symbols.get(name)
    return s.addr if s is not None else None


def int3_flow(vm: Machine, target: str, workload: str) -> Flow:
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


def ftrace_flow(vm: Machine, func: str, workload: str) -> Flow:
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


def _wait_for_the_jump(vm: Machine, addr: int, deadline: float) -> None:
    """Until the probed address holds the ``jmp`` (0xe9) or ``deadline``. A kprobe queued
    for optimization is "optimized" at once (kernel/kprobes.c: optimize_kprobe sets
    KPROBE_FLAG_OPTIMIZED, which kprobe_optimized() reads), but the jump is written later,
    by the deferred kprobe_optimizer() after synchronize_rcu_tasks() (arch/x86/kernel/
    kprobes/opt.c: arch_optimize_kprobes, text_poke_bp): seconds under TCG, and only
    while the guest runs, so each look halts it for a read and lets it go on."""
    stub = vm.gdbstub(resume=False)
    while True:
        if stub.running:
            stub.interrupt()
        if stub.read_memory(addr, 1) == b"\xe9" or time.monotonic() > deadline:
            return                          # halted; a late optimizer shows as int3
        stub.cont()
        time.sleep(0.5)


def optimized_flow(vm: Machine, target: str, workload: str, *, wait: float = 5.0,
                   jump_wait: float = 30.0) -> Flow:
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
        if mode == "optimized":
            _wait_for_the_jump(vm, p, time.monotonic() + jump_wait)
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


def kretprobe_flow(vm: Machine, func: str, workload: str) -> Flow:
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


USER_PROG, USER_FUNC = "/usr/bin/kph-loop", "kph_add"
_USER_TOP = 1 << 47


def _user_probe(vm: Machine, line: str) -> tuple[Any, int, int]:
    """Place one ``uprobe_events`` line; return (backend, its offset's user address, size
    of the instruction there)."""
    (spec,) = resolve_uprobes(vm, [parse(line)])
    eb = EventsBackend(vm)
    (o,) = eb.register([spec])
    if not o.accepted:
        eb.close()
        raise HarnessError(f"the guest refused {line}: errno {o.errno} ({o.message})")
    eb.enable()
    elf = vm.pull(spec.path)
    vaddr = ElfImage(elf).vaddr(spec.offset)
    ins = instruction_at(elf[spec.offset:spec.offset + 16], vaddr)
    return eb, vaddr, ins.size if ins else 1


def _lanes(vm: Machine, names: tuple[tuple[str, str, str], ...]) -> dict[int, tuple[str, str]]:
    out = {}
    for name, lane, title in names:
        a = _sym(vm, name)
        if a is not None:
            out[a] = (lane, title)
    return out


def _name_user_steps(vm: Machine, steps: list[Step]) -> list[Step]:
    """Steps in the program's own text get its function name, as docs/demo.md's tables show
    it (``0x401711 (kph_add+0x1)``): kernel symbols do not cover user addresses."""
    import dataclasses

    elf = ElfImage(vm.pull(USER_PROG))
    funcs = sorted((a, n) for n, a in elf._syms.items())
    out = []
    for st in steps:
        if st.addr < _USER_TOP and elf.executable(st.addr):
            below = [(a, n) for a, n in funcs if a <= st.addr]
            if below:
                a, n = below[-1]
                st = dataclasses.replace(st, where=f"{st.addr:#x} ({n}+{st.addr - a:#x})")
        out.append(st)
    return out


def uprobe_flow(vm: Machine, workload: str) -> Flow:
    eb, p, size = _user_probe(vm, f"p:kph/tf_u {USER_PROG}:{USER_FUNC}+1")
    try:
        obs = _Observer(vm)
        lanes = {p: ("CPU", "the probed instruction: int3 in this process's copy of the page"),
                 p + size: ("CPU", "resumed at the next instruction")}
        lanes.update(_lanes(vm, (
            ("asm_exc_int3", "exception entry", "#BP exception entry (IDT vector 3) from user mode"),
            ("exc_int3", "exception entry", "exc_int3(): do_int3_user -> notify_die(DIE_INT3)"),
            ("arch_uprobe_exception_notify", "uprobes core", "arch_uprobe_exception_notify()"),
            ("uprobe_pre_sstep_notifier", "uprobes core", "uprobe_pre_sstep_notifier(): sets TIF_UPROBE, nothing more"),
            ("uprobe_notify_resume", "uprobes core", "uprobe_notify_resume() on the way back to user mode: handle_swbp()"),
            ("uprobe_dispatcher", "probe handler", "trace_uprobe's consumer records the event"),
            ("arch_uprobe_pre_xol", "uprobes core", "arch_uprobe_pre_xol(): ip = the XOL slot, TF set"),
            ("asm_exc_debug", "exception entry", "#DB after the copy ran (TF)"),
            ("uprobe_post_sstep_notifier", "uprobes core", "uprobe_post_sstep_notifier(): TIF_UPROBE again"),
            ("arch_uprobe_post_xol", "uprobes core", "arch_uprobe_post_xol(): ip back after the probed instruction"))))
        pre_xol = _sym(vm, "arch_uprobe_pre_xol")
        # arch_uprobe_pre_xol(auprobe, regs) sets regs->ip to the task's XOL slot
        # (arch/x86/kernel/uprobes.c): the first user-mode place after it is that slot
        # unless the way back to user mode scheduled another task in, whose user code is
        # run past (a guest slowed by a loaded host takes more timer ticks there)
        at: dict[str, int] = {}

        def discover(pc: int, regs: dict[str, int]) -> dict[int, tuple[str, str]]:
            if pc == pre_xol:
                at["regs"] = regs["rsi"]
            return {}

        def slot_ip() -> int | None:
            if "slot" not in at and "regs" in at:
                at["slot"] = int.from_bytes(obs.stub.read_memory(at["regs"] + REG_OFFSET["ip"],
                                                                 8), "little")
            return at.get("slot")

        def user_not_slot(pc: int) -> int | None:
            slot = slot_ip() if pc < _USER_TOP else None
            return slot if slot is not None and pc != slot else None
        steps = obs.run(workload, lanes, p, p + size, after_addr=pre_xol,
                        until=lambda last, pc: pc < _USER_TOP and pc == (slot_ip() or pc),
                        run_to=user_not_slot, discover=discover,
                        final_lane="instruction slot",
                        final="the XOL slot ([uprobes] page): the copied instruction runs there",
                        continue_after=True, max_steps=96)
        flow = Flow("uprobe", f"p {USER_PROG}:{USER_FUNC}+1 (uprobe_events, int3 in user text)",
                    _name_user_steps(vm, steps))
        slot = next((s for s in steps if s.lane == "instruction slot"), None)
        flow.facts = [f"probed address {p:#x} (int3 only in the probed process's copy of the "
                      "page); XOL slot " + (f"{slot.addr:#x} in the [uprobes] page" if slot
                                            else "not reached"),
                      "the handlers run in uprobe_notify_resume() at the exit to user mode, "
                      "not in the int3 handler (a uprobe handler may sleep)"]
        return flow
    finally:
        eb.close()


def uretprobe_flow(vm: Machine, workload: str) -> Flow:
    eb, p, _ = _user_probe(vm, f"r:kph/tf_ur {USER_PROG}:{USER_FUNC}")
    try:
        obs = _Observer(vm)
        hijack = _sym(vm, "arch_uretprobe_hijack_return_addr")
        if hijack is None:
            raise HarnessError("this kernel has no arch_uretprobe_hijack_return_addr")
        lanes = {hijack: ("uprobes core", "prepare_uretprobe(): the user return address "
                          "becomes the trampoline (rdi)")}
        lanes.update(_lanes(vm, (
            ("asm_exc_int3", "exception entry", "#BP: the int3 of the trampoline"),
            ("uprobe_notify_resume", "uprobes core", "uprobe_notify_resume(): handle_swbp -> handle_trampoline"),
            ("uretprobe_dispatcher", "probe handler", "trace_uprobe's ret handler records the event"))))

        def discover(pc: int, regs: dict[str, int]) -> dict[int, tuple[str, str]]:
            if pc == hijack:   # arch_uretprobe_hijack_return_addr(trampoline_vaddr, regs)
                return {regs["rdi"]: ("CPU", "the function returned into the trampoline "
                                      "(first slot of the [uprobes] page)")}
            return {}
        steps = obs.run(workload, lanes, hijack, after_lane="probe handler",
                        until=lambda last, pc: pc < _USER_TOP, discover=discover,
                        final="back at the real return address in the caller")
        return Flow("uretprobe", f"r {USER_PROG}:{USER_FUNC} (return through the uprobes "
                    "trampoline)", _name_user_steps(vm, steps))
    finally:
        eb.close()


def demo(vm: Machine, *, target: str = "do_sys_openat2+5", workload: str = "cat /proc/version",
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
        elif v == "uprobe":
            flows.append(uprobe_flow(vm, f"{USER_PROG} 1"))
        elif v == "uretprobe":
            flows.append(uretprobe_flow(vm, f"{USER_PROG} 1"))
    return flows


# ---------------------------------------------------------------- rendering (text, HTML)

def trapflow_blocks(f: Any) -> list[str]:
    """One flow as text blocks: its header, then one block per step, then its facts
    (``kph demo trap-flow --step`` pauses after each block)."""
    blocks = [f"== {f.kind}: {f.probe}"]
    for s in f.steps:
        changed = f"  changed: {', '.join(s.changed)}" if s.changed else ""
        lines = [f"{s.n:3d}. [{s.lane}] {s.title}",
                 f"     {s.where}  {s.addr:#x}  {s.insn}",
                 f"     ip={s.regs.get('rip', 0):#x} sp={s.regs.get('rsp', 0):#x} "
                 f"{s.flags_text()} cs={s.regs.get('cs', 0):#x}{changed}"]
        if s.note:
            lines.append(f"     note: {s.note}")
        blocks.append("\n".join(lines))
    if f.facts:
        blocks.append("\n".join(f"   * {x}" for x in f.facts))
    return blocks


def trapflow_text(flows: list) -> str:
    return "".join("\n".join(trapflow_blocks(f)) + "\n\n" for f in flows)


def _svg(flow: Any) -> str:
    """The flow as a sequence diagram: only the lanes this flow visits, one row per step
    (a numbered circle in its lane), arrows from circle edge to circle edge, and the
    step labels in a column of their own at the right, so no line runs over a circle or
    a label. The drawing keeps its natural size where the page is wide enough and scales
    down (viewBox) where it is not: nothing is cut off."""
    lanes = [ln for ln in LANES if any(s.lane == ln for s in flow.steps)]
    lanes += [ln for ln in dict.fromkeys(s.lane for s in flow.steps) if ln not in lanes]
    lane_w, left, top, row_h, r = 118, 8, 44, 30, 9
    labels = [f"{s.n}. {s.where.split('/')[0]}" for s in flow.steps]
    label_x = left + lane_w * len(lanes) + 14
    width = label_x + 7 * max((len(t) for t in labels), default=10) + 12
    height = top + row_h * len(flow.steps) + 12
    x = {ln: left + lane_w * i + lane_w // 2 for i, ln in enumerate(lanes)}
    e = html.escape
    parts = [f'<svg class="flow" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" style="max-width:100%;height:auto" '
             f'font-family="sans-serif" font-size="11">',
             '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" '
             'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>']
    for ln in lanes:
        parts.append(f'<text class="lane" x="{x[ln]}" y="18" text-anchor="middle" '
                     f'font-weight="bold">{e(ln)}</text>')
        parts.append(f'<line class="lane-line" x1="{x[ln]}" y1="28" x2="{x[ln]}" '
                     f'y2="{height - 4}" stroke="#ccc" stroke-dasharray="4 3"/>')
    pos = [(x.get(s.lane, left), top + row_h * i + r) for i, s in enumerate(flow.steps)]
    for (x0, y0), (x1, y1) in zip(pos, pos[1:]):
        dx, dy = x1 - x0, y1 - y0
        d = (dx * dx + dy * dy) ** 0.5
        ux, uy = dx / d, dy / d
        a, b = r + 1, r + 2          # leave the circles; room for the arrow head
        parts.append(f'<line class="edge" x1="{x0 + ux * a:.1f}" y1="{y0 + uy * a:.1f}" '
                     f'x2="{x1 - ux * b:.1f}" y2="{y1 - uy * b:.1f}" stroke="#333" '
                     f'marker-end="url(#arr)"/>')
    for (cx, cy), s, label in zip(pos, flow.steps, labels):
        parts.append(f'<line class="guide" x1="{cx + r + 2}" y1="{cy}" x2="{label_x - 4}" '
                     f'y2="{cy}" stroke="#e4e4e4" stroke-dasharray="1 3"/>')
        parts.append(f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="#4a7ab5"/>'
                     f'<text class="num" x="{cx}" y="{cy + 4}" text-anchor="middle" '
                     f'fill="white" font-size="10">{s.n}</text>')
        parts.append(f'<text class="label" x="{label_x}" y="{cy + 4}">{e(label)}'
                     f'<title>{e(s.title)}</title></text>')
    parts.append("</svg>")
    return "".join(parts)


def trapflow_html(flows: list, *, title: str = "kprobe trap flow") -> str:
    body = []
    for f in flows:
        rows = "".join(
            f"<tr><td>{s.n}</td><td>{html.escape(s.lane)}</td><td>{html.escape(s.title)}</td>"
            f"<td><code>{html.escape(s.where)}</code><br><code>{s.addr:#x}</code></td>"
            f"<td><code>{html.escape(s.insn)}</code></td>"
            f"<td><code>ip={s.regs.get('rip', 0):#x}<br>sp={s.regs.get('rsp', 0):#x}<br>"
            f"{s.flags_text()} cs={s.regs.get('cs', 0):#x}</code></td>"
            f"<td>{html.escape(', '.join(s.changed))}</td><td>{html.escape(s.note)}</td></tr>"
            for s in f.steps)
        facts = "".join(f"<li>{html.escape(x)}</li>" for x in f.facts)
        body.append(f'<section class="flow" id="{html.escape(f.kind)}"><h2>{html.escape(f.kind)}: '
                    f'{html.escape(f.probe)}</h2>{_svg(f)}<ul>{facts}</ul>'
                    f'<table class="steps"><tr><th>#</th><th>lane</th><th>step</th><th>where</th>'
                    f'<th>instruction</th><th>registers</th><th>changed</th><th>note</th></tr>'
                    f'{rows}</table></section>')
    return f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{html.escape(title)}</title>
<style>body{{font:14px sans-serif;margin:1.5em;max-width:1400px}}
table{{border-collapse:collapse;margin:1em 0;width:100%}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top;font-size:12px;
overflow-wrap:break-word}}
code{{font-size:11px;overflow-wrap:anywhere}}section{{margin-bottom:3em}}
svg.flow{{display:block}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>A real in-guest kprobe (or uprobe), observed from the host through QEMU's gdbstub:
silent breakpoints along the kernel's path, each passed by a single-step. Each diagram
shows the lanes its flow goes through (of: user task, CPU, exception entry, kprobes core,
uprobes core, probe handler, instruction slot); the labels name where each step was.</p>
{''.join(body)}</body></html>
"""
