"""The dynamic-event grammar, split as the kernel splits it: one argument parser, two users.

- ``common``   the shared part (``kernel/trace/trace_probe.c``): the line types
               (:class:`ProbeSpec`, :class:`ProbeArg`, :class:`KernelView`), 6.1's argument
               parser, event names, the error log;
- ``args``     the argument parser of 6.12 and 7.3 (``trace_probe.c`` rewritten around a
               ``struct traceprobe_parse_context`` in 6.4), BTF arguments included;
- ``kprobe``   ``kprobe_events`` lines (``kernel/trace/trace_kprobe.c``);
- ``uprobe``   ``uprobe_events`` lines (``kernel/trace/trace_uprobe.c``);
- ``fprobe``   ``f`` lines of ``dynamic_events`` (``kernel/trace/trace_fprobe.c``, 6.12+);
- ``eprobe``   ``e`` lines of ``dynamic_events`` (``kernel/trace/trace_eprobe.c``, 6.12+),
               their ``if`` filters parsed by :mod:`harness.kernel.evfilter`;
- ``fetch``    what fetch args are and yield: the tree, host-side evaluation, printed text
               (``kernel/trace/trace_probe_tmpl.h``: ``process_fetch_insn()``);
- ``program``  fetch args compiled for the QEMU plugin, and its captures read back.

``kprobe``, ``uprobe``, ``fprobe`` and ``eprobe`` build on ``common`` and none imports another. This
package is the one entry, as the ``dynamic_events`` file is (``kernel/trace/trace_dynevent.c``):
:func:`parse` splits a line, takes comments and ``-:`` deletions, and hands a ``p``/``r``
line to the grammar its target names; :func:`format`, :func:`kernel_format` and
:func:`guest_line` write a spec back::

    p[:[GRP/][EVENT]] [MOD:]SYM[+OFFS]|ADDR [FETCHARGS]
    r[MAXACTIVE][:[GRP/][EVENT]] [MOD:]SYM[+0] [FETCHARGS]
    p[:[GRP/][EVENT]] [MOD:]SYM[+0]%return [FETCHARGS]
    p[:[GRP/][EVENT]] PATH:OFFSET[(REF_CTR_OFFSET)][%return] [FETCHARGS]
    f[MAXACTIVE][:[GRP/][EVENT]] KSYM[%return] [FETCHARGS]          (6.12+)
    t[:[GRP/][EVENT]] TRACEPOINT [FETCHARGS]                         (6.12+)
    e[:[GRP/][EVENT]] SYSTEM.EVENT [FETCHARGS] [if FILTER]           (6.12+)
    -:[GRP/][EVENT] [SYM [NAME=FETCHARG]...]

``format(parse(s)) == s`` for canonical ``s``: one space between tokens, no comment, symbol
offsets as ``+0x..``, raw addresses as ``0x..``.
"""
from __future__ import annotations

import re
from typing import Callable

from ...errors import NotMirroredError, ProbeSpecError
from ..rules import rules_for
from .common import (DYNEVENT_SUBSYSTEM, MAX_TRACE_ARGS, REGISTERS, KernelView, ParseFail,
                     ProbeArg, ProbeSpec, default_event_name, default_uprobe_event_name,
                     error_subsystem, format_error, is_good_name, kstrtol, kstrtoul,
                     line_subsystem, parse_arg, render_body, split_symbol_offset)
from .fetch import (Bitfield, Comm, Deref, FetchArg, FuncArg, Imm, ImmString, MemAddr, MemSymbol,
                    Reg, RetVal, StackEntry, StackPointer)
from .eprobe import format_eprobe, kernel_format_eprobe, parse_eprobe
from .fprobe import format_fprobe, kernel_format_fprobe, parse_fprobe
from .kprobe import format_kprobe, kernel_format_kprobe, parse_kprobe
from .uprobe import format_uprobe, kernel_format_uprobe, parse_uprobe

__all__ = [
    "ProbeSpec", "ProbeArg", "parse", "parse_arg", "format", "kernel_format", "format_error",
    "error_subsystem", "line_subsystem",
    "guest_line", "default_event_name", "default_uprobe_event_name", "kstrtoul", "kstrtol",
    "split_symbol_offset", "render_body", "REGISTERS", "MAX_TRACE_ARGS", "KernelView",
    # the fetch-arg tree, defined in harness.kernel.grammar.fetch and re-exported here
    "FetchArg", "Reg", "StackEntry", "StackPointer", "RetVal", "Comm", "FuncArg", "Imm",
    "ImmString", "MemAddr", "MemSymbol", "Deref", "Bitfield",
]

#: ``argv_split()`` splits on ``isspace()``.
_SPACE = re.compile(r"[^ \t\n\v\f\r]+")

