"""The ``kprobe_events`` lines, as ``kernel/trace/trace_kprobe.c`` reads them.

``__trace_kprobe_create()`` of Linux 6.1 (Debian's ``linux-source-6.1``), and where 6.12 and
7.3 differ, their ``validate_probe_symbol()`` and argument context (:mod:`harness.kernel.rules`
says which series does what)::

    p[:[GRP/][EVENT]] [MOD:]SYM[+OFFS]|ADDR [FETCHARGS]
    r[MAXACTIVE][:[GRP/][EVENT]] [MOD:]SYM[+0] [FETCHARGS]
    p[:[GRP/][EVENT]] [MOD:]SYM[+0]%return [FETCHARGS]

The arguments, event names and the error log are the shared part,
:mod:`harness.kernel.grammar.common`; a whole line (comments, ``-:`` deletions, the choice
between this and :mod:`harness.kernel.grammar.uprobe`) is :func:`harness.kernel.grammar.parse`.

Checks that need the symbol table (``kprobe_on_func_entry()``, ``number_of_same_symbols()``,
``register_kprobe()``) are not made here, except through the optional callbacks
:func:`harness.kernel.grammar.parse` takes: a refused probe is a result, not a parse error.
"""
from __future__ import annotations

import logging
from typing import Callable

from ..rules import rules_for
from .args import FL_FENTRY, FL_KERNEL, FL_RETURN
from .common import (KPROBE_EVENT_SYSTEM, KRETPROBE_MAXACTIVE_MAX, MAX_EVENT_NAME_LEN,
                     MAX_TRACE_ARGS, UINT_MAX, KernelView, ParseFail, ProbeSpec, arg_flags, arg_text,
                     context_args, default_event_name, kstrtol, kstrtoul, parse_event_name,
                     parse_probe_arg, split_return_suffix)

log = logging.getLogger(__name__)

__all__ = ["parse_kprobe", "format_kprobe", "kernel_format_kprobe", "default_event_name"]


def parse_kprobe(toks: list[tuple[int, str]], text: str,
                 on_func_entry: Callable[[str, int], bool | None] | None,
                 count_symbol: Callable[[str], int] | None = None,
                 kernel: KernelView | None = None) -> ProbeSpec:
    """``__trace_kprobe_create()`` for the words of one ``p``/``r`` line (``[(column, word)]``)
    whose target is a kernel place; :func:`harness.kernel.grammar.parse` has split the line,
    checked its kind and sent file targets to the uprobe grammar.

    :raise ParseFail: through :func:`harness.kernel.grammar.parse`, which makes it a
        ProbeSpecError.
    """
    rules = kernel.rules if kernel is not None else rules_for(None)
    h0, head = toks[0]
    kind = head[0]
    is_return = kind == "r"
    colon = head.find(":", 1)
    maxactive = 0
    if head[1:2].isascii() and head[1:2].isdigit():
        if not is_return:
            raise ParseFail(rules.message(rules.maxact_on_kprobe), h0 + 1)
        digits = head[1:colon] if colon >= 0 else head[1:]
        n = kstrtoul(digits) if len(digits) <= MAX_EVENT_NAME_LEN - 1 else None
        if n is None or n == 0 or n > UINT_MAX:
            raise ParseFail("Invalid maxactive number", h0 + 1)
        if n > KRETPROBE_MAXACTIVE_MAX:
            raise ParseFail("Maxactive is too big", h0 + 1)
        maxactive = n

    t0, target = toks[1]
    module = symbol = None
    offset, suffix, fentry = 0, False, False
    addr = kstrtoul(target)
    if addr is None:
        sym, suffix = split_return_suffix(target, t0)
        is_return = is_return or suffix
        cut = next((i for i, ch in enumerate(sym) if ch in "+-"), len(sym))
        off = kstrtol(sym[cut:]) if cut < len(sym) else 0
        if off is None or off < 0 or off > UINT_MAX:
            raise ParseFail("Invalid probed address or symbol", t0)
        sym, offset = sym[:cut], off
        if ":" in sym:
            module, sym = sym.split(":", 1)
        if rules.symbol_check == "validate":
            _validate_probe_symbol(kernel, module, sym, count_symbol, t0)
        elif sym == "" or module == "":
            raise ParseFail("Invalid probed address or symbol", t0)
        symbol = sym
        name = f"{module}:{sym}" if module is not None else sym
        entry = on_func_entry(name, offset) if on_func_entry else offset == 0
        fentry = entry is True and (rules.fentry_on_return or not is_return)
        if entry is False and is_return:
            raise ParseFail("Retprobe address must be an function entry", t0)
        if rules.symbol_check == "after_retprobe" and module is None and \
                count_symbol is not None:
            n = count_symbol(sym)       # __trace_kprobe_create(): number_of_same_symbols()
            if n > 1:
                raise ParseFail("The symbol is not unique", t0, 99)     # -EADDRNOTAVAIL
            if n == 0:
                raise ParseFail("Invalid probed address or symbol", t0, 2)     # -ENOENT

    group, event, exp_group, exp_event = KPROBE_EVENT_SYSTEM, "", False, False
    if colon >= 0:
        group, event, exp_group, exp_event = parse_event_name(head[colon + 1:], h0 + colon + 1)
    if not exp_event:
        event = default_event_name(is_return, None if symbol is None else name, offset, addr)

    # __trace_kprobe_create() sets TPARG_FL_RETURN in its symbol branch only: on a raw
    # address a return probe's $retval is RETVAL_ON_PROBE (seen on 6.1, 6.12 and 7.3)
    ret_flag = is_return and symbol is not None
    if rules.arg_parser == "context":
        flags = FL_KERNEL | (FL_RETURN if ret_flag else 0) | (FL_FENTRY if fentry else 0)
        args = context_args(toks, text, kernel, rules, flags,
                             None if symbol is None else name)
        return ProbeSpec(kind, group, event, module, symbol, offset, addr, maxactive,
                         tuple(args), suffix, exp_group, exp_event, fentry=fentry, text=text)
    flags = arg_flags(ret_flag, fentry)
    args = []
    size = [0]
    if len(toks) - 2 > MAX_TRACE_ARGS:
        log.warning("%s: only the first %d of %d fetch args count (MAX_TRACE_ARGS)",
                    event, MAX_TRACE_ARGS, len(toks) - 2)
    for i, (start, tok) in enumerate(toks[2:2 + MAX_TRACE_ARGS]):
        try:
            args.append(parse_probe_arg(tok, i, flags, tuple(a.name for a in args), size))
        except ParseFail as exc:
            exc.pos += start
            raise
    return ProbeSpec(kind, group, event, module, symbol, offset, addr, maxactive, tuple(args),
                     suffix, exp_group, exp_event, fentry=fentry, text=text)


