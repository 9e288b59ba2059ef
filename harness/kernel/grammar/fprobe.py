"""The ``f`` lines of ``dynamic_events``, as ``kernel/trace/trace_fprobe.c`` reads them.

``__trace_fprobe_create()`` of Linux 6.12 (Debian's ``linux-source-6.12``, 6.12.117) and
``trace_fprobe_create_internal()`` of 7.3 (7.3.4), with their ``parse_symbol_and_return()``::

    f[:[GRP/][EVENT]] [MOD:]KSYM [FETCHARGS]
    f[MAXACTIVE][:[GRP/][EVENT]] [MOD:]KSYM%return [FETCHARGS]     (MAXACTIVE: 6.12 only)

- ``KSYM`` is an ftrace filter (``register_fprobe(fp, filter, NULL)``): a glob such as
  ``vfs_rea*`` probes every function of ``available_filter_functions`` it matches. Nothing
  checks it while parsing; a filter matching nothing fails at registration
  (:mod:`harness.backends.tracelayer`).
- ``$retval`` in an argument makes the probe an exit probe without ``%return``.
- the default group is ``fprobes``; the default event ``KSYM__entry`` or ``KSYM__exit``,
  ``sanitize_event_name()``'d (``:``, ``.`` and ``*`` after the first character become ``_``).
- arguments are parsed with ``TPARG_FL_KERNEL | TPARG_FL_FPROBE`` and ``TPARG_FL_FENTRY``
  or ``TPARG_FL_RETURN``: ``$argN``, BTF names, ``$stackN``, ``$comm``, memory, but no
  ``%REG`` (``parse_probe_arg()``: "eprobe and fprobe do not handle registers").

Tracepoint probes share the file and the parser::

    t[:[GRP/][EVENT]] TRACEPOINT [FETCHARGS]

an fprobe on the tracepoint's stub ``__probestub_TP`` (:func:`probestub`), which the
event puts on the tracepoint: group ``tracepoints``, event ``TP``, no ``%return`` and no
``$retval`` (RETVAL_ON_PROBE), only ``[A-Za-z0-9_]`` in the name (BAD_TP_NAME), and the
stub's first argument, ``void *__data``, hidden (``TPARG_FL_TPOINT``: ``$arg1`` and BTF
names start at its second).
"""
from __future__ import annotations

from ..rules import rules_for
from .args import FL_FENTRY, FL_FPROBE, FL_KERNEL, FL_RETURN, FL_TPOINT
from .common import (MAX_EVENT_NAME_LEN, KernelView, ParseFail, ProbeSpec, arg_text,
                     context_args, parse_event_name)

__all__ = ["FPROBE_EVENT_SYSTEM", "TRACEPOINT_EVENT_SYSTEM", "RETHOOK_MAXACTIVE_MAX",
           "parse_fprobe", "format_fprobe", "kernel_format_fprobe", "fprobe_event_name",
           "tprobe_event_name", "probestub"]

FPROBE_EVENT_SYSTEM = "fprobes"
TRACEPOINT_EVENT_SYSTEM = "tracepoints"
RETHOOK_MAXACTIVE_MAX = 4096            # trace_fprobe.c (6.12)


def fprobe_event_name(symbol: str, is_return: bool) -> str:
    """``"%s__%s"`` of the symbol and ``entry``/``exit``, then ``sanitize_event_name()``
    (kernel/trace/trace.h), cut to ``MAX_EVENT_NAME_LEN - 1`` as ``snprintf()`` cuts it."""
    name = f"{symbol}__{'exit' if is_return else 'entry'}"[:MAX_EVENT_NAME_LEN - 1]
    return name[:1] + "".join("_" if c in ":.*" else c for c in name[1:])


def _retval_arg(word: str) -> bool:
    """``strstr(argv[i], "$retval")`` followed by neither an alphanumeric nor ``_``."""
    at = word.find("$retval")
    if at < 0:
        return False
    nxt = word[at + 7:at + 8]
    return not (nxt.isascii() and (nxt.isalnum() or nxt == "_"))


def probestub(tracepoint: str) -> str:
    """The function a tracepoint probe is an fprobe on: ``__probestub_TP``, which
    ``DEFINE_TRACE_FN()`` makes with the tracepoint's prototype after a hidden
    ``void *__data`` (include/linux/tracepoint.h), and which ``t`` events put on the
    tracepoint (trace_fprobe.c: ``__regsiter_tracepoint_fprobe()`` / 7.3's
    ``__register_tracepoint_fprobe()``)."""
    return f"__probestub_{tracepoint}"