_KIND_NAMES = {"f": "fprobe events (f:)", "t": "tracepoint probes (t:)",
               "e": "event probes (e:)", "s": "synthetic events (s:)"}




def parse(text: str, *,
          on_func_entry: Callable[[str, int], bool | None] | None = None,
          count_symbol: Callable[[str], int] | None = None,
          kernel: KernelView | None = None, uprobe_symbols: bool = True) -> ProbeSpec:
    """Parse one ``kprobe_events`` line the way the kernel of ``kernel`` does (6.1 without
    one, the default image's).

    Errors come in the kernel's order (maxactive, target, event name, then each argument),
    with its ``error_log`` texts. Like ``trace_parse_run_command()``, everything from ``#`` on
    is a comment. Like 6.1's ``__trace_kprobe_create()``, arguments past
    :data:`MAX_TRACE_ARGS` are ignored (a warning is logged); 6.12 and 7.3 refuse them.

    :param on_func_entry: ``kprobe_on_func_entry()`` for ``(symbol_name, offset)``: True on a
        function entry, False when not (a return probe there is BAD_RETPROBE), None when the
        symbol is unknown (the kernel defers that to ENOENT at register time). By default
        ``offset == 0``, which holds for the default image (no IBT ``endbr64`` at entries).
    :param count_symbol: ``number_of_same_symbols()`` for an unqualified ``SYM``: the kernel
        refuses 0 (BAD_PROBE_ADDR, ENOENT) and more than 1 (NON_UNIQ_SYMBOL, EADDRNOTAVAIL)
        right after the return-probe check, before the event name and the arguments.
    :param kernel: the kernel's rules and facts; its callbacks replace the two above.
    :param uprobe_symbols: take the harness's ``PATH:SYMBOL[+OFFS]`` uprobe places; False
        parses as ``uprobe_events`` does, where only ``PATH:OFFSET`` is valid.
    :raise ProbeSpecError: when the kernel would refuse the line before looking anything up;
        ``column`` is the 0-based offset in ``text`` of the offending character, ``errno``
        the write's errno.
    :raise NotMirroredError: a kind that kernel takes and the host side does not mirror.
    """
    if kernel is not None:
        on_func_entry = kernel.on_func_entry or on_func_entry
        count_symbol = kernel.count_symbol or count_symbol
    line = text.split("#", 1)[0]
    if "\n" in line.rstrip("\n"):
        raise ProbeSpecError("One probe per line", text, line.index("\n"))
    toks = [(m.start(), m.group()) for m in _SPACE.finditer(line)]
    if not toks:
        raise ProbeSpecError("No probe definition", text, 0)
    try:
        if line[0] == "-":
            return _parse_delete(toks, text)
        return _parse_probe(toks, text, on_func_entry, count_symbol, kernel, uprobe_symbols)
    except ParseFail as exc:
        # The kernel splits the line into words (argv_split()) and logs the error against
        # the words joined by single spaces (trace_probe_log_err(): the "Command:" of
        # error_log), so a caret after doubled spaces or tabs moves left (kph fuzz found it).
        if exc.words is not None:
            err = ProbeSpecError(str(exc), " ".join(exc.words), exc.pos, errno=exc.errno,
                                 logged=exc.logged)
        else:
            command = " ".join(t for _, t in toks)
            err = ProbeSpecError(str(exc), command, _argv_column(toks, exc.pos),
                                 errno=exc.errno, logged=exc.logged)
        # who the kernel logs it under (error_subsystem(), format_error()): the parser of
        # the line's kind, an event filter, 7.3's dynevent; "" when it logs nothing
        err.subsystem = (exc.subsystem or line_subsystem([t for _, t in toks])) \
            if exc.logged else ""
        raise err from None


def _argv_column(toks: list[tuple[int, str]], pos: int) -> int:
    """``pos`` in the typed text as a column of the words joined by single spaces."""
    col = 0
    for start, tok in toks:
        if pos < start:
            return col
        if pos <= start + len(tok):
            return col + pos - start
        col += len(tok) + 1
    return col                  # past the last word: where a next one would start


def _parse_delete(toks: list[tuple[int, str]], text: str) -> ProbeSpec:
    """``dyn_event_release()``: ``-:[GRP/]EVENT`` plus optional literal match tokens.
    It refuses with -EINVAL and writes nothing to error_log (kernel/trace/trace_dynevent.c,
    6.1 to 7.3: no trace_probe_log there)."""
    start, head = toks[0]
    if head[1:2] != ":":
        raise ParseFail("A probe is deleted with -:[GRP/]EVENT", start + 1, logged=False)
    name = head[2:]
    group, slash = "", name.find("/")
    if slash >= 0:
        group, name = name[:slash], name[slash + 1:]
    if slash < 0 and name == "":
        raise ParseFail("Event name is not specified", start + 2, logged=False)
    return ProbeSpec("-", group, name, explicit_group=slash >= 0, explicit_event=name != "",
                     match=tuple(t for _, t in toks[1:]), text=text)