def _validate_probe_symbol(kernel: KernelView | None, module: str | None, sym: str,
                           count_symbol: Callable[[str], int] | None, t0: int) -> None:
    """6.12+ ``validate_probe_symbol()``, before the return-probe check: ``SYM`` counted in
    vmlinux and the modules (7.3: vmlinux alone when it has the name), ``MOD:SYM`` in MOD
    when MOD is loaded; none is BAD_PROBE_ADDR, several NON_UNIQ_SYMBOL, both -EINVAL."""
    if module is not None:
        n = kernel.module_count(module, sym) if kernel and kernel.module_count else None
    else:
        n = count_symbol(sym) if count_symbol is not None else None
    if n is None:
        return
    if n > 1:
        raise ParseFail("The symbol is not unique", t0)
    if n == 0:
        raise ParseFail("Invalid probed address or symbol", t0)


def format_kprobe(spec: ProbeSpec) -> str:
    """Write a ``p``/``r`` spec back as its line (``format(parse(s)) == s``)."""
    head = spec.kind + (str(spec.maxactive) if spec.maxactive else "")
    if spec.explicit_group or spec.explicit_event:
        head += ":" + (f"{spec.group}/" if spec.explicit_group else "")
        head += spec.event if spec.explicit_event else ""
    if spec.symbol is None:
        target = f"0x{(spec.addr or 0):x}"
    else:
        target = f"{spec.symbol_name}" + (f"+0x{spec.offset:x}" if spec.offset else "")
        target += "%return" if spec.return_suffix else ""
    args = [(f"{a.name}=" if a.explicit_name else "") + arg_text(a, spec.is_return)
            for a in spec.args]
    return " ".join([head, target] + args)


def kernel_format_kprobe(spec: ProbeSpec) -> str:
    """The line ``cat kprobe_events`` shows for ``spec`` (``trace_kprobe_show()``).

    Always ``r`` for return probes, the group and event spelled out, ``SYM+%u`` in decimal
    and every argument as ``NAME=COMM``. Raw addresses print through ``%p``, which the guest
    hashes unless booted with ``no_hash_pointers``; this shows the unhashed value.
    """
    head = "r" if spec.is_return else "p"
    head += str(spec.maxactive) if spec.is_return and spec.maxactive else ""
    if spec.symbol is None:
        target = f"0x{(spec.addr or 0):016x}"
    else:
        target = f"{spec.symbol_name}" + (f"+{spec.offset}" if spec.offset else "")
    args = "".join(f" {a.name}={arg_text(a, spec.is_return)}" for a in spec.args)
    return f"{head}:{spec.group}/{spec.event} {target}{args}"

