"""Python uprobe and uretprobe handlers in the plugin engine: ``vm.host.register_uprobe``
of ``Machine.boot(host="plugin")``.

The API and the rules are the gdbstub engine's (``harness.engines.uprobes``: ``Uprobe``,
its two targeting modes, ``UprobeManager.prepare``'s checks); the handler chains are the
engines' shared core (``EngineCore.uprobe_handlers``, ``uretprobe_handlers``). What is the
plugin's own is where a hit is decided:

- **Which process.** A gdbstub breakpoint stops every process at that address and the
  engine looks at ``current`` in Python. Here the plugin's filter does it in C, before
  any round trip (``filter_ok()`` in returns.c: a chain of member offsets from
  ``current`` must end in an expected value):
  - ``Uprobe(pid=None)``, what ``uprobe_events`` does (the kernel places a uprobe on an
    inode, kernel/events/uprobes.c): ``current->mm->exe_file->f_inode->i_ino`` is the
    file's inode, the spec uprobes' filter (``harness.backends.plugin``);
  - ``Uprobe(pid=N)``: ``current->mm`` is the mm process N had at registration. Python
    then checks ``current->tgid`` too (a ``vfork()`` child shares the mm), as the
    gdbstub engine does. A fork child has another mm; after ``exec`` the process has a
    new one; at exit the mm goes. The kernel drops an mm's uprobe state in
    ``uprobe_clear_state()``: a Python kprobe there (while per-process uprobes exist)
    marks the probe ``GONE``, so a later mm at the same address is not taken for it.
- **The hit** is a ``PK_KPROBE`` round trip with ``regs.ip`` the probed address
  (``handle_swbp()``), every consumer of the address that targets this process counting
  ``nhit``, newest first; register changes but ``ip`` are written back.
- **The return**: a ``PK_KRET`` probe on the same address hooks ``[sp]`` after the
  handlers (``prepare_uretprobe()``, in C with no round trip: a consumer has no entry
  handler) with the plugin's trampoline in that program (the byte after the gdbstub
  engine's, the end of its executable segment), instances keyed by (mm, stack slot) in C. At the trampoline the ret_handlers run with ``regs.ip`` the
  real return address, the newest registered consumer first (``handle_uretprobe_chain()``),
  and on 6.11+ the ``sys_uretprobe()`` frame below sp is written as the kernel's
  trampoline leaves it (returns.c: ``on_trampoline()``). A fork child gets copies of
  the task's instances at ``uprobe_copy_process()`` (``PK_FORK``, ``dup_utask()``): its
  return runs an every-process consumer's ret_handler, not a per-process one's. A call in flight when its uprobe is unregistered returns with no handler.

Adding a uprobe flushes every translation (user code has no one virtual address to
invalidate through; docs/plugin.md).
"""
from __future__ import annotations

import logging
import struct
from typing import Any

from .uprobes import Uprobe, UprobeManager, UretprobeInstance
from ..errors import HarnessError, ProbeRejectedError
from ..kernel.kprobes import Kprobe, ProbeFlags
from ..machine.pluginlink import (ACT_CONTINUE, ADD_ENABLED, ADD_FLUSH, ADD_NO_ENTRY_RT,
                                  ADD_NO_INVALIDATE, PK_KPROBE, PK_KRET, Channel, Event)

log = logging.getLogger(__name__)

EINVAL, ESRCH = 22, 3
#: a uretprobe has no pool in the kernel (one return_instance per call): the plugin's
#: largest stands in
URET_INSTANCES = 4096


def user_ext(tramp: int, chain: tuple[int, ...], expect: int, direct_map: int = 0) -> bytes:
    """``CMD_ADD``'s extension of a user probe (kph_proto.h ``ADD_EXT_SIZE``): its
    trampoline, the filter (member offsets from ``current``, the value they end in), and
    the kernel's direct map (``page_offset_base``; 0: unknown, so the plugin reaches code
    translated before by flushing every translation, kph_plugin.c ``user_invalidate``)."""
    return struct.pack("<QII4QQQ", tramp, len(chain), 0, *(list(chain) + [0] * 4)[:4],
                       expect, direct_map)


def user_filter(btf: Any, up: Uprobe) -> tuple[tuple[int, ...], int]:
    """The plugin's filter for ``up``: ``current->mm`` for one process (``pid``), else
    ``current->mm->exe_file->f_inode->i_ino`` (the inode a uprobe is placed on)."""
    mm = btf.offset("task_struct", "mm")
    if up.pid is not None:
        assert up.mm is not None
        return (mm,), up.mm
    assert up.ino is not None
    return (mm, btf.offset("mm_struct", "exe_file"), btf.offset("file", "f_inode"),
            btf.offset("inode", "i_ino")), up.ino


