"""Host-side kprobes in QEMU's TCG plugin API: ``vm.host`` of ``Machine.boot(host="plugin")``.

The second host engine of issue 15 (DESIGN.md, "Two host engines, one API"). Where
``harness.engine`` stops the whole VM at a gdbstub breakpoint and decides in Python,
here ``probes/plugin/kph_plugin.c`` runs inside QEMU: an instruction callback on the
probed address runs on the vCPU that reached it, before the instruction, while the
other vCPUs go on. The semantics are the same modules' (``kprobes``, ``fetchargs``,
``probespec``, ``symbols``); what differs is where the work happens:

- spec probes (``kprobe_events`` lines, ``harness.backends.plugin``): fetch args are
  compiled (``harness.fetchprog``) and run in C at the hit; each hit is a record in a
  shared-memory ring, read back and evaluated by ``harness.fetchargs``: no round trip;
- kretprobes take instances from a pool of ``maxactive`` in C, per concurrent call across
  all vCPUs, as ``pre_handler_kretprobe()`` (kernel/kprobes.c, 6.1) does, and the
  trampoline is serviced in C.

Registration applies the kernel's rules first (``harness.symbols.check_probe_address``,
reading kernel text through the human monitor's ``x``, which works while the guest
runs). What the host needs to know of the kernel (symbols, blacklist, task_struct
offsets from BTF) is loaded before any probe is armed; nothing is fetched from the guest
in a callback.

Code translated before a probe was added is invalidated by the plugin (see
kph_plugin.c): ``stats["invalidations"]`` and ``invalidation_ms`` say what it cost.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .errors import HarnessError, ProbeRejectedError
from .plugin import (ADD_ENABLED, ADD_NO_INVALIDATE, CMD_ADD, CMD_CONFIG, CMD_ENABLE, CMD_GSTATS, CMD_INVALIDATE, CMD_REMOVE,
                     CMD_STATS, INVAL_PENDING, INVAL_TEXT, PK_SPEC_P, PK_SPEC_R, PluginLink,
                     RawRecord, decode)
from .symbols import check_probe_address

log = logging.getLogger(__name__)

EINVAL, ENOENT = 22, 2
#: The plugin's kretprobe trampoline: one byte past ``_etext``, the gdbstub engine's, so
#: the two engines never share an address (a gdbstub breakpoint there would win).
DEFAULT_TRAMPOLINE = "_etext+1"
_HMP_LINE = re.compile(r"^([0-9a-f]+):((?:\s+0x[0-9a-f]{2})+)\s*$")


@dataclass
class PluginProbe:
    """One probe in the plugin (the id the records carry)."""

    id: int
    addr: int
    kind: int
    maxactive: int = 0
    enabled: bool = True
    invalidation: str = "done"


class PluginEngine:
    """Host-side kprobes through the QEMU plugin. Use ``vm.host`` rather than constructing it."""

    kind = "plugin"

    def __init__(self, vm: Any, *, trampoline: str | int | None = None) -> None:
        if getattr(vm, "rundir", None) is None or getattr(vm, "plugin_path", None) is None:
            raise HarnessError(f"{vm.name} was not started with the plugin; "
                               "boot it with Machine.boot(host='plugin')")
        self.vm = vm
        self.symbols = vm.symbols
        self.blacklist = vm.blacklist
        self.stats: Counter[str] = Counter()
        self.handler_errors: list[BaseException] = []
        self._uprobes = None
        self._ids = itertools.count(1)
        self._probes: dict[int, PluginProbe] = {}
        self._lock = threading.Lock()
        tramp = trampoline if trampoline is not None else os.environ.get(
            "KPH_PLUGIN_TRAMPOLINE", DEFAULT_TRAMPOLINE)
        self.trampoline = tramp if isinstance(tramp, int) else self.symbols.resolve(str(tramp))
        cur = self.symbols.get("current_task")
        self.task_offsets = (cur.addr if cur is not None else 0, self._btf("pid"), self._btf("comm"))
        self.link = PluginLink(vm.rundir / "plugin.sock")
        self.link.request(CMD_CONFIG, struct.pack("<4Q", *self.task_offsets, self.trampoline))
        self._closed = False

    def _btf(self, member: str) -> int:
        try:
            return self.vm.btf.offset("task_struct", member)
        except Exception as exc:  # noqa: BLE001 - no BTF: hits carry no pid/comm
            log.warning("no task_struct.%s offset (%s): plugin hits carry none", member, exc)
            return 0

    # -- guest memory, without stopping anything -----------------------------------------
    def read(self, addr: int, n: int) -> bytes:
        """Guest virtual memory read through the human monitor's ``x`` (CPU 0's address
        space: meant for kernel addresses, e.g. probed text at registration)."""
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

    # -- probes ---------------------------------------------------------------------------
    def check_address(self, addr: int, *, kretprobe: bool = False) -> None:
        """The kernel's registration rules (``register_kprobe()``), with its errnos."""
        check_probe_address(addr, symbols=self.symbols, blacklist=self.blacklist,
                            read=self.read, kretprobe=kretprobe)
        if addr == self.trampoline:
            raise ProbeRejectedError(f"{addr:#x} is the plugin's kretprobe trampoline (-EINVAL)",
                                     EINVAL, addr)

    def resolve(self, symbol_name: str | None, offset: int, addr: int | None) -> int:
        """``_kprobe_addr()``: symbol_name + offset, or addr + offset."""
        if symbol_name and addr is not None:
            raise ProbeRejectedError("give either symbol_name or addr, not both (-EINVAL)", EINVAL)
        if symbol_name:
            try:
                return self.symbols.lookup(symbol_name).addr + offset
            except KeyError as exc:
                raise ProbeRejectedError(f"{exc} (-ENOENT)", ENOENT) from None
        if addr is None:
            raise ProbeRejectedError("a probe needs symbol_name or addr (-EINVAL)", EINVAL)
        return addr + offset

    def add_spec_probe(self, addr: int, *, ret: bool, program: bytes, maxactive: int = 0,
                       enabled: bool = True, invalidate: bool = True) -> PluginProbe:
        """Arm a compiled spec probe at ``addr`` (checked by the caller); a return probe
        gets ``maxactive`` instances (0: the kernel's default, max(10, 2 * vCPUs)).
        ``invalidate=False`` leaves code translated earlier without the probe (tests use
        it to show what the invalidation is for)."""
        if ret and maxactive <= 0:
            maxactive = max(10, 2 * self.vm.smp)      # register_kretprobe(), kernel/kprobes.c
        pid = next(self._ids)
        kind = PK_SPEC_R if ret else PK_SPEC_P
        flags = (ADD_ENABLED if enabled else 0) | (0 if invalidate else ADD_NO_INVALIDATE)
        payload = struct.pack("<IIQIIII", pid, kind, addr, maxactive, flags,
                              len(program) // 16, 0) + program
        st = struct.unpack("<I", self.link.request(CMD_ADD, payload))[0]
        p = PluginProbe(pid, addr, kind, maxactive, enabled, INVAL_TEXT.get(st, str(st)))
        if st == INVAL_PENDING:
            log.warning("probe at %#x: old translations not invalidated yet (a busy vCPU "
                        "took no interrupt within 2 s)", addr)
        self.stats["invalidation_" + p.invalidation.replace(" ", "_")] += 1
        with self._lock:
            self._probes[pid] = p
        return p

    def remove_probe(self, p: PluginProbe) -> None:
        with self._lock:
            if self._probes.pop(p.id, None) is None:
                return
        self.link.request(CMD_REMOVE, struct.pack("<I", p.id))

    def enable_probe(self, p: PluginProbe, on: bool) -> None:
        self.link.request(CMD_ENABLE, struct.pack("<II", p.id, int(on)))
        p.enabled = on

    def probe_stats(self, p: PluginProbe) -> tuple[int, int, int]:
        """``(nhit, nmissed, instances in use)`` of one probe."""
        return struct.unpack("<3Q", self.link.request(CMD_STATS, struct.pack("<I", p.id)))

    def global_stats(self) -> dict[str, int]:
        n, ns, missing, seq = struct.unpack("<4Q", self.link.request(CMD_GSTATS))
        return {"invalidations": n, "invalidation_ns": ns, "trampoline_unmatched": missing,
                "records": seq, "dropped": self.link.dropped}

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

    def records(self) -> list[RawRecord]:
        """Every hit recorded since the last call, in the order they happened."""
        recs = [decode(r) for r in self.link.take_records()]
        recs.sort(key=lambda r: r.seq)
        return recs

    def list(self) -> str:
        lines = []
        for p in sorted(self._probes.values(), key=lambda p: p.addr):
            hit = self.symbols.symbolize(p.addr)
            where = f"{hit[0].name}+{hit[1]:#x}" if hit else f"{p.addr:#x}"
            kind = "r" if p.kind == PK_SPEC_R else "k"
            lines.append(f"{p.addr:016x}  {kind}  {where}    {'' if p.enabled else '[DISABLED]'}")
        return "\n".join(lines) + ("\n" if lines else "")

    def raise_handler_errors(self) -> None:
        if self.handler_errors:
            raise HarnessError(f"{len(self.handler_errors)} handler error(s)") from self.handler_errors[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the session: the plugin goes inert. Return addresses still hijacked stay
        serviced by the plugin for as long as QEMU runs."""
        if self._closed:
            return
        self._closed = True
        self.link.close()
