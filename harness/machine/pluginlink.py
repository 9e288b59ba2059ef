"""The kph QEMU plugin (``probes/plugin/``) from the harness side: build, load, talk.

- :func:`build_plugin` compiles the plugin on demand into ``$KPH_CACHE/plugin/<key>/``,
  the key being a hash of its sources, the compiler and flags, and the QEMU identity it is
  loaded into (``harness.machine.qemu.qemu_identity``). A failed build is one ``SetupError``
  naming the fix.
- :func:`qemu_args` is what ``harness.vmctl`` adds to QEMU's command line:
  ``-plugin PATH,ctl=FD``, FD being a listening UNIX socket the harness made in the
  machine's private 0700 run directory (never TCP), inherited by QEMU.
- :class:`PluginLink` is one session on that socket: request/reply commands (the
  ``CMD_*`` of kph_proto.h), and the record ring, a memfd shared with the plugin (sent
  over the socket with SCM_RIGHTS), one single-producer ring per vCPU, drained by a
  thread while the guest runs. When the link closes the plugin goes inert.

Wire format: a request is ``u32 type, u32 len, payload``; a reply ``u32 status (0 or an
errno), u32 len, payload``; one request at a time. The kprobe semantics live in
``harness.engines.plugin_engine``; this module knows nothing of them.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from .. import constants as C
from ..errors import EngineReadError, HarnessError, SetupError, VMLostError
from .qemu import qemu_identity

log = logging.getLogger(__name__)

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "probes" / "plugin"
#: what is compiled into the plugin; SOURCES is what its cache key hashes
C_SOURCES = ("kph_plugin.c", "returns.c", "roundtrip.c", "control.c", "fetch.c")
SOURCES = C_SOURCES + ("kph_plugin.h", "fetch.h", "kph_proto.h", "qemu-plugin.h", "waiter.c")
CFLAGS = ("-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall",
          "-Wno-unused-parameter")
SO_NAME = "kph_plugin.so"
#: the host-side waiter (probes/plugin/waiter.c), built beside the plugin, loaded by ctypes
WAITER_SO = "kph_waiter.so"
#: How long a channel's thread polls for the next event before it sleeps (ns): the
#: handler round trips of a dense workload then start without a thread wake-up.
CHANNEL_SPIN_NS = 200_000
#: How long a vCPU polls its channel for a handler's answer before it sleeps (us), where a
#: core is left over for the channel's thread (as long as that thread polls for events:
#: a vCPU asleep when the answer comes is woken by the harness's send(), which then often
#: waits for a core); else the plugin's own :data:`ANSWER_SPIN_US`.
ANSWER_SPIN_DENSE_US = CHANNEL_SPIN_NS // 1000

# The wire protocol: probes/plugin/kph_proto.h is the one definition; these spell the
# same names and values (tests/unit/test_plugin_build.py compiles a program against the
# header and compares every constant, offset and size with them).
PROTO = 2
#: limits the plugin bounds every request by (CMD_ADD past one: ENOSPC with a FULL_* reason)
MAX_VCPUS, MAX_PROBES, MAX_PER_SITE, MAX_PROG, MAX_MAXACTIVE = 64, 8192, 64, 1024, 4096
#: a return probe's entry-saved ``$argN`` (CMD_ADD past it: EINVAL): the kernel's
#: MAX_TRACE_ARGS, which the grammar bounds a line's arguments by already
MAX_EDATA = 128
REC_MAX = 64 * 1024
#: CMD_CHANNEL's default answer_spin_us
ANSWER_SPIN_US = 40
CMD_HELLO, CMD_RING, CMD_CONFIG, CMD_ADD, CMD_REMOVE, CMD_ENABLE = 1, 2, 3, 4, 5, 6
CMD_STATS, CMD_GSTATS, CMD_INVALIDATE, CMD_CHANNEL, CMD_ARRANGE = 7, 8, 9, 10, 11
#: tests only: the plugin's reads of a range fail although it maps (an unconfirmed fault)
CMD_FAILREAD = 12
#: the recording window, and the guest's own switch written at the same instant
CMD_WINDOW = 13
MAX_WIN_WRITES = 4
#: the words the last opening and closing of the window read at their instant
CMD_MARKS = 14
MAX_WIN_READS = 256
#: CMD_MARKS: per direction, read / still to be applied / never asked / a read failed
MARKS_READ, MARKS_PENDING, MARKS_NONE, MARKS_FAILED = 0, 1, 2, 3
#: CMD_WINDOW's reply (kph_proto.h says what each means)
WIN_SETTLED, WIN_IDLE, WIN_UNSETTLED, WIN_PENDING, WIN_FAILED = 0, 1, 2, 3, 4
WIN_TEXT = {WIN_SETTLED: "settled", WIN_IDLE: "idle", WIN_UNSETTLED: "unsettled",
            WIN_PENDING: "pending", WIN_FAILED: "failed"}
#: why CMD_ADD answered ENOSPC (its reply's u32)
FULL_SITE, FULL_PROBES, FULL_TABLE = 1, 2, 3
#: CMD_CONFIG flags: the kernel's 64-bit uretprobe trampoline pushes rax, rcx and r11
#: (6.11+; ``harness.kernel.rules.KernelRules.uretprobe_syscall``)
CFG_URET_SYSCALL = 1
#: CMD_GSTATS: how many u64 counters
NGSTATS = 17
PK_SPEC_P, PK_SPEC_R, PK_KPROBE, PK_KRET = 1, 2, 3, 4
#: returns.c: at uprobe_copy_process(), a fork child gets copies of the user return instances
PK_FORK = 5
#: returns.c: at rethook_flush_task(), a dead task's kernel return instances are recycled
PK_FLUSH = 6
#: returns.c: at uprobe_free_utask(), a task's user return instances are freed (exit, exec)
PK_UFREE = 7
EV_PRE, EV_POST, EV_FAULT, EV_RET_ENTRY, EV_RET, EV_MISS = 1, 2, 3, 4, 5, 6
C_READ, C_WRITE, C_READREG, C_DONE = 1, 2, 3, 4
ACT_CONTINUE, ACT_SETPC, ACT_POST, ACT_DISCARD, ACT_HANDLED = 0, 1, 2, 3, 4
#: ``regs.read_sys()`` names, in the plugin's order (kph_plugin.c sys_names).
SYS_REGS = ("cr0", "cr2", "cr3", "cr4", "cr8", "efer", "fs_base", "gs_base", "k_gs_base")
#: kph_ev_hdr less its ids[4] (the 16 bytes at 240)
EV_HDR = struct.Struct("<IIIIQ21QQiI16sQQ")
EV_SIZE = 256
REC_HIT, REC_RET, REC_PAD, REC_ERROR = 1, 2, 3, 4
#: RF_UNCONFIRMED: a read of the hit's program failed where every page translates (the
#: plugin's failure, not a fault of the guest's: the hit is an engine error)
RF_TRUNC, RF_TASK, RF_PID, RF_COMM, RF_BADPROG, RF_UNCONFIRMED = 1, 2, 4, 8, 16, 32
#: the caller's context: its preempt_count() was read (RF_CTX), and what it held
RF_CTX, RF_SOFTIRQ, RF_HARDIRQ, RF_NMI = 64, 128, 256, 512
#: a kernel hit where ``nmi_uaccess_okay()`` is false: a plain user-half read is refused
RF_NOUACCESS = 1024
INVAL_DONE, INVAL_IDLE, INVAL_PENDING, INVAL_SKIPPED = 0, 1, 2, 3
INVAL_TEXT = {INVAL_DONE: "done", INVAL_IDLE: "all vCPUs idle", INVAL_PENDING: "pending",
              INVAL_SKIPPED: "skipped"}
ADD_ENABLED, ADD_NO_INVALIDATE, ADD_POST, ADD_ENTRY, ADD_EXT, ADD_FLUSH = 1, 2, 4, 8, 16, 32
ADD_FTRACE = 64
#: a return probe whose kernel counterpart hooks the return through the function graph
#: (7.3's fprobe exits: ``return_to_handler``), not rethook
ADD_FGRAPH = 128
#: an fprobe (ftrace_ops callback): its exit record carries the real return address even
#: when stacked on another return hook (fprobe_exit_handler(), fprobe_return())
ADD_FTRACE_OPS = 256
#: a Python return probe with no entry round trip (a uretprobe: no entry_handler)
ADD_NO_ENTRY_RT = 512
#: a kprobe of the guest's kind: missed while a guest kprobe handler runs on that CPU
#: (per-cpu ``current_kprobe``, ``kprobe_running()``)
ADD_KPROBE_RUNNING = 1024
ADD_EXT_SIZE = 64

RING_MAGIC = 0x4B504852
RING_CTL_OFF = 4096
RING_CTL_SIZE = 128
#: Bytes of ring per vCPU (a power of two), unless the machine says otherwise
#: (``Machine.plugin_ring_mib``, ``kph diff --host-buffer``): ~70,000 register-only
#: records (240 bytes each). A record the ring has no room for is dropped, and the run is
#: not compared: a hot probe's vCPU writes ~35 MB a second of them (100,000 ``vfs_read``
#: hits in 0.7 s, 2026-12-03, this machine), so the drain thread (every 2 ms) may fall
#: behind by ~0.5 s; it was 4 MiB, 0.12 s, and one run of that bench lost records so.
RING_SIZE = 16 << 20
#: kph_rec_hdr
REC_HDR = struct.Struct("<IHHIIQ21QQQQiI16s")
assert REC_HDR.size == 240
#: kph_rec_hdr without its registers (skipped: 21 numbers a record need not become):
#: what a register-only probe's hit is placed from (harness.backends.plugin), the
#: registers it reads taken as bytes at REGS_OFF. Its fields: size, type, vcpu, probe id,
#: nblocks, seq, task, func, ret_addr, pid, flags, comm (NUL-padded).
REC_LEAN = struct.Struct("<IHHIIQ168xQQQiI16s")
assert REC_LEAN.size == REC_HDR.size
REGS_OFF = 24
#: How often the drain thread empties the rings while the guest runs (seconds).
DRAIN_INTERVAL = 0.002
#: How much of a ring a drain copies before it gives that space back (bytes)
DRAIN_RELEASE = 256 << 10
REQUEST_TIMEOUT = 15.0


def _sources_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (PLUGIN_DIR / name).read_bytes())
    return h.hexdigest()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise SetupError("no C compiler to build the QEMU plugin",
                         "apt-get install gcc libc6-dev (./setup.sh installs them)")
    return cc


def plugin_key(qemu: Any) -> str:
    """Sources, compiler, flags and the QEMU identity the plugin is built for."""
    cc = _compiler()
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=20,
                             check=False).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"cannot run the C compiler {cc}: {exc}",
                         "apt-get install gcc libc6-dev") from exc
    blob = json.dumps({"sources": _sources_hash(), "cc": ver, "cflags": CFLAGS,
                       "qemu": qemu_identity(qemu)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: The plugin speaks QEMU's plugin API 7 (callbacks with user data, no plugin id), what
#: QEMU 11.1 offers (min = cur = 7 in 11.1.3); older QEMUs refuse to load it.
MIN_QEMU = (11, 1)


def build_plugin(qemu: Any) -> Path:
    """The plugin for ``qemu`` (a ``QemuBinary``), built now if not cached.

    :raise SetupError: QEMU too old, no compiler, or the build failed (the first error
        line is given).
    """
    if tuple(qemu.version[:2]) < MIN_QEMU:
        raise SetupError(f"the plugin engine needs QEMU >= {MIN_QEMU[0]}.{MIN_QEMU[1]} "
                         f"(plugin API 7); QEMU {qemu.version_str} is older",
                         "run `kph qemu provision` (or ./setup.sh), or use the gdbstub engine")
    key = plugin_key(qemu)
    dest = C.cache_dir() / "plugin" / key / SO_NAME
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # the waiter first: a plugin in the cache means both are there
    _compile(dest.with_name(WAITER_SO), [PLUGIN_DIR / "waiter.c"])
    _compile(dest, [PLUGIN_DIR / name for name in C_SOURCES])
    return dest


def _compile(dest: Path, sources: list[Path]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=dest.parent)
    os.close(fd)
    cmd = [_compiler(), *CFLAGS, "-I", str(PLUGIN_DIR), "-o", tmp, *map(str, sources)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            errors = [ln for ln in out.stderr.splitlines() if "error" in ln] or \
                out.stderr.strip().splitlines() or ["(no output)"]
            raise SetupError(f"building the QEMU plugin failed: {errors[0].strip()}",
                             "install gcc and libc6-dev (./setup.sh), or use the gdbstub "
                             "engine (host='gdbstub')")
        os.replace(tmp, dest)   # atomic: concurrent builders (xdist) agree on one file
        log.info("built %s", dest)
    except subprocess.TimeoutExpired as exc:
        raise SetupError("building the QEMU plugin timed out", "retry on a quieter machine") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def host_waiter(plugin: Path | None) -> Callable[[int, int], int] | None:
    """``kph_wait_readable(fd, spin_ns)`` of the waiter built beside ``plugin``, or None
    when it cannot be loaded (the channels then sleep in recv() at once)."""
    so = Path(plugin).with_name(WAITER_SO) if plugin is not None else None
    if so is None or not so.is_file():
        log.info("no spinning wait for handler events: %s is missing", so)
        return None
    try:
        fn = ctypes.CDLL(str(so)).kph_wait_readable    # CDLL: the GIL is released
    except (OSError, AttributeError) as exc:
        log.info("no spinning wait for handler events: %s", exc)
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int64), ctypes.c_int
    return fn


def qemu_args(plugin: Path, ctl_fd: int) -> list[str]:
    """The QEMU arguments that load the plugin, inert, with its control socket."""
    return ["-plugin", f"{str(plugin).replace(',', ',,')},ctl={ctl_fd}"]


class PluginError(HarnessError):
    """The plugin refused a command (``errno``, and what its reply said: ``data``) or its
    socket went away."""

    def __init__(self, msg: str, errno: int = 0, data: bytes = b"") -> None:
        super().__init__(msg)
        self.errno = errno
        self.data = data


class PluginRecord(NamedTuple):
    """One record from a vCPU's ring, undecoded past its header (a named tuple: a run
    decodes one per hit, and a frozen dataclass took 2 us of the 6 each cost)."""

    type: int
    vcpu: int
    probe_id: int
    nblocks: int
    seq: int
    regs: tuple[int, ...]
    task: int
    func: int
    ret_addr: int
    pid: int
    flags: int
    comm: bytes
    body: bytes


def lean(recs: Iterable[bytes]) -> list[tuple[tuple[Any, ...], bytes]]:
    """Records as (their :data:`REC_LEAN` fields, the record), in the order they
    happened (``seq``)."""
    out = [(_unpack_lean(r), r) for r in recs]
    out.sort(key=lean_seq)
    return out


def lean_seq(pair: tuple[tuple[Any, ...], bytes]) -> int:
    """A :func:`lean` record's ``seq``."""
    return pair[0][5]


