"""``Machine``: one QEMU guest, driven over QMP and the guest agent, always torn down.

The only module that builds a QEMU command line. Every socket lives in a private 0700
run directory and is created by the harness, listening, then handed to QEMU by file
descriptor (``-chardev socket,fd=N,server=on,wait=off``): no TCP, no race on socket
files appearing. QMP runs on an asyncio loop thread (``qemu.qmp``), so GUEST_PANICKED and
SHUTDOWN are seen the moment QEMU sends them, even while a guest command is running.

Lifecycle (``VmState``): OFF -> BOOTING -> RUNNING <-> HALTED (by the gdbstub) ->
SHUTDOWN | PANICKED | LOST. QEMU is ended by its pid on every path: ``close()`` (also
from ``__exit__`` and an ``atexit`` hook) and, if this process is killed outright, by
the kernel through ``PR_SET_PDEATHSIG``.

Fresh starts: ``Machine.boot()`` restores the image's ready snapshot (``harness.machine.snapshot``)
when one matches, else boots cold and logs why once. Nothing on the host side crosses
the snapshot boundary (every Machine has its own QEMU, sockets, gdbstub session and
HostEngine); what the guest carries across it (the agent channel, the clock, the random
state) is resynchronised before ``boot()`` returns.

Kernel facts: ``vm.facts`` (``harness.machine.image.facts.KernelFacts``: kallsyms, blacklist, BTF, ...)
is complete when ``boot()`` returns: the image's own, or harvested right then for a
kernel booted without an image. Nothing is fetched from the guest on demand, so nothing
the host side reads inside a probe handler can wait on the stopped guest.

Waiting on the guest: every call that needs the guest running (``run``, ``push``,
``pull``, ``write_file``) raises ``GuestStoppedError`` at once from a probe handler's
thread (``harness.machine.handlerctx``), and, from any thread, as soon as the guest is seen
stopped for good (QMP ``query-status`` not running for a second, or a host-side engine
holding it in one handler for ``HANDLER_STUCK_TIMEOUT``). No wait can outlive its cause.
"""
from __future__ import annotations

import atexit
import collections
import enum
import hashlib
import inspect
import itertools
import json
import logging
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import constants as C
from .machine.image import facts as F
from .machine.agent import STALL_AFTER, GuestAgent
from .aio import LoopThread, qmp_connect
from .errors import (GuestAgentError, GuestExecError, GuestPanicError, GuestShutdownError,
                     GuestStoppedError, HandlerError, HarnessError, SetupError, StateError,
                     VMError, VMLostError)
from .machine.handlerctx import ADVICE, stopped_reason
from .machine.image.kbuild import boot_refusal
from .machine.image.store import Image, check_recipe, default_image
from .procs import (drain_fd, listen_unix, make_run_dir, pdeathsig, reap_stale_run_dirs,
                    stop_process)
from .machine.qemu import QemuBinary, find_qemu
from .machine.pluginlink import build_plugin, qemu_args
from .machine.snapshot import ensure, file_sha256, say_once
from .gdbstub import attach, spawn as spawn_gdb
from .kernel.symbols import SymbolTable, load_disassembler

log = logging.getLogger(__name__)

_PANIC_MARK = b"Kernel panic - not syncing"
_CONSOLE_KEEP = 1 << 20
_counter = itertools.count(1)
_live: "weakref.WeakSet[Machine]" = weakref.WeakSet()
#: the id of the reader's port device (QEMU's VSERPORT_CHANGE names it)
_READER_DEVICE = "kphreaderport"
#: characters of the kernel log :meth:`Machine.kernel_log` keeps (whole lines)
KLOG_MAX = 4 << 20
#: the longest op of :meth:`Machine.reader_writes`, in bytes (kph-reader keeps a request
#: line of up to 16 KiB, and writes an op's text with its newline from a 16,400-byte buffer)
READER_OP_MAX = 16000
_plugin_said: set[str] = set()
#: Host-side engines by name (``vm.host``), registered by their modules when imported.
HOST_ENGINES: dict[str, Callable[["Machine"], Any]] = {}
#: The module that registers each engine: imported by name on first use, so this lower
#: layer never imports an engine (which sits above it) statically.
ENGINE_MODULES = {"gdbstub": "harness.engines.gdbstub_engine", "plugin": "harness.engines.plugin_engine"}
#: A function that says whether something holds the guest stopped: None, or (since, who)
#: with ``since`` a ``time.monotonic()`` value.
StopHolder = Callable[[], "tuple[float, str] | None"]


def register_host_engine(name: str, factory: Callable[["Machine"], Any]) -> None:
    """Make ``factory(vm)`` available as the host-side engine ``name``."""
    HOST_ENGINES[name] = factory


class VmState(enum.Enum):
    OFF = "off"
    BOOTING = "booting"
    RUNNING = "running"
    HALTED = "halted"
    PANICKED = "panicked"
    SHUTDOWN = "shutdown"
    LOST = "lost"


@dataclass(frozen=True)
class RunResult:
    """What one guest command returned."""

    cmd: str
    status: int
    out: bytes
    err: bytes

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.status == 0


def check_kernel_format(path: Path) -> None:
    """Refuse files QEMU would load as garbage and then hang on: bzImage or ELF only."""
    with open(path, "rb") as f:
        head = f.read(0x206)
    if head[:4] == b"\x7fELF" or head[0x202:0x206] == b"HdrS":
        return
    raise SetupError(f"not a bootable x86 kernel: {path}",
                     "pass a bzImage (arch/x86/boot/bzImage) or an ELF vmlinux with a PVH note")


_accel_seen: dict[tuple[tuple[str, ...], str, str], tuple[bool, str]] = {}


def probe_accel(qemu: QemuBinary, accel: str, kernel: Path | None = None, *,
                timeout: float = C.KVM_PROBE_TIMEOUT) -> tuple[bool, str]:
    """Start ``kernel`` (default: the default image's) under ``accel`` and say whether it
    reached ``start_kernel()`` ("Linux version" on the early console) within ``timeout``.

    Why run a kernel: on some hosts /dev/kvm opens, even a real-mode test guest runs, and
    yet a Linux guest spins for ever right after its decompressor (seen here). Only the
    kernel itself tells. Cached per process. Returns (usable, one line of what was seen).
    """
    if kernel is None:
        try:
            kernel = default_image().kernel
        except SetupError:
            return False, "no kernel to try it with (run `kph image build`)"
    key = (qemu.argv, accel, str(kernel))
    if key in _accel_seen:
        return _accel_seen[key]
    if accel == "kvm" and not os.path.exists("/dev/kvm"):
        return _accel_seen.setdefault(key, (False, "no /dev/kvm on this host"))
    cmd = qemu.command(["-nodefaults", "-no-user-config", "-display", "none",
                        "-machine", C.MACHINE, "-accel", accel, "-m", "128", "-serial", "stdio",
                        "-no-reboot", "-kernel", str(kernel), "-append",
                        "console=ttyS0 earlyprintk=serial,ttyS0 nokaslr quiet panic=-1"])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=pdeathsig, env=dict(os.environ, **qemu.env))
    assert proc.stdout is not None
    out = b""
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        while b"Linux version" not in out and time.monotonic() - t0 < timeout:
            select.select([proc.stdout], [], [], 0.05)
            chunk = proc.stdout.read() or b""
            out += chunk
            if not chunk and proc.poll() is not None:
                break
    finally:
        proc.kill()
        proc.wait(5)
        proc.stdout.close()
    took = time.monotonic() - t0
    if b"Linux version" in out:
        res = (True, f"a Linux guest started under -accel {accel} in {took:.2f} s")
    elif proc.returncode not in (None, -signal.SIGKILL) and took < timeout:
        last = out.decode(errors="replace").strip().splitlines()
        res = (False, f"QEMU -accel {accel} failed" + (f": {last[-1][:160]}" if last else ""))
    else:
        res = (False, f"a Linux guest did not reach start_kernel in {timeout:.0f} s under "
                      f"-accel {accel} (the vCPU spins): unusable here")
    return _accel_seen.setdefault(key, res)


def _opt(path: Path) -> str:
    """A path as a QEMU option value (a comma is written twice)."""
    return str(path).replace(",", ",,")


def _close_pipes(proc: "subprocess.Popen[bytes]") -> None:
    """Close the pipes of a gdb started early (``Machine.boot(early_gdb=True)``) that no
    session took: it ended, or the machine closes before attaching."""
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def _smp_arg(smp: int) -> str:
    """``-smp``'s value: one CPU a socket. QEMU's default topology puts every CPU in one
    package (cores), and SeaBIOS's MP table lists one entry a package (its
    src/fw/mptable.c steps its CPU loop by the logical CPUs a package has): a kernel
    without ACPI, which finds its CPUs in that table (arch/x86/kernel/mpparse.c, tree
    builds: images/kernel.config), would bring up one CPU of two. With one CPU a
    socket every CPU has its entry; ACPI kernels see the same CPUs either way."""
    return "1" if smp == 1 else f"{smp},sockets={smp},cores=1,threads=1"


