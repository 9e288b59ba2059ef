"""Ready snapshots: a guest booted once until its agent answers, restored in a fraction
of a second by every later ``Machine.boot()``.

What is saved, and why this shape. A cold TCG boot of the default image costs ~2.5-3.5 s;
most tests need a fresh guest, not a new boot. The obvious shape, an internal qcow2
snapshot (``savevm``) with one copy-on-write qcow2 overlay per machine, does not work:
internal snapshots live in the snapshot table of the image that holds them, and an
overlay with that image as its backing file has an empty table, so ``-loadvm`` fails
("Snapshot 'kph-ready' does not exist in one or more devices"; measured with QEMU
11.1.3). A full per-machine copy of the qcow2 works but costs ~95 MB of writes each.

So the snapshot is split the way QEMU's VM templating splits it:

``ram``
    The guest's RAM as a plain file. The machine that builds the snapshot runs with it
    as its memory backend (``memory-backend-file,share=on``), so the guest's memory *is*
    that file. Restored machines map it ``share=off,readonly=on,rom=off``: a private
    copy-on-write mapping (MAP_PRIVATE) of a file opened read-only. Every machine gets
    its own overlay at page granularity from the host kernel; pages it never writes are
    shared through the page cache; nothing a machine does can reach the file.
``state``
    The device and CPU state, a migration stream written with ``migrate file:`` and the
    ``x-ignore-shared`` capability (RAM in a shared file backend is left out): ~0.4 MB.
    A restore is ``-incoming defer`` then ``migrate-incoming file:``.
``snapshot.json``
    The key the snapshot was built for, sizes and hashes.
``module-kallsyms/``, ``tracefs/``
    Added by the machines restored from it (``harness.vmctl.Machine.keep``): texts the
    guest gives in a state, the same in every machine of the snapshot. The modules'
    kallsyms lines for each layout of the loaded modules
    (``harness.vmctl.Machine.refresh_module_symbols``), so the kernel's walk of every
    symbol to list them (4 to 10 s under TCG) is made once per state and snapshot, not
    once per process; tracefs's lists of ftrace locations for each set of loaded modules,
    and the built-in events ``available_events`` leaves out
    (``harness.backends.tracelayer``: 0.25-0.3 s a ``kph`` command). Removed with the
    snapshot.

Key and invalidation. Snapshots of an image live in ``<image dir>/snapshots/<slot>/``,
where the slot is a hash of the machine options (kernel and initrd paths, append line,
memory, vCPUs, accelerator, the device arguments). The key adds the sha256 of the
kernel and the initrd and the identity of the QEMU binary (version, and path, size and
mtime of each executable file QEMU is started through). A key that differs from the
slot's ``snapshot.json`` in any field makes the snapshot stale: it is rebuilt, never
used, and the reason names the fields. Rebuilding an image removes its directory, and
with it its snapshots.

Concurrency. Under ``pytest -n N`` several workers may want the same snapshot on first
use: building takes an exclusive ``flock`` on ``snapshots/.lock`` (with a timeout) and
checks again once it holds it; the result is renamed into place only when complete.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from .. import constants as C
from ..errors import HarnessError, SetupError, VMError
from ..procs import lock_file
from .image.store import sha256_file
from .qemu import QemuBinary, qemu_identity

log = logging.getLogger(__name__)


class Snapshottable(Protocol):
    """What a snapshot needs of a machine (``harness.vmctl.Machine`` is one): its
    configuration, which keys the snapshot, and a twin of it booted with its RAM in a file.
    The machine layer's own modules meet through this, so the snapshot store knows
    nothing of ``Machine`` and ``Machine`` imports the store."""

    kernel: Path
    initrd: Path | None
    append: str
    smp: int
    accel: str
    memory: str
    name: str
    image: Any
    qemu: QemuBinary
    extra_args: Sequence[str]

    def machine_args(self) -> list[str]: ...

    def twin(self, *, ram_file: Path, name: str) -> Any:
        """A machine of this configuration, not started, whose RAM is ``ram_file``."""

#: Bump when what a snapshot holds, or how it is restored, changes.
FORMAT = 1
#: ``migrate file:`` and ``memory-backend-file,readonly=on,rom=off`` are both 8.2.
MIN_QEMU = (8, 2)
META = "snapshot.json"

_said: set[str] = set()


@dataclass(frozen=True)
class Snapshot:
    """A complete snapshot on disk (see the module docstring for its files)."""

    dir: Path
    meta: dict[str, Any]

    @property
    def ram(self) -> Path:
        return self.dir / "ram"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def key(self) -> dict[str, Any]:
        return dict(self.meta["key"])


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size, mtime: cache key only
    return sha256_file(Path(path))


def file_sha256(path: Path) -> str:
    """sha256 of a file, computed once per process for an unchanged (size, mtime)."""
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def snapshot_key(m: Snapshottable) -> dict[str, Any]:
    """Everything a saved guest depends on. ``options`` alone names the slot."""
    return {
        "format": FORMAT,
        "options": {"machine_args": m.machine_args(), "append": m.append, "smp": m.smp,
                    "memory": m.memory, "accel": m.accel},
        "kernel_sha256": file_sha256(m.kernel),
        "initrd_sha256": file_sha256(m.initrd) if m.initrd is not None else None,
        "qemu": qemu_identity(m.qemu),
    }


def _slot(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key["options"], sort_keys=True).encode()).hexdigest()[:16]


def why_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Name what differs between two keys, for the one line that says why."""
    out = []
    for field, label in (("kernel_sha256", "kernel"), ("initrd_sha256", "initrd"),
                         ("format", "snapshot format"), ("options", "machine options")):
        if old.get(field) != new.get(field):
            out.append(f"{label} changed")
    oq, nq = old.get("qemu", {}), new.get("qemu", {})
    if oq.get("version") != nq.get("version"):
        out.append(f"QEMU {oq.get('version')} -> {nq.get('version')}")
    elif oq != nq:
        out.append("QEMU binary changed")
    return ", ".join(out) or "key changed"


