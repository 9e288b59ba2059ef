"""The ``uprobe_events`` grammar of Linux 6.1: user-space probes as ``ProbeSpec`` lines.

Why a module of its own: ``__trace_uprobe_create()`` (kernel/trace/trace_uprobe.c) reads its
target differently from ``kprobe_events`` and compiles the same fetch-arg grammar into a
program that only touches user memory; :func:`harness.kernel.grammar.parse` hands every line
whose target has a ``/`` to :func:`parse_uprobe`. It shares the arguments, event names and
error log with the kprobe grammar (:mod:`harness.kernel.grammar.common`), and neither
includes the other::

    p[:[GRP/][EVENT]] PATH:OFFSET[(REF_CTR_OFFSET)][%return] [FETCHARGS]
    r[:[GRP/][EVENT]] PATH:OFFSET[(REF_CTR_OFFSET)] [FETCHARGS]

``OFFSET`` is a *file* offset into ``PATH`` (the kernel needs a number). The harness also
takes ``PATH:SYMBOL[+OFFS]``, its own form: :func:`resolve_symbol` turns it into the file
offset from the program's ELF symbol table before anything is written to the guest.

Fetch args follow ``traceprobe_parse_probe_arg()`` without ``TPARG_FL_KERNEL``: ``%REG``,
``$stack``, ``$stackN``, ``$comm``, ``$retval`` (return probes), ``@ADDR``, ``@+OFFS`` (memory
at a file offset of PATH), ``+|-[u]OFFS(FETCHARG)``, immediates; ``$argN`` is refused ("Invalid
$-variable specified", 6.1 has no argument access for uprobes) and so is ``@SYM`` ("Symbol is
not available with uprobe"). Every memory access is ``copy_from_user()`` in the probed task.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import ProbeSpecError
from ..elf import ElfImage
from .args import FL_RETURN, FL_USER
from .common import (FLAG_RETURN, FLAG_UPROBE, MAX_TRACE_ARGS, ParseFail, ProbeArg, ProbeSpec,
                     arg_text, context_args, default_uprobe_event_name, kstrtoul,
                     parse_event_name, parse_probe_arg, split_return_suffix)

UPROBE_EVENT_SYSTEM = "uprobes"

__all__ = ["parse_uprobe", "format_uprobe", "kernel_format_uprobe", "default_uprobe_event_name",
           "resolve_symbol", "UPROBE_EVENT_SYSTEM"]


def parse_uprobe(toks: list[tuple[int, str]], text: str, kernel: Any = None, *,
                 symbols: bool = True) -> ProbeSpec:
    """``__trace_uprobe_create()`` for the tokens of one line (``[(column, token)]``);
    ``kernel`` a :class:`harness.kernel.grammar.common.KernelView` (None: 6.1). ``symbols``: take the
    harness's ``PATH:SYMBOL`` form (False: only the kernel's ``PATH:OFFSET``).

    :raise ParseFail: through :func:`harness.kernel.grammar.parse`, which makes it a ProbeSpecError.
    """
    h0, head = toks[0]
    kind = head[0]
    is_return = kind == "r"
    # Only "p:" / "r:" names an event; the kernel ignores anything else after the letter
    # (there is no MAXACTIVE for uretprobes: return instances are allocated as needed).
    event_text = head[2:] if head[1:2] == ":" else None
    t0, target = toks[1]
    colon = target.rfind(":")
    if colon < 0:       # -ECANCELED before trace_probe_log_init(): nothing is logged
        raise ParseFail("Invalid uprobe target; use PATH:OFFSET (or PATH:SYMBOL)",
                        t0 + len(target), logged=False)
    path, rest, r0 = target[:colon], target[colon + 1:], t0 + colon + 1
    if not symbols and not (rest[:1].isascii() and rest[:1].isdigit()):
        # __trace_uprobe_create(): `if (!arg || !isdigit(arg[1])) return -ECANCELED;`, a
        # line that is no uprobe's, before trace_probe_log_init() (6.1 to 7.3): the write
        # fails with EINVAL and nothing in error_log
        raise ParseFail("Invalid uprobe offset (no digit after the ':')", r0, logged=False)
    if path == "":
        raise ParseFail("Failed to find the given file", t0)
    ref_ctr = None
    lp = rest.find("(")
    if lp >= 0:
        rp = rest.find(")", lp)
        if rp < 0:
            raise ParseFail("Reference counter brace is not closed", r0 + len(rest))
        if rest[rp + 1:] != "":
            raise ParseFail("Reference counter has wrong suffix", r0 + rp + 1)
        ref_ctr = kstrtoul(rest[lp + 1:rp])
        if ref_ctr is None:
            raise ParseFail("Invalid reference counter offset", r0 + lp + 1)
        rest = rest[:lp]
    rest, suffix = split_return_suffix(rest, r0)
    is_return = is_return or suffix
    symbol = None
    if not symbols or (rest[:1].isascii() and rest[:1].isdigit()):
        offset = kstrtoul(rest)
        if offset is None:
            raise ParseFail("Invalid uprobe offset", r0)
    else:   # PATH:SYMBOL[+OFFS], the harness's form (the kernel wants a number)
        cut = next((i for i, ch in enumerate(rest) if ch in "+-"), len(rest))
        off = kstrtoul(rest[cut + 1:]) if rest[cut:cut + 1] == "+" else (0 if cut == len(rest) else None)
        if cut == 0 or off is None:
            raise ParseFail("Invalid uprobe offset; use PATH:OFFSET or PATH:SYMBOL[+OFFS]", r0)
        symbol, offset = rest[:cut], off

    group, event, exp_group, exp_event = UPROBE_EVENT_SYSTEM, "", False, False
    if event_text is not None:
        group, event, exp_group, exp_event = parse_event_name(event_text, h0 + 2)
        if not exp_group:
            group = UPROBE_EVENT_SYSTEM
    rules = kernel.rules if kernel is not None else None
    if rules is not None and rules.arg_parser == "context":
        args = context_args(toks, text, kernel, rules,
                             FL_USER | (FL_RETURN if is_return else 0), None, uprobe=True)
        return ProbeSpec(kind, group, event if exp_event else "", None, symbol, offset, None,
                         0, tuple(args), suffix, exp_group, exp_event, text=text, path=path,
                         ref_ctr_offset=ref_ctr)
    flags = FLAG_UPROBE | (FLAG_RETURN if is_return else 0)
    args: list[ProbeArg] = []
    size = [0]
    for start, tok in toks[2:2 + MAX_TRACE_ARGS]:
        try:
            args.append(parse_probe_arg(tok, len(args), flags, tuple(a.name for a in args), size))
        except ParseFail as exc:
            exc.pos += start
            raise
    return ProbeSpec(kind, group, event if exp_event else "", None, symbol, offset, None, 0,
                     tuple(args), suffix, exp_group, exp_event, text=text, path=path,
                     ref_ctr_offset=ref_ctr)


def _target(spec: ProbeSpec, *, kernel: bool) -> str:
    if spec.symbol is not None:
        if kernel:
            raise ValueError(f"{spec.path}:{spec.symbol} is not resolved to a file offset; "
                             "call harness.kernel.grammar.uprobe.resolve_symbol first")
        t = f"{spec.path}:{spec.symbol}" + (f"+0x{spec.offset:x}" if spec.offset else "")
    else:
        width = 16 if kernel else 0
        t = f"{spec.path}:0x{spec.offset:0{width}x}"
    if spec.ref_ctr_offset:
        t += f"(0x{spec.ref_ctr_offset:x})"
    return t


def format_uprobe(spec: ProbeSpec) -> str:
    """The canonical line (``format(parse(s)) == s``)."""
    head = spec.kind
    if spec.explicit_group or spec.explicit_event:
        head += ":" + (f"{spec.group}/" if spec.explicit_group else "")
        head += spec.event if spec.explicit_event else ""
    target = _target(spec, kernel=False) + ("%return" if spec.return_suffix else "")
    args = [(f"{a.name}=" if a.explicit_name else "") + arg_text(a, spec.is_return, True)
            for a in spec.args]
    return " ".join([head, target] + args)


def kernel_format_uprobe(spec: ProbeSpec) -> str:
    """What ``cat uprobe_events`` shows (``trace_uprobe_show()``): ``0x%016lx`` offsets,
    group and event spelled out, every argument as ``NAME=COMM``."""
    head = "r" if spec.is_return else "p"
    args = "".join(f" {a.name}={arg_text(a, spec.is_return, True)}" for a in spec.args)
    return f"{head}:{spec.group}/{spec.event} {_target(spec, kernel=True)}{args}"


def resolve_symbol(spec: ProbeSpec, elf: "bytes | ElfImage") -> ProbeSpec:
    """``PATH:SYMBOL[+OFFS]`` -> ``PATH:OFFSET`` (file offset), from the ELF's ``.symtab``
    (the file's bytes, or the file parsed already).

    :raise ProbeSpecError: when the symbol is not in the file (column of the target).
    """
    if spec.symbol is None:
        return spec
    img = elf if isinstance(elf, ElfImage) else ElfImage(elf)
    try:
        vaddr = img.symbol(spec.symbol) + spec.offset
    except KeyError:
        col = spec.text.find(spec.symbol) if spec.text else 0
        raise ProbeSpecError(f"no symbol {spec.symbol} in {spec.path}", spec.text or spec.symbol,
                             max(col, 0)) from None
    return dataclasses.replace(spec, symbol=None, offset=img.file_offset(vaddr),
                               event=spec.event if spec.explicit_event else "")
