"""Event triggers the harness mirrors on both sides: ``stacktrace`` (kernel/trace/
trace_events_trigger.c, 6.1, 6.12 and 7.3).

``echo 'stacktrace[:N]' > events/GROUP/EVENT/trigger`` makes the kernel save a stack trace
after each record of the event (a post trigger: ``event_triggers_post_call()`` ->
``stacktrace_trigger()`` -> ``__trace_stack()``), N times at most
(``stacktrace_count_trigger()`` counts down, whether or not the record reaches the
buffer). The trace shows it after the event as ``<stack trace>`` and one ``=> FUNCTION``
per frame, innermost first: the kernel's own frames from its trigger down through its
probe machinery (``kprobe_trace_func``, ``kprobe_ftrace_handler``, ``ftrace_regs_call``
...), then the probed context's.

The guest side writes the trigger and reads the ``kernel_stack`` entries that follow its
events (``harness.backends.events``); the host side takes ``regs.stack_trace()`` at each
hit, the count kept the same way (``harness.backends.host``). ``harness.diff.verdict``
compares the two frame for frame from the probed context down (``stack-machinery``).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ..errors import SetupError

__all__ = ["parse_triggers", "resolve", "check_counts", "UNLIMITED"]

UNLIMITED = -1
_TRIGGER = re.compile(r"^stacktrace(?::(\d+))?$")


def parse_triggers(items: Sequence[str]) -> dict[str, int]:
    """``EVENT=stacktrace[:N]`` items as ``{EVENT: N}`` (``UNLIMITED`` without ``:N``).
    ``EVENT`` is ``GROUP/EVENT`` or an event name.

    :raise SetupError: an item of another shape, or another trigger command (the
        harness mirrors ``stacktrace`` only).
    """
    out: dict[str, int] = {}
    for item in items:
        event, eq, cmd = item.partition("=")
        m = _TRIGGER.match(cmd.strip())
        if not eq or not event.strip() or m is None:
            raise SetupError(f"--trigger {item!r}: not EVENT=stacktrace[:N]",
                             "write e.g. --trigger kprobes/open=stacktrace:5 (the harness "
                             "mirrors the stacktrace trigger only)")
        n = int(m[1]) if m[1] is not None else UNLIMITED
        if n == 0:
            raise SetupError(f"--trigger {item!r}: stacktrace:0 never fires",
                             "give a count of 1 or more, or none")
        out[event.strip()] = n
    return out


def check_counts(triggers: Mapping[str, int], specs: Sequence[Any]) -> None:
    """A count on a return probe's trigger is not compared: a call entered before the
    window returns into the guest's return probe inside it and runs the count down there
    (``event_trigger_count()``), while the host, armed at the window, never saw that call.

    :raise SetupError: such a trigger.
    """
    names = [f"{s.group}/{s.event}" for s in specs if s.kind != "-"]
    trig = resolve(triggers, names)
    bad = sorted(f"{s.group}/{s.event}" for s in specs
                 if s.kind != "-" and s.is_return and trig.get(f"{s.group}/{s.event}", -1) > 0)
    if bad:
        raise SetupError(f"--trigger: a count on a return probe's trigger is not compared "
                         f"({', '.join(bad)}): calls entered before the window run it down "
                         "in the guest only",
                         "give the trigger no count (stacktrace) on return probes")


def resolve(triggers: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    """``triggers`` keyed by the ``GROUP/EVENT`` of ``names`` they name (an event name
    alone names every group's event of that name).

    :raise SetupError: a trigger on an event no line defines.
    """
    out: dict[str, int] = {}
    for key, n in triggers.items():
        hits = [nm for nm in names if nm == key or nm.split("/", 1)[-1] == key]
        if not hits:
            raise SetupError(f"--trigger: no probe line defines the event {key!r}",
                             "name the GROUP/EVENT or EVENT of one of the lines")
        out.update({nm: n for nm in hits})
    return out