def unsupported(m: Snapshottable) -> str | None:
    """Why this machine cannot start from a snapshot at all, or None."""
    if m.image is None:
        return "snapshots are made for images only (an explicit --kernel boots cold)"
    if Path(m.kernel) != Path(m.image.kernel) or m.initrd is None or \
            Path(m.initrd) != Path(m.image.initrd):
        return "snapshots are made for an image's own kernel and initrd (--initrd boots cold)"
    if m.accel != "tcg":
        return f"snapshots are made under TCG only (--accel {m.accel})"
    if m.extra_args:
        return "extra QEMU arguments are not part of any snapshot"
    if m.qemu.version[:2] < MIN_QEMU:
        return (f"QEMU {m.qemu.version_str} cannot restore them (needs >= "
                f"{'.'.join(map(str, MIN_QEMU))}; ./setup.sh provisions one)")
    return None


def slot_dir(m: Snapshottable, key: dict[str, Any] | None = None) -> Path:
    return Path(m.image.dir) / "snapshots" / _slot(key or snapshot_key(m))


def find(m: Snapshottable, key: dict[str, Any] | None = None) -> tuple[Snapshot | None, str]:
    """The matching snapshot, or None and why there is none (never a stale one)."""
    key = key or snapshot_key(m)
    d = slot_dir(m, key)
    try:
        meta = json.loads((d / META).read_text())
    except FileNotFoundError:
        return None, "no snapshot built yet"
    except ValueError:
        return None, f"{d / META} is unreadable"
    if meta.get("key") != key:
        return None, f"the snapshot is stale ({why_changed(meta.get('key', {}), key)})"
    snap = Snapshot(d, meta)
    for name in ("ram", "state"):
        p = d / name
        if not p.is_file() or p.stat().st_size != meta["files"][name]["size"]:
            return None, f"the snapshot's {name} file is missing or truncated"
    if file_sha256(snap.state) != meta["files"]["state"]["sha256"]:
        return None, "the snapshot's state file does not match its hash"
    return snap, ""


def ensure(m: Snapshottable, progress: Callable[[str], None] | None = None) -> tuple[Snapshot | None, str]:
    """The snapshot for ``m``'s image and options, built first when missing or stale.

    Returns (snapshot, "") or (None, why the machine has to boot cold). Never raises for
    a snapshot that cannot be made: a cold boot still works.
    """
    reason = unsupported(m)
    if reason:
        return None, reason
    key = snapshot_key(m)
    snap, why = find(m, key)
    if snap is not None:
        return snap, ""
    say = progress or log.info
    try:
        return build(m, key, why, say), ""
    except HarnessError as exc:
        return None, f"building the snapshot failed: {str(exc).splitlines()[0]}"


