"""The ``e`` lines of ``dynamic_events``, as ``kernel/trace/trace_eprobe.c`` reads them.

``__trace_eprobe_create()`` of Linux 6.12 (Debian's ``linux-source-6.12``, 6.12.117) and
``trace_eprobe_create_internal()`` of 7.3 (7.3.4)::

    e[:[GRP/][EVENT]] SYSTEM.EVENT [FETCHARGS] [if FILTER]

- ``SYSTEM.EVENT`` (or ``SYSTEM/EVENT``) names an existing trace event, the attached one;
  without both parts the line is NO_EVENT_INFO, an event the kernel lacks
  BAD_ATTACH_EVENT (-ENODEV). The default group is ``eprobes``, the default event name the
  attached event's.
- arguments are parsed with ``TPARG_FL_KERNEL | TPARG_FL_TEVENT`` and nothing expanded
  (no ``$arg*``, no ``%pd``): ``$FIELD`` reads a field of the attached event's record
  (``FETCH_OP_TP_ARG``; its own fields only, not ``common_*``), ``$comm`` is
  ``current->comm`` *without* the string type forced (untyped, it records the address),
  ``@SYM``, immediates and dereferences as usual, no ``%REG``, no ``$argN``. 7.3 also takes
  a bare ``FIELD`` (an unknown one is NO_EVENT_FIELD) and typecasts of fields; 6.12 takes
  a bare name for a BTF argument and refuses it (NOSUP_BTFARG).
- an untyped field is ``u64`` (``find_fetch_type(NULL)``), whatever the field's type.
- ``if FILTER``: the rest of the line, joined by single spaces, is an event filter on the
  attached event's record (``trace_eprobe_parse_filter()``, checked with
  ``create_event_filter()``); nothing after ``if`` is NO_EP_FILTER.
  :mod:`harness.kernel.evfilter` parses and evaluates it.

The event fires when the attached event's record is complete: the eprobe is a trigger on
that event (``enable_eprobe()``, ``eprobe_trigger_func()``), called from
``event_triggers_call()`` in ``trace_event_buffer_commit()`` with the record
(:mod:`harness.backends.host` mirrors it there).
"""
from __future__ import annotations

import errno as E

from ..evfilter import FilterError, parse_filter
from ..rules import rules_for
from .args import FL_KERNEL, FL_TEVENT
from .common import (FILTER_SUBSYSTEM, MAX_TRACE_ARGS, KernelView, ParseFail, ProbeSpec, arg_text, context_args,
                     parse_event_name)

__all__ = ["EPROBE_EVENT_SYSTEM", "parse_eprobe", "format_eprobe", "kernel_format_eprobe"]

EPROBE_EVENT_SYSTEM = "eprobes"


def _system_event(word: str) -> tuple[str, str] | None:
    """``traceprobe_parse_event_name(&sys_event, &sys_name, buf, 0)`` for the attached
    event: (system, event), or None when either is missing or malformed (the kernel logs
    its own error, then NO_EVENT_INFO over it)."""
    try:
        group, event, explicit_group, explicit_event = parse_event_name(word, 0)
    except ParseFail:
        return None
    if not explicit_group or not explicit_event:
        return None
    return group, event


def parse_eprobe(toks: list[tuple[int, str]], text: str,
                 kernel: KernelView | None = None) -> ProbeSpec:
    """One ``e`` line (``[(column, word)]``, at least two words) as its kernel parses it.

    :raise ParseFail: with the ``error_log`` text and column the kernel logs.
    """
    rules = kernel.rules if kernel is not None else rules_for("6.12")
    h0, head = toks[0]
    group, name, exp_group, exp_event = EPROBE_EVENT_SYSTEM, "", False, False
    colon = head.find(":", 1)                   # strchr(&argv[0][1], ':')
    if colon >= 0:
        g, name, exp_group, exp_event = parse_event_name(head[colon + 1:], h0 + colon + 1)
        group = g if exp_group else EPROBE_EVENT_SYSTEM
    t0, target = toks[1]
    attached = _system_event(target)
    if attached is None:
        raise ParseFail(rules.message("NO_EVENT_INFO"), t0)
    system, event = attached
    if not exp_event:
        name = event                            # strscpy(buf1, sys_event)
    words = toks
    filter_at = next((i for i in range(2, len(toks)) if toks[i][1] == "if"), None)
    if filter_at is not None:
        words = toks[:filter_at]
    if len(words) - 2 > MAX_TRACE_ARGS:
        if rules.too_many_args == "TOO_MANY_ARGS":
            raise ParseFail(rules.message("TOO_MANY_ARGS"), toks[2][0], E.E2BIG)
        raise ParseFail("Too many arguments (more than 128)", toks[2][0], E.E2BIG,
                        logged=False)
    fmt = None
    if kernel is not None and kernel.event_format is not None:
        # find_and_get_event(): the system and the event's name must both match
        fmt = kernel.event_format(system, event)
        if fmt is None:
            raise ParseFail(rules.message("BAD_ATTACH_EVENT"), t0, E.ENODEV)
    filt = None
    if filter_at is not None:
        rest = toks[filter_at + 1:]
        if not rest:
            raise ParseFail(rules.message("NO_EP_FILTER"),
                            len(" ".join(t for _, t in toks)) + 1)
        ftext = " ".join(t for _, t in rest)
        try:
            filt = parse_filter(ftext, fmt.fields if fmt is not None else None)
        except FilterError as exc:
            # create_event_filter() logs under "event filter parse error" with the filter
            # as its command; the write fails with EINVAL
            # the error_log's command is the filter itself, the caret in it
            raise ParseFail(str(exc), exc.pos, E.EINVAL, words=[ftext],
                            subsystem=FILTER_SUBSYSTEM) from None
    fields = None
    if fmt is not None:
        fields = {n: f for n, f in fmt.fields.items() if not n.startswith("common_")}
    args = context_args(words, text, kernel, rules, FL_KERNEL | FL_TEVENT, None,
                        event_fields=fields, eprobe=True)
    return ProbeSpec("e", group, name, None, None, 0, None, 0, tuple(args), False,
                     exp_group, exp_event, text=text, attach=(system, event), filter=filt)


def format_eprobe(spec: ProbeSpec) -> str:
    """Write an ``e`` spec back as its line (``format(parse(s)) == s``)."""
    head = "e"
    if spec.explicit_group or spec.explicit_event:
        head += ":" + (f"{spec.group}/" if spec.explicit_group else "")
        head += spec.event if spec.explicit_event else ""
    system, event = spec.attach or ("", "")
    args = [(f"{a.name}=" if a.explicit_name else "") + arg_text(a, False) for a in spec.args]
    tail = ["if", spec.filter.text] if spec.filter is not None else []
    return " ".join([head, f"{system}.{event}"] + args + tail)


def kernel_format_eprobe(spec: ProbeSpec) -> str:
    """The line ``cat dynamic_events`` shows for ``spec`` (``eprobe_dyn_event_show()``:
    ``e:GRP/EVENT SYSTEM.EVENT`` and the arguments; the filter is not shown)."""
    system, event = spec.attach or ("", "")
    args = "".join(f" {a.name}={arg_text(a, False)}" for a in spec.args)
    return f"e:{spec.group}/{spec.event} {system}.{event}{args}"