def decode(rec: bytes) -> PluginRecord:
    f = _unpack_hdr(rec)
    return _new_record(PluginRecord, (f[1], f[2], f[3], f[4], f[5], f[6:27], f[27], f[28],
                                      f[29], f[30], f[31], f[32].split(b"\0", 1)[0],
                                      rec[_HDR_SIZE:f[0]]))


_unpack_hdr, _HDR_SIZE, _new_record = REC_HDR.unpack_from, REC_HDR.size, tuple.__new__
_unpack_lean = REC_LEAN.unpack_from


class _Ring:
    """The shared record area: per-vCPU control blocks and data, in one memfd."""

    def __init__(self, nvcpus: int, size: int = RING_SIZE) -> None:
        self.n, self.size = nvcpus, size
        ctl_pages = -(-nvcpus * RING_CTL_SIZE // 4096)
        self.data_off = RING_CTL_OFF + 4096 * ctl_pages
        self.total = self.data_off + size * nvcpus
        self.fd = os.memfd_create("kph-ring", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.total)
        self.map = mmap.mmap(self.fd, self.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        struct.pack_into("<IIIIQQ", self.map, 0, RING_MAGIC, PROTO, nvcpus, 0, size, self.data_off)
        self._heads = [ctypes.c_uint64.from_buffer(self.map, self._ctl(i)) for i in range(nvcpus)]
        self._dropped = [ctypes.c_uint64.from_buffer(self.map, self._ctl(i) + 8) for i in range(nvcpus)]
        self._tails = [ctypes.c_uint64.from_buffer(self.map, self._ctl(i) + 64) for i in range(nvcpus)]

    def _ctl(self, i: int) -> int:
        return RING_CTL_OFF + i * RING_CTL_SIZE

    def dropped(self) -> int:
        return sum(d.value for d in self._dropped)

    def drain(self, out: list[bytes]) -> int:
        """Move every complete record into ``out``; return how many. The space is given
        back to the producer as the copying goes (every :data:`DRAIN_RELEASE` bytes),
        not once at the end: a full ring's drain (16 MiB, ~70,000 records, tens of ms in
        Python) would otherwise leave it full, and drop what comes meanwhile, for as long."""
        got = 0
        for i in range(self.n):
            head = self._heads[i].value          # an aligned 8-byte load (x86: atomic)
            tail = self._tails[i].value
            base = self.data_off + i * self.size
            release = tail + DRAIN_RELEASE
            while tail < head:
                pos = tail & (self.size - 1)
                size, rtype = struct.unpack_from("<IH", self.map, base + pos)
                if size < 8 or size & 7 or pos + size > self.size:
                    raise PluginError(f"corrupt record in vCPU {i}'s ring at {tail}")
                if rtype != REC_PAD:
                    out.append(self.map[base + pos:base + pos + size])   # a copy
                    got += 1
                tail += size
                if tail >= release:
                    self._tails[i].value = tail  # releases the space copied to the producer
                    release = tail + DRAIN_RELEASE
            self._tails[i].value = tail
        return got

    def close(self) -> None:
        # ctypes views pin the buffer: drop them before unmapping.
        self._heads = self._dropped = self._tails = []
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


class PluginLink:
    """One harness session with the plugin of one Machine (see the module docstring)."""

    def __init__(self, sock_path: Path, *, ring_size: int = RING_SIZE,
                 timeout: float = REQUEST_TIMEOUT) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(sock_path))
        except OSError as exc:
            self.sock.close()
            raise VMLostError(f"cannot connect to the QEMU plugin at {sock_path}: {exc}") from exc
        proto, self.nvcpus, self.api, regs_ready = struct.unpack("<4I", self.request(CMD_HELLO))
        if proto != PROTO:
            raise PluginError(f"plugin protocol {proto}, harness {PROTO}: rebuild the plugin")
        self.ring = _Ring(self.nvcpus, ring_size)
        self.request(CMD_RING, struct.pack("<QI", ring_size, self.nvcpus), fds=[self.ring.fd])
        self.records: list[bytes] = []
        self._rec_lock = threading.Lock()
        self._stop = threading.Event()
        self._drainer = threading.Thread(target=self._drain_loop, name="kph-plugin-ring",
                                         daemon=True)
        self.closed = False
        self._drainer.start()

    # -- requests -------------------------------------------------------------------------
    def request(self, cmd: int, payload: bytes = b"", *, fds: Sequence[int] = ()) -> bytes:
        """Send one command; return the reply's payload.

        :raise PluginError: the plugin answered with an errno.
        :raise VMLostError: the socket closed or timed out (QEMU gone or stuck).
        """
        with self._lock:
            try:
                head = struct.pack("<II", cmd, len(payload))
                if fds:
                    socket.send_fds(self.sock, [head], list(fds))
                    self.sock.sendall(payload)
                else:
                    self.sock.sendall(head + payload)
                status, n = struct.unpack("<II", self._recv(8))
                data = self._recv(n) if n else b""
            except (OSError, struct.error) as exc:
                raise VMLostError(f"the QEMU plugin did not answer command {cmd}: {exc}") from exc
        if status:
            raise PluginError(f"the QEMU plugin refused command {cmd}: {os.strerror(status)}",
                              status, data)
        return data

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise OSError("connection closed")
            buf += chunk
        return bytes(buf)

    # -- records --------------------------------------------------------------------------
    def _drain_loop(self) -> None:
        while not self._stop.wait(DRAIN_INTERVAL):
            self.drain()

    def drain(self) -> None:
        """Move what the rings hold into ``records`` now."""
        with self._rec_lock:
            if not self.closed:
                self.ring.drain(self.records)

    def take_records(self) -> list[bytes]:
        """Every record drained so far (the caller owns them), in no particular order."""
        self.drain()
        with self._rec_lock:
            out, self.records = self.records, []
        return out

    @property
    def dropped(self) -> int:
        """Records the plugin dropped because a ring was full."""
        return self.ring.dropped()

    def close(self) -> None:
        """End the session: the plugin goes inert (no new hits)."""
        if getattr(self, "closed", True):
            return
        self._stop.set()
        self._drainer.join(2)
        self.drain()
        self.closed = True
        try:
            self.sock.close()
        finally:
            with self._rec_lock:
                self.ring.close()


class Event(NamedTuple):
    """A vCPU waiting in a handler round trip (``EV_*``): where, its registers, current
    (a named tuple: one per hit, and a frozen dataclass took ~2 us to make)."""

    type: int
    vcpu: int
    extra: int
    addr: int
    regs: tuple[int, ...]
    task: int
    pid: int
    tflags: int
    comm: bytes
    a: int
    b: int
    ids: tuple[int, ...]


#: ``C_DONE`` with no register written, for each action (one per hit of a plain pre_handler)
_DONE_PLAIN = {a: struct.pack("<IIIIQ21Q", C_DONE, 16 + 8 * 21, a, 0, 0, *[0] * 21)
               for a in range(8)}


class Channel:
    """One vCPU's handler channel: a socketpair whose other end the plugin holds.

    The vCPU thread writes an event and blocks; :meth:`serve` hands it to ``dispatch``,
    which may call :meth:`read`, :meth:`write` and :meth:`read_reg` on that vCPU (they
    run in its context, with its address space) and returns what to do. The other vCPUs
    are not stopped. Closing the channel lets a blocked vCPU go on (as if every handler
    returned 0).
    """

    def __init__(self, link: "PluginLink", vcpu: int, *,
                 waiter: Callable[[int, int], int] | None = None,
                 spin_ns: int = CHANNEL_SPIN_NS, answer_spin_us: int = ANSWER_SPIN_US) -> None:
        """``waiter`` (:func:`host_waiter`): poll for the next event ``spin_ns`` before
        sleeping, without the GIL; None: sleep in recv() at once. ``answer_spin_us``: how
        long the vCPU polls for each answer before it sleeps."""
        self.vcpu = vcpu
        self._waiter, self._spin_ns = waiter, spin_ns
        self.answer_spin_us = answer_spin_us
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            link.request(CMD_CHANNEL, struct.pack("<II", vcpu, answer_spin_us),
                         fds=[theirs.fileno()])
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self._buf = bytearray(EV_SIZE)
        self.closed = False

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def next_event(self) -> Event | None:
        """The next event, or None when the channel closed."""
        buf = self._buf
        try:
            if self._waiter is not None:
                self._waiter(self.sock.fileno(), self._spin_ns)
            got = self.sock.recv_into(buf, EV_SIZE, socket.MSG_WAITALL)
        except OSError:
            return None
        if got < EV_SIZE:
            return None
        (etype, vcpu, n, extra, addr, *rest) = EV_HDR.unpack_from(buf)
        regs = tuple(rest[:21])
        task, pid, tflags, comm, a, b = rest[21:]
        ids = struct.unpack_from(f"<{min(n, 4)}I", buf, 240)   # up to 4 in the header
        if n > 4:
            try:
                ids += struct.unpack(f"<{n - 4}I", self._recv(4 * (n - 4)))
            except (EOFError, OSError):
                return None
        return Event(etype, vcpu, extra, addr, regs, task, pid, tflags,
                     comm.split(b"\0", 1)[0], a, b, ids)

    def read(self, addr: int, n: int) -> bytes | None:
        """``n`` bytes of guest virtual memory in this vCPU's address space, or None: a
        fault the plugin confirmed (a page does not translate), or the plugin closed the
        channel (the session is ending).

        :raise EngineReadError: the read failed where the memory maps (``EIO``: the
            plugin's failure, never the guest's fault).
        """
        try:
            self.sock.sendall(struct.pack("<IIQI", C_READ, 12, addr & (1 << 64) - 1, n))
            status, length = struct.unpack("<II", self._recv(8))
            data = self._recv(length) if length else b""
        except (EOFError, OSError):
            return None
        if status == errno.EIO:
            raise EngineReadError(f"the plugin's read of {n} byte(s) at {addr:#x} failed "
                                  "where the guest's memory maps (not a fault the guest "
                                  "takes)", addr, n)
        return None if status else data

    def write(self, addr: int, data: bytes) -> bool:
        self.sock.sendall(struct.pack("<IIQ", C_WRITE, 8 + len(data), addr & (1 << 64) - 1) + data)
        status, _ = struct.unpack("<II", self._recv(8))
        return status == 0

    def read_reg(self, name: str) -> int:
        self.sock.sendall(struct.pack("<III", C_READREG, 4, SYS_REGS.index(name)))
        status, _, value = struct.unpack("<IIQ", self._recv(16))
        if status:
            raise PluginError(f"the plugin cannot read {name}", status)
        return value

    def done(self, action: int, writes: dict[int, int]) -> None:
        """Let the vCPU go: ``writes`` maps pt_regs indexes to new values."""
        if not writes:
            self.sock.sendall(_DONE_PLAIN[action] if action in _DONE_PLAIN else
                              struct.pack("<IIIIQ21Q", C_DONE, 16 + 8 * 21, action, 0, 0,
                                          *[0] * 21))
            return
        mask, vals = 0, [0] * 21
        for i, v in writes.items():
            mask |= 1 << i
            vals[i] = v & (1 << 64) - 1
        self.sock.sendall(struct.pack("<IIIIQ21Q", C_DONE, 16 + 8 * 21, action, 0, mask, *vals))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise VMLostError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
