#!/usr/bin/env python3
"""The oracle's mutation score: host-side faults injected into each host engine, each
judged by a real ``kph diff`` on a booted kernel (issue 25).

A mutant is one class of host-engine bug: a wrong value, a failed or misdirected read, a
hit lost, doubled, moved or swapped, a return matched to the wrong call, a wrong
``nmissed``, a registration the kernel would not give, and the plugin engine's own (a ring
record dropped, a ring overflow, a truncated record, a capture miss). Each is applied by
patching the engine's Python side for one ``kph diff`` run, in this process (``cli.main``,
the same code path as the command). A mutant is *killed* when that run does not exit 0:
diverged (1), a named error (2, 3) or nothing measured (4). A mutant that survives (exit
0, "equivalent") is a bug in the oracle. Before the mutants, each probe set runs
unmutated and must be equivalent, or the score means nothing.

    python bench/oracle_mutants.py [--engine gdbstub|plugin|both] [--kind record,c,source]
                                   [--only NAME,...] [--list]

Three kinds (issue 36): ``record``, the catalogue here (engine patches and edits of the
hit stream, on one-pid, threaded, interrupt, several-task, stack-trigger and silent-line
workloads); ``c``, mutants of the plugin's C compiled and loaded (bench/plugin_mutants.py);
``source``, cosmic-ray's mutants of the backends' Python (bench/source_mutants.py, slow).
Prints one line per mutant, the score per engine and kind with the survivors and errors
by name, and the run time. The suite runs the record catalogue, one C and one source
mutant (tests/vm/test_oracle_mutants.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import cli, constants, errors, gdbstub
from harness.kernel.grammar import program as fetchprog  # noqa: E402
from harness.backends import host as host_backend  # noqa: E402
from harness.backends import plugin as plugin_backend  # noqa: E402
from harness.machine.pluginlink import REC_HIT, RF_TRUNC, PluginLink  # noqa: E402
from harness.engines.plugin_engine import PluginEngine  # noqa: E402

WORKLOAD = "dd if=/proc/version of=/dev/null bs=64 count=4 2>/dev/null"
READS = ("p:rd vfs_read f=+16(%di):x64 cnt=%dx:u64", "r:rr vfs_read ret=$retval:s64")
OPENS = ("p:op do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring flags=%dx:x32",
         "r:opr do_sys_openat2 ret=$retval:s64")
REFUSED = ("p:bl do_int3", "p:rd vfs_read")
#: several threads of one process (kph-threads, probes/progs/threads.c): a uprobe and its
#: return in each thread (thread-order), kernel probes hit by every task (clone, exit)
THREADS = ("p:u/work /usr/bin/kph-threads:kph_work t=%di:s64 i=%si:s64",
           "r:u/workr /usr/bin/kph-threads:kph_work v=$retval:s64",
           "p:cl kernel_clone fl=+0(%di):x64", "r:clr kernel_clone ret=$retval:s64",
           "p:ex do_exit code=%di:s64")
#: interrupts: kfree from tasks and from the RCU softirq, rcu_core from the softirq only
#: (irq-order; the context of each hit is compared)
IRQ = ("p:kf kfree ptr=%di:x64", "p:rc rcu_core")
#: a stacktrace trigger on a probe (the gdbstub engine only: kph diff --trigger)
STACK = ("p:op do_sys_openat2 dfd=%di:s32 flags=%dx:x32",)
#: probe kinds 6.1 does not have (fprobes, $argN at a return, an event probe)
NEWER = ("f:fx vfs_read%return ret=$retval:s64 cnt=$arg3:u64",
         "r:rx vfs_read cnt=$arg3:u64 ret=$retval:s64", "f:fe vfs_read buf=$arg2:x64",
         "e:chdir syscalls.sys_enter_chdir file=+0($filename):ustring")
NEWER_RUN = WORKLOAD + "; cd /sys/kernel/tracing; cd /"
#: an armed line no workload calls (kexec_load) beside lines that fire
SILENT = READS + ("p:sl __x64_sys_kexec_load",)
#: tasks that die inside a kretprobed function: their instances come back only at
#: rethook_flush_task() (the plugin's flush_task(); a pool of 10 instances)
EXITS = ("r:dx do_exit", "p:de do_exit")


@dataclass(frozen=True)
class ProbeSet:
    """The lines of one ``kph diff``, its workload, its extra options and the host engines
    it runs on."""

    specs: tuple[str, ...]
    run: str = WORKLOAD
    extra: tuple[str, ...] = ()
    engines: tuple[str, ...] = ("gdbstub", "plugin")


#: several runnable tasks at once on the one vCPU: three shells that loop and write
PREEMPT_RUN = ("for j in 1 2 3; do (i=0; while [ $i -lt 15 ]; do i=$((i+1)); k=0; "
               "while [ $k -lt 100 ]; do k=$((k+1)); done; echo $i >/dev/null; done) & done; wait")
PREEMPT = ("p:wr ksys_write fd=%di:s32 n=%dx:u64", "r:wrr ksys_write ret=$retval:s64")
#: the default command line with full preemption (PREEMPT_DYNAMIC's preempt=full)
PREEMPT_FULL = constants.DEFAULT_APPEND + " preempt=full"

PROBE_SETS: dict[str, ProbeSet] = {
    "reads": ProbeSet(READS), "opens": ProbeSet(OPENS), "refused": ProbeSet(REFUSED),
    "threads": ProbeSet(THREADS, "/usr/bin/kph-threads 4 8"),
    # both engines since the plugin's window opens and closes with the guest's tracing
    # (CMD_WINDOW): it missed rcu_core's softirq hits at the window's edges before
    "irq": ProbeSet(IRQ, "ls /proc >/dev/null; sleep 0.05"),
    "tasks": ProbeSet(PREEMPT, PREEMPT_RUN),
    # the same, booted preempt=full: a task preempted between the host's record and the
    # guest's handler (preempt-order applies: 21 and 22 moves in two gdbstub runs, 6.1)
    "preempt": ProbeSet(PREEMPT + ("p:kf kfree ptr=%di:x64",), PREEMPT_RUN,
                        ("--append", PREEMPT_FULL)),
    "stack": ProbeSet(STACK, WORKLOAD, ("--trigger", "kprobes/op=stacktrace"), ("gdbstub",)),
    "silent": ProbeSet(SILENT),
    "exits": ProbeSet(EXITS, "for i in $(seq 20); do /bin/true; done"),
    # %ip at an entry (regs->ip past the breakpoint) and two return probes on one call
    # (the second hijacks the first's trampoline)
    "stacked": ProbeSet(("p:ipa vfs_read ip=%ip:x64", "r:ra vfs_read ret=$retval:s64",
                         "r:rb vfs_read ret=$retval:s64")),
    # two tasks asleep in one function with a pool of one: the second call is missed
    # (nmissed 1 on each side)
    "missed": ProbeSet(("r1:ns hrtimer_nanosleep ret=$retval:s64",),
                       "sleep 0.2 & sleep 0.2 & wait"),
    # %flags (the plugin engine cannot know TCG's lazy flags: the flags rule)
    "flags": ProbeSet(("p:fl vfs_read fl=%flags:x64 f=%di:x64",)),
    # a stacktrace trigger with a count: the first two hits only
    # (three opens and more: a count that never ends shows a third stack)
    "stackn": ProbeSet(STACK, WORKLOAD + "; cat /proc/version /proc/version >/dev/null",
                       ("--trigger", "kprobes/op=stacktrace:2"), ("gdbstub",)),
    # a probed function called from inside the guest's own kprobe handler (its fetch
    # reads memory: probe_mem_read() -> copy_from_kernel_nofault()): missed on each side
    "nested": ProbeSet(("p:o do_sys_openat2 x=+0(%sp):u64", "p:c copy_from_kernel_nofault"),
                       "cat /proc/version >/dev/null"),
    # two probes under one event name (each line a kprobe_profile line of its own), and a
    # probe armed on both sides that never fires (its nhit 0 on both)
    "multi": ProbeSet(("r:rw vfs_read ret=$retval:s64", "r:rw vfs_write ret=$retval:s64",
                       "p:pw vfs_read f=%di:x64", "p:pw vfs_write f=%di:x64",
                       "p:nv __x64_sys_reboot")),
    # what 6.1 has not: fprobe entries and exits, $argN at a return, an event probe, on
    # 6.12 (rethook: an exit sees the real return address) and 7.3 (the function graph)
    # (on 6.12 the return probe first: the fprobe exit's hook then finds the slot
    # hijacked, and still prints the real return address, rethook's correct_ret_addr)
    "newer": ProbeSet((NEWER[1], NEWER[0]) + NEWER[2:], NEWER_RUN, ("--image", "6.12")),
    # (on 7.3 the event probe first: the lines after it still have their counters)
    "newest": ProbeSet(NEWER[3:] + NEWER[:3], NEWER_RUN, ("--image", "7.3")),
    # a return probe with a pool of one instance: every call takes the last one
    "pool": ProbeSet(("r1:rr vfs_read ret=$retval:s64", "p:rd vfs_read f=%di:x64"),
                     engines=("plugin",)),
}


@dataclass(frozen=True)
class Parts:
    """What a mutant patches, per host engine: its backend, its FetchContext over one hit
    and the module whose ``format_value`` prints the hit."""

    engine: str
    backend: Any
    ctx: Any
    module: Any


PARTS = {"gdbstub": Parts("gdbstub", host_backend.HostBackend, host_backend._Ctx, host_backend),
         "plugin": Parts("plugin", plugin_backend.PluginBackend, plugin_backend._RecordCtx,
                         plugin_backend)}


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    probes: str                                       # a key of PROBE_SETS
    apply: Callable[[contextlib.ExitStack, Parts], None]
    engines: tuple[str, ...] = ("gdbstub", "plugin")


# -- helpers that build patches --------------------------------------------------------------

def _wrap(stack: contextlib.ExitStack, owner: Any, name: str,
          make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig = getattr(owner, name)
    stack.enter_context(mock.patch.object(owner, name, make(orig)))


#: Set by a hit-stream mutant whose transform changed the stream in the current run.
_CHANGED: list[int] = []


def _hits(transform: Callable[[list[Any]], list[Any]]) -> Callable[[contextlib.ExitStack, Parts], None]:
    """A mutant on the hit stream the backend hands to the diff. A run in which the
    transform found nothing to change is no kill and no survivor: ``run_mutant`` reports
    it as not applied."""
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        def collect(orig: Callable[..., Any]) -> Callable[..., Any]:
            def c(self: Any) -> list[Any]:
                hits = list(orig(self))
                out = transform(list(hits))
                if out != hits:
                    _CHANGED.append(1)
                return out
            return c
        _wrap(stack, p.backend, "collect", collect)
    apply.edits_hits = True         # type: ignore[attr-defined]
    return apply


def _relevant(hits: list[Any], kind: str | None = None) -> list[int]:
    return [i for i, h in enumerate(hits)
            if h.comm != "qemu-ga" and (kind is None or h.kind == kind)]


def _edit(i_pick: Callable[[list[Any]], int | None],
          change: Callable[[Any], Any]) -> Callable[[list[Any]], list[Any]]:
    def t(hits: list[Any]) -> list[Any]:
        i = i_pick(hits)
        if i is not None:
            hits[i] = change(hits[i])
        return hits
    return t


def _first(kind: str | None = None) -> Callable[[list[Any]], int | None]:
    return lambda hits: next(iter(_relevant(hits, kind)), None)


def _drop(pick: Callable[[list[Any]], int | None]) -> Callable[[list[Any]], list[Any]]:
    def t(hits: list[Any]) -> list[Any]:
        i = pick(hits)
        return hits if i is None else hits[:i] + hits[i + 1:]
    return t


def _last(kind: str | None = None) -> Callable[[list[Any]], int | None]:
    return lambda hits: (_relevant(hits, kind) or [None])[-1]


def _dup(hits: list[Any]) -> list[Any]:
    i = _first()(hits)
    return hits if i is None else hits[:i + 1] + [hits[i]] + hits[i + 1:]


def _swap_in_thread(kind: str | None, fields: Callable[[Any, Any], tuple[Any, Any]]
                    ) -> Callable[[list[Any]], list[Any]]:
    """A hit and the next hit of the same probe and pid whose arguments differ: exchange
    them (``fields`` says what moves)."""
    def t(hits: list[Any]) -> list[Any]:
        idx = _relevant(hits, kind)
        for n, a in enumerate(idx):
            b = next((j for j in idx[n + 1:] if hits[j].probe == hits[a].probe
                      and hits[j].pid == hits[a].pid), None)
            if b is not None and hits[a].args != hits[b].args:
                hits[a], hits[b] = fields(hits[a], hits[b])
                return hits
        return hits
    return t


def _args(change: Callable[[tuple], tuple]) -> Callable[[Any], Any]:
    return lambda h: dataclasses.replace(h, args=change(h.args))


def _ctx_reg(reg: str, f: Callable[[Any, int], int]) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        _wrap(stack, p.ctx, "reg", lambda orig: lambda self, name: (
            f(self, orig(self, name)) if name == reg else orig(self, name)))
    return apply


def _ctx_read(change: Callable[[Callable[..., bytes], Any, int, int], bytes]
              ) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        def make(orig: Callable[..., bytes]) -> Callable[..., bytes]:
            def read(self: Any, addr: int, size: int) -> bytes:
                return change(lambda a, n: orig(self, a, n), self, addr, size)
            return read
        _wrap(stack, p.ctx, "read", make)
        _wrap(stack, p.ctx, "read_user", make)
    return apply


def _format(change: Callable[[Any, Any, str], str]) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        orig = p.module.format_value
        stack.enter_context(mock.patch.object(
            p.module, "format_value", lambda arg, v, sym=None: change(arg, v, orig(arg, v, sym))))
    return apply


def _string_cut(arg: Any, v: Any, text: str) -> str:
    return text[:-2] + '"' if isinstance(v, bytes) and len(v) > 1 else text


def _string_byte(arg: Any, v: Any, text: str) -> str:
    return text.replace("p", "q", 1) if isinstance(v, bytes) else text


def _unsigned(arg: Any, v: Any, text: str) -> str:
    return str(v & 0xFFFFFFFF) if isinstance(v, int) and v < 0 else text


def _during_hits(stack: contextlib.ExitStack, p: Parts) -> list[int]:
    """A flag set while the gdbstub engine records a hit (its reads then, not others)."""
    active: list[int] = []

    def make(orig: Callable[..., int]) -> Callable[..., int]:
        def record(self: Any, *a: Any, **k: Any) -> int:
            active.append(1)
            try:
                return orig(self, *a, **k)
            finally:
                active.pop()
        return record
    _wrap(stack, host_backend.HostBackend, "_record", make)
    return active


def _stub_read_fails(exc: Callable[[int], Exception]) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        active = _during_hits(stack, p)

        def make(orig: Callable[..., bytes]) -> Callable[..., bytes]:
            def read(self: Any, addr: int, size: int) -> bytes:
                if size == 8 and active:
                    raise exc(addr)
                return orig(self, addr, size)
            return read
        _wrap(stack, gdbstub.GdbStub, "read_memory", make)
    return apply


def _capture_blocks(change: Callable[[Any], Any | None]) -> Callable[[contextlib.ExitStack, Parts], None]:
    """The plugin's captured reads of each record, changed (None: dropped)."""
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        orig = plugin_backend.parse_blocks
        stack.enter_context(mock.patch.object(plugin_backend, "parse_blocks", lambda body, n: [
            c for c in (change(b) for b in orig(body, n)) if c is not None]))
    return apply


