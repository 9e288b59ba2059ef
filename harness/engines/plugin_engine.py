"""Host-side kprobes in QEMU's TCG plugin API: ``vm.host`` of ``Machine.boot(host="plugin")``.

The second host engine (docs/plugin.md; the project's design notes: "Two host engines,
one API"); what both engines share is ``harness.engines.base``. Where
``harness.engines.gdbstub_engine`` stops the whole VM at a gdbstub breakpoint and decides in Python,
here the plugin (``probes/plugin/``) runs inside QEMU: an instruction callback on the
probed address runs on the vCPU that reached it, before the instruction, while the
other vCPUs go on. The semantics are the same modules' (``kprobes``, ``fetchargs``,
``probespec``, ``symbols``); what differs is where the work happens:

- spec probes (``kprobe_events`` lines, ``harness.backends.plugin``): fetch args are
  compiled (``harness.kernel.grammar.program``) and run in C at the hit; each hit is a record in a
  shared-memory ring, read back and evaluated by ``harness.kernel.grammar.fetch``: no round trip;
- kretprobes take instances from a pool of ``maxactive`` in C, per concurrent call across
  all vCPUs, as ``pre_handler_kretprobe()`` (kernel/kprobes.c, 6.1) does, and the
  trampoline is serviced in C;
- Python handlers (``register_kprobe(Kprobe(pre_handler=...))``, kretprobes with
  ``entry_handler``/``handler``, jprobes) are a synchronous round trip on that vCPU only
  (``harness.machine.pluginlink.Channel``): the vCPU waits in its callback while the handler runs
  here, may read and write guest memory and system registers through it, and resumes
  with the registers the handler changed (``qemu_plugin_write_register``) or at the ip it
  chose (``qemu_plugin_set_pc``). The other vCPUs keep running.

The hit flow mirrors ``harness.engines.gdbstub_engine`` (kprobe_int3_handler(), aggr_pre_handler(),
kprobe_post_process() of Linux 6.1): pre_handlers newest first, the first non-zero
return ends the chain and the vCPU resumes at ``regs.ip`` with no instruction and no
post_handler; with 0 an ip change is dropped (``setup_singlestep()`` overwrites it) and
the other registers carry over; the instruction then runs *in QEMU* (nothing emulated,
nothing single-stepped), and the post_handlers run at the next instruction this vCPU
executes, whatever the probed one was (a branch, call or ret: at the next block's first
instruction; an interrupt delivered right after it: at the interrupt, with ip/flags/sp
from the interrupt frame). When the probed instruction itself faults, the
fault_handlers run with the faulting registers from the exception frame (1 = handled:
the frame is undone, the vCPU resumes at ``regs.ip``) and no post_handler runs; the
guest's own int3 there (vector 3) is the guest's business.

Registration applies the kernel's rules first (``harness.kernel.symbols.check_probe_address``,
reading kernel text through the human monitor's ``x``, which works while the guest
runs). What the host needs to know of the kernel (symbols, blacklist, task_struct
offsets from BTF) is loaded before any probe is armed; nothing is fetched from the guest
in a callback.

Code translated before a probe was added is invalidated by the plugin (see
kph_plugin.c and docs/plugin.md): ``global_stats()`` counts invalidations and the time until
they were done. The hit flow of Python handlers is ``harness.engines.plugin_handlers``.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .base import EXCEPTION_ENTRIES, EngineCore, read_cstring
from ..errors import HarnessError, ProbeRejectedError, SetupError
from .uprobes import Uprobe
from ..kernel.kprobes import (Kprobe, Kretprobe, KretprobeInstance, ProbeFlags, PtRegs,
                              kernel_rethook_trampoline)
from ..machine.pluginlink import (
    ADD_ENABLED, ADD_EXT, ADD_FGRAPH, ADD_FLUSH, ADD_FTRACE, ADD_FTRACE_OPS, ADD_KPROBE_RUNNING,
    ANSWER_SPIN_DENSE_US, ANSWER_SPIN_US,
    ADD_NO_INVALIDATE, ADD_POST, CFG_URET_SYSCALL, CMD_ADD, CMD_ARRANGE, CMD_CONFIG, CMD_ENABLE,
    CMD_FAILREAD, CMD_GSTATS, CMD_INVALIDATE, CMD_REMOVE, CMD_STATS, CMD_WINDOW, FULL_PROBES,
    FULL_SITE, INVAL_PENDING, INVAL_TEXT, MAX_PER_SITE, MAX_PROBES, MAX_WIN_WRITES, NGSTATS,
    CMD_MARKS, MARKS_READ, MAX_WIN_READS, RING_SIZE,
    PK_FLUSH, PK_FORK, PK_KPROBE, PK_KRET, PK_SPEC_P, PK_SPEC_R, PK_UFREE, WIN_FAILED,
    WIN_PENDING, WIN_TEXT, WIN_UNSETTLED, Channel, PluginError, PluginLink, PluginRecord, decode,
    host_waiter, lean)
from .plugin_handlers import HandlerDispatch
from .plugin_uprobes import PluginUprobes, user_ext
from ..machine.image.facts import percpu_current_task, percpu_preempt_count, uaccess_offsets
from ..machine.handlerctx import HandlerErrors
from ..kernel.symbols import ReservedText, is_ftrace_site, kprobe_addr
from ..vmctl import register_host_engine
from ..vmctl import Machine

log = logging.getLogger(__name__)

EINVAL, ENOENT, ENOSPC = 22, 2, 28
#: The plugin's kretprobe trampoline: one byte past ``_etext``, the gdbstub engine's, so
#: the two engines never share an address (a gdbstub breakpoint there would win); the
#: byte before it where that one is not executable (:meth:`PluginEngine._executable_trampoline`).
DEFAULT_TRAMPOLINE = "_etext+1"
_HMP_LINE = re.compile(r"^([0-9a-f]+):((?:\s+0x[0-9a-f]{2})+)\s*$")
#: bytes a monitor read takes while probes are placed (PluginEngine.text_reads): an
#: ENDBR, a 5-byte call and a 15-byte instruction past it; and the reads kept
TEXT_READ, TEXT_MEMO = 64, 64
#: Many sites placed at once (an ``f:`` glob: PluginEngine.prefetch_text): sites less than
#: PREFETCH_GAP apart share a cluster; a cluster of PREFETCH_MIN sites or more is read
#: with one ``memsave`` (1.9 ms for 64 KiB, 61 ms for 16 MiB of text on this machine,
#: where a monitor read of one site takes ~0.7-1.3 ms), up to PREFETCH_SPAN bytes
PREFETCH_GAP, PREFETCH_MIN, PREFETCH_SPAN = 1 << 20, 4, 64 << 20


def _clusters(addrs: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Sorted site addresses as ``(lo, hi, sites)`` ranges: each covers its sites' reads
    (the symbol's ENDBR before a site past it, TEXT_READ bytes from the site), a gap
    under PREFETCH_GAP joins two sites."""
    first = 0
    for i in range(1, len(addrs) + 1):
        if i == len(addrs) or addrs[i] - addrs[i - 1] >= PREFETCH_GAP:
            yield addrs[first] - 16, addrs[i - 1] + TEXT_READ, i - first
            first = i