def parse_fprobe(toks: list[tuple[int, str]], text: str,
                 kernel: KernelView | None = None) -> ProbeSpec:
    """One ``f`` or ``t`` line (``[(column, word)]``, at least two words) as its kernel
    parses it.

    :raise ParseFail: with the ``error_log`` text and column the kernel logs.
    """
    rules = kernel.rules if kernel is not None else rules_for("6.12")
    h0, head = toks[0]
    tracepoint = head[0] == "t"
    maxactive = 0
    event: str | None = None
    event_col = 0
    if rules.fprobe == "fgraph":
        # 7.3: anything but ':' after the 'f' is BAD_MAXACT (no exit instance pool)
        if len(head) > 1:
            if head[1] != ":":
                raise ParseFail(rules.message("BAD_MAXACT"), h0 + 1)
            event, event_col = head[2:], h0 + 2
    else:
        colon = head.find(":", 1)
        if colon >= 0:
            event, event_col = head[colon + 1:], h0 + colon + 1
        if head[1:2].isascii() and head[1:2].isdigit():
            digits = head[1:colon] if colon >= 0 else head[1:]
            n = _kstrtouint(digits) if len(digits) <= MAX_EVENT_NAME_LEN - 1 else None
            if not n:
                raise ParseFail(rules.message("BAD_MAXACT"), h0 + 1)
            if n > RETHOOK_MAXACTIVE_MAX:
                raise ParseFail(rules.message("MAXACT_TOO_BIG"), h0 + 1)
            maxactive = n

    # parse_symbol_and_return()
    t0, target = toks[1]
    pct = target.find("%")
    suffix = False
    if pct >= 0:
        if tracepoint or target[pct:] != "%return":
            raise ParseFail(rules.message("BAD_ADDR_SUFFIX"), t0 + pct)
        symbol, suffix = target[:pct], True
    else:
        symbol = target
    implicit = False
    if not suffix:
        if tracepoint:
            bad = next((i for i, c in enumerate(symbol)
                        if not (c.isascii() and (c.isalnum() or c == "_"))), None)
            if bad is not None:
                raise ParseFail(rules.message("BAD_TP_NAME"), t0 + bad)
        for col, word in toks[2:]:
            if _retval_arg(word):
                if tracepoint:
                    raise ParseFail(rules.message("RETVAL_ON_PROBE"), col + word.find("$retval"))
                implicit = True
                break
    is_return = suffix or implicit
    if not is_return and maxactive:
        raise ParseFail(rules.message("BAD_MAXACT_TYPE"), h0 + 1)

    default = TRACEPOINT_EVENT_SYSTEM if tracepoint else FPROBE_EVENT_SYSTEM
    group, exp_group, exp_event = default, False, False
    name = ""
    if event is not None:
        g, name, exp_group, exp_event = parse_event_name(event, event_col)
        group = g if exp_group else default
    if not exp_event:
        name = tprobe_event_name(symbol) if tracepoint else fprobe_event_name(symbol, is_return)
    flags = FL_KERNEL | FL_FPROBE | (FL_RETURN if is_return else FL_FENTRY)
    funcname = symbol
    if tracepoint:
        flags |= FL_TPOINT
        # find_tracepoint(): the BTF prototype is its stub's; a tracepoint the kernel lacks
        # may come with a module later (TRACEPOINT_STUB): the name as it is
        count = kernel.count_symbol if kernel is not None else None
        if count is None or count(probestub(symbol)):
            funcname = probestub(symbol)
    args = context_args(toks, text, kernel, rules, flags, funcname)
    return ProbeSpec("t" if tracepoint else "f", group, name, None, symbol, 0, None, maxactive,
                     tuple(args), suffix, exp_group, exp_event, fentry=not is_return,
                     text=text, implicit_return=implicit)


def tprobe_event_name(tracepoint: str) -> str:
    """``"%s%s"`` of ``_`` before a leading digit and the tracepoint, sanitized."""
    name = (("_" if tracepoint[:1].isdigit() else "") + tracepoint)[:MAX_EVENT_NAME_LEN - 1]
    return name[:1] + "".join("_" if c in ":.*" else c for c in name[1:])


def _kstrtouint(s: str) -> int | None:
    """``kstrtouint(buf, 0, &v)``: decimal, ``0x`` hex or ``0`` octal, fitting 32 bits."""
    try:
        v = int(s, 16) if s[:2].lower() == "0x" else int(s, 8) if s[:1] == "0" and \
            len(s) > 1 else int(s, 10)
    except ValueError:
        return None
    if not s or not s.isascii() or s[:1] in "+-" or v > 0xFFFFFFFF:
        return None
    return v


def format_fprobe(spec: ProbeSpec) -> str:
    """Write an ``f`` spec back as its line (``format(parse(s)) == s``)."""
    head = spec.kind + (str(spec.maxactive) if spec.maxactive else "")
    if spec.explicit_group or spec.explicit_event:
        head += ":" + (f"{spec.group}/" if spec.explicit_group else "")
        head += spec.event if spec.explicit_event else ""
    target = (spec.symbol or "") + ("%return" if spec.return_suffix else "")
    args = [(f"{a.name}=" if a.explicit_name else "") + arg_text(a, spec.is_return)
            for a in spec.args]
    return " ".join([head, target] + args)


def kernel_format_fprobe(spec: ProbeSpec) -> str:
    """The line ``cat dynamic_events`` shows for ``spec`` (``trace_fprobe_show()``)."""
    head = spec.kind + (str(spec.maxactive) if spec.is_return and spec.maxactive else "")
    args = "".join(f" {a.name}={arg_text(a, spec.is_return)}" for a in spec.args)
    return (f"{head}:{spec.group}/{spec.event} {spec.symbol}"
            f"{'%return' if spec.is_return else ''}{args}")