class Machine:
    """A booted guest. Use ``Machine.boot()`` as a context manager."""

    def __init__(self, *, kernel: Path, initrd: Path | None, append: str, smp: int = 1,
                 accel: str = "tcg", memory: str = C.DEFAULT_MEMORY,
                 qemu: QemuBinary | None = None, name: str | None = None,
                 extra_args: Sequence[str] = (), image: Any = None,
                 vmlinux: Path | None = None, ram_file: Path | None = None,
                 host: str = "gdbstub") -> None:
        self.kernel, self.initrd, self.append = kernel, initrd, append
        #: The host-side engine ``vm.host`` is: "gdbstub" (harness.engines.gdbstub_engine) or "plugin"
        #: (harness.engines.plugin_engine, QEMU started with probes/plugin loaded, inert).
        self.host_kind = host
        self.plugin_path: Path | None = None
        self.vmlinux = vmlinux
        self.smp, self.accel, self.memory = smp, accel, memory
        self.qemu = qemu or find_qemu()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        self.name = name or f"kph{('-' + worker) if worker else ''}-{os.getpid()}-{next(_counter)}"
        self.image = image
        self.extra_args = list(extra_args)
        #: Guest RAM in this file, shared (only the machine that builds a snapshot).
        self.ram_file = ram_file
        #: The snapshot this machine starts from (``harness.machine.snapshot.Snapshot``), or None.
        self.snapshot: Any = None
        #: "cold" or "snapshot" once started; ``cold_reason`` says why a fresh boot was cold.
        self.start_mode = "cold"
        self.cold_reason = ""
        #: Where the start's seconds went, once started, in order: ``qemu`` (the process
        #: started and its QMP connected), ``agent`` (a cold boot, or a snapshot's restore,
        #: up to the guest agent answering), and after a restore ``resync`` (the clock and
        #: the random seed: :meth:`_resync`, the guest's first exec since the restore).
        self.boot_phases: dict[str, float] = {}
        #: After a restore: the bound on the guest clock's error, from the offset measurement.
        self.clock_error_ns: int | None = None
        self.log = log.getChild(self.name)
        self.state = VmState.OFF
        self.rundir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent: GuestAgent | None = None
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.saved_console: Path | None = None
        self._socks: dict[str, socket.socket] = {}
        #: our end of the guest's data port (:meth:`read_stream`), connected at start
        self._data: socket.socket | None = None
        self._data_lock = threading.Lock()
        #: our end of the reader's port (kph-reader: :meth:`kernel_log`, :meth:`pull_many`),
        #: connected at start; whether the guest's reader holds it open (QEMU's
        #: VSERPORT_CHANGE, or the snapshot's record of it); the log read through it so far
        #: (None: not read yet)
        self._reader: socket.socket | None = None
        self._reader_lock = threading.Lock()
        self._reader_open = False
        self._reader_ids = itertools.count(1)
        self._reader_buf = bytearray()      # what came of an answer not read yet
        self._reader_skip = 0               # bytes still to drop of an answer given up on
        self._klog: str | None = None
        self._loop: LoopThread | None = None
        self._qmp: Any = None
        self._panicked = threading.Event()
        self._shutdown = threading.Event()
        self._quitting = False
        self._console_fd: int | None = None
        self._console = bytearray()
        #: bytes of the console dropped from the front of ``_console`` (marks stay valid)
        self._console_base = 0
        self._lock = threading.RLock()
        self._host: Any = None
        self._stub: Any = None
        #: Start gdb with QEMU (``boot(early_gdb=True)``); the gdb started so, until
        #: :meth:`gdbstub` attaches through it (ended by its pid in :meth:`close` if never)
        self.early_gdb = False
        #: The thread loading the host side beside the start (:meth:`_warm_host_side`)
        self.warmer: threading.Thread | None = None
        #: The plugin engine's record ring per vCPU in MiB (a power of two; None:
        #: ``harness.machine.pluginlink.RING_SIZE``), read when the engine starts
        #: (``kph diff --host-buffer``)
        self.plugin_ring_mib: int | None = None
        self._early_gdb: subprocess.Popen[bytes] | None = None
        self._symbols: Any = None
        #: refresh_module_symbols(): kallsyms lines per module state seen
        self._module_kallsyms: dict[frozenset[Any], dict[str, str]] = {}
        self._scripts = itertools.count()
        #: What the host side knows about the kernel (``harness.machine.image.facts``); set by ``boot()``.
        self.facts: F.KernelFacts | None = image.facts if image is not None else None
        #: Set by ``abort()``: the process is being interrupted; talk to nothing, just end.
        self.aborting = False
        self._stop_holders: list[StopHolder] = []
        #: probe stops a host engine handled (``note_host_stop``)
        self.host_stops = 0
        #: (when it ended, how long the guest was held) of each recent host probe stop
        self._host_held: collections.deque[tuple[float, float]] = collections.deque()
        self._stopped_seen: tuple[float, str] | None = None
        self._last_stall_check = 0.0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def boot(cls, image: Any = None, *, kernel: str | os.PathLike[str] | None = None,
             initrd: str | os.PathLike[str] | None = None, smp: int = 1, accel: str = "tcg",
             memory: str = C.DEFAULT_MEMORY, append: str | None = None,
             qemu: QemuBinary | str | None = None, name: str | None = None,
             timeout: float = C.BOOT_TIMEOUT, extra_args: Sequence[str] = (),
             vmlinux: str | os.PathLike[str] | None = None, fresh: bool = True,
             host: str = "gdbstub", early_gdb: bool = False) -> "Machine":
        """Boot the default image (or ``image``, or ``kernel``/``initrd``) until the agent answers.

        ``fresh`` (the default) starts from the image's ready snapshot, building it on first
        use; when there is none to be had (``harness.machine.snapshot.unsupported``), or ``$KPH_COLD``
        is set, or the restore fails, the guest boots cold and the reason is logged once.
        ``fresh=False`` always boots cold. Either way the guest has never run anything else.
        ``host`` picks the engine ``vm.host`` is: "gdbstub" (``harness.engines.gdbstub_engine``) or "plugin"
        (``harness.engines.plugin_engine``: QEMU starts with ``probes/plugin`` loaded, inert; it is
        built on first use, a failed build is a SetupError).
        ``early_gdb``: the caller will attach GDB (:meth:`gdbstub`, the gdbstub engine):
        gdb starts with QEMU, its own start (~50-70 ms) beside the guest's.

        :raise SetupError: a kernel, initrd or image that does not exist.
        :raise GuestPanicError: the guest panicked while booting.
        :raise VMError: QEMU refused to start.
        :raise VMLostError: the guest agent never answered.
        """
        m = cls.prepare(image, kernel=kernel, initrd=initrd, smp=smp, accel=accel,
                        memory=memory, append=append, qemu=qemu, name=name,
                        extra_args=extra_args, vmlinux=vmlinux, host=host)
        m.early_gdb = early_gdb
        if fresh and os.environ.get(C.COLD_ENV, "") in ("", "0"):
            m.use_snapshot()
        elif fresh:
            m.cold_reason = f"${C.COLD_ENV} is set"
        try:
            m.start(timeout=timeout)
        except (VMError, GuestExecError) as exc:  # GuestExecError: the resync command failed
            m.close()
            if m.snapshot is None or isinstance(exc, GuestPanicError):
                if isinstance(exc, VMError):
                    exc.console_log = m.saved_console
                raise
            # A snapshot that does not restore must not cost the caller the machine.
            why = f"restoring {m.snapshot.dir} failed: {str(exc).splitlines()[0]}"
            say_once(why)
            cold = cls.boot(image, kernel=kernel, initrd=initrd, smp=smp, accel=accel,
                            memory=memory, append=append, qemu=m.qemu, name=name,
                            timeout=timeout, extra_args=extra_args, vmlinux=vmlinux, fresh=False,
                            host=host, early_gdb=early_gdb)
            cold.cold_reason = why
            return cold
        except BaseException:
            m.close()
            raise
        try:
            m.ensure_facts()
        except BaseException:
            m.close()
            raise
        return m

    def ensure_facts(self) -> F.KernelFacts:
        """Make ``self.facts`` complete before anything can arm a probe.

        An image brings its own (harvested by ``kph image build``). A kernel booted without
        an image has them harvested now, with the guest running, into
        ``$KPH_CACHE/kernels/<kernel sha256>-<initrd sha256>/`` (once per kernel and
        initramfs), with ``nokaslr`` off only kallsyms is harvested per boot (into the run
        directory), since KASLR moves every address at each boot.

        :raise GuestExecError: the guest could not give a fact (a kernel without BTF, ...).
        """
        kaslr = "nokaslr" not in self.append.split()
        if self.facts is None:
            key = file_sha256(self.kernel)[:16] + "-" + (
                file_sha256(self.initrd)[:16] if self.initrd is not None else "none")
            d = C.cache_dir() / "kernels" / key
            if not F.is_harvested(d):
                self.log.info("harvesting kernel facts into %s", d)
                F.harvest(self, d)
            self.facts = F.KernelFacts(d)
        if kaslr and self.facts.kallsyms_file is None and self.rundir is not None:
            F.harvest(self, self.rundir, only=("kallsyms",))
            self.facts = F.KernelFacts(self.facts.dir, kallsyms_file=self.rundir / "kallsyms")
        return self.facts

    def use_snapshot(self, progress: Any = None) -> bool:
        """Start from the matching ready snapshot (built now if missing or stale).

        Returns False, with ``cold_reason`` set and logged once, when there is none.
        """
        snap, why = ensure(self, progress)
        self.snapshot = snap
        if snap is None:
            self.cold_reason = why
            say_once(why)
        return snap is not None

    def twin(self, *, ram_file: Path, name: str) -> Machine:
        """A machine of this one's configuration, not started, whose RAM is ``ram_file``
        (``harness.machine.snapshot`` boots it cold and saves it)."""
        return Machine(kernel=self.kernel, initrd=self.initrd, append=self.append, smp=self.smp,
                       accel=self.accel, memory=self.memory, qemu=self.qemu, name=name,
                       image=self.image, ram_file=ram_file)

    @classmethod
    def prepare(cls, image: Any = None, *, kernel: str | os.PathLike[str] | None = None,
                initrd: str | os.PathLike[str] | None = None, smp: int = 1,
                accel: str = "tcg", memory: str = C.DEFAULT_MEMORY, append: str | None = None,
                qemu: QemuBinary | str | None = None, name: str | None = None,
                extra_args: Sequence[str] = (),
                vmlinux: str | os.PathLike[str] | None = None,
                host: str = "gdbstub") -> "Machine":
        """Resolve and check every input without starting anything (``--dry-run`` uses it)."""
        if accel not in ("tcg", "kvm"):
            raise SetupError(f"unknown accelerator {accel!r}", "use --accel tcg or --accel kvm")
        if smp < 1:
            raise SetupError(f"--smp {smp} is not a CPU count", "use --smp 1 or more")
        if host not in ("gdbstub", "plugin"):
            raise SetupError(f"unknown host-side engine {host!r}", "use --host gdbstub or --host plugin")
        if kernel is None:
            img = image if isinstance(image, Image) else default_image(image)
            check_recipe(img)
            kpath, ipath = img.kernel, img.initrd
            if initrd is not None:
                ipath = Path(initrd)
        else:
            img = None
            kpath = Path(kernel)
            ipath = Path(initrd) if initrd is not None else None
            if ipath is None:
                # A kernel alone has no root to run init from: it gets the default image's
                # initramfs (busybox, the guest agent), which boots any x86_64 kernel with
                # virtio-pci and virtio-console built in (harness.machine.image.kbuild's do).
                try:
                    base = default_image()
                except SetupError as exc:
                    raise SetupError(f"--kernel {kernel} needs an initramfs, and there is no "
                                     "default image to take it from",
                                     "run `kph image build`, or pass --initrd FILE") from exc
                check_recipe(base)
                ipath = base.initrd
            if kpath.is_dir():  # a kernel build directory
                cand = kpath / "arch/x86/boot/bzImage"
                if not cand.exists():
                    raise SetupError(f"no arch/x86/boot/bzImage in {kpath}",
                                     "build the kernel first or pass the bzImage itself")
                why = boot_refusal((kpath / ".config").read_text()) \
                    if initrd is None and (kpath / ".config").is_file() else None
                if why:
                    raise SetupError(f"{kpath} cannot boot the harness's initramfs: {why}",
                                     "build it with `kph kernel build SRC` (images/kernel.config "
                                     "sets them), or set them =y, or pass --initrd FILE")
                if vmlinux is None and (kpath / "vmlinux").is_file():
                    vmlinux = kpath / "vmlinux"
                kpath = cand
        vpath = Path(vmlinux) if vmlinux is not None else None
        for what, p in (("kernel", kpath), ("initrd", ipath), ("vmlinux", vpath)):
            if p is not None and not p.is_file():
                raise SetupError(f"{what} not found: {p}",
                                 f"pass an existing file with --{what}" +
                                 (" or run `kph image build`" if img is None else ""))
        check_kernel_format(kpath)
        q = qemu if isinstance(qemu, QemuBinary) else find_qemu(qemu)
        if accel == "kvm":
            ok, detail = probe_accel(q, "kvm", kpath)
            if not ok:
                raise SetupError(f"--accel kvm: {detail}", "use --accel tcg (the default)")
        m = cls(kernel=kpath, initrd=ipath, append=append or C.DEFAULT_APPEND, smp=smp,
                accel=accel, memory=memory, qemu=q, name=name, extra_args=extra_args,
                image=img, vmlinux=vpath, host=host)
        # The TCG plugin (harness.machine.pluginlink) goes into every machine whose QEMU can load it,
        # inert until an engine connects (no measurable cost: bench in docs/plugin.md). The
        # plugin engine needs it; for the others it is best effort.
        try:
            m.plugin_path = build_plugin(q)
        except SetupError as exc:
            if host == "plugin":
                raise
            if str(exc) not in _plugin_said:
                _plugin_said.add(str(exc))
                log.info("machines start without the TCG plugin: %s", exc)
        return m

    def machine_args(self) -> list[str]:
        """The guest-visible part of the command line, without this machine's name, run
        directory or descriptors: what a snapshot's key records as machine options."""
        args = self._args({"qmp": 3, "qga": 4, "gdb": 5, "data": 7, "reader": 8}, Path("RUNDIR"))
        i = args.index("-name")
        return args[:i] + args[i + 2:]

    def command_line(self, fds: dict[str, int] | None = None) -> list[str]:
        """The exact QEMU argv (``fds`` maps qmp/qga/gdb/data/reader to the descriptors
        QEMU inherits)."""
        args = self._args(fds or {"qmp": 3, "qga": 4, "gdb": 5, "data": 7, "reader": 8},
                          self.rundir or Path("RUNDIR"))
        mem = None
        if self.ram_file is not None:  # building a snapshot: the guest's RAM is the file
            mem = f"mem-path={_opt(self.ram_file)},share=on"
        elif self.snapshot is not None:  # a private copy-on-write mapping of it
            mem = f"mem-path={_opt(self.snapshot.ram)},share=off,readonly=on,rom=off"
            args += ["-incoming", "defer"]
        if mem is not None:
            args[args.index("-machine") + 1] += ",memory-backend=kph-ram"
            args += ["-object", f"memory-backend-file,id=kph-ram,size={self.memory},{mem}"]
        if self.plugin_path is not None:  # harness.machine.pluginlink: loaded inert, not guest-visible
            args += qemu_args(self.plugin_path, (fds or {}).get("plugin", 6))
        return self.qemu.command(args + self.extra_args)

    def _args(self, fds: dict[str, int], rundir: Path) -> list[str]:
        console = rundir / "console.log"
        args = ["-name", self.name, "-nodefaults", "-no-user-config", "-display", "none",
                "-machine", C.MACHINE, "-m", self.memory, "-smp", _smp_arg(self.smp),
                "-accel", self.accel, "-no-reboot", "-action", "panic=pause",
                "-serial", f"file:{console}",
                "-chardev", f"socket,id=qmp0,fd={fds['qmp']},server=on,wait=off",
                "-mon", "chardev=qmp0,mode=control",
                "-device", "virtio-serial-pci,id=vs0",
                "-chardev", f"socket,id=qga0,fd={fds['qga']},server=on,wait=off",
                "-device", "virtserialport,bus=vs0.0,chardev=qga0,name=org.qemu.guest_agent.0",
                # raw bytes from the guest to the host (Machine.read_stream), no agent
                "-chardev", f"socket,id=kphdata0,fd={fds['data']},server=on,wait=off",
                "-device", f"virtserialport,bus=vs0.0,chardev=kphdata0,name={C.DATA_PORT}",
                # the guest's kernel log and files, read by kph-reader (Machine.kernel_log)
                "-chardev", f"socket,id=kphreader0,fd={fds['reader']},server=on,wait=off",
                "-device", f"virtserialport,bus=vs0.0,chardev=kphreader0,id={_READER_DEVICE},"
                           f"name={C.READER_PORT}",
                "-chardev", f"socket,id=gdb0,fd={fds['gdb']},server=on,wait=off",
                "-gdb", "chardev:gdb0",
                "-device", "pvpanic-pci",
                "-kernel", str(self.kernel), "-append", self.append]
        if self.accel == "kvm":
            args += ["-cpu", "host"]
        if self.initrd is not None:
            args += ["-initrd", str(self.initrd)]
        return args

    def dry_run(self) -> str:
        return shlex.join(self.command_line())

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, *, timeout: float = C.BOOT_TIMEOUT) -> None:
        if self.state is not VmState.OFF:
            raise StateError(f"{self.name} is {self.state.value}; it can start only once",
                             self.state, VmState.OFF)
        t0 = time.monotonic()
        self.state = VmState.BOOTING
        _live.add(self)
        reap_stale_run_dirs()
        self.rundir = make_run_dir(self.name)
        for key in ("qmp", "qga", "gdb", "data", "reader") + (("plugin",) if self.plugin_path else ()):
            self._socks[key] = listen_unix(self.rundir / f"{key}.sock")
        fds = {k: s.fileno() for k, s in self._socks.items()}
        console = self.rundir / "console.log"
        console.touch()
        self._console_fd = os.open(console, os.O_RDONLY | os.O_NONBLOCK)
        cmd = self.command_line(fds)
        self.log.debug("starting %s", shlex.join(cmd))
        qlog = open(self.rundir / "qemu.log", "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=qlog,
                                         stderr=subprocess.STDOUT, pass_fds=list(fds.values()),
                                         start_new_session=True, preexec_fn=pdeathsig,
                                         env=dict(os.environ, **self.qemu.env))
        except OSError as exc:
            raise SetupError(f"cannot start QEMU {self.qemu.argv[0]}: {exc}",
                             "run `kph doctor`") from exc
        finally:
            qlog.close()
        self._warm_host_side()
        if self.early_gdb:
            # gdb starts beside the restore and the guest's first answers; it attaches
            # when first asked for (gdbstub()): its start is then done
            self._early_gdb = spawn_gdb(log_path=self.rundir / "gdb.log")
        # QEMU holds the listening sockets now; ours are only needed to connect.
        self._loop = LoopThread(f"{self.name}-qmp")
        try:
            self._loop.call(self._qmp_connect(), C.QMP_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - turned into a precise error below
            self._check()
            raise VMLostError(f"QMP did not answer: {exc}", self.console_tail()) from exc
        t_qmp = time.monotonic()
        qga = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        qga.connect(str(self.rundir / "qga.sock"))
        self.agent = GuestAgent(qga, check=self._check, stalled=self._stall_check)
        # connected before the guest runs: a port whose host end is not connected blocks
        # the guest's writes (virtio_console.c: will_write_block())
        self._data = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._data.connect(str(self.rundir / "data.sock"))
        self._reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._reader.connect(str(self.rundir / "reader.sock"))
        # restored: the reader held its port when the snapshot was saved (no event then)
        self._reader_open = bool(self.snapshot is not None and self.snapshot.meta.get("reader"))
        if self.snapshot is not None:
            self.qmp("migrate-set-capabilities",
                     {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
            self.qmp("migrate-incoming", {"uri": f"file:{self.snapshot.state}"})
        try:
            # After a restore the agent's stream may hold whatever the snapshot's client
            # left in flight: this is a guest-sync-delimited resynchronisation either way.
            self.agent.wait_ready(max(1.0, timeout - (time.monotonic() - t0)))
        except VMLostError as exc:
            raise VMLostError(f"{self.name}: guest agent not ready after {timeout:.0f} s "
                              f"(kernel {self.kernel})", self.console_tail()) from exc
        self.state = VmState.RUNNING
        t_agent = time.monotonic()
        self.boot_phases = {"qemu": t_qmp - t0, "agent": t_agent - t_qmp}
        if self.snapshot is not None:
            self.start_mode = "snapshot"
            self._resync()
            self.boot_phases["resync"] = time.monotonic() - t_agent
        self.boot_seconds = time.monotonic() - t0
        self.log.debug("ready in %.2f s (%s)", self.boot_seconds, self.start_mode)

    def _warm_host_side(self) -> None:
        """Load what the host side asks for first, in a thread beside the guest's start
        (QEMU's start, the restore, the resync: ~0.5 s in which this process waits): the
        image's BTF and, where the addresses are fixed (``nokaslr``), its kallsyms table
        (parsed, or read back from their kept copies: harness.machine.image.facts), and
        the disassembler. Whoever asks for one of them first waits for its load
        (``functools.cached_property`` holds a lock in Python 3.11; ``_load_btf`` and
        ``_load_symbols`` are cached per file); a failure here is left for that caller
        to meet and report, never raised from the thread."""
        facts = self.facts
        if facts is None:
            return
        fixed = "nokaslr" in self.append.split()

        def warm() -> None:
            try:
                facts.btf
                if fixed:
                    facts.symbols
                load_disassembler()
            except Exception as exc:  # noqa: BLE001 - the caller that needs it reports it
                self.log.debug("loading the host side beside the start: %s", exc)
        self.warmer = threading.Thread(target=warm, name=f"{self.name}-warm", daemon=True)
        self.warmer.start()

    def _resync(self) -> None:
        """Bring a restored guest back in step with the host: without this, every guest
        restored from one snapshot would wake with the snapshot's wall clock and hand out
        the same "random" bytes (the crng keeps its key until its next scheduled reseed).

        The clock offset is measured with the agent's ``guest-get-time`` (answered inside
        qemu-ga, milliseconds once warm), then ``kph-resync`` (probes/progs/resync.c)
        moves the clock by that offset, credits host random bytes with RNDADDENTROPY and
        forces RNDRESEEDCRNG. A delta rather than a time: that exec is the first after
        the restore and pays for TCG translating the exec path afresh (~0.2 s).
        """
        agent = self._require_running()
        best = None
        for _ in range(C.RESYNC_CLOCK_TRIES):
            t0 = time.time_ns()
            guest = int(agent.execute("guest-get-time", timeout=C.RESYNC_TIMEOUT))
            t1 = time.time_ns()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - guest)
            if t1 - t0 < C.RESYNC_CLOCK_SLACK * 1e9:
                break
        self.clock_error_ns = best[0] // 2
        self.run(f"/usr/bin/kph-resync {best[1]}", stdin=os.urandom(64), check=True,
                 timeout=C.RESYNC_TIMEOUT)

    async def _qmp_connect(self) -> None:
        self._qmp = await qmp_connect(self.name, str(self.rundir / "qmp.sock"), self._on_event)

    def _on_event(self, name: str, data: dict[str, Any]) -> None:
        self.events.append((time.time(), name, data))
        if name == "VSERPORT_CHANGE" and data.get("id") == _READER_DEVICE:
            self._reader_open = bool(data.get("open"))
        del self.events[:-200]
        self.log.debug("<-- event %s %s", name, data)
        if name == "GUEST_PANICKED":
            self._panicked.set()
        elif name == "SHUTDOWN" and not self._quitting:
            self._shutdown.set()

    def __enter__(self) -> "Machine":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except HandlerError as err:
            if exc is None:
                raise
            self.log.warning("%s (not raised: %r is already on its way)", err, exc)

    def abort(self) -> None:
        """Mark the machine as being torn down because the process is interrupted: every
        later call that would talk to the guest refuses at once, ``close()`` ends QEMU
        without asking it to quit and host-side engines stop without cleaning the guest
        (it is about to vanish)."""
        self.aborting = True
        self.log.debug("aborting")

    def _call_quietly(self, coro: Any) -> None:
        """Run a QMP coroutine on the machine's loop for a second at most, on the way
        out: a failure is ignored, and a coroutine the loop never started is closed
        (else Python warns that it was never awaited)."""
        try:
            self._loop.call(coro, 1.0)
        except Exception:  # noqa: BLE001 - what follows ends QEMU whatever this did
            if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()

    def close(self) -> None:
        """End QEMU by its pid, stop the QMP loop and remove the run directory. Idempotent.

        :raise HandlerError: host-side handlers raised and nobody took the errors (raised
            after the teardown is complete).
        """
        handler_error: HandlerError | None = None
        with self._lock:
            if self.state is VmState.OFF and self.rundir is None:
                return
            self._quitting = True
            failed = self.state in (VmState.PANICKED, VmState.LOST, VmState.BOOTING)
            if self.aborting:
                # Interrupted: other threads may be mid-conversation with gdb or QEMU;
                # end both by pid first, then let the parts close without asking anything.
                if self.proc is not None and self.proc.poll() is None:
                    self.proc.kill()
                if self._stub is not None:
                    self._stub.kill()
            for part in (self._host, self._stub):
                if part is None:
                    continue
                try:
                    part.close()
                except HandlerError as exc:
                    handler_error = exc
                except Exception:  # noqa: BLE001 - teardown goes on
                    if not self.aborting:
                        self.log.exception("closing %r failed", part)
            self._host = self._stub = None
            early, self._early_gdb = self._early_gdb, None
            if early is not None:               # never attached: ended by its pid
                stop_process(early, ((signal.SIGKILL, 5.0),))
                _close_pipes(early)
            if self.agent is not None:
                self.agent.close()
            if self._data is not None:
                self._data.close()
                self._data = None
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            proc = self.proc
            if proc is not None and proc.poll() is None and self.aborting:
                proc.kill()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    pass
            if proc is not None and proc.poll() is None:
                if self._qmp is not None and self._loop is not None:
                    self._call_quietly(self._qmp.execute("quit"))     # signals follow
                stop_process(proc, ((None, C.QUIT_TIMEOUT), (signal.SIGTERM, 2.0),
                                    (signal.SIGKILL, 5.0)))
            if self._qmp is not None and self._loop is not None:
                self._call_quietly(self._qmp.disconnect())
            if self._loop is not None:
                self._loop.close()
            for s in self._socks.values():
                s.close()
            self._read_console()
            if self._console_fd is not None:
                os.close(self._console_fd)
                self._console_fd = None
            if self.rundir is not None:
                if failed and self._console:
                    self._save_console()
                shutil.rmtree(self.rundir, ignore_errors=True)
                self.rundir = None
            if self.state in (VmState.RUNNING, VmState.HALTED, VmState.BOOTING):
                self.state = VmState.SHUTDOWN
            _live.discard(self)
        if handler_error is not None:
            raise handler_error

    def _save_console(self) -> None:
        logs = C.cache_dir() / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            self.saved_console = logs / f"{self.name}.console.log"
            self.saved_console.write_bytes(bytes(self._console))
        except OSError:
            self.saved_console = None

    # -- health ---------------------------------------------------------------------------
    def _read_console(self) -> bytes:
        if self._console_fd is None:
            return b""
        new = drain_fd(self._console_fd)
        if new:
            self._console += new
            if len(self._console) > _CONSOLE_KEEP:
                self._console_base += len(self._console) - _CONSOLE_KEEP
                del self._console[:-_CONSOLE_KEEP]
        return new

    def console_mark(self) -> int:
        """A mark in the serial console: the count of bytes the guest has written to it
        so far (``console_since`` gives what came after)."""
        self._read_console()
        return self._console_base + len(self._console)

    def console_since(self, mark: int, end: int | None = None) -> str:
        """The console's text from ``mark`` (``console_mark()``) to ``end`` (a later mark;
        None: now), CRLF made plain newlines; what was dropped (past the last MiB kept)
        is not there."""
        self._read_console()
        lo = max(0, mark - self._console_base)
        hi = len(self._console) if end is None else max(0, end - self._console_base)
        return bytes(self._console[lo:hi]).decode("utf-8", "replace").replace("\r\n", "\n")

    def console_text(self) -> str:
        """The serial console so far, with the UART's CRLF line ends made plain newlines."""
        self._read_console()
        return self._console.decode("utf-8", "replace").replace("\r\n", "\n")

    def console_tail(self, lines: int = C.CONSOLE_TAIL_LINES) -> str:
        return "\n".join(self.console_text().rstrip("\n").splitlines()[-lines:])

    def _panic_line(self) -> str:
        """The console's panic line, whole: the UART writes it a character at a time, and
        pvpanic's event may come before it, so a check that saw the panic waits (at most
        ``C.PANIC_LINE_WAIT`` s) for the line's end."""
        deadline = time.monotonic() + C.PANIC_LINE_WAIT
        while True:
            self._read_console()
            at = self._console.find(_PANIC_MARK)
            over = time.monotonic() > deadline or \
                (self.proc is not None and self.proc.poll() is not None)
            if at < 0:
                if over:        # pvpanic's event with no line on the console
                    return "GUEST_PANICKED from pvpanic"
                time.sleep(0.01)
                continue
            end = self._console.find(b"\n", at)
            if end >= 0 or over:
                line = self._console[at:end if end >= 0 else len(self._console)]
                start = self._console.rfind(b"\n", 0, at) + 1
                return bytes(self._console[start:at] + line).decode("utf-8", "replace").strip()
            time.sleep(0.01)

    def alive(self) -> bool:
        """Running, with no panic, shutdown or QEMU exit seen (no guest round trip)."""
        if self.state is not VmState.RUNNING:
            return False
        try:
            self._check()
        except HarnessError:
            return False
        return self.state is VmState.RUNNING

    def _check(self) -> None:
        """Raise at once if the guest panicked, shut down, or QEMU died."""
        self._read_console()
        where = f" while booting {self.kernel}" + (f" with initrd {self.initrd}" if self.initrd else "") \
            if self.state is VmState.BOOTING else ""
        if self._panicked.is_set() or _PANIC_MARK in self._console:
            self.state = VmState.PANICKED
            raise GuestPanicError(f"{self.name}: guest kernel panicked{where}: {self._panic_line()}",
                                  self.console_tail())
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.state = VmState.LOST if not self._shutdown.is_set() else VmState.SHUTDOWN
            qlog = ""
            if self.rundir is not None and (self.rundir / "qemu.log").exists():
                qlog = (self.rundir / "qemu.log").read_text(errors="replace").strip()
            if self._shutdown.is_set():
                raise GuestShutdownError(f"{self.name}: guest shut down or reset{where}",
                                         self.console_tail())
            first = qlog.splitlines()[-1] if qlog else ""
            raise VMError(f"{self.name}: QEMU exited with status {code}{where}"
                          + (f": {first}" if first else ""), self.console_tail())
        if self._shutdown.is_set():
            self.state = VmState.SHUTDOWN
            raise GuestShutdownError(f"{self.name}: guest shut down{where}", self.console_tail())

    def _require_running(self) -> GuestAgent:
        if self.aborting:
            raise StateError(f"{self.name} is being torn down (interrupted)", self.state,
                             VmState.RUNNING)
        if self.state not in (VmState.RUNNING,) or self.agent is None:
            raise StateError(f"{self.name} is {self.state.value}; the guest must be running",
                             self.state, VmState.RUNNING)
        self._stopped_seen = None  # each wait judges the guest afresh
        why = stopped_reason()
        if why is not None:
            raise GuestStoppedError(
                f"{self.name}: called from {why}: the guest stays stopped until it returns, "
                f"so the guest agent cannot answer; {ADVICE}", why)
        return self.agent

    def note_host_stop(self, held: float) -> None:
        """A host engine handled a probe stop of the guest (a gdbstub breakpoint or step,
        a plugin round trip), holding the guest ``held`` seconds, and let it run on."""
        now = time.monotonic()
        self.host_stops += 1
        q = self._host_held
        q.append((now, held))
        while q and now - q[0][0] > 4 * C.HOST_BUSY_WINDOW:
            q.popleft()

    def host_busy(self, at: float | None = None) -> bool:
        """Whether the host's probe stops held the guest for at least
        ``C.HOST_BUSY_SHARE`` of the ``C.HOST_BUSY_WINDOW`` seconds before ``at`` (now by
        default): a wait on the guest that ran out then was outlasted by a guest slowed
        by the host's probes, not hung (``harness.machine.kwatch``). A stop now and then
        (a probe a timer or the harness's own commands hit) is not that."""
        at = time.monotonic() if at is None else at
        start = at - C.HOST_BUSY_WINDOW
        held = sum(min(h, end - start) for end, h in list(self._host_held)
                   if start < end <= at)
        return held >= C.HOST_BUSY_SHARE * C.HOST_BUSY_WINDOW

    def _stall_check(self) -> float | None:
        """Called by the agent while a reply is overdue: raise ``GuestStoppedError`` when
        the guest cannot run, so no wait outlives its cause (see the module docstring).
        Returns now while the host's probe stops hold the guest most of the time
        (``host_busy``), for the agent to wait on a guest slowed by them; None otherwise: a
        probe a timer hits now and then does not stretch the wait on a hung guest."""
        if self.state is not VmState.RUNNING or self.aborting:
            return None
        self._stall_check_stopped()
        return time.monotonic() if self.host_busy() else None

    def _stall_check_stopped(self) -> None:
        now = time.monotonic()
        if self._stop_holders:
            # A host-side engine owns the stub: the guest stops only at its hits, for as
            # long as their handlers take. Only a handler that never returns is stuck.
            for holder in list(self._stop_holders):
                held = holder()
                if held is not None and now - held[0] >= C.HANDLER_STUCK_TIMEOUT:
                    raise GuestStoppedError(
                        f"{self.name}: {held[1]} has held the guest stopped for "
                        f"{now - held[0]:.0f} s; nothing that needs the guest can finish "
                        "until it returns", held[1])
            return
        if now - self._last_stall_check < C.STALL_CHECK_INTERVAL:
            return
        self._last_stall_check = now
        try:
            status = str(self.qmp("query-status", timeout=2.0).get("status"))
        except (VMError, StateError):
            return
        if status == "running":
            self._stopped_seen = None
            return
        if self._stopped_seen is None or self._stopped_seen[1] != status:
            self._stopped_seen = (now, status)
            return
        if now - self._stopped_seen[0] >= 1.0:
            who = {"debug": "stopped at a debug event: a gdbstub breakpoint or step",
                   "paused": "paused: a QMP stop or a debugger's interrupt"
                   }.get(status, f"QEMU reports {status!r}")
            raise GuestStoppedError(f"{self.name}: the guest is not running ({who}); resume "
                                    "it before calling anything that needs the guest", status)

    # -- guest access ---------------------------------------------------------------------
    def run(self, cmd: str, *, timeout: float = C.RUN_TIMEOUT, check: bool = False,
            stdin: bytes | None = None) -> RunResult:
        """Run ``cmd`` with the guest's ``/bin/sh -c``; return status, stdout, stderr.

        :raise GuestExecError: ``check`` is true and the command exited non-zero.
        :raise GuestPanicError: the guest panicked meanwhile (seconds, not the timeout).
        :raise VMLostError: no result within ``timeout``.
        """
        agent = self._require_running()
        self.log.debug("--> run %r", cmd)
        argv = ["/bin/sh", "-c", cmd]
        if len(cmd.encode()) > C.MAX_INLINE_CMD:
            # past execve()'s MAX_ARG_STRLEN (a registration script of 1,000 lines): the
            # script goes through the agent's file calls and removes itself as it starts
            path = f"/tmp/kph-run-{os.getpid()}-{next(self._scripts)}.sh"
            agent.write_file(path, f"rm -f {path}\n{cmd}".encode(), timeout=timeout)
            argv = ["/bin/sh", path]
        try:
            status, out, err = agent.exec(argv, stdin=stdin, timeout=timeout)
        except VMLostError as exc:
            self._check()
            raise VMLostError(str(exc), self.console_tail(), at=exc.at) from exc
        res = RunResult(cmd, status, out, err)
        if check and not res.ok:
            raise GuestExecError(cmd, status, res.stdout, res.stderr)
        return res

    @property
    def has_data_port(self) -> bool:
        """Whether :meth:`read_stream` can be used (a running machine started with it)."""
        return self._data is not None and self.state is VmState.RUNNING

    def read_stream(self, cmd: str, size: int, *, timeout: float = C.RUN_TIMEOUT) -> bytes:
        """Run ``cmd`` with the guest's ``/bin/sh -c``, ``$KPH_DATA`` naming the device of
        the machine's data port (a virtio-serial port of its own, ``C.DATA_PORT``), and
        return the ``size`` bytes it writes there: raw bytes, where the agent's answers
        carry base64 in JSON (a ring-buffer page through the agent ~1.2 ms under TCG,
        through the port ~0.15 ms). The port has no end of stream: ``cmd`` must write
        exactly ``size`` bytes.

        :raise GuestExecError: ``cmd`` exited non-zero.
        :raise VMLostError: ``size`` bytes did not come within ``timeout``.
        :raise StateError: the machine has no data port.
        """
        self._require_running()
        if self._data is None:
            raise StateError(f"{self.name} has no data port", self.state, VmState.RUNNING)
        with self._data_lock:
            sock = self._data
            sock.setblocking(False)
            try:        # what an interrupted stream left behind
                while sock.recv(1 << 20):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            buf = bytearray()
            deadline = time.monotonic() + timeout
            stop = threading.Event()
            failed: list[BaseException] = []

            def pump() -> None:
                try:
                    sock.settimeout(0.05)
                    while len(buf) < size and not stop.is_set() and time.monotonic() < deadline:
                        try:
                            chunk = sock.recv(min(1 << 20, size - len(buf)))
                        except TimeoutError:
                            continue
                        if not chunk:
                            return
                        buf.extend(chunk)
                except OSError as exc:
                    failed.append(exc)

            reader = threading.Thread(target=pump, name=f"{self.name}-data", daemon=True)
            reader.start()
            port = ("p=; for f in /sys/class/virtio-ports/*/name; do read -r n < \"$f\"; "
                    f"[ \"$n\" = {C.DATA_PORT} ] && p=${{f%/name}}; done; "
                    "KPH_DATA=/dev/${p##*/}; ")
            try:
                self.run(port + cmd, timeout=timeout, check=True)
            except BaseException:
                stop.set()
                raise
            finally:
                # a port's write() returns with its buffer queued, not taken by the host
                # (drivers/char/virtio_console.c: port_fops_write() sends it nonblock):
                # what the command wrote last may come after it ended, within moments
                reader.join(max(0.0, min(deadline - time.monotonic(), 5.0)) + 0.2)
                stop.set()
                reader.join()
                sock.setblocking(False)
        if len(buf) != size:
            raise VMLostError(f"guest command {cmd!r} wrote {len(buf)} of {size} bytes to "
                              f"the data port within {timeout:.0f} s"
                              + (f" ({failed[0]})" if failed else ""), self.console_tail())
        return bytes(buf)

    @property
    def has_reader(self) -> bool:
        """Whether :meth:`kernel_log` and :meth:`pull_many` go through the guest's
        kph-reader (else ``dmesg`` and the guest agent's file calls)."""
        return self._reader is not None and self._reader_open and self.state is VmState.RUNNING

    def kernel_log(self, *, timeout: float = C.RUN_TIMEOUT) -> str:
        """The guest's kernel log as its ``dmesg`` prints it.

        Read by kph-reader (probes/progs/reader.c) on the machine's reader port: no guest
        process, and only the records printed since the last read are formatted, where a
        ``dmesg`` is a fork and formats every record (~13 ms under TCG, twice a run: the
        kernel watch's two edges, ``harness.machine.kwatch``). The text is every line
        read on this machine from its first read on, the last :data:`KLOG_MAX`
        characters (whole lines); the kernel's own buffer may have dropped some of them
        since. Without the reader (an initramfs of one's own, or a reader that did not
        answer once): ``dmesg`` in the guest.

        :raise GuestExecError: ``dmesg`` failed.
        :raise VMLostError: no answer within ``timeout`` (the reader is not asked again).
        """
        self._require_running()
        if not self.has_reader:
            r = self.run("dmesg", timeout=timeout)
            if r.status != 0:
                raise GuestExecError("dmesg", r.status, r.stdout, r.stderr)
            return r.stdout
        with self._reader_lock:
            text = self._ask_reader("a" if self._klog is None else "n", timeout)
            got = (self._klog or "") + text.decode("utf-8", "replace")
            if len(got) > KLOG_MAX:
                cut = got.find("\n", len(got) - KLOG_MAX)
                got = got[cut + 1:] if cut >= 0 else got[-KLOG_MAX:]
            self._klog = got
            return got

    def _ask_reader(self, request: str, timeout: float, lines: Sequence[str] = (),
                    count: int = 0) -> bytes:
        """Send kph-reader ``request`` (``a``, ``n``, ``f``, ``w``, or ``p`` with ``count``,
        its MAX) with its id and ``lines`` after it, and read its answer, ``KPH ID LEN`` and
        LEN bytes. A VMLostError (no answer in time, a broken port, an answer out of step)
        and the reader is not asked again (``has_reader`` False); after any other error (a
        guest that cannot run) its answer is still to come, and is skipped when it does."""
        sock = self._reader
        assert sock is not None
        ident = next(self._reader_ids)
        try:
            head = f"{request} {ident}" + (f" {len(lines)}" if request in ("f", "w") else
                                           f" {int(count)}" if request == "p" else "")
            return self._reader_answer(sock, ident, head, lines, timeout)
        except VMLostError:
            self._reader_open = False
            self._klog = None
            raise
        except BaseException:
            # left unanswered (a guest that cannot run): its answer comes later and is
            # skipped, so the log is read whole again next time, none of it lost
            self._klog = None
            raise

    def _reader_answer(self, sock: socket.socket, ident: int, head: str,
                       lines: Sequence[str], timeout: float) -> bytes:
        """Send the request, then read the answer to ``ident``: what comes before it is an
        earlier request's answer, one a call gave up on, dropped as it arrives (its bytes
        counted in ``_reader_skip`` across calls, its rest kept in ``_reader_buf``)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        buf = self._reader_buf
        try:
            sock.setblocking(True)
            sock.sendall("".join(f"{ln}\n" for ln in (head, *lines)).encode())
            sock.setblocking(False)
            want: int | None = None
            while True:
                if self._reader_skip:
                    n = min(self._reader_skip, len(buf))
                    del buf[:n]
                    self._reader_skip -= n
                while not self._reader_skip and want is None and b"\n" in buf:
                    line = bytes(buf[:buf.index(b"\n")])
                    parts = line.split()
                    if len(parts) != 3 or parts[0] != b"KPH" or not parts[1].isdigit() \
                            or not parts[2].isdigit() or int(parts[1]) > ident:
                        raise VMLostError(f"{self.name}: the reader answered {line[:80]!r} "
                                          f"to request {ident}")
                    del buf[:len(line) + 1]
                    if int(parts[1]) == ident:
                        want = int(parts[2])
                    else:
                        self._reader_skip = int(parts[2])
                        n = min(self._reader_skip, len(buf))
                        del buf[:n]
                        self._reader_skip -= n
                if want is not None and len(buf) >= want:
                    out = bytes(buf[:want])
                    del buf[:want]
                    return out
                self._check()
                if time.monotonic() - t0 >= STALL_AFTER:
                    self._stall_check()     # a guest that cannot run: said at once
                left = deadline - time.monotonic()
                if left <= 0:
                    raise VMLostError(f"{self.name}: the guest's reader (kph-reader) did not "
                                      f"answer in {timeout:.0f} s", self.console_tail())
                r, _, _ = select.select([sock], [], [], min(left, 0.05))
                if r:
                    chunk = sock.recv(1 << 20)
                    if not chunk:
                        raise VMLostError(f"{self.name}: the reader's port closed")
                    buf += chunk
        except OSError as exc:
            raise VMLostError(f"{self.name}: the reader's port broke: {exc}") from exc

    def read_pieces(self, guest_path: str, max_pieces: int, *,
                    timeout: float = C.RUN_TIMEOUT) -> tuple[list[bytes], bool] | None:
        """Up to ``max_pieces`` reads of a guest file whose every ``read()`` is one piece
        (``trace_pipe_raw``: a ring-buffer page a read), each kept, through kph-reader in
        one request (no process, raw bytes): the pieces and whether a read found nothing
        more (EAGAIN: the file is opened O_NONBLOCK, or its end). None when the machine
        has no reader (:attr:`has_reader`): the caller reads another way.

        :raise GuestAgentError: the open or a read failed (qemu-ga's words), nothing kept.
        """
        self._require_running()
        if not self.has_reader or "\n" in guest_path or not guest_path.startswith("/"):
            return None
        with self._reader_lock:
            body = self._ask_reader("p", timeout, [guest_path], count=max(1, max_pieces))
        head, _, rest = body.partition(b"\n")
        parts = head.split()
        if len(parts) != 4 or parts[0] not in (b"P", b"O") or \
                not all(x.isdigit() for x in parts[1:]):
            self._reader_open = False
            raise VMLostError(f"{self.name}: the reader's answer for {guest_path} is "
                              f"{head[:40]!r}")
        err, count, ended = int(parts[1]), int(parts[2]), parts[3] == b"1"
        pieces, at = [], 0
        for _ in range(count):
            nl = rest.find(b"\n", at)
            size = int(rest[at:nl]) if nl > at and rest[at:nl].isdigit() else -1
            if size < 0 or nl + 1 + size > len(rest):
                self._reader_open = False
                raise VMLostError(f"{self.name}: the reader's pieces of {guest_path} are "
                                  "cut short")
            pieces.append(rest[nl + 1:nl + 1 + size])
            at = nl + 1 + size
        if parts[0] == b"O":
            raise GuestAgentError(f"guest-file-open: failed to open file '{guest_path}' "
                                  f"(mode: 'r'): {os.strerror(err)}", "GenericError")
        if err:
            raise GuestAgentError(f"guest-file-read: failed to read file: {os.strerror(err)}",
                                  "GenericError")
        return pieces, ended

    def reader_writes(self, ops: Sequence[Sequence[str]], *,
                      timeout: float = C.RUN_TIMEOUT) -> str | None:
        """kph-reader's ``w`` request: ``ops`` (each a list of fields: ``P``, ``L`` or
        ``C`` and their arguments, probes/progs/reader.c) carried out in the guest in
        order, by plain syscalls in one request, no process; the text they print. None
        when the machine has no reader (:attr:`has_reader`) or a field cannot be sent (a
        newline, a NUL or the 0x1f that separates the fields, or an op longer than
        :data:`READER_OP_MAX`): the caller writes another way."""
        self._require_running()
        lines = ["\x1f".join(op) for op in ops]
        if not self.has_reader or not lines or any(
                len(ln.encode()) > READER_OP_MAX or "\n" in ln or "\0" in ln
                or any("\x1f" in f for f in op) for ln, op in zip(lines, ops)):
            return None
        with self._reader_lock:
            return self._ask_reader("w", timeout, lines).decode("utf-8", "replace")

    def _reader_files(self, paths: list[str], timeout: float) -> list[bytes | GuestAgentError]:
        """:meth:`pull_many` through kph-reader: one request, each file's bytes or the
        error qemu-ga would have answered (its words: qga/commands-posix.c)."""
        with self._reader_lock:
            body = self._ask_reader("f", timeout, paths)
        out: list[bytes | GuestAgentError] = []
        at = 0
        for path in paths:
            nl = body.find(b"\n", at)
            kind, err, size = body[at:nl].split() if nl >= 0 else (b"?", b"0", b"0")
            at = nl + 1
            if kind == b"D":
                out.append(body[at:at + int(size)])
                at += int(size)
            elif kind == b"O":
                out.append(GuestAgentError(f"guest-file-open: failed to open file '{path}' "
                                           f"(mode: 'r'): {os.strerror(int(err))}",
                                           "GenericError"))
            elif kind == b"R":
                out.append(GuestAgentError(f"guest-file-read: failed to read file: "
                                           f"{os.strerror(int(err))}", "GenericError"))
            else:
                self._reader_open = False
                raise VMLostError(f"{self.name}: the reader's answer for {path} is "
                                  f"{body[at:at + 40]!r}")
        return out

    def push(self, local: str | os.PathLike[str], guest_path: str, *, mode: int | None = None,
             timeout: float = C.RUN_TIMEOUT) -> None:
        """Copy a host file into the guest (``mode`` as for chmod)."""
        agent = self._require_running()
        data = Path(local).read_bytes()
        agent.write_file(guest_path, data, timeout=timeout)
        if mode is not None:
            self.run(f"chmod {mode:o} {shlex.quote(guest_path)}", timeout=timeout, check=True)

    def write_file(self, guest_path: str, data: bytes, *, timeout: float = C.RUN_TIMEOUT) -> None:
        """Write ``data`` to a guest file through the agent itself (no shell is spawned,
        so the only process touching the file is qemu-ga)."""
        self._require_running().write_file(guest_path, data, timeout=timeout)

    def write_files(self, items: list[tuple[str, bytes]], *,
                    timeout: float = C.RUN_TIMEOUT) -> None:
        """Write several guest files through the agent, in ``items``' order, in two pipelined
        waves of the agent (each file opened before the first write:
        ``GuestAgent.write_files``; a wave is one round trip per 4,000 bytes of requests)."""
        self._require_running().write_files(items, timeout=timeout)

    def pull(self, guest_path: str, *, timeout: float = C.RUN_TIMEOUT) -> bytes:
        """Read a whole guest file (:meth:`pull_many`).

        :raise GuestAgentError: it cannot be opened or read."""
        (data,) = self.pull_many([guest_path], timeout=timeout)
        if isinstance(data, GuestAgentError):
            raise data
        return data

    def pull_many(self, guest_paths: list[str], *,
                  timeout: float = C.RUN_TIMEOUT) -> list[bytes | GuestAgentError]:
        """Read several whole guest files; each item is the file's bytes or the
        :class:`GuestAgentError` of its open or read (returned, so a file the kernel may
        lack does not cost the others). Through kph-reader in one request when the
        machine has it (:attr:`has_reader`; each file read with plain syscalls, opened
        O_NONBLOCK as qemu-ga opens it, its error in qemu-ga's words), else in three
        pipelined waves of the agent (open, read, close: each request ~0.5 ms of the
        guest's vCPU under TCG)."""
        agent = self._require_running()
        paths = list(guest_paths)
        if paths and self.has_reader and all(p.startswith("/") and "\n" not in p
                                             and len(p) < 4000 for p in paths):
            return self._reader_files(paths, timeout)
        return agent.read_files(paths, timeout=timeout)

    def qmp(self, cmd: str, args: dict[str, Any] | None = None, *,
            timeout: float = C.QMP_TIMEOUT) -> Any:
        """Execute one QMP command and return its result."""
        if self._loop is None or self._qmp is None:
            raise StateError(f"{self.name} has no QMP connection", self.state, VmState.RUNNING)
        try:
            return self._loop.call(self._qmp.execute(cmd, args), timeout)
        except TimeoutError as exc:
            self._check()
            raise VMLostError(f"QMP {cmd} did not answer in {timeout} s",
                              self.console_tail()) from exc
        except Exception as exc:  # qemu.qmp's own errors stop at this boundary
            from qemu.qmp import ExecuteError

            if isinstance(exc, ExecuteError):
                raise VMError(f"QMP {cmd}: {exc}", self.console_tail()) from exc
            raise VMLostError(f"QMP {cmd} failed: {exc}", self.console_tail()) from exc

    def gdbstub(self, *, resume: bool = True) -> Any:
        """The machine's one GDB/MI session (``harness.gdbstub.GdbStub``), attached on first use.

        Attaching pauses the guest; it is resumed unless ``resume`` is False. The stub is
        closed (gdb ended by its pid) before QEMU when the machine closes.
        """
        if self._stub is None or self._stub.proc.poll() is not None:
            # A panicked guest is paused by QEMU (-action panic=pause): exactly when its
            # registers matter. Only a dead QEMU has no stub.
            if self.proc is None or self.proc.poll() is not None or self.rundir is None:
                raise StateError(f"{self.name} has no QEMU process", self.state, VmState.RUNNING)
            early, self._early_gdb = self._early_gdb, None
            if early is not None and early.poll() is not None:     # it died: a new one
                _close_pipes(early)
                early = None
            self._stub = attach(self, resume=resume and self.state is VmState.RUNNING,
                                proc=early)
        return self._stub

    @property
    def host(self) -> Any:
        """Host-side kprobes on this machine: the engine named by ``host_kind``
        (``harness.engines.gdbstub_engine.HostEngine`` for "gdbstub"), started on first use."""
        if self._host is None or self._host.closed:
            if self.host_kind not in HOST_ENGINES and self.host_kind in ENGINE_MODULES:
                import importlib

                importlib.import_module(ENGINE_MODULES[self.host_kind])
            factory = HOST_ENGINES.get(self.host_kind)
            if factory is None:
                raise SetupError(f"no host-side engine {self.host_kind!r}",
                                 f"use one of {', '.join(sorted(HOST_ENGINES)) or 'gdbstub'}")
            self._require_running()
            self._host = factory(self)
        return self._host

    def add_stop_holder(self, holder: StopHolder) -> None:
        """Register something that may hold the guest stopped (a host-side engine); the
        stall check asks it before concluding that the guest is stuck."""
        self._stop_holders.append(holder)

    def remove_stop_holder(self, holder: StopHolder) -> None:
        if holder in self._stop_holders:
            self._stop_holders.remove(holder)

    def _facts(self) -> F.KernelFacts:
        if self.facts is None:
            raise StateError(f"{self.name} has no kernel facts yet; Machine.boot() harvests "
                             "them before it returns", self.state, VmState.RUNNING)
        return self.facts

    @property
    def symbols(self) -> Any:
        """The kernel's ``SymbolTable``: from ``vmlinux`` if given, else the kernel facts'
        kallsyms (``vm.facts``)."""
        if self._symbols is None:
            if self.vmlinux is not None:
                self._symbols = SymbolTable.from_vmlinux(self.vmlinux)
            else:
                self._symbols = self._facts().symbols
        return self._symbols

    @property
    def blacklist(self) -> Any:
        """The guest's kprobe blacklist, from the kernel facts."""
        return self._facts().blacklist

    @property
    def btf(self) -> Any:
        """The kernel's BTF, from the kernel facts."""
        return self._facts().btf

    def refresh_module_symbols(self) -> list[str]:
        """Merge the symbols and section bases of the guest's loaded modules; return their names.

        ``/proc/modules`` (names, sizes, load addresses) is read first: when it is what it
        was at this table's last refresh, the merge is already done. Otherwise each
        module's section bases and build ID are read (``/sys/module/NAME/sections``,
        ``notes/.note.gnu.build-id``: a few ms each); a module seen before with the same
        size, address, sections and build ID is the same ELF laid out the same way
        (kernel/module/main.c: layout_sections() is a function of the ELF), so a set of
        modules seen before has the kallsyms lines read then. Only a new set costs a read
        of the modules' kallsyms lines: the kernel walks every vmlinux symbol first, ~4 to 10 s
        under TCG (``kph_kprobes.ko`` loaded and unloaded around each module-side run
        comes back where it was, and costs that once)."""
        table = self.symbols
        mods = self.pull("/proc/modules", timeout=30).decode("utf-8", "replace")
        listed = {p[0]: (p[1], p[5]) for p in (ln.split() for ln in mods.splitlines())
                  if len(p) > 5}
        known = table.modules_key
        # kptr_restrict hides the addresses (0x0000000000000000): nothing can be keyed then
        addrs_known = all(int(a, 16) for _, a in listed.values())
        if (isinstance(known, tuple) and len(known) == 3 and known[0] == "guest modules"
                and known[1] == mods and addrs_known):
            return list(known[2])
        # the files named by a glob (shell builtins: no process), then read as files
        # (Machine.pull_many: kph-reader's one request); a `cat` of each in the script
        # was a process each, ~0.5 s a refresh under TCG for the image's ~150 sections
        names = self.run("cd /sys/module && for f in */sections/.* */notes/.note.gnu.build-id; "
                         "do [ -f \"$f\" ] && echo \"$f\"; done; true",
                         timeout=60).stdout.split()
        got: list[bytes | GuestAgentError] = []
        for k in range(0, len(names), 256):     # the agent's open files are limited
            got += self.pull_many([f"/sys/module/{n}" for n in names[k:k + 256]], timeout=60)
        sections: dict[str, dict[str, int]] = {}
        build_ids: dict[str, str] = {}
        for path, data in zip(names, got):
            if isinstance(data, GuestAgentError):
                continue                # gone meanwhile, as the script's `cat` was silent
            mod, _, name = path.partition("/sections/")
            value = data.decode("ascii", "replace").strip()
            if name and value.startswith("0x"):
                sections.setdefault(mod, {})[name] = int(value, 16)
            elif path.endswith("/notes/.note.gnu.build-id") and data:
                build_ids[path.split("/", 1)[0]] = data.hex()
        # the state: every module as it is laid out. The lines of what is not a module
        # ([__builtin__ftrace] trampolines, [bpf] programs, [__builtin__kprobes] slot
        # pages) come and go with ftrace ops, programs and probes, not with the modules:
        # what is remembered for a state (here and kept) leaves them out (a copy kept
        # while a probe's ftrace trampoline existed named an address no trampoline held
        # in a later run). Read with the modules' lines they are as the guest listed them
        # then, and a table without them names such an address by nothing (a difference,
        # never a false name).
        state = frozenset((mod, size, addr, build_ids.get(mod),
                           tuple(sorted(sections.get(mod, {}).items())))
                          for mod, (size, addr) in listed.items())
        seen = self._module_kallsyms
        if addrs_known and state not in seen:
            kept = self.kept("module-kallsyms", sorted(state))
            if kept is not None:
                try:
                    seen[state] = {m: t for m, t in json.loads(kept).items() if m in listed}
                except (ValueError, AttributeError):
                    pass                # a torn copy: read below
        if addrs_known and state in seen:
            per = seen[state]
        else:
            text = self.run("grep '\\[' /proc/kallsyms || true", check=True,
                            timeout=60).stdout
            lines: dict[str, list[str]] = {}
            for line in text.splitlines():
                if line.endswith("]") and "[" in line:
                    lines.setdefault(line.rsplit("[", 1)[1].rstrip("]"), []).append(line)
            per = {mod: "\n".join(ls) for mod, ls in lines.items()}
            if addrs_known:
                seen[state] = {m: t for m, t in per.items() if m in listed}
                self.keep("module-kallsyms", sorted(state), json.dumps(seen[state]).encode())
        # a module no longer listed, or a trampoline no longer read, leaves the table too
        gone = {m: "" for m in table.modules() if m not in listed and m not in per}
        table.set_modules({**gone, **per}, sections,
                          key=("guest modules", mods, tuple(sorted(per))))
        return sorted(per)

    def _kept_path(self, kind: str, state: Any) -> Path | None:
        """``<snapshot>/<kind>/<digest of state>``, or None without a snapshot."""
        snap = self.snapshot
        if snap is None:
            return None
        digest = hashlib.sha256(repr(state).encode()).hexdigest()[:24]
        return Path(snap.dir) / kind / digest

    def kept(self, kind: str, state: Any) -> bytes | None:
        """What :meth:`keep` kept of ``kind`` for ``state``, or None. A text the guest
        gives in a state (the modules' kallsyms lines for their layout, a tracefs file for
        the loaded modules) is the same for every machine restored from this machine's
        snapshot, the same kernel: read once per snapshot and state, not once per process.
        Kept in the snapshot's directory, and removed with it. ``state`` must be ordered
        (a sorted tuple, not a set): its ``repr`` is hashed."""
        path = self._kept_path(kind, state)
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError:
            return None

    def keep(self, kind: str, state: Any, data: bytes) -> None:
        """Keep ``data`` for :meth:`kept` (whole or not at all; a cache that cannot be
        written is only not kept)."""
        path = self._kept_path(kind, state)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            F.write_whole(path, data)
        except OSError as exc:
            log.debug("not kept: %s: %s", path, exc)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def gdb_socket(self) -> Path:
        if self.rundir is None:
            raise StateError(f"{self.name} is not started", self.state, VmState.RUNNING)
        return self.rundir / "gdb.sock"

    def __repr__(self) -> str:
        return f"<Machine {self.name} {self.state.value} pid={self.pid}>"


def abort_all() -> None:
    """``abort()`` every live machine of this process (the CLI's SIGINT/SIGTERM handler)."""
    for m in list(_live):
        m.abort()


@atexit.register
def _close_all() -> None:
    for m in list(_live):
        try:
            m.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