def _records(transform: Callable[[list[Any]], list[Any]]) -> Callable[[contextlib.ExitStack, Parts], None]:
    """The plugin engine's raw records, changed once (the first batch ``transform``
    changes) before the backend reads them."""
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        done: list[int] = []

        def make(orig: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
            def records(self: Any) -> list[Any]:
                recs = list(orig(self))
                if done:
                    return recs
                out = transform(recs)
                if out != recs:
                    done.append(1)
                return out
            return records
        _wrap(stack, PluginEngine, "records", make)
    return apply


def _nth_hit_record(recs: list[Any], change: Callable[[Any], Any | None]) -> list[Any]:
    """The second hit record not of the agent, changed (None: dropped)."""
    hits = [i for i, r in enumerate(recs)
            if r.type == REC_HIT and not (r.comm or b"").startswith(b"qemu-ga")]
    if len(hits) < 2:
        return recs
    i = hits[1]
    new = change(recs[i])
    return recs[:i] + ([] if new is None else [new]) + recs[i + 1:]


def _ring_overflow(stack: contextlib.ExitStack) -> None:
    """The ring's drop counter reads one more after its first read (the backend's mark at
    enable): one record dropped during the run."""
    reads: list[int] = []
    orig = PluginLink.dropped.fget

    def dropped(self: Any) -> int:
        reads.append(1)
        return orig(self) + (1 if len(reads) > 1 else 0)
    stack.enter_context(mock.patch.object(PluginLink, "dropped", property(dropped)))


def _counters(change: Callable[[Any], Any]) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        _wrap(stack, p.backend, "counters", lambda orig: lambda self: {
            k: change(c) for k, c in orig(self).items()})
    return apply


def _outcomes(change: Callable[[list[Any]], list[Any]]) -> Callable[[contextlib.ExitStack, Parts], None]:
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        _wrap(stack, p.backend, "register", lambda orig: lambda self, specs: change(
            list(orig(self, specs))))
    return apply


def _refuse_first(outs: list[Any]) -> list[Any]:
    from harness.records import Outcome
    return [Outcome.rejected(o.probe, 22, "mutant", index=o.index) if i == 0 else o
            for i, o in enumerate(outs)]


def _errno(outs: list[Any]) -> list[Any]:
    return [dataclasses.replace(o, errno=2) if not o.accepted else o for o in outs]


def _accept(outs: list[Any]) -> list[Any]:
    from harness.records import Outcome
    return [Outcome(o.probe, True, mode="host", index=o.index) if not o.accepted else o
            for o in outs]


def _offset_probe(stack: contextlib.ExitStack, p: Parts) -> None:
    """The probe placed 5 bytes into the function (past the ftrace nop): wrong offset."""
    from harness.kernel.grammar import ProbeSpec
    if p.engine == "gdbstub":
        _wrap(stack, p.backend, "_make", lambda orig: lambda self, spec, name: orig(
            self, dataclasses.replace(spec, offset=spec.offset + 5) if isinstance(spec, ProbeSpec)
            and not spec.is_return and spec.symbol_name else spec, name))
    else:
        _wrap(stack, p.backend, "_place", lambda orig: lambda self, spec, *a, **k: orig(
            self, dataclasses.replace(spec, offset=spec.offset + 5) if not spec.is_return
            and spec.symbol_name and not spec.is_uprobe else spec, *a, **k))


def _pair_across_pids(hits: list[Any], kind: str | None = None
                      ) -> tuple[int, int] | None:
    """Two hits of one probe from different tasks whose arguments differ, as far apart as
    such a pair goes (so that no single preemption window explains their exchange)."""
    idx = _relevant(hits, kind)
    best: tuple[int, int] | None = None
    for n, a in enumerate(idx):
        for b in idx[n + 1:]:
            if hits[b].probe == hits[a].probe and hits[b].pid != hits[a].pid \
                    and hits[b].args != hits[a].args \
                    and (best is None or b - a > best[1] - best[0]):
                best = (a, b)
        if best is not None:
            return best
    return best


def _pids_swapped(hits: list[Any]) -> list[Any]:
    """The pid and comm of two hits of one probe from different tasks exchanged (the
    engine read another vCPU's or task's ``current``)."""
    ab = _pair_across_pids(hits)
    if ab is not None:
        a, b = ab
        x, y = hits[a], hits[b]
        hits[a] = dataclasses.replace(x, pid=y.pid, comm=y.comm)
        hits[b] = dataclasses.replace(y, pid=x.pid, comm=x.comm)
    return hits


def _hits_swapped_across_pids(hits: list[Any]) -> list[Any]:
    """Two hits of one probe from different tasks exchanged in the stream (each keeps the
    other's place and sequence number)."""
    ab = _pair_across_pids(hits)
    if ab is not None:
        a, b = ab
        x, y = hits[a], hits[b]
        hits[a], hits[b] = dataclasses.replace(y, seq=x.seq), dataclasses.replace(x, seq=y.seq)
    return hits


def _probes_reordered(hits: list[Any]) -> list[Any]:
    """Two hits of one task, of two different probes, recorded in the other order (each
    probe's own hits stay as they were: only the order across probes changes)."""
    idx = sorted(_relevant(hits), key=lambda i: hits[i].seq)
    for a, b in zip(idx, idx[1:]):
        x, y = hits[a], hits[b]
        if x.probe != y.probe and (x.pid, x.cpu, x.irq) == (y.pid, y.cpu, y.irq):
            hits[a], hits[b] = dataclasses.replace(x, seq=y.seq), dataclasses.replace(y, seq=x.seq)
            hits.sort(key=lambda h: h.seq)
            return hits
    return hits


def _stale_arg(h: Any) -> Any:
    """The hit's first argument read as a fault (``(unknown)``, reason ``stale``)."""
    if not h.args:
        return h
    (k, _), rest = h.args[0], h.args[1:]
    return dataclasses.replace(h, args=((k, "(unknown)"),) + rest,
                               unknown=tuple(h.unknown) + ((k, "stale"),))


def _irq_flipped(h: Any) -> Any:
    return dataclasses.replace(h, irq={"irq": "task", "task": "irq"}.get(h.irq, h.irq))


def _first_irq(hits: list[Any]) -> int | None:
    return next((i for i in _relevant(hits) if hits[i].irq == "irq"), None)


def _irq_hit_late(hits: list[Any]) -> list[Any]:
    """A hit the interrupt context made recorded after every other hit of its probe."""
    i = next((i for i in _relevant(hits) if hits[i].irq == "irq" and any(
        hits[j].probe == hits[i].probe and hits[j].irq != "irq" for j in _relevant(hits)
        if j > i)), None)
    if i is None:
        return hits
    h = hits.pop(i)
    last = max(j for j, x in enumerate(hits) if x.probe == h.probe)
    hits.insert(last + 1, h)
    return hits


def _stack_edit(change: Callable[[tuple[str, ...]], tuple[str, ...]]
                ) -> Callable[[list[Any]], list[Any]]:
    """The stack trace of the first hit that has one, changed."""
    def t(hits: list[Any]) -> list[Any]:
        i = next((i for i in _relevant(hits) if hits[i].stack), None)
        if i is not None:
            hits[i] = dataclasses.replace(hits[i], stack=change(tuple(hits[i].stack)))
        return hits
    return t


def _line_pending(index: int, drop_hits: bool) -> Callable[[contextlib.ExitStack, Parts], None]:
    """The host's outcome of line ``index``: accepted but pending (never installed); its
    hits gone with it when ``drop_hits``."""
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        probe: list[str] = []

        def register(orig: Callable[..., Any]) -> Callable[..., Any]:
            def reg(self: Any, specs: Any) -> list[Any]:
                outs = list(orig(self, specs))
                for n, o in enumerate(outs):
                    if o.index == index or (o.index < 0 and n == index):
                        outs[n] = dataclasses.replace(o, pending="mutant: never installed")
                        probe.append(o.probe)
                return outs
            return reg
        _wrap(stack, p.backend, "register", register)
        if drop_hits:
            _wrap(stack, p.backend, "collect", lambda orig: lambda self: [
                h for h in orig(self) if h.probe not in probe])
    return apply


def _counter_missing(stack: contextlib.ExitStack, p: Parts) -> None:
    """The host has no counter for the first probe it counted."""
    _wrap(stack, p.backend, "counters", lambda orig: lambda self: dict(
        list(orig(self).items())[1:]))


def _stub_fault_once(stack: contextlib.ExitStack, p: Parts) -> None:
    """The stub's first read of an argument's memory fails as a fault (its raw read,
    which would confirm it, works): a fault the guest never took."""
    active: list[int] = []
    done: list[int] = []

    def ctx_read(orig: Callable[..., bytes]) -> Callable[..., bytes]:
        def read(self: Any, addr: int, size: int) -> bytes:
            active.append(1)
            try:
                return orig(self, addr, size)
            finally:
                active.pop()
        return read

    def make(orig: Callable[..., bytes]) -> Callable[..., bytes]:
        def read(self: Any, addr: int, size: int) -> bytes:
            if active and not done:
                done.append(1)
                raise errors.MemoryFaultError("Unable to read memory.", addr)
            return orig(self, addr, size)
        return read
    _wrap(stack, p.ctx, "read", ctx_read)
    _wrap(stack, gdbstub.GdbStub, "read_memory", make)


# -- the catalogue ---------------------------------------------------------------------------

def _m(name: str, what: str, probes: str, apply: Callable[[contextlib.ExitStack, Parts], None],
       engines: tuple[str, ...] = ("gdbstub", "plugin")) -> Mutant:
    return Mutant(name, what, probes, apply,
                  tuple(e for e in engines if e in PROBE_SETS[probes].engines))


def _bump_tail(text: str) -> str:
    """``sym+0x4/0x170`` -> ``sym+0x5/0x170``."""
    head, _, tail = text.partition("+0x")
    off, _, size = tail.partition("/")
    return f"{head}+{int(off or '0', 16) + 1:#x}/{size}" if tail else text + "+0x1"


MUTANTS: tuple[Mutant, ...] = (
    # values and reads
    _m("wrong-register", "%di reads %si", "reads", _ctx_reg("di", lambda c, v: c.reg("si"))),
    _m("off-by-one", "%dx is one more", "reads", _ctx_reg("dx", lambda c, v: v + 1)),
    _m("retval-wrong", "$retval is one more", "reads",
       lambda st, p: _wrap(st, p.ctx, "retval", lambda o: lambda self: o(self) + 1)),
    _m("read-wrong-address", "memory read 8 bytes further", "reads",
       _ctx_read(lambda rd, c, a, n: rd(a + 8, n))),
    _m("read-wrong-bytes", "memory read with one bit flipped", "reads",
       _ctx_read(lambda rd, c, a, n: (lambda d: d[:-1] + bytes([d[-1] ^ 1]))(rd(a, n)))),
    _m("string-cut-short", "a string loses its last character", "opens", _format(_string_cut)),
    _m("string-wrong-byte", "a string's 'p' read as 'q'", "opens", _format(_string_byte)),
    _m("sign-lost", "a negative value printed unsigned", "opens", _format(_unsigned)),
    _m("read-fails", "the stub's 8-byte reads raise its error during hits", "reads",
       _stub_read_fails(lambda a: errors.GdbMIError(f"-data-read-memory-bytes {a:#x} 8: "
                                                    "mutant")), ("gdbstub",)),
    _m("read-times-out", "the stub's 8-byte reads time out during hits", "reads",
       _stub_read_fails(lambda a: errors.VMLostError("gdb did not answer in time (mutant)")),
       ("gdbstub",)),
    _m("spurious-fault", "a mapped address read as a fault", "reads",
       _stub_read_fails(lambda a: errors.MemoryFaultError("Unable to read memory.", a)),
       ("gdbstub",)),
    _m("capture-miss", "the plugin's 8-byte captured reads missing", "reads",
       _capture_blocks(lambda b: None if b.kind == fetchprog.DATA and b.length == 8 else b),
       ("plugin",)),
    _m("capture-wrong-bytes", "the plugin's captured reads corrupted", "reads",
       _capture_blocks(lambda b: dataclasses.replace(b, data=bytes(x ^ 0x10 for x in b.data))
                       if b.kind == fetchprog.DATA else b), ("plugin",)),
    # hits
    _m("hit-dropped", "one hit lost", "reads", _hits(_drop(_first("p")))),
    _m("last-hit-dropped", "the last hit lost", "opens", _hits(_drop(_last()))),
    _m("hit-duplicated", "one hit recorded twice", "reads", _hits(_dup)),
    _m("hit-invented", "a hit nobody made, from pid 1", "reads", _hits(
        lambda hs: hs + [dataclasses.replace(hs[_first("p")(hs)], pid=1, comm="init")]
        if _first("p")(hs) is not None else hs)),
    _m("pid-moved", "a hit moved to another pid", "reads",
       _hits(_edit(_first(), lambda h: dataclasses.replace(h, pid=(h.pid or 0) + 1)))),
    _m("comm-moved", "a hit moved to another comm", "reads",
       _hits(_edit(_first(), lambda h: dataclasses.replace(h, comm=h.comm + "x")))),
    _m("cpu-moved", "a hit moved to another cpu", "reads",
       _hits(_edit(_first(), lambda h: dataclasses.replace(h, cpu=h.cpu + 1)))),
    _m("hits-swapped", "two hits of one thread swapped", "reads",
       _hits(_swap_in_thread(None, lambda x, y: (y, x)))),
    _m("kind-flipped", "an entry hit recorded as a return", "reads",
       _hits(_edit(_first("p"), lambda h: dataclasses.replace(h, kind="r")))),
    _m("ip-shifted", "an entry hit's ip one byte off", "reads",
       _hits(_edit(_first("p"), lambda h: dataclasses.replace(h, ip=_bump_tail(h.ip))))),
    _m("arg-dropped", "a hit's last argument lost", "opens",
       _hits(_edit(_first("p"), _args(lambda a: a[:-1])))),
    _m("args-swapped", "two arguments' values exchanged", "opens",
       _hits(_edit(_first("p"), _args(lambda a: ((a[0][0], a[2][1]), a[1], (a[2][0], a[0][1]))
                                      if len(a) > 2 else a)))),
    _m("arg-renamed", "an argument under another name", "opens",
       _hits(_edit(_first("p"), _args(lambda a: (("x" + a[0][0], a[0][1]),) + a[1:] if a else a)))),
    # returns and handlers
    _m("return-lost", "a return hit lost", "reads", _hits(_drop(_first("r")))),
    _m("return-wrong-instance", "a return matched to another call's instance", "reads",
       _hits(_swap_in_thread("r", lambda x, y: (dataclasses.replace(x, args=y.args),
                                                 dataclasses.replace(y, args=x.args))))),
    _m("ret-from-wrong", "a return hit names another function", "reads",
       _hits(_edit(_first("r"), lambda h: dataclasses.replace(h, ret_from="vfs_write")))),
    _m("nmissed-off-by-one", "nmissed one more", "reads",
       _counters(lambda c: dataclasses.replace(c, nmissed=c.nmissed + 1))),
    _m("nhit-off-by-one", "nhit one more over the window", "reads",
       _counters(lambda c: dataclasses.replace(c, nhit=c.nhit + 1))),
    _m("wrong-offset", "the probe placed 5 bytes into the function", "reads", _offset_probe),
    # registration
    _m("refuses-accepted", "a line the kernel accepts refused host-side", "reads",
       _outcomes(_refuse_first)),
    _m("refusal-errno", "a refusal with another errno", "refused", _outcomes(_errno)),
    _m("accepts-refused", "a line the kernel refuses accepted host-side", "refused",
       _outcomes(_accept)),
    # the plugin engine's own
    _m("ring-record-dropped", "a ring record dropped, uncounted", "reads",
       _records(lambda rs: _nth_hit_record(rs, lambda r: None)), ("plugin",)),
    _m("ring-overflow", "the ring overflowed during the run (one record dropped)", "reads",
       lambda st, p: _ring_overflow(st), ("plugin",)),
    _m("record-truncated", "a record marked truncated", "reads",
       _records(lambda rs: _nth_hit_record(rs, lambda r: dataclasses.replace(
           r, flags=r.flags | RF_TRUNC))), ("plugin",)),
    # several tasks, interrupts, counters, registrations and stacks (issue 36)
    _m("pids-swapped", "two tasks' hits of one probe: their pids and comms exchanged",
       "threads", _hits(_pids_swapped)),
    _m("hits-swapped-across-pids", "two tasks' hits of one probe exchanged in the stream",
       "threads", _hits(_hits_swapped_across_pids)),
    _m("thread-hits-swapped", "two hits of one thread swapped, threads running (uprobe)",
       "threads", _hits(_swap_in_thread(None, lambda x, y: (y, x)))),
    _m("probes-reordered", "one task's hits of two probes recorded in the other order",
       "reads", _hits(_probes_reordered)),
    _m("threads-probes-reordered", "one thread's hits of two probes in the other order",
       "threads", _hits(_probes_reordered)),
    _m("pid-none", "one hit's pid not read (None)", "reads",
       _hits(_edit(_first(), lambda h: dataclasses.replace(h, pid=None)))),
    _m("counter-missing", "no host counter for one probe", "reads", _counter_missing),
    _m("stale-spurious", "an argument (unknown) with the reason stale, no fault taken",
       "reads", _hits(_edit(_first("p"), _stale_arg))),
    _m("stale-unconfirmed", "a read that faults once where the memory maps", "reads",
       _stub_fault_once, ("gdbstub",)),
    _m("pending-silent", "an armed line that no workload calls, said pending host-side",
       "silent", _line_pending(2, False)),
    _m("pending-armed", "an armed line said pending host-side, never installed", "reads",
       _line_pending(0, True)),
    _m("irq-flipped", "a hit of the interrupt context recorded as the task's", "irq",
       _hits(_edit(_first_irq, _irq_flipped))),
    _m("irq-hit-late", "a hit of the interrupt context recorded after its probe's others",
       "irq", _hits(_irq_hit_late)),
    _m("irq-unknown", "no hit's context read host-side (every kernel hit's irq empty)",
       "reads", _hits(lambda hs: [dataclasses.replace(h, irq="") for h in hs])),
    _m("tasks-hits-swapped", "two tasks' writes exchanged while they take turns", "tasks",
       _hits(_hits_swapped_across_pids)),
    _m("tasks-pids-swapped", "two tasks' writes: their pids exchanged", "tasks",
       _hits(_pids_swapped)),
    _m("preempt-hits-swapped", "two tasks' hits exchanged, preemption on", "preempt",
       _hits(_hits_swapped_across_pids)),
    _m("preempt-pids-swapped", "two tasks' hits: their pids exchanged, preemption on",
       "preempt", _hits(_pids_swapped)),
    _m("preempt-probes-reordered", "one task's hits of two probes in the other order, "
       "preemption on", "preempt", _hits(_probes_reordered)),
    _m("stack-extra-frames", "two host frames of probe machinery on top of the stack",
       "stack", _hits(_stack_edit(lambda f: ("kprobe_ftrace_handler", "0xffffffffc0401000") + f)),
       ("gdbstub",)),
    _m("stack-frame-dropped", "the stack's outermost frame lost", "stack",
       _hits(_stack_edit(lambda f: f[:-1])), ("gdbstub",)),
    _m("stack-frame-wrong", "a frame of the stack named as the one below it", "stack",
       _hits(_stack_edit(lambda f: f[:1] + f[2:3] + f[2:] if len(f) > 2 else f)), ("gdbstub",)),
    _m("stack-starts-higher", "the unwinder starts one frame above the probed function",
       "stack", _hits(_stack_edit(lambda f: f[1:])), ("gdbstub",)),
)


# -- running ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    mutant: str
    engine: str
    exit: int
    line: str           # the kph diff line that judged it
    seconds: float
    kind: str = "record"
    #: the mutant could not be made (a hit-stream edit found nothing to change, a C
    #: pattern that no longer matches, a build that failed): neither killed nor survived
    error: str = ""

    @property
    def killed(self) -> bool:
        return not self.error and self.exit != 0

    @property
    def status(self) -> str:
        return "ERROR   " if self.error else "killed  " if self.killed else "SURVIVED"


#: The normalizations the last kph_diff() applied, with their counts (its JSON's).
LAST_RULES: dict[str, int] = {}


def kph_diff(engine: str, probes: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """One real ``kph diff`` (in this process, ``-q``, its JSON to a file): its exit
    status and its verdict, or its error line."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "diff.json"
        ps = PROBE_SETS[probes]
        argv = ["-q", "diff", *ps.specs, "--run", ps.run, "--host", engine,
                "-o", str(out), *ps.extra, *extra]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
        if out.exists():
            res = json.loads(out.read_text())
            LAST_RULES.clear()
            LAST_RULES.update({k: v["count"] for k, v in res.get("normalizations", {}).items()})
            return code, "result: " + res["verdict"]
    said = [ln for ln in err.getvalue().splitlines() if ln.strip()] or [""]
    return code, next((ln for ln in said if ln.startswith("error:")), said[-1])


def run_mutant(m: Mutant, engine: str) -> Outcome:
    t0 = time.monotonic()
    _CHANGED.clear()
    with contextlib.ExitStack() as stack:
        m.apply(stack, PARTS[engine])
        code, line = kph_diff(engine, m.probes)
    err = ""
    if getattr(m.apply, "edits_hits", False) and not _CHANGED and code == 0:
        err = "not applied: the run had no hits this mutant changes"
    return Outcome(m.name, engine, code, line, time.monotonic() - t0, error=err)


def baselines(engines: tuple[str, ...], sets: set[str]) -> bool:
    """Each probe set unmutated on each engine it runs on: all must be equivalent, or no
    score means anything. Prints one line per run (with the order rules it applied)."""
    ok = True
    for engine in engines:
        for probes in sorted(sets):
            if engine not in PROBE_SETS[probes].engines:
                continue
            code, line = kph_diff(engine, probes)
            order = {k: n for k, n in LAST_RULES.items() if k.endswith("-order") and n}
            print(f"baseline {engine:8s} {probes:8s} exit {code}  {line[:90]}"
                  + (f"  [{', '.join(f'{k} {n}' for k, n in order.items())}]" if order else ""),
                  flush=True)
            if code != 0:
                print(f"error: the unmutated {probes} run is not equivalent on {engine}; "
                      "no score", file=sys.stderr)
                ok = False
    return ok


def report(outs: list[Outcome], seconds: float) -> int:
    """The score per engine and kind, the survivors and errors by name; 1 if any."""
    bad = 0
    keys = sorted({(o.engine, o.kind) for o in outs})
    for engine, kind in keys:
        these = [o for o in outs if (o.engine, o.kind) == (engine, kind)]
        judged = [o for o in these if not o.error]
        k = sum(o.killed for o in judged)
        surv = [o.mutant for o in judged if not o.killed]
        errs = [o.mutant for o in these if o.error]
        bad += len(surv) + len(errs)
        print(f"score {engine:8s} {kind:8s}: {k}/{len(judged)} killed "
              f"({100 * k / max(1, len(judged)):.0f}%)"
              + (f"; survived: {', '.join(surv)}" if surv else "")
              + (f"; errors: {', '.join(errs)}" if errs else ""))
    print(f"{len(outs)} mutant runs in {seconds:.0f} s on {time.strftime('%Y-%m-%d')}")
    return 1 if bad else 0


KINDS = ("record", "c", "source")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("gdbstub", "plugin", "both"), default="both")
    ap.add_argument("--kind", default="record,c", metavar="KIND,...",
                    help="record (hit-stream and engine-patch mutants), c (the plugin's C, "
                    "compiled and loaded), source (bench/source_mutants.py: cosmic-ray's "
                    "mutants of harness/engines and harness/backends; slow)")
    ap.add_argument("--only", default="", metavar="NAME,...", help="run only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    engines = ("gdbstub", "plugin") if args.engine == "both" else (args.engine,)
    kinds = [k for k in args.kind.split(",") if k]
    if set(kinds) - set(KINDS):
        ap.error(f"--kind: one of {', '.join(KINDS)}")
    only = {n for n in args.only.split(",") if n}
    chosen = [m for m in MUTANTS if not only or m.name in only] if "record" in kinds else []
    cmuts: list[Any] = []
    if "c" in kinds and "plugin" in engines:
        import plugin_mutants
        cmuts = [m for m in plugin_mutants.MUTANTS if not only or m.name in only]
    if args.list:
        for m in chosen:
            print(f"record {m.name:26s} {'/'.join(m.engines):15s} {m.what}")
        for c in cmuts:
            print(f"c      {c.name:26s} {'plugin':15s} {c.what}")
        print(f"{len(chosen)} record mutants, {len(cmuts)} C mutants")
        return 0
    t0 = time.monotonic()
    sets = {m.probes for m in chosen} | {c.probes for c in cmuts}
    if not baselines(engines, sets):
        return 2
    outs: list[Outcome] = []
    for engine in engines:
        for m in chosen:
            if engine not in m.engines:
                continue
            o = run_mutant(m, engine)
            outs.append(o)
            print(f"{o.status} {engine:8s} {m.name:26s} exit {o.exit} ({o.seconds:.1f} s)  "
                  f"{(o.error or o.line)[:100]}", flush=True)
    for c in cmuts:
        o = plugin_mutants.run(c)
        outs.append(o)
        print(f"{o.status} plugin   {c.name:26s} exit {o.exit} ({o.seconds:.1f} s)  "
              f"{(o.error or o.line)[:100]}", flush=True)
    if "source" in kinds:
        import source_mutants
        outs += source_mutants.run_all(engines, only)
    return report(outs, time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