def say_once(reason: str) -> None:
    """Log why a machine boots cold, once per reason per process."""
    if reason not in _said:
        _said.add(reason)
        log.warning("booting cold: %s", reason)


def build(m: Snapshottable, key: dict[str, Any], why: str, say: Callable[[str], None]) -> Snapshot:
    """Boot ``m``'s configuration cold with its RAM in a file, wait for the agent, save.

    :raise VMError: the build machine failed to boot or to save.
    :raise SetupError: the lock was held too long, or the disk is full.
    """
    d = slot_dir(m, key)
    d.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(d.parent / ".lock", C.SNAPSHOT_LOCK_TIMEOUT,
                   "wait for it, or remove a stale snapshot directory")
    try:
        snap, why_now = find(m, key)  # someone else may have built it while we waited
        if snap is not None:
            return snap
        say(f"snapshot: {why_now or why}; building one for {m.image.version} "
            f"(QEMU {m.qemu.version_str}, {m.memory}, smp {m.smp})")
        tmp = d.parent / f".tmp-{d.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            t0 = time.monotonic()
            boot_s, reader = _save(m, tmp)
            for name in ("ram", "state"):
                os.chmod(tmp / name, 0o444)
            meta = {
                "key": key,
                "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "built_unix": time.time(),
                "boot_seconds": round(boot_s, 2),
                # the guest's kph-reader held its port (Machine.has_reader): a restored
                # machine gets no event saying so
                "reader": reader,
                "files": {n: {"size": (tmp / n).stat().st_size} for n in ("ram", "state")},
            }
            meta["files"]["state"]["sha256"] = file_sha256(tmp / "state")
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
            if d.exists():
                shutil.rmtree(d)
            tmp.rename(d)
        except OSError as exc:
            raise SetupError(f"writing the snapshot in {d.parent} failed: {exc}",
                             "free some disk space in the cache") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        used = sum(b.stat().st_blocks * 512 for b in (d / "ram", d / "state"))
        say(f"snapshot: saved in {time.monotonic() - t0:.1f} s to {d} ({used >> 20} MiB on disk)")
        return Snapshot(d, meta)
    finally:
        os.close(fd)


def _save(m: Snapshottable, out: Path) -> tuple[float, bool]:
    """Cold-boot a twin of ``m`` whose RAM is ``out/ram``; migrate its devices to
    ``out/state``. Returns its boot time and whether its kph-reader was there."""
    twin = m.twin(ram_file=out / "ram", name=f"{m.name}-snap")
    with twin:
        twin.start(timeout=C.BOOT_TIMEOUT)
        # Save a quiet guest. The agent answers before init has finished its last lines;
        # saved then, every restored guest would first finish them. And qemu-ga's first
        # guest-exec sets up what later ones reuse: done once here, not once per restore.
        twin.run("i=0; until grep -qs '(sleep) S 1 ' /proc/[0-9]*/stat || [ $i -ge 300 ]; do "
                 "usleep 10000; i=$((i + 1)); done", check=True)
        twin.run("true", check=True)
        reader = bool(twin.has_reader)
        twin.qmp("migrate-set-capabilities",
                 {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
        twin.qmp("migrate", {"uri": f"file:{out / 'state'}"})
        deadline = time.monotonic() + C.SNAPSHOT_SAVE_TIMEOUT
        while True:
            st = twin.qmp("query-migrate")
            status = st.get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise VMError(f"{twin.name}: saving the snapshot {status or 'timed out'}: "
                              f"{st.get('error-desc', '')}", twin.console_tail())
            time.sleep(0.01)
        return float(twin.boot_seconds), reader


def snapshots_of(image: Any) -> list[Snapshot]:
    """Every complete snapshot stored with ``image`` (for ``kph image info``)."""
    out = []
    for meta in sorted((Path(image.dir) / "snapshots").glob(f"*/{META}")):
        try:
            out.append(Snapshot(meta.parent, json.loads(meta.read_text())))
        except ValueError:
            continue
    return out
