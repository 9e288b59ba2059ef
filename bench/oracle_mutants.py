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

    python bench/oracle_mutants.py [--engine gdbstub|plugin|both] [--only NAME,...] [--list]

Prints one line per mutant and the score per engine. The suite runs the same catalogue
(tests/vm/test_oracle_mutants.py).
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

from harness import cli, errors, gdbstub
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
PROBE_SETS = {"reads": READS, "opens": OPENS, "refused": REFUSED}


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


def _hits(transform: Callable[[list[Any]], list[Any]]) -> Callable[[contextlib.ExitStack, Parts], None]:
    """A mutant on the hit stream the backend hands to the diff."""
    def apply(stack: contextlib.ExitStack, p: Parts) -> None:
        _wrap(stack, p.backend, "collect", lambda orig: lambda self: transform(list(orig(self))))
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


# -- the catalogue ---------------------------------------------------------------------------

def _m(name: str, what: str, probes: str, apply: Callable[[contextlib.ExitStack, Parts], None],
       engines: tuple[str, ...] = ("gdbstub", "plugin")) -> Mutant:
    return Mutant(name, what, probes, apply, engines)


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
)


# -- running ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    mutant: str
    engine: str
    exit: int
    line: str           # the kph diff line that judged it
    seconds: float

    @property
    def killed(self) -> bool:
        return self.exit != 0


def kph_diff(engine: str, probes: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """One real ``kph diff`` (in this process, ``-q``, its JSON to a file): its exit
    status and its verdict, or its error line."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "diff.json"
        argv = ["-q", "diff", *PROBE_SETS[probes], "--run", WORKLOAD, "--host", engine,
                "-o", str(out), *extra]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
        if out.exists():
            return code, "result: " + json.loads(out.read_text())["verdict"]
    said = [ln for ln in err.getvalue().splitlines() if ln.strip()] or [""]
    return code, next((ln for ln in said if ln.startswith("error:")), said[-1])


def run_mutant(m: Mutant, engine: str) -> Outcome:
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        m.apply(stack, PARTS[engine])
        code, line = kph_diff(engine, m.probes)
    return Outcome(m.name, engine, code, line, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("gdbstub", "plugin", "both"), default="both")
    ap.add_argument("--only", default="", metavar="NAME,...", help="run only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    engines = ("gdbstub", "plugin") if args.engine == "both" else (args.engine,)
    only = {n for n in args.only.split(",") if n}
    chosen = [m for m in MUTANTS if not only or m.name in only]
    if args.list:
        for m in chosen:
            print(f"{m.name:24s} {'/'.join(m.engines):15s} {m.what}")
        print(f"{len(MUTANTS)} mutants")
        return 0
    t0 = time.monotonic()
    for engine in engines:
        for probes in sorted({m.probes for m in chosen if engine in m.engines}):
            code, line = kph_diff(engine, probes)
            print(f"baseline {engine:8s} {probes:8s} exit {code}  {line}", flush=True)
            if code != 0:
                print(f"error: the unmutated {probes} run is not equivalent on {engine}; "
                      "no score", file=sys.stderr)
                return 2
    score: dict[str, list[Outcome]] = {e: [] for e in engines}
    for engine in engines:
        for m in chosen:
            if engine not in m.engines:
                continue
            o = run_mutant(m, engine)
            score[engine].append(o)
            print(f"{'killed ' if o.killed else 'SURVIVED'} {engine:8s} {m.name:24s} exit {o.exit} "
                  f"({o.seconds:.1f} s)  {o.line[:110]}", flush=True)
    bad = 0
    for engine, outs in score.items():
        k = sum(o.killed for o in outs)
        bad += len(outs) - k
        print(f"score {engine}: {k}/{len(outs)} killed ({100 * k / max(1, len(outs)):.0f}%)")
    print(f"{sum(len(v) for v in score.values())} mutant runs in {time.monotonic() - t0:.0f} s "
          f"on {time.strftime('%Y-%m-%d')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