def _parse_probe(toks: list[tuple[int, str]], text: str,
                 on_func_entry: Callable[[str, int], bool | None] | None,
                 count_symbol: Callable[[str], int] | None,
                 kernel: KernelView | None, uprobe_symbols: bool) -> ProbeSpec:
    """``create_dyn_event()``: the kinds the kernel knows, then the grammar the target
    names (a ``/`` makes it a file: ``__trace_uprobe_create()``, else
    ``__trace_kprobe_create()``)."""
    rules = kernel.rules if kernel is not None else rules_for(None)
    h0, head = toks[0]
    kind = head[0]
    if kind in ("f", "t") and rules.fprobe and len(toks) >= 2:
        return parse_fprobe(toks, text, kernel)
    if kind == "e" and rules.eprobe and len(toks) >= 2:
        return parse_eprobe(toks, text, kernel)
    if kind not in ("p", "r"):
        if kind in ("f", "t", "e") and rules.fprobe:    # *_create(): argc < 2
            # create_dyn_event(): every kind said -ECANCELED; 7.3 logs it against the
            # whole command (the "dynevent" subsystem) at 0
            if rules.dynevent_no_match_logged:
                raise ParseFail("No matching dynamic event type", 0,
                                subsystem=DYNEVENT_SUBSYSTEM)
            raise ParseFail("Unknown probe type; use p, r or -", h0, logged=False)
        if kind in rules.dynevent_kinds or kind in ("e", "s") and rules.dynevent_kinds:
            raise NotMirroredError(f"not mirrored host-side: {_KIND_NAMES[kind]} on "
                                   f"{rules.series}", text, h0,
                                   hint="probe the function with a p: or r: line instead")
        raise ParseFail("Unknown probe type; use p, r or -", h0, logged=False)   # -ECANCELED
    if len(toks) < 2:
        raise ParseFail("No probe point (SYM[+OFFS] or ADDR) is given",
                        len(text.split("#", 1)[0].rstrip()) + 1, logged=False)
    if "/" in toks[1][1]:
        return parse_uprobe(toks, text, kernel, symbols=uprobe_symbols)
    return parse_kprobe(toks, text, on_func_entry, count_symbol, kernel)


def format(spec: ProbeSpec) -> str:  # noqa: A001 - the module's verb, as in the guide
    """Write ``spec`` back as its line (``format(parse(s)) == s``)."""
    if spec.is_uprobe:
        return format_uprobe(spec)
    if spec.kind == "-":
        name = (f"{spec.group}/" if spec.explicit_group else "") + spec.event
        return " ".join((f"-:{name}",) + spec.match)
    if spec.is_fprobe:
        return format_fprobe(spec)
    if spec.is_eprobe:
        return format_eprobe(spec)
    return format_kprobe(spec)


def kernel_format(spec: ProbeSpec) -> str:
    """The line ``cat kprobe_events`` (``uprobe_events``) shows for ``spec``
    (``trace_kprobe_show()``, ``trace_uprobe_show()``)."""
    if spec.kind == "-":
        return format(spec)
    if spec.is_uprobe:
        return kernel_format_uprobe(spec)
    if spec.is_fprobe:
        return kernel_format_fprobe(spec)
    if spec.is_eprobe:
        return kernel_format_eprobe(spec)
    return kernel_format_kprobe(spec)


def guest_line(spec: ProbeSpec) -> str:
    """The line written to a guest's ``kprobe_events``: a kprobe line as written (its
    arguments untouched, so the kernel expands ``$arg*``, ``$argN`` and ``%pd`` and types
    BTF arguments itself) under the explicit ``GROUP/EVENT`` the harness expects; uprobe
    lines and lines built in Python as :func:`kernel_format` writes them."""
    if spec.is_uprobe or spec.kind == "-" or not spec.text:
        return kernel_format(spec)
    toks = _SPACE.findall(spec.text.split("#", 1)[0])
    if spec.is_eprobe:
        return " ".join([f"e:{spec.group}/{spec.event}"] + toks[1:])
    if spec.is_fprobe:
        head = spec.kind + (str(spec.maxactive) if spec.maxactive else "")
        if not spec.explicit_event and not is_good_name(spec.event):
            # the kernel does not check a name it made ("f vfs_read+10" is refused at
            # registration, not for its name "vfs_read+10__entry"): let it make it
            return " ".join([toks[0]] + toks[1:])
        return " ".join([f"{head}:{spec.group}/{spec.event}"] + toks[1:])
    head = "r" if spec.kind == "r" else "p"
    head += str(spec.maxactive) if spec.kind == "r" and spec.maxactive else ""
    return " ".join([f"{head}:{spec.group}/{spec.event}"] + toks[1:])