def user_trampoline(mgr: UprobeManager, up: Uprobe) -> int:
    """The plugin's uretprobe trampoline in ``up``'s program: the byte after the gdbstub
    engine's (the end of the executable segment), so the two engines never share it;
    moved with the program where one process maps a PIE.

    :raise ProbeRejectedError: the segment ends a page (no byte left after it)."""
    img = mgr.elf(up.path)
    tramp = img.trampoline() + 1
    if up.pid is not None and img.pie and up.vaddr is not None:
        tramp += up.vaddr - img.vaddr(up.offset or 0)
    if tramp % 4096 == 0:
        raise ProbeRejectedError(f"{up.path}: no room for a uretprobe trampoline after its "
                                 "text (-EINVAL)", EINVAL)
    return tramp


class PluginUprobes:
    """The Python uprobes of one ``PluginEngine`` (``vm.host.uprobes``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.vm = engine.vm
        self.stats = engine.stats
        #: what ``harness.diff.runner.trampoline_text`` reads: every uretprobe trampoline used
        self.used_trampolines: set[int] = set()
        self._ids: dict[int, Uprobe] = {}              # plugin probe id -> its consumer
        self._ret_ids: set[int] = set()
        self._clear_kp: Kprobe | None = None
        self._mgr: UprobeManager | None = None

    @property
    def mgr(self) -> UprobeManager:
        """The gdbstub engine's checks and kernel lookups, reading through the monitor."""
        if self._mgr is None:
            self._mgr = UprobeManager.resolver(self.vm, stats=self.stats,
                                               symbols=self.engine.symbols, read=self.engine.read)
        return self._mgr

    @property
    def tramps(self) -> dict[int, int]:
        """Each uretprobe trampoline still needed, and by how many: registered consumers
        with a ret_handler, and calls in flight (an unregistered consumer's included)."""
        out: dict[int, int] = {}
        users = [up for up in set(self._ids.values())
                 if up.registered and up.ret_handler is not None]
        for rid in self._ret_ids:      # the plugin's instances in use (CMD_STATS)
            up = self._ids.get(rid)
            try:
                users += [up] * self.engine._cmd_stats(rid)[2] if up is not None else []
            except HarnessError:       # its slot was taken again: none in use
                pass
        for up in users:
            t = getattr(up, "_kph_tramp", None)
            if t is not None:
                out[t] = out.get(t, 0) + 1
        return out

    def owns(self, pid: int) -> bool:
        return pid in self._ids

    # -- registration (the caller's thread; the guest runs) -------------------------------
    def register(self, up: Uprobe) -> Uprobe:
        if up.registered:
            raise ProbeRejectedError("uprobe is already registered (-EINVAL)", EINVAL)
        mgr = self.mgr
        mgr.prepare(up)
        assert up.vaddr is not None
        if up.pid is not None:
            task = mgr.find_task(up.pid)
            if task is None:
                raise ProbeRejectedError(f"no process {up.pid} in the guest (-ESRCH)", ESRCH)
            up.mm = mgr._task_mm(task)
        chain, expect = user_filter(self.vm.btf, up)
        tramp = user_trampoline(mgr, up) if up.ret_handler is not None else \
            self.engine.trampoline
        ext = user_ext(tramp, chain, expect, self.engine.direct_map())
        flags = 0 if up.disabled else ADD_ENABLED
        ids: list[int] = []
        up.registered = True
        try:
            if up.ret_handler is not None:
                # added first: the newest runs first at the address, so the handlers'
                # probe comes before the hook (handler_chain(), then prepare_uretprobe())
                # not invalidated here: the next add, at the same address, invalidates
                # what was translated there (kph_plugin.c user_invalidate)
                rid = self.engine._add_handler_probe(
                    up, up.vaddr, PK_KRET, flags | ADD_NO_ENTRY_RT | ADD_NO_INVALIDATE,
                    URET_INSTANCES, ext=ext, table=self._ids)
                ids.append(rid)
                self._ret_ids.add(rid)
                self.used_trampolines.add(tramp)
                self.engine.ensure_fork_hook()
                up._kph_tramp = tramp  # type: ignore[attr-defined]
            ids.append(self.engine._add_handler_probe(up, up.vaddr, PK_KPROBE,
                                                      flags | ADD_FLUSH, ext=ext,
                                                      table=self._ids))
        except BaseException:
            up.registered = False
            self._remove_ids(ids)
            raise
        up._kph_ids = tuple(ids)  # type: ignore[attr-defined]
        self._sync_clear_hook()
        return up

    def _remove_ids(self, ids: Any) -> None:
        for pid in ids:
            try:
                self.engine._cmd_remove(pid)
            except HarnessError as exc:
                log.warning("removing uprobe probe %d: %s", pid, exc)
            if pid not in self._ret_ids:     # a return's id stays: calls in flight end
                self._ids.pop(pid, None)     # through it, with no handler

    def unregister(self, up: Uprobe) -> None:
        """Disarm ``up`` (a GONE one quietly); calls in flight return with no handler."""
        ids = getattr(up, "_kph_ids", ())
        if not up.registered:
            return
        up.registered = False
        self._remove_ids(ids)
        up._kph_ids = ()  # type: ignore[attr-defined]
        self._sync_clear_hook()

    def _sync_clear_hook(self) -> None:
        """A Python kprobe on ``uprobe_clear_state()`` while a per-process uprobe is
        registered and not GONE (kernel/events/uprobes.c: the kernel drops an mm's
        uprobe state there, at exit and for the old mm of an exec)."""
        need = any(up.pid is not None and up.registered and not up.gone
                   for up in set(self._ids.values()))
        if need and self._clear_kp is None:
            self._clear_kp = Kprobe(symbol_name="uprobe_clear_state",
                                    pre_handler=self._on_clear_state)
            self.engine.register_kprobe(self._clear_kp)
        elif not need and self._clear_kp is not None:
            self.engine.unregister_kprobe(self._clear_kp)
            self._clear_kp = None

    def _on_clear_state(self, _kp: Kprobe, regs: Any) -> int:
        mm = regs.di
        for up in set(self._ids.values()):
            if up.pid is not None and up.mm == mm and up.registered and not up.gone:
                up.flags |= ProbeFlags.GONE
                up.gone_reason = "its process exited or exec'd (uprobe_clear_state)"
                self.stats["uprobes_gone"] += 1
        return 0

    # -- hits (a vCPU's channel thread) ---------------------------------------------------
    def _mine(self, ch: Channel, ev: Event, up: Uprobe | None) -> bool:
        """Does this hit belong to ``up``? The plugin checked the mm (or the inode); one
        process is also its thread group (``current->tgid``, a vfork child shares the mm)."""
        if up is None or not up.registered or up.disabled:
            return False
        if up.pid is None:
            return True
        return self._tgid(ch, ev) == up.pid

    def _tgid(self, ch: Channel, ev: Event) -> int | None:
        if not ev.task:
            return None
        raw = ch.read(ev.task + self.mgr._offset("task_struct", "tgid"), 4)
        return int.from_bytes(raw, "little", signed=True) if raw else None

    def on_pre(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        mine = [up for i in ev.ids if self._mine(ch, ev, up := self._ids.get(i))]
        if not mine:
            self.stats["uprobe_filtered"] += 1
            return ACT_CONTINUE, {}
        self.stats["uprobe_hits"] += 1
        regs = self.engine._regs(ev, ch, {"ip": ev.addr})
        self.engine.uprobe_handlers(mine, regs)
        return ACT_CONTINUE, self.engine._writes(regs, keep_ip=False)

    def on_ret(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """The function returned into the trampoline: ``ev.a`` is the real return address,
        ``ev.b`` the slot the plugin hooked at the entry (``prepare_uretprobe()``, in C:
        no round trip at the entry, a consumer has no entry handler). A call of another
        thread group sharing the mm (a vfork child) runs no handler."""
        up = self._ids.get(ev.ids[0])
        self.stats["uretprobe_returns"] += 1
        if up is None:
            return ACT_CONTINUE, {}
        # ri.mm and ri.pid are known without a read for one process (the filter matched
        # its mm); for every process they would cost a read each per return: left 0/None
        mm, tgid = 0, None
        if up.pid is not None:
            tgid = self._tgid(ch, ev)
            if tgid != up.pid:
                return ACT_CONTINUE, {}
            mm = up.mm or 0
        ri = UretprobeInstance((up,), ev.addr, ev.a, ev.b, mm, tgid)
        regs = self.engine._regs(ev, ch, {"ip": ev.a})
        self.engine.uretprobe_handlers(ri, regs)
        return ACT_CONTINUE, self.engine._writes(regs, keep_ip=False)

    def on_miss(self, ch: Channel, ev: Event) -> tuple[int, dict[int, int]]:
        """The plugin's instances for a uretprobe ran out (4,096 calls in flight)."""
        for pid in ev.ids:
            up = self._ids.get(pid)
            if up is not None:
                up.nmissed += 1
        return ACT_CONTINUE, {}

    def close(self) -> None:
        """Drop the state. Returns in flight stay serviced by the plugin (no handler)."""
        if self._clear_kp is not None:
            self.engine._unregister(self._clear_kp)     # logs a failure, raises nothing
            self._clear_kp = None
        for up in set(self._ids.values()):
            up.registered = False
