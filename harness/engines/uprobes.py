"""Host-side uprobes and uretprobes: breakpoints in user code, fired per address space.

The kernel places a uprobe on an *inode* (``uprobe_register(inode, offset, uc)``,
kernel/events/uprobes.c): every mm that maps that file gets an int3 in its own copy of the
page, and nothing else does. A gdbstub breakpoint is only a virtual address: it stops
whatever runs there, in any process (two static no-pie programs both have text at
0x401000). So every stop at a uprobe address is checked first: the current task
(``current_task`` through ``MSR_KERNEL_GS_BASE``, since the CPU is in user mode with the
user's GS) and its ``mm``; a hit that is not ours runs its instruction and goes on
silently, as if there were no breakpoint.

Two targeting modes, after the two texts:

- ``Uprobe(pid=None)``: the 6.1 kernel's, what ``uprobe_events`` does: every process
  whose executable is ``path`` (``mm->exe_file->f_inode->i_ino``; the shipped programs
  are static, so the main executable is the only file mapping). Fork children fire too,
  as their copied mm maps the same file.
- ``Uprobe(pid=N)``: the utrace uprobes of shared/seeds/004 (per process): only the mm
  process N has when the probe is registered. A fork child has another mm and does not
  fire; after exec (same pid, new mm) or exit the probe is gone (``ProbeFlags.GONE``),
  noticed at ``uprobe_clear_state()``, where the kernel itself drops an mm's uprobe state
  (a host kprobe sits there while uprobes or return instances exist; it also keeps the
  per-mm cache of exe inodes valid, as mm addresses are reused).

Uretprobes: at the entry hit the return address at ``[sp]`` is replaced by a trampoline
address in that process, padding right past the end of the executable segment (mapped
executable, never executed by the program, like the kernel's ``_etext`` trampoline of
``harness.engines.gdbstub_engine``). At the trampoline the instance is found by ``(mm, stack slot)``, so
threads and recursion match; the handler runs with ``regs.ip`` = the real return address
(``handle_uretprobe_chain()`` sets it first) and the thread resumes there. A fork child
gets copies of the task's instances at ``uprobe_copy_process()`` (``dup_utask()``): its
return runs the every-process consumers' ret_handlers (:meth:`UprobeManager._on_fork`).
A child returning through a slot no copy covers resumes at the parent's return address
without a handler call.

User pages may be absent: memory is only read at a hit, while that process is current
and its stack and text are mapped. At close, return addresses still hijacked are put back
through the kernel's direct map, walking that mm's page tables, whatever process runs.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import shlex
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from ..errors import GuestAgentError, HarnessError, ProbeRejectedError
from ..kernel.elf import ElfImage
from ..machine.memo import PerMachine
from ..kernel.kprobes import Kprobe, ProbeFlags, PtRegs

log = logging.getLogger(__name__)

EINVAL, ENOENT = 22, 2
_USER_TOP = 1 << 47


class UprobeNeverFires(ProbeRejectedError):
    """A uprobe 6.1 would register and never install: its offset is in the file but in no
    mapping that can execute it (``valid_vma()`` in kernel/events/uprobes.c installs
    breakpoints only in read+exec mappings), or the file is no program at all. The API
    refuses it (EINVAL, it could never fire); ``uprobe_events`` accepts the line."""


def _maps_base(maps: str, path: str, offset: int) -> int | None:
    """The user address of file offset ``offset`` of ``path`` in a ``/proc/PID/maps`` text."""
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[5] != path:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        off = int(parts[2], 16)
        if off <= offset < off + (hi - lo):
            return lo + offset - off
    return None


UprobeHandler = Callable[["Uprobe", PtRegs], Any]
UretprobeHandler = Callable[["UretprobeInstance", PtRegs], Any]


@dataclass(eq=False)
class Uprobe:
    """A ``struct uprobe_consumer`` on ``path`` at file ``offset`` (or ELF ``symbol``).

    ``handler(up, regs)`` runs at the probed instruction, ``regs.ip`` = its address (as
    ``handle_swbp()`` sets it). ``ret_handler(ri, regs)`` runs when the function returns
    (``ri.func`` the probed address, ``regs.ip`` the real return address). ``pid``
    selects one process (see the module docstring). ``vaddr`` is where it was placed.
    """

    path: str
    offset: int | None = None
    symbol: str | None = None
    pid: int | None = None
    handler: UprobeHandler | None = None
    ret_handler: UretprobeHandler | None = None
    flags: int = 0
    nhit: int = 0
    nmissed: int = 0
    vaddr: int | None = None
    mm: int | None = field(default=None, repr=False)
    ino: int | None = field(default=None, repr=False)
    registered: bool = field(default=False, repr=False)
    gone_reason: str = ""

    @property
    def disabled(self) -> bool:
        return bool(self.flags & (ProbeFlags.DISABLED | ProbeFlags.GONE))

    @property
    def gone(self) -> bool:
        return bool(self.flags & ProbeFlags.GONE)


@dataclass(eq=False)
class UretprobeInstance:
    """``struct return_instance``: one pending return of one call in one mm."""

    probes: tuple[Uprobe, ...]
    func: int
    ret_addr: int
    stack_slot: int
    mm: int
    pid: int | None = None
    #: the task whose call it is (``utask->return_instances`` are per task)
    task: int = field(default=0, repr=False)
    #: the trampoline the call returns through
    tramp: int | None = field(default=None, repr=False)



@dataclass(frozen=True)
class GuestFile:
    """What one ``stat -L`` says of a guest file: its kind (``%F``: "regular file",
    "directory", ...), its inode number, and a key that changes with the file (device,
    inode, size, change and modification times to the nanosecond): a program's ELF is
    read again only when its key changed (:func:`cached_elf`)."""

    kind: str
    ino: int
    key: tuple[str, ...]


#: machine -> {path: its stat} while :func:`one_stat_each` holds for it
_STATS: "weakref.WeakKeyDictionary[Any, dict[str, GuestFile | None]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def one_stat_each(vm: Any) -> Iterator[None]:
    """Within it, :func:`file_stat` asks the guest once per path: for one differential
    run, whose registration looks at a uprobe's file for its refusal, its ELF, its
    inode and its place (a ``stat`` is a guest process, ~15 ms under TCG), nothing but
    the harness's own reads running in the guest in between; a uprobe stays on the
    inode it was registered on, whatever the workload does to the path later. Nested:
    the outermost one holds."""
    try:
        outer = vm not in _STATS
    except TypeError:           # a stand-in machine without weak references
        yield
        return
    if outer:
        _STATS[vm] = {}
    try:
        yield
    finally:
        if outer:
            _STATS.pop(vm, None)


def file_stat(vm: Any, path: str) -> GuestFile | None:
    """``stat -L`` of ``path`` in the guest (one command), None when there is no such
    file; within :func:`one_stat_each`, the one asked first. A ``stat`` that succeeds
    and prints nothing is the agent losing its output (seen once under load, kph fuzz
    on 7.3), not a kind of file: asked again, then an error of the harness, never a
    kernel's refusal.

    :raise GuestAgentError: the guest's answer stayed empty or was not stat's."""
    try:
        memo = _STATS.get(vm)
    except TypeError:
        memo = None
    if memo is not None and path in memo:
        return memo[path]
    got = _file_stat(vm, path)
    if memo is not None:
        memo[path] = got
    return got


def _file_stat(vm: Any, path: str) -> GuestFile | None:
    for _ in range(2):
        st = vm.run(f"stat -L -c '%F|%d|%i|%s|%z|%y' {shlex.quote(path)}", timeout=30)
        if st.status != 0:
            return None
        out = st.stdout.strip()
        if out:
            parts = out.rsplit("|", 5)
            if len(parts) != 6 or not parts[2].isdigit():
                raise GuestAgentError(f"stat -L {path} in the guest printed {out[:200]!r}")
            return GuestFile(parts[0], int(parts[2]), (path, *parts[1:]))
    raise GuestAgentError(f"stat -L {path} in the guest succeeded twice with no output")


def file_type(vm: Any, path: str) -> str | None:
    """``stat -L -c %F`` of ``path`` in the guest ("regular file", "directory", ...), None
    when there is no such file (:func:`file_stat`)."""
    st = file_stat(vm, path)
    return st.kind if st is not None else None


#: machine -> (GuestFile.key -> the program's ELF): a program pulled once per machine
#: while it stays the same file (kph fuzz places uprobes in kph-loop, 0.75 MB, at one
#: example in three: ~0.1 s a pull under TCG)
_ELF_CACHE: PerMachine[tuple[str, ...], ElfImage] = PerMachine()
#: programs kept per machine
ELF_CACHE_MAX = 16


def cached_elf(vm: Any, f: GuestFile, path: str) -> ElfImage:
    """The ELF of guest file ``path`` whose ``stat`` is ``f``: pulled and parsed, or as
    pulled before on this machine when its key is the same.

    :raise ProbeRejectedError: it cannot be read (-ENOENT).
    :raise UprobeNeverFires: it is not an ELF file (-EINVAL)."""
    cache = _ELF_CACHE.table(vm)
    img = cache.get(f.key)
    if img is not None:
        return img
    try:
        data = vm.pull(path)
    except HarnessError as exc:
        raise ProbeRejectedError(f"{path}: cannot read it in the guest ({exc}) (-ENOENT)",
                                 ENOENT) from None
    try:
        img = ElfImage(data)
    except Exception as exc:  # noqa: BLE001 - pyelftools raises several kinds
        raise UprobeNeverFires(f"{path} is not an ELF file ({exc}) (-EINVAL)", EINVAL,
                               reason="not a program: never executed") from None
    while len(cache) >= ELF_CACHE_MAX:
        del cache[next(iter(cache))]
    cache[f.key] = img
    return img


class UprobeManager:
    """The uprobes of one ``HostEngine`` (``vm.host.uprobes``); runs on its dispatcher."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stub = engine.stub
        self.vm = engine.vm
        self.addrs: dict[int, list[Uprobe]] = {}       # user address -> consumers, newest first
        self.tramps: dict[int, int] = {}               # trampoline address -> users
        self._bps: set[int] = set()
        self._live: dict[tuple[int, int], UretprobeInstance] = {}
        self._elf: dict[str, ElfImage] = {}
        self._exe_ino: dict[int, int | None] = {}      # mm -> its exe inode number
        self._clear_kp: Kprobe | None = None
        self._fork_kp: Kprobe | None = None
        self._off: dict[tuple[str, str], int] = {}
        self.used_trampolines: set[int] = set()
        self.stats = engine.stats

    @classmethod
    def resolver(cls, vm: Any, *, stats: Any, symbols: Any,
                 read: Callable[[int, int], bytes] | None = None) -> "UprobeManager":
        """A manager that only prepares uprobes and looks kernel objects up, for the plugin
        engine (``harness.engines.plugin_uprobes``, ``harness.backends.plugin``): the
        same checks as this engine's, reading kernel memory through ``read``."""
        stub = SimpleNamespace(read_memory=read) if read is not None else None
        return cls(SimpleNamespace(stub=stub, vm=vm, stats=stats, symbols=symbols,
                                   btf=getattr(vm, "btf", None)))

    # -- kernel objects -------------------------------------------------------------------
    def _offset(self, struct: str, member: str) -> int:
        key = (struct, member)
        if key not in self._off:
            self._off[key] = self.engine.btf.offset(struct, member)
        return self._off[key]

    def _u64(self, addr: int) -> int:
        return int.from_bytes(self.stub.read_memory(addr, 8), "little")

    def _task_mm(self, task: int) -> int:
        return self._u64(task + self._offset("task_struct", "mm"))

    def _tgid(self, task: int) -> int:
        raw = self.stub.read_memory(task + self._offset("task_struct", "tgid"), 4)
        return int.from_bytes(raw, "little", signed=True)

    def exe_ino(self, mm: int) -> int | None:
        """``mm->exe_file->f_inode->i_ino`` (cached per mm until ``uprobe_clear_state``)."""
        if mm not in self._exe_ino:
            try:
                f = self._u64(mm + self._offset("mm_struct", "exe_file"))
                inode = self._u64(f + self._offset("file", "f_inode")) if f else 0
                self._exe_ino[mm] = self._u64(inode + self._offset("inode", "i_ino")) \
                    if inode else None
            except HarnessError:
                return None
        return self._exe_ino[mm]

    def find_task(self, pid: int) -> int | None:
        """The ``task_struct`` of thread-group leader ``pid``, walking ``init_task.tasks``."""
        head = self.engine.symbols.lookup("init_task").addr
        off = self._offset("task_struct", "tasks")
        pid_off = self._offset("task_struct", "pid")
        node = self._u64(head + off)
        for _ in range(1 << 15):
            if node == head + off:
                return None
            task = node - off
            if int.from_bytes(self.stub.read_memory(task + pid_off, 4), "little") == pid:
                return task
            node = self._u64(node)
        return None

    def current(self, regs: PtRegs) -> tuple[int | None, int, int]:
        """(task, tgid, mm) of the task on the vCPU of ``regs`` (in user mode)."""
        task = self.engine.current_task(regs)
        if task is None:
            return None, -1, 0
        return task, self._tgid(task), self._task_mm(task)

    # -- registration (dispatcher, guest halted) ------------------------------------------
    def elf(self, path: str, f: GuestFile | None = None) -> ElfImage:
        """``path``'s ELF: as :meth:`prepare` read it, else read now (``f``: its stat,
        taken by the caller; else one ``stat`` first).

        :raise ProbeRejectedError: no such file (-ENOENT)."""
        if path not in self._elf:
            if f is None:
                f = file_stat(self.vm, path)
                if f is None:
                    raise ProbeRejectedError(f"{path}: cannot read it in the guest (-ENOENT)",
                                             ENOENT)
            self._elf[path] = cached_elf(self.vm, f, path)
        return self._elf[path]

    def prepare(self, up: Uprobe) -> None:
        """Resolve ``up`` with the guest running (agent calls): ELF, inode, pid's mapping.

        The file is checked first, as ``__trace_uprobe_create()`` does before anything else
        of a line (``kern_path(LOOKUP_FOLLOW)``, then ``d_is_reg()``): ENOENT "Failed to find
        the given file", EINVAL "Not a regular file" (a directory such as /sys, a device)."""
        f = file_stat(self.vm, up.path)
        if f is None:
            raise ProbeRejectedError(f"{up.path}: Failed to find the given file (-ENOENT)",
                                     ENOENT, reason="Failed to find the given file")
        if not f.kind.startswith("regular"):
            raise ProbeRejectedError(f"{up.path} is a {f.kind}: Not a regular file "
                                     "(-EINVAL)", EINVAL, reason="Not a regular file")
        img = self.elf(up.path, f)
        if up.symbol is not None:
            try:
                up.offset = img.file_offset(img.symbol(up.symbol)) + (up.offset or 0)
            except KeyError:
                raise ProbeRejectedError(f"no function {up.symbol} in {up.path} (-ENOENT)",
                                         ENOENT) from None
        if up.offset is None:
            raise ProbeRejectedError("a uprobe needs offset or symbol (-EINVAL)", EINVAL)
        if up.offset > img.size:        # __uprobe_register(): offset > i_size_read()
            raise ProbeRejectedError(f"{up.path}: file offset {up.offset:#x} is past its end "
                                     f"({img.size} bytes) (-EINVAL)", EINVAL,
                                     reason="offset past the end of the file (uprobe_register)")
        never = "in no mapping that executes (valid_vma())"
        try:
            vaddr = img.vaddr(up.offset)
        except KeyError as exc:
            raise UprobeNeverFires(f"{up.path}: {exc} (-EINVAL)", EINVAL, reason=never) from None
        if not img.executable(vaddr):
            raise UprobeNeverFires(f"{up.path}:{up.offset:#x} is not in executable text "
                                   "(-EINVAL)", EINVAL, reason=never)
        q = shlex.quote(up.path)
        up.ino = f.ino              # the file stat -L followed (kern_path(LOOKUP_FOLLOW))
        if up.pid is not None:
            maps = self.vm.run(f"cat /proc/{up.pid}/maps", timeout=30)
            if maps.status != 0:
                raise ProbeRejectedError(f"no process {up.pid} in the guest (-ESRCH)", 3)
            real = _maps_base(maps.stdout, self.vm.run(f"readlink -f {q}", timeout=30)
                              .stdout.strip() or up.path, up.offset)
            if real is None:
                raise ProbeRejectedError(f"process {up.pid} does not map {up.path} at file "
                                         f"offset {up.offset:#x} (-EINVAL)", EINVAL)
            vaddr = real
        elif img.pie:
            raise ProbeRejectedError(f"{up.path} is PIE: every process maps it elsewhere; give "
                                     "pid= (one process) or build it -no-pie (-EINVAL)", EINVAL)
        up.vaddr = vaddr

    def register(self, up: Uprobe) -> None:
        """Arm a prepared ``up`` (dispatcher)."""
        if up.registered:
            raise ProbeRejectedError("uprobe is already registered (-EINVAL)", EINVAL)
        assert up.vaddr is not None
        if up.pid is not None:
            task = self.find_task(up.pid)
            if task is None:
                raise ProbeRejectedError(f"no process {up.pid} in the guest (-ESRCH)", 3)
            up.mm = self._task_mm(task)
        if up.ret_handler is not None:
            tramp = self.elf(up.path).trampoline()
            if up.pid is not None and self.elf(up.path).pie:
                tramp += up.vaddr - self.elf(up.path).vaddr(up.offset or 0)
            up._kph_tramp = tramp  # type: ignore[attr-defined]
            self.used_trampolines.add(tramp)
            self.tramps[tramp] = self.tramps.get(tramp, 0) + 1
            self._arm(tramp)
        # uprobe_consumer lists take the newest first (consumer_add()), as kprobes do.
        self.addrs.setdefault(up.vaddr, []).insert(0, up)
        up.registered = True
        self._arm(up.vaddr)
        self._sync_clear_hook()

    def unregister(self, up: Uprobe) -> None:
        lst = self.addrs.get(up.vaddr or 0, [])
        if not up.registered or up not in lst:
            up.registered = False           # never armed, or GONE and already detached
            return
        lst.remove(up)
        if not lst:
            self.addrs.pop(up.vaddr or 0, None)
            self._disarm(up.vaddr or 0)
        up.registered = False
        tramp = getattr(up, "_kph_tramp", None)
        if tramp is not None:
            self.tramps[tramp] -= 1
            # Calls in flight still return through the trampoline: keep it while they do.
            self._drop_idle_trampoline(tramp)
        self._sync_clear_hook()

    def _drop_idle_trampoline(self, tramp: int) -> None:
        """Disarm ``tramp`` once no uretprobe uses it and no call in flight returns to it
        (unregistering keeps it for those, as the 2007 text says uprobes does)."""
        if self.tramps.get(tramp, 1) <= 0 and not any(_tramp_of(ri) == tramp
                                                       for ri in self._live.values()):
            self.tramps.pop(tramp)
            self._disarm(tramp)

    def _arm(self, addr: int) -> None:
        # Always a raw Z0: GDB would read the user page for its shadow copy, in whatever
        # process happens to be current now.
        if addr not in self._bps:
            if self.stub.raw(f"Z0,{addr:x},1") != "OK":
                raise HarnessError(f"QEMU refused a breakpoint at {addr:#x}")
            self._bps.add(addr)
            self.engine._bp[addr] = -1
        self.engine._emul.pop(addr, None)

    def _disarm(self, addr: int) -> None:
        if addr in self._bps and addr not in self.addrs and addr not in self.tramps:
            self.stub.raw(f"z0,{addr:x},1")
            self._bps.discard(addr)
            self.engine._bp.pop(addr, None)

    def _sync_clear_hook(self) -> None:
        """A host kprobe on ``uprobe_clear_state(mm)`` while some state is per mm, and one
        on ``uprobe_copy_process()`` while return instances are live."""
        forks = bool(self._live)
        if forks and self._fork_kp is None:
            self._fork_kp = Kprobe(symbol_name="uprobe_copy_process",
                                   pre_handler=lambda p, regs: self._on_fork(regs))
            self.engine._register(self._fork_kp)
        elif not forks and self._fork_kp is not None:
            self.engine._unregister(self._fork_kp)
            self._fork_kp = None
        need = bool(self.addrs or self._live)
        if need != (self._clear_kp is not None):
            # Without the hook an mm can be freed and its address reused unnoticed: the
            # per-mm cache is only valid while the hook is in place.
            self._exe_ino.clear()
        if need and self._clear_kp is None:
            self._clear_kp = Kprobe(symbol_name="uprobe_clear_state",
                                    pre_handler=lambda p, regs: self._on_clear_state(regs.di))
            self.engine._register(self._clear_kp)
        elif not need and self._clear_kp is not None:
            self.engine._unregister(self._clear_kp)
            self._clear_kp = None

    def _on_fork(self, regs: PtRegs) -> int:
        """``uprobe_copy_process(t, flags)`` (kernel/events/uprobes.c, 6.1 to 7.3): a child
        with an mm of its own gets a copy of each return instance of the current task
        (``dup_utask()``), so its return through a copied slot runs the chain as its own:
        a ``fork()`` probed with ``r:`` returns twice, in the parent and in the child. The
        copy keeps the consumers that target every process; one process's (``pid``) do
        not follow into its children. A thread shares the mm and gets none; a vfork
        child (the same mm, ``CLONE_VFORK``) is not mirrored (its copies would share the
        parent's keys)."""
        task, _tgid, mm = self.current(regs)
        child = regs.di
        try:
            cmm = self._task_mm(child)
        except HarnessError:
            return 0
        if not task or not cmm or cmm == mm:
            return 0
        for ri in [r for (m, _s), r in self._live.items() if m == mm and r.task == task]:
            keep = tuple(up for up in ri.probes if up.pid is None)
            self._live[(cmm, ri.stack_slot)] = UretprobeInstance(
                keep, ri.func, ri.ret_addr, ri.stack_slot, cmm, None, child, ri.tramp)
            self.stats["uretprobe_forked"] += 1
        return 0

    def _on_clear_state(self, mm: int) -> int:
        """The kernel drops ``mm``'s uprobes state (exit, or the old mm of an exec)."""
        self._exe_ino.pop(mm, None)
        for key in [k for k in self._live if k[0] == mm]:
            del self._live[key]
        for lst in list(self.addrs.values()):
            for up in list(lst):
                if up.pid is not None and up.mm == mm:
                    up.flags |= ProbeFlags.GONE
                    up.gone_reason = "its process exited or exec'd (uprobe_clear_state)"
                    self.stats["uprobes_gone"] += 1
                    self.unregister(up)
                    up.registered = True       # still registered, as a GONE kprobe is
        return 0

    # -- hits (dispatcher) ----------------------------------------------------------------
    def claims(self, addr: int) -> bool:
        return addr in self._bps

    def on_stop(self, pc: int, th: int) -> int:
        """A stop at a uprobe address or a trampoline; return where to resume."""
        regs = self.engine._regs(th, {"ip": pc})
        if regs.get("cs") & 3 != 3:           # kernel code at a user address: not ours
            return self.engine._execute(pc, th, regs.get)
        task, tgid, mm = self.current(regs)
        if pc in self.tramps:
            nxt = self._on_trampoline(pc, th, regs, mm, tgid)
            if nxt is not None:
                return nxt
        mine = [up for up in self.addrs.get(pc, ()) if not up.disabled and self._targets(up, tgid, mm)]
        if not mine:
            self.stats["uprobe_filtered"] += 1
            return self.engine._execute(pc, th, regs.get)
        self.stats["uprobe_hits"] += 1
        self.engine.uprobe_handlers(mine, regs)
        rets = tuple(up for up in mine if up.ret_handler is not None)
        if rets:
            self._prepare_uretprobe(rets, pc, regs, mm, tgid, task or 0)
        self.engine._flush(regs, th, keep_ip=False)
        return self.engine._execute(pc, th, regs.get)

    def _targets(self, up: Uprobe, tgid: int, mm: int) -> bool:
        if up.pid is not None:
            return tgid == up.pid and mm == up.mm
        return mm != 0 and self.exe_ino(mm) == up.ino

    def _prepare_uretprobe(self, rets: tuple[Uprobe, ...], func: int, regs: PtRegs, mm: int,
                           tgid: int, task: int = 0) -> None:
        """``prepare_uretprobe()``: save the return address at ``[sp]``, put the trampoline."""
        slot = regs.sp
        try:
            ret = self._u64(slot)
        except HarnessError:
            for up in rets:
                up.nmissed += 1
            return
        tramp = getattr(rets[0], "_kph_tramp")
        self.stub.write_memory(slot, tramp.to_bytes(8, "little"))
        self._live[(mm, slot)] = UretprobeInstance(rets, func, ret, slot, mm, tgid, task, tramp)
        self._sync_clear_hook()

    @functools.cached_property
    def _syscall_trampoline(self) -> bool:
        facts = getattr(self.vm, "facts", None)
        return bool(facts is not None and facts.rules.uretprobe_syscall)

    def _push_trampoline_args(self, sp: int, r11: int, cx: int, ax: int) -> None:
        """6.11+ (``arch/x86/kernel/uprobes.c``): a 64-bit process returns into
        ``uretprobe_trampoline_entry``, which pushes rax, rcx and r11 and calls
        ``sys_uretprobe()``; that reads them back (``struct uretprobe_syscall_args`` at
        ``sp - 24``), runs the handlers with sp as it was, and writes r11, cx and the
        return address back for the trampoline's pops and ``ret``. So a handler (and a
        ``-8($stack)`` fetch) sees rax, rcx and r11 just below sp, and the program finds
        r11, rcx and its return address there afterwards. The host's trampoline is a
        breakpoint: it writes what the kernel's would have."""
        m = (1 << 64) - 1
        data = b"".join((v & m).to_bytes(8, "little") for v in (r11, cx, ax))
        try:
            self.stub.write_memory((sp - 24) & m, data)
        except HarnessError as exc:
            # where the kernel's push or copy_to_user() faults it sends SIGILL: not mirrored
            log.debug("uretprobe trampoline frame at %#x: %s", sp - 24, exc)

    def _on_trampoline(self, pc: int, th: int, regs: PtRegs, mm: int, tgid: int) -> int | None:
        slot = (regs.sp - 8) & ((1 << 64) - 1)
        ri = self._live.pop((mm, slot), None)
        if ri is None:
            inherited = next((r for (m, s), r in self._live.items() if s == slot), None)
            if inherited is None:
                return None                    # another program running this address
            # A fork child returning through a slot it copied from its parent: no handler
            # (children do not inherit probes), but it must get the real address back.
            self.stats["uretprobe_inherited"] += 1
            return inherited.ret_addr
        self.stats["uretprobe_returns"] += 1
        syscall_tramp = self._syscall_trampoline
        sp = regs.sp
        if syscall_tramp:
            self._push_trampoline_args(sp, regs.get("r11"), regs.get("cx"), regs.get("ax"))
        regs.set("ip", ri.ret_addr)
        regs.clear_dirty()
        self.engine.uretprobe_handlers(ri, regs)
        if syscall_tramp and regs.sp == sp:
            # sys_uretprobe() writes back r11, cx and, in ax's slot, the address its
            # trampoline's ret goes to (a consumer that moved sp gets an iret instead)
            self._push_trampoline_args(sp, regs.get("r11"), regs.get("cx"), ri.ret_addr)
        self.engine._flush(regs, th, keep_ip=False)
        self._drop_idle_trampoline(pc)
        self._sync_clear_hook()
        return ri.ret_addr

    def user_address_kernel_view(self, mm: int, vaddr: int) -> int | None:
        """The kernel's direct-map address of user address ``vaddr`` in ``mm``, walking
        ``mm->pgd`` (4-level paging) from any context; None when not mapped.

        Why: a process that is not current cannot be reached through its virtual
        addresses, but its page tables and pages are all in the kernel's direct map
        (``page_offset_base`` + physical address)."""
        base = self._u64(self.engine.symbols.lookup("page_offset_base").addr)
        table = self._u64(mm + self._offset("mm_struct", "pgd"))
        for level, shift in enumerate((39, 30, 21, 12)):
            entry = self._u64(table + 8 * ((vaddr >> shift) & 511))
            if not entry & 1:                              # _PAGE_PRESENT
                return None
            phys = entry & 0x000FFFFFFFFFF000
            if level in (1, 2) and entry & 0x80:           # _PAGE_PSE: 1 GiB or 2 MiB page
                size = 1 << shift
                return base + (phys & ~(size - 1)) + (vaddr & (size - 1))
            if level == 3:
                return base + phys + (vaddr & 0xFFF)
            table = base + phys
        return None

    def close(self) -> None:
        """Put every hijacked return address back (through the direct map, whichever
        process is current), remove the breakpoints, drop all state."""
        for ri in list(self._live.values()):
            try:
                where = self.user_address_kernel_view(ri.mm, ri.stack_slot)
                if where is not None and self._u64(where) == _tramp_of(ri):
                    self.stub.write_memory(where, ri.ret_addr.to_bytes(8, "little"))
                    self.stats["uretprobe_restored"] += 1
                    continue
            except HarnessError as exc:
                log.debug("restoring the return address at %#x failed: %s", ri.stack_slot, exc)
            log.warning("uretprobe return address at %#x in mm %#x not restored",
                        ri.stack_slot, ri.mm)
        self._live.clear()
        self._exe_ino.clear()
        for addr in list(self._bps):
            self.stub.raw(f"z0,{addr:x},1")
            self.engine._bp.pop(addr, None)
        self._bps.clear()
        self.addrs.clear()
        self.tramps.clear()
        for kp in (self._clear_kp, self._fork_kp):
            if kp is not None:
                self.engine._unregister(kp)
        self._clear_kp = self._fork_kp = None


def _tramp_of(ri: UretprobeInstance) -> int | None:
    return ri.tramp