@dataclass
class PluginProbe:
    """One probe in the plugin (the id the records carry)."""

    id: int
    addr: int
    kind: int
    maxactive: int = 0
    enabled: bool = True
    invalidation: str = "done"


class PluginEngine(EngineCore, HandlerDispatch, HandlerErrors):
    """Host-side kprobes through the QEMU plugin. Use ``vm.host`` rather than constructing it."""

    TRAMPOLINE_NAME = "the plugin's kretprobe trampoline"
    kind = "plugin"

    def __init__(self, vm: Machine, *, trampoline: str | int | None = None) -> None:
        if getattr(vm, "rundir", None) is None or getattr(vm, "plugin_path", None) is None:
            raise HarnessError(f"{vm.name} was not started with the plugin; "
                               "boot it with Machine.boot(host='plugin')")
        self.vm = vm
        self.symbols = vm.symbols
        self.blacklist = vm.blacklist
        self.stats: Counter[str] = Counter()
        self._init_handler_errors()
        #: What ``harness.diff.runner.trampoline_text`` reads: the uretprobe trampolines in use.
        self._uprobes = PluginUprobes(self)
        self._fork_hook: int | None = None
        self._flush_hook: int | None = None
        self._direct_map: int | None = None
        self._ids = itertools.count(1)
        self._probes: dict[int, PluginProbe] = {}
        self._lock = threading.Lock()
        # Python handlers (made on first use): per-vCPU channels and their threads
        self._channels: list[Channel] = []
        self._threads: list[threading.Thread] = []
        self._tls = threading.local()
        tramp = trampoline if trampoline is not None else os.environ.get(
            "KPH_PLUGIN_TRAMPOLINE", DEFAULT_TRAMPOLINE)
        self.trampoline = tramp if isinstance(tramp, int) else self.symbols.resolve(str(tramp))
        if tramp == DEFAULT_TRAMPOLINE:
            self.trampoline = self._executable_trampoline()
        self.task_offsets = (percpu_current_task(self.symbols, vm.btf) or 0, self._btf("pid"),
                             self._btf("comm"))
        mib = getattr(vm, "plugin_ring_mib", None)
        self.link = PluginLink(vm.rundir / "plugin.sock",
                               ring_size=mib << 20 if mib else RING_SIZE)
        facts = getattr(vm, "facts", None)
        flags = CFG_URET_SYSCALL if facts is not None and facts.rules.uretprobe_syscall else 0
        # where preempt_count()'s hardirq bits start on this kernel (kph_proto.h:
        # CFG_HARDIRQ_SHIFT; KernelRules.preempt_hardirq_shift: 16, 24 on 7.3)
        if facts is not None:
            flags |= facts.rules.preempt_hardirq_shift << 8
        # what the guest kernel writes in a return-address slot it hooks: a program
        # reading a slot the plugin hooked sees that (kph_plugin.c: prog_read())
        rth = self.symbols.get("return_to_handler")
        # and this_cpu_off's per-cpu offset: what this_cpu_ptr() adds (fetch.c: KOP_CPU_PTR)
        tco = self.symbols.get("this_cpu_off")
        # and current_kprobe's: kprobe_running() for probes of the guest's kind (the
        # gdbstub engine's guest_kprobe_running(), the same per-cpu read)
        ckp = self.symbols.get("current_kprobe")
        # and preempt_count()'s: each hit's context, irq or task (the gdbstub engine's
        # hit_contexts(), the same per-cpu read)
        pco = percpu_preempt_count(self.symbols, vm.btf)
        # and what nmi_uaccess_okay() compares: each kernel hit's RF_NOUACCESS
        uacc = uaccess_offsets(self.symbols, vm.btf) or (0, 0)
        self.link.request(CMD_CONFIG, struct.pack("<12Q", *self.task_offsets, self.trampoline,
                                                  flags, kernel_rethook_trampoline(self.symbols),
                                                  rth.addr if rth is not None else 0,
                                                  tco.addr if tco is not None else 0,
                                                  ckp.addr if ckp is not None else 0,
                                                  pco or 0, *uacc))
        self._closed = False
        self._held_by: dict[int, tuple[float, str]] = {}
        self._reserved: ReservedText | None = None
        vm.add_stop_holder(self._holding)
        self._by_id: dict[int, Kprobe | Kretprobe] = {}
        self._hooked: dict[int, list[KretprobeInstance]] = {}
        self._aggr: dict[int, list[Kprobe | Kretprobe]] = {}
        self._pending: dict[int, tuple[int, list[Kprobe]]] = {}
        self._exc = {sym.addr: vec for name, vec in EXCEPTION_ENTRIES.items()
                     if (sym := self.symbols.get(name)) is not None}

    def _btf(self, member: str) -> int:
        try:
            return self.vm.btf.offset("task_struct", member)
        except Exception as exc:  # noqa: BLE001 - no BTF: hits carry no pid/comm
            log.warning("no task_struct.%s offset (%s): plugin hits carry none", member, exc)
            return 0

    # -- guest memory, without stopping anything -----------------------------------------
    def _executable_trampoline(self) -> int:
        """``_etext+1`` when that byte is on a page of kernel text; else the int3 padding
        byte just before ``_etext``. The plugin's callback runs when the vCPU executes the
        trampoline, after QEMU fetched it: on a page past the text (6.12's ``_etext`` is
        2 MiB aligned, so the byte past it is NX rodata; arch/x86/mm/init_64.c:
        mark_rodata_ro()) the fetch faults first and the guest oopses. A gdbstub
        breakpoint is taken before the fetch, so the gdbstub engine's ``_etext`` works."""
        etext = self.symbols.lookup("_etext").addr
        if (etext + 1) & ~0xFFF < etext:
            return etext + 1
        try:
            pad = self.read(etext - 1, 1)
        except HarnessError:
            pad = b""
        if pad != b"\xcc":
            raise SetupError(f"no trampoline for the plugin engine: _etext ({etext:#x}) ends "
                             f"a page and the byte before it is {pad.hex() or 'unreadable'}, "
                             "not int3 padding",
                             "set $KPH_PLUGIN_TRAMPOLINE to an executable address the "
                             "kernel never runs (int3 padding)")
        return etext - 1

    def read(self, addr: int, n: int) -> bytes:
        """Guest virtual memory. In a handler: through its vCPU (that task's address
        space). Elsewhere: through the human monitor's ``x``, in CPU 0's address space,
        without stopping anything (meant for kernel addresses, e.g. probed text).

        :raise HarnessError: the address does not map.
        """
        ch = self._channel()
        if ch is not None:
            # the plugin answers at most a record's worth a request (REC_MAX - 8 bytes)
            buf = bytearray()
            while len(buf) < n:
                data = ch.read(addr + len(buf), n - len(buf))
                if data is None:
                    raise HarnessError(f"cannot read guest memory at {addr + len(buf):#x}")
                if not data:
                    raise HarnessError(f"the plugin read nothing at {addr + len(buf):#x}")
                buf += data
            return bytes(buf)
        memo = self._text_memo
        if memo is not None:
            for base, data in itertools.chain(self._text_spans, memo):
                if base <= addr and addr + n <= base + len(data):
                    return data[addr - base:addr - base + n]
            if n < TEXT_READ:
                try:
                    data = self._monitor_read(addr, TEXT_READ)
                except HarnessError:
                    pass                # past the end of what maps: the exact read below
                else:
                    memo.append((addr, data))
                    del memo[:-TEXT_MEMO]
                    return data[:n]
        return self._monitor_read(addr, n)

    def _monitor_read(self, addr: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = min(n - len(out), 1024)
            a = addr + len(out)
            text = self.vm.qmp("human-monitor-command",
                               {"command-line": f"x/{chunk}xb {a:#x}"})
            got = bytearray()
            for line in text.splitlines():
                m = _HMP_LINE.match(line.strip())
                if m is None:
                    raise HarnessError(f"cannot read guest memory at {a:#x}: {text.strip()[:80]}")
                got += bytes(int(x, 16) for x in m[2].split())
            if len(got) != chunk:
                raise HarnessError(f"short read of guest memory at {a:#x}")
            out += got
        return bytes(out)

    #: None, or while a batch of probes is placed (:meth:`text_reads`): the monitor
    #: reads made, (address, bytes), newest last
    _text_memo: list[tuple[int, bytes]] | None = None
    #: while a batch of probes is placed: the clusters :meth:`prefetch_text` read
    _text_spans: Sequence[tuple[int, bytes]] = ()

    @contextlib.contextmanager
    def text_reads(self) -> Iterator[None]:
        """While a batch of probes is placed: each monitor read outside a handler takes
        :data:`TEXT_READ` bytes and serves the next reads inside them. Placing one probe
        reads its site four times (the ENDBR, the ``__fentry__`` call, the instruction
        decode, the reserved sites), ~0.6 ms each through the monitor: an ``f:`` glob of
        968 functions read 3,872 times, 2.3 s of its 2.6 s. The plugin writes no guest
        text; the guest's own patching (a jump label, ftrace) is no more atomic with
        these reads than it was with the four."""
        if self._text_memo is not None:     # nested: the outer batch's
            yield
            return
        self._text_memo = []
        try:
            yield
        finally:
            self._text_memo, self._text_spans = None, ()

    def prefetch_text(self, addrs: Sequence[int]) -> int:
        """Inside :meth:`text_reads`: the text around many sites to be placed, read by
        cluster with QMP ``memsave`` (CPU 0's address space, as the monitor's ``x``) into
        the machine's private run directory, so the reads of placing them are served from
        it; a cluster that does not map whole is left to the per-site reads. Placing an
        ``f:`` glob of 968 functions read the monitor ~800 times (~0.65 s). The number
        of clusters read."""
        rundir = getattr(self.vm, "rundir", None)
        if self._text_memo is None or rundir is None:
            return 0
        read = 0
        for lo, hi, n in _clusters(sorted(set(addrs))):
            if n < PREFETCH_MIN or hi - lo > PREFETCH_SPAN:
                continue
            f = rundir / "text.bin"
            try:
                self.vm.qmp("memsave", {"val": lo, "size": hi - lo, "filename": str(f)})
                data = f.read_bytes()
            except (HarnessError, OSError) as exc:
                log.debug("memsave of %#x..%#x: %s", lo, hi, exc)
                continue
            finally:
                f.unlink(missing_ok=True)
            if len(data) == hi - lo:
                self._text_spans = [*self._text_spans, (lo, data)]
                read += 1
        return read

    # -- probes ---------------------------------------------------------------------------
    def ftrace_flag(self, addr: int) -> int:
        """ADD_FTRACE for a kernel probe on a function's ``__fentry__`` site (an ftrace
        kprobe in the kernel: its regs carry orig_ax 0, not an int3 frame's -1)."""
        if addr < 0xFFFF800000000000:
            return 0
        try:
            on_entry = kprobe_addr(addr, symbols=self.symbols, read=self.read)[1]
            return ADD_FTRACE if on_entry and is_ftrace_site(self.read(addr, 5)) else 0
        except HarnessError:
            return 0

    def resolve(self, symbol_name: str | None, offset: int, addr: int | None) -> int:
        """``_kprobe_addr()`` then ``arch_adjust_kprobe_addr()`` (the engines' core)."""
        return self.kprobe_addr(symbol_name, offset, addr)[0]

    def add_spec_probe(self, addr: int, *, ret: bool, program: bytes, maxactive: int = 0,
                       enabled: bool = True, invalidate: bool = True,
                       user: tuple[int, tuple[int, ...], int] | None = None,
                       fgraph: bool = False, fprobe: bool = False,
                       kprobe: bool = False) -> PluginProbe:
        """Arm a compiled spec probe at ``addr`` (checked by the caller); a return probe
        gets ``maxactive`` instances (0: the kernel's default, max(10, 2 * vCPUs)).
        ``invalidate=False`` leaves code translated earlier without the probe (tests use
        it to show what the invalidation is for).

        ``user``: a uprobe, ``(trampoline, filter offsets, inode)``: it fires only in
        processes where ``current->mm->exe_file->f_inode->i_ino`` (the chain of
        ``task_struct`` member offsets given) is the inode; its returns go through the
        trampoline in that program. Code translated at it before is reached through the
        kernel's direct map, or by flushing all translations (:meth:`direct_map`).

        ``fgraph``: a return probe whose kernel counterpart returns through the function
        graph (7.3's fprobe exits), for what its hooked slot reads as. ``fprobe``: an
        fprobe's probe, whose exit records the real return address even when stacked.
        ``kprobe``: a kprobe of the guest's kind (a ``p``/``r`` line), missed while one of
        the guest's own kprobe handlers runs on that CPU (``ADD_KPROBE_RUNNING``: the
        plugin reads the per-cpu ``current_kprobe``, as ``kprobe_int3_handler()`` and
        ``kprobe_ftrace_handler()`` test ``kprobe_running()``; the gdbstub engine's
        ``guest_kprobe_running()``); fprobes, event probes and uprobes are not kprobes.
        """
        if ret and maxactive <= 0:
            # register_kretprobe() (kernel/kprobes.c); uretprobes have no pool in the
            # kernel (one return_instance per call): a large one stands in.
            maxactive = max(10, 2 * self.vm.smp) if user is None else 4096
        pid = next(self._ids)
        kind = PK_SPEC_R if ret else PK_SPEC_P
        flags = (ADD_ENABLED if enabled else 0) | (0 if invalidate else ADD_NO_INVALIDATE) | \
            (ADD_FGRAPH if fgraph and ret else 0) | (ADD_FTRACE_OPS if fprobe else 0) | \
            (ADD_KPROBE_RUNNING if kprobe and user is None and not fprobe else 0)
        if user is None:
            flags |= self.ftrace_flag(addr)
            if ret:
                self.ensure_flush_hook()
        ext = b""
        if user is not None:
            tramp, chain, ino = user
            flags |= ADD_EXT | ADD_FLUSH
            ext = user_ext(tramp, chain, ino, self.direct_map())
            if ret:
                self._uprobes.used_trampolines.add(tramp)
                self.ensure_fork_hook()
        st = self._cmd_add(pid, kind, addr, maxactive, flags, program, ext)
        p = PluginProbe(pid, addr, kind, maxactive, enabled, INVAL_TEXT.get(st, str(st)))
        if st == INVAL_PENDING:
            log.warning("probe at %#x: old translations not invalidated yet (a busy vCPU "
                        "took no interrupt within 2 s)", addr)
        self.stats["invalidation_" + p.invalidation.replace(" ", "_")] += 1
        with self._lock:
            self._probes[pid] = p
        return p

    def ensure_fork_hook(self) -> None:
        """Once a user return probe exists, for the rest of the session: the plugin's
        ``PK_FORK`` probe at ``uprobe_copy_process()``, which gives a fork child copies of
        its parent task's user return instances there, as ``dup_utask()`` does (returns.c
        ``user_fork()``). A call that forks (``fork()`` itself, probed with ``r:``) then
        returns through the trampoline in both processes and is recorded twice, as the
        kernel records it; a copy's program sees the child. Kept after the last uretprobe
        goes: calls in flight may still fork.

        With it, a ``PK_UFREE`` probe at ``uprobe_free_utask(t)`` (kernel/events/uprobes.c,
        called from ``mm_release()`` in kernel/fork.c at exit and exec, 6.1 to 7.3): the
        task's user return instances are freed there, with no handler (returns.c
        ``flush_task()``), so a process that exits inside a uretprobed call (``exit()``
        never returns) leaves no instance behind, and the pool does not run dry."""
        if self._fork_hook is not None:
            return
        addr = self.resolve("uprobe_copy_process", 0, None)
        self.check_address(addr)
        pid = next(self._ids)
        self._cmd_add(pid, PK_FORK, addr, 0, ADD_ENABLED | self.ftrace_flag(addr))
        self._fork_hook = pid
        if self.symbols.get("uprobe_free_utask") is not None:
            addr = self.resolve("uprobe_free_utask", 0, None)
            self._cmd_add(next(self._ids), PK_UFREE, addr, 0,
                          ADD_ENABLED | self.ftrace_flag(addr))

    def direct_map(self) -> int:
        """Where the kernel maps all physical memory (``page_offset_base``: arch/x86/mm/
        kaslr.c, a variable with CONFIG_DYNAMIC_MEMORY_LAYOUT, as Debian builds it), for
        the plugin to invalidate a user page's translations through; 0 when the kernel
        has no such variable or it cannot be read (the plugin then flushes every
        translation, as before)."""
        if self._direct_map is None:
            self._direct_map = 0
            sym = self.symbols.get("page_offset_base")
            if sym is not None:
                try:
                    self._direct_map = int.from_bytes(self.read(sym.addr, 8), "little")
                except HarnessError:
                    pass
        return self._direct_map

    def ensure_flush_hook(self) -> None:
        """Once a kernel return probe exists, for the rest of the session: the plugin's
        ``PK_FLUSH`` probe at ``rethook_flush_task(tk)`` (kernel/trace/rethook.c, called
        from ``delayed_put_task_struct()`` in kernel/exit.c: 6.1, 6.12 and 7.3 alike),
        which gives the kernel return instances of a dead task back to their pools
        (returns.c ``flush_task()``), as the kernel recycles the task's rethook nodes.
        A task that dies inside a probed function (``do_exit()`` never returns) then
        leaves no instance behind, and later calls do not miss for want of one. The
        gdbstub engine keeps the same hook (``harness.engines.rethook``,
        ``_sync_flush_hook``). Without the symbol (no rethook) nothing is hooked."""
        if self._flush_hook is not None or self.symbols.get("rethook_flush_task") is None:
            return
        addr = self.resolve("rethook_flush_task", 0, None)
        pid = next(self._ids)
        self._cmd_add(pid, PK_FLUSH, addr, 0, ADD_ENABLED | self.ftrace_flag(addr))
        self._flush_hook = pid

    def fail_reads(self, addr: int, size: int) -> None:
        """Tests only: from now on the plugin's reads of ``[addr, addr + size)`` fail
        although the memory maps (``CMD_FAILREAD``; size 0 ends it), which a hit must
        report as the engine's failure (``RF_UNCONFIRMED``), never as the guest's fault."""
        self.link.request(CMD_FAILREAD, struct.pack("<QQ", addr, size))

    def _cmd_add(self, pid: int, kind: int, addr: int, maxactive: int, flags: int,
                 program: bytes = b"", ext: bytes = b"") -> int:
        """``CMD_ADD`` of one probe; the invalidation status (``INVAL_*``).

        :raise SetupError: a limit of the plugin's (not a rule of the kernel's, which has
            none of them): one line naming the probe, its address and the limit.
        """
        payload = struct.pack("<IIQIIII", pid, kind, addr, maxactive, flags,
                              len(program) // 16, 0) + program + ext
        try:
            return struct.unpack("<I", self.link.request(CMD_ADD, payload))[0]
        except PluginError as exc:
            if exc.errno != ENOSPC:
                raise
            raise SetupError(self._full_text(pid, addr, exc.data),
                             "remove probes, or use the gdbstub engine (--host gdbstub)") \
                from None

    def _full_text(self, pid: int, addr: int, why: bytes) -> str:
        """What a CMD_ADD refused with ENOSPC ran into (its reply's ``FULL_*``)."""
        hit = self.symbols.symbolize(addr)
        where = f"{addr:#x} ({hit[0].name}+{hit[1]:#x})" if hit else f"{addr:#x}"
        reason = struct.unpack("<I", why)[0] if len(why) == 4 else 0
        limit = {FULL_SITE: f"at most {MAX_PER_SITE} probes at one address",
                 FULL_PROBES: f"at most {MAX_PROBES} live probes"}.get(
                     reason, "no room left in its site table")
        return f"the plugin engine refused probe {pid} at {where}: it holds {limit}"

    def arrange_probes(self, addr: int, probes: Sequence[PluginProbe]) -> None:
        """Run the probes at ``addr`` in the order of ``probes`` (the others after them, as
        they were): for handler orders other than ``add_new_kprobe()``'s newest first
        (fprobes on 7.3, ``harness.backends.tracelayer.FprobeOps``)."""
        ids = [p.id for p in probes]
        self.link.request(CMD_ARRANGE, struct.pack(f"<QII{len(ids)}I", addr, len(ids), 0, *ids))

    def remove_probe(self, p: PluginProbe) -> None:
        with self._lock:
            if self._probes.pop(p.id, None) is None:
                return
        self._cmd_remove(p.id)

    def _cmd_remove(self, pid: int) -> None:
        self.link.request(CMD_REMOVE, struct.pack("<I", pid))

    def _cmd_enable(self, pid: int, on: bool) -> None:
        self.link.request(CMD_ENABLE, struct.pack("<II", pid, int(on)))

    def enable_probe(self, p: PluginProbe, on: bool) -> None:
        self._cmd_enable(p.id, on)
        p.enabled = on

    def probe_stats(self, p: PluginProbe) -> tuple[int, int, int]:
        """``(nhit, nmissed, instances in use)`` of one probe."""
        return self._cmd_stats(p.id)

    def _cmd_stats(self, pid: int) -> tuple[int, int, int]:
        return struct.unpack("<3Q", self.link.request(CMD_STATS, struct.pack("<I", pid)))

    def global_stats(self) -> dict[str, int]:
        vals = struct.unpack(f"<{NGSTATS}Q", self.link.request(CMD_GSTATS))
        keys = ("invalidations", "invalidation_ns", "trampoline_unmatched", "records",
                "interrupts", "exceptions", "posts_next_insn", "posts_next_block",
                "posts_interrupt", "flushes", "uprobe_filtered", "uretprobe_inherited",
                "uretprobe_forked", "kretprobe_flushed", "trampoline_overflow",
                "unconfirmed_reads", "uretprobe_freed")
        return {**dict(zip(keys, vals)), "dropped": self.link.dropped}

    def invalidate(self, addr: int, *, flush_all: bool = False) -> str:
        """Invalidate the translations of ``addr`` now (what adding a probe does);
        ``flush_all``: through ``qemu_plugin_reset()`` instead, which drops the whole
        translation cache (measured in bench/plugin_invalidation.py, not used)."""
        st = struct.unpack("<I", self.link.request(
            CMD_INVALIDATE, struct.pack("<QI", addr, 1 if flush_all else 0)))[0]
        return INVAL_TEXT.get(st, str(st))

    def invalidate_code(self) -> None:
        """Nothing to forget: the plugin decodes no instruction (the gdbstub engine's
        emulation cache is what this clears there), and QEMU retranslates guest-patched
        code through the same callbacks."""

    def window(self, on: bool, writes: Sequence[tuple[int, int, int, int]] = (), *,
               reads: Sequence[int] = (), now: bool = False) -> int:
        """Open or close the plugin's recording window (spec probes record only while it
        is open; their counts and instances go on regardless, as a guest kprobe's do
        under ``tracing_on``), and make ``writes`` (``(addr, size, set, clear)``: the
        guest's own switch) at the same instant, where no vCPU is between a hit and the
        guest's handler of it (kph_proto.h ``CMD_WINDOW``). ``now``: at once, with no
        write. ``reads``: 8-byte words read at that instant, before the writes (the
        guest's counters at the window's edge: :meth:`window_marks`). Returns a ``WIN_*``
        status; ``WIN_UNSETTLED`` is counted (``stats["unsettled"]``).

        :raise HarnessError: the switch was not made in time, or a guest write failed.
        """
        if len(writes) > MAX_WIN_WRITES or len(reads) > MAX_WIN_READS or \
                (now and (writes or reads)):
            raise ValueError(f"window(): {len(writes)} writes, {len(reads)} reads (now={now})")
        st = struct.unpack("<I", self.link.request(CMD_WINDOW, struct.pack(
            "<II", int(on) | (2 if now else 0), len(writes)) + b"".join(
                struct.pack("<QIIQQ", a, size, 0, set_, clear)
                for a, size, set_, clear in writes) + (
                struct.pack(f"<I{len(reads)}Q", len(reads), *reads) if reads else b"")))[0]
        if not now:
            self.stats[f"window_{WIN_TEXT.get(st, st)}"] += 1
        if st == WIN_UNSETTLED:
            self.stats["unsettled"] += 1
            log.warning("the plugin switched its recording window where a vCPU was busy "
                        "(no vCPU idled within a second): a hit in flight there is seen "
                        "by one side only")
        elif st == WIN_PENDING:
            raise HarnessError("the plugin could not switch its recording window within "
                               "2 s: no vCPU ran a callback (is the guest hung?)")
        elif st == WIN_FAILED:
            raise HarnessError("the plugin could not write the guest's switch at "
                               + ", ".join(f"{a:#x}" for a, *_ in writes))
        return st

    def window_marks(self) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """The words the last opening and the last closing of the window read
        (``window(reads=)``), each None where that switch read nothing, is still to be
        applied (an idle guest applies it as a vCPU leaves idle) or a read failed."""
        raw = self.link.request(CMD_MARKS, b"")
        out: list[tuple[int, ...] | None] = []
        pos = 0
        for _ in range(2):
            state, n = struct.unpack_from("<II", raw, pos)
            vals = struct.unpack_from(f"<{n}Q", raw, pos + 8)
            pos += 8 + 8 * n
            out.append(vals if state == MARKS_READ else None)
        return out[0], out[1]

    def records(self) -> list[PluginRecord]:
        """Every hit recorded since the last call, in the order they happened."""
        recs = [decode(r) for r in self.link.take_records()]
        recs.sort(key=lambda r: r.seq)
        return recs

    def lean_records(self) -> list[tuple[tuple[Any, ...], bytes]]:
        """:meth:`records` undecoded: each as its header's fields but the registers
        (``pluginlink.REC_LEAN``) and its bytes (``pluginlink.decode`` makes the record)."""
        return lean(self.link.take_records())

    # -- Python handlers: the kprobes API (kernel names, harness.kernel.kprobes values) ---------
    def _ensure_channels(self) -> None:
        if self._channels:
            return
        # A channel's thread polls for its next event while hits are dense, on a core
        # the vCPUs leave free; with as many vCPUs as cores it would take theirs. Where
        # it polls, the vCPU polls as long for the answer (docs/plugin.md).
        spin = self.link.nvcpus < (os.cpu_count() or 1)
        waiter = host_waiter(self.vm.plugin_path) if spin else None
        answer = ANSWER_SPIN_DENSE_US if waiter is not None else ANSWER_SPIN_US
        for i in range(self.link.nvcpus):
            ch = Channel(self.link, i, waiter=waiter, answer_spin_us=answer)
            th = threading.Thread(target=self._serve, args=(ch,), daemon=True,
                                  name=f"{self.vm.name}-plugin-vcpu{i}")
            self._channels.append(ch)
            self._threads.append(th)
            th.start()

    def _add_handler_probe(self, p: Any, addr: int, kind: int, flags: int,
                           maxactive: int = 0, *, ext: bytes = b"",
                           table: dict[int, Any] | None = None) -> int:
        """A probe whose hits are round trips to Python handlers (``PK_KPROBE``,
        ``PK_KRET``). ``table``: where its id is looked up at a hit (a uprobe's is
        ``harness.engines.plugin_uprobes``'s; a kprobe's, ``_by_id``)."""
        self._ensure_channels()
        pid = next(self._ids)
        flags |= self.ftrace_flag(addr)
        if ext:
            flags |= ADD_EXT
        own = self._by_id if table is None else table
        with self._lock:
            own[pid] = p
        try:
            st = self._cmd_add(pid, kind, addr, maxactive, flags, b"", ext)
        except HarnessError:
            with self._lock:
                own.pop(pid, None)
            raise
        self.stats["invalidation_" + INVAL_TEXT.get(st, str(st)).replace(" ", "_")] += 1
        if table is None:
            p._kph_id = pid  # type: ignore[attr-defined]
            self._aggr.setdefault(addr, []).insert(0, p)   # add_new_kprobe(): newest first
        return pid

    def _register(self, p: Kprobe) -> None:
        if p.registered:
            raise ProbeRejectedError("probe is already registered (-EINVAL)", EINVAL, p.addr)
        if p.ftrace_ops:
            addr = self.ftrace_location(p.symbol_name, p.addr)
        else:
            addr = self.resolve(p.symbol_name, p.offset, p.addr)
            self.check_address(addr)
        p.addr = addr
        flags = (0 if p.disabled else ADD_ENABLED) | \
            (ADD_POST if p.post_handler is not None or p.fault_handler is not None else 0)
        self._add_handler_probe(p, addr, PK_KPROBE, flags)
        p.registered = True

    def _unregister(self, p: Kprobe | Kretprobe) -> None:
        pid = getattr(p, "_kph_id", None)
        if not p.registered or pid is None:
            return
        p.registered = False
        lst = self._aggr.get(p.addr or 0, [])
        if p in lst:
            lst.remove(p)
        if not lst:
            self._aggr.pop(p.addr or 0, None)
        try:
            self._cmd_remove(pid)
        except HarnessError as exc:
            log.warning("removing probe %d: %s", pid, exc)

    def register_kprobe(self, p: Kprobe) -> Kprobe:
        """Arm ``p``; raise ProbeRejectedError with the kernel's errno if it cannot go there."""
        self.raise_handler_errors()
        self._register(p)
        return p

    def unregister_kprobe(self, p: Kprobe) -> None:
        self._unregister(p)
        self.raise_handler_errors()

    def register_kprobes(self, ps: Any) -> None:
        """Register all or none: a failure unregisters those already done, then raises."""
        self.raise_handler_errors()
        self._register_all(ps)

    def unregister_kprobes(self, ps: Any) -> None:
        for p in list(ps):
            self._unregister(p)
        self.raise_handler_errors()

    def _set_enabled(self, p: Kprobe | Kretprobe, on: bool) -> None:
        if on:
            p.flags &= ~ProbeFlags.DISABLED
        else:
            p.flags |= ProbeFlags.DISABLED
        pid = getattr(p, "_kph_id", None)
        if pid is not None and p.registered:
            self._cmd_enable(pid, on)

    def enable_kprobe(self, p: Kprobe | Kretprobe) -> None:
        self._set_enabled(p, True)

    def disable_kprobe(self, p: Kprobe | Kretprobe) -> None:
        self._set_enabled(p, False)

    def register_kretprobe(self, rp: Kretprobe) -> Kretprobe:
        """Arm a return probe at a function entry (offset 0, as the kernel requires).

        Instances come from a pool of ``maxactive`` (default max(10, 2 * vCPUs), as
        register_kretprobe() sets it) kept in the plugin, shared by all vCPUs: a call
        finding it empty counts ``nmissed`` and runs no entry_handler.
        """
        self.raise_handler_errors()
        if rp.registered:
            raise ProbeRejectedError("probe is already registered (-EINVAL)", EINVAL, rp.addr)
        if rp.ftrace_ops:
            addr = self.ftrace_location(rp.symbol_name, rp.addr)
        else:
            addr = self.resolve(rp.symbol_name, rp.offset,
                                rp.addr if rp.symbol_name is None else None)
            self.check_address(addr, kretprobe=True)
        if rp.maxactive <= 0:
            rp.maxactive = max(10, 2 * self.vm.smp)
        self.ensure_flush_hook()
        rp._kph_insts = [KretprobeInstance(rp) for _ in range(rp.maxactive)]  # type: ignore[attr-defined]
        rp.addr = addr
        self._add_handler_probe(rp, addr, PK_KRET, 0 if rp.disabled else ADD_ENABLED,
                                rp.maxactive)
        rp.registered = True
        return rp

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        """Disarm ``rp``; calls in flight still return through the trampoline, without
        the handler (as 6.1 does)."""
        for ri in getattr(rp, "_kph_insts", ()):
            ri.orphan = True
        self._unregister(rp)
        self.raise_handler_errors()

    # -- uprobes: Python handlers in user code (harness.engines.plugin_uprobes) -------------
    @property
    def uprobes(self) -> PluginUprobes:
        """The user-space probes with Python handlers."""
        return self._uprobes

    def register_uprobe(self, up: Uprobe) -> Uprobe:
        """Arm a ``harness.engines.uprobes.Uprobe`` (a uretprobe too when it has
        ``ret_handler``), for every process running ``up.path`` or, with ``pid``, for
        that process alone; the rules of the gdbstub engine's (docs/uprobes.md).

        :raise ProbeRejectedError: no such file, symbol, process or mapping; a PIE
            without ``pid``.
        """
        self.raise_handler_errors()
        return self._uprobes.register(up)

    def unregister_uprobe(self, up: Uprobe) -> None:
        self._uprobes.unregister(up)
        self.raise_handler_errors()

    # -- in a handler: the vCPU's own view --------------------------------------------------
    def _channel(self) -> Channel | None:
        return getattr(self._tls, "ch", None)

    def current_task(self, regs: PtRegs | None = None) -> int | None:
        """``current`` on the vCPU of the handler running now."""
        ev = getattr(self._tls, "ev", None)
        return ev.task or None if ev is not None else None

    def task_pid(self, task: int | None) -> int | None:
        off = self.task_offsets[1]
        if task is None or not off:
            return None
        try:
            return int.from_bytes(self.read(task + off, 4), "little", signed=True)
        except HarnessError:
            return None

    def task_comm(self, task: int | None) -> str | None:
        off = self.task_offsets[2]
        if task is None or not off:
            return None
        try:
            return self.read(task + off, 16).split(b"\0", 1)[0].decode("utf-8", "replace")
        except HarnessError:
            return None

    def read_string(self, addr: int, maxlen: int = 4096) -> bytes | None:
        """A NUL-terminated string, a page at a time; None when its first byte cannot be read."""
        return read_cstring(self.read, addr, maxlen, HarnessError)

    def write(self, addr: int, data: bytes) -> None:
        """Guest memory, from a handler (through its vCPU).

        :raise HarnessError: outside a handler (nothing is stopped to write through), or
            when the address does not map.
        """
        ch = self._channel()
        if ch is None:
            raise HarnessError("the plugin engine writes guest memory only from a handler; "
                               "use the gdbstub engine to write with the guest stopped")
        if not ch.write(addr, data):
            raise HarnessError(f"cannot write guest memory at {addr:#x}")

    def list(self) -> str:
        """The registered probes as ``/sys/kernel/debug/kprobes/list`` prints them."""
        rows: list[tuple[int, str, bool]] = []
        for addr, ps in self._aggr.items():
            rows += [(addr, "r" if isinstance(p, Kretprobe) else "k", p.disabled) for p in ps]
        rows += [(p.addr, "r" if p.kind == PK_SPEC_R else "k", not p.enabled)
                 for p in self._probes.values()]
        lines = []
        for addr, kind, disabled in sorted(rows, key=lambda r: r[0]):
            hit = self.symbols.symbolize(addr)
            where = f"{hit[0].name}+{hit[1]:#x}" if hit else f"{addr:#x}"
            mod = hit[0].module if hit and hit[0].module else " "
            lines.append(f"{addr:016x}  {kind}  {where}  {mod} {'[DISABLED]' if disabled else ''}")
        return "\n".join(lines) + ("\n" if lines else "")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the session: the plugin goes inert. Return addresses still hijacked stay
        serviced by the plugin for as long as QEMU runs."""
        if self._closed:
            return
        self._closed = True
        self.vm.remove_stop_holder(self._holding)
        for ch in self._channels:
            ch.close()                 # a vCPU waiting on one goes on
        for th in self._threads:
            th.join(2)
        for probes in self._aggr.values():
            for p in probes:
                p.registered = False
        self._uprobes.close()
        self.link.close()
        self.raise_handler_errors()


register_host_engine("plugin", PluginEngine)
