"""Event probes (``e`` lines) on either host engine: where the kernel runs them, and how a
hit there is taken for one of them (kernel/trace/trace_eprobe.c, 6.12 and 7.3).

An event probe is a trigger on the attached event (``enable_eprobe()``), run by
``event_triggers_call()`` from ``trace_event_buffer_commit(fbuffer)`` once the record is
complete; its filter is tested on the record first (``filter_match_preds()``). Host-side
both engines put a probe at ``trace_event_buffer_commit()`` for each line and fetch, with
the line's own arguments, a few more values from the same stop, the *trigger arguments*
(:func:`trigger_args`): ``fbuffer->trace_file->tr`` (the top trace instance's events
only), ``fbuffer->trace_file->event_call->event.type`` (the attached event's ID), and each
field the filter reads. :func:`triggered` then says whether the kernel's trigger ran. The
gdbstub engine evaluates them at the stop, the plugin engine from its capture: one
program, one rule, both engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..kernel.grammar import ProbeArg, ProbeSpec
from ..kernel.grammar.fetch import TASK_SIZE_MAX, Reg

__all__ = ["COMMIT", "CommitSite", "trigger_args", "triggered"]

#: where the kernel runs event probes' triggers (kernel/trace/trace.c)
COMMIT = "trace_event_buffer_commit"


@dataclass(frozen=True)
class CommitSite:
    """Offsets (from the kernel's BTF) and the top trace instance's address
    (``global_trace``) that :func:`trigger_args` reads through."""

    entry: int      # struct trace_event_buffer: entry (the record)
    file: int       # struct trace_event_buffer: trace_file
    call: int       # struct trace_event_file: event_call
    tr: int         # struct trace_event_file: tr
    type: int       # struct trace_event_call: event.type (the event's ID)
    top: int        # &global_trace

    @classmethod
    def of(cls, btf: Any, symbols: Any) -> "CommitSite":
        return cls(btf.offset("trace_event_buffer", "entry"),
                   btf.offset("trace_event_buffer", "trace_file"),
                   btf.offset("trace_event_file", "event_call"),
                   btf.offset("trace_event_file", "tr"),
                   btf.offset("trace_event_call", "event.type"),
                   symbols.lookup("global_trace").addr)


#: include/linux/sched.h: the generic ``comm`` predicate passes current->comm with this
#: length (filter_pred_comm()); the kernel keeps the name zero-padded (strscpy_pad() in
#: __set_task_comm(), a fork's copy of its parent's)
TASK_COMM_LEN = 16


def _arg(name: str, type_: str, code: tuple, count: int = 0) -> ProbeArg:
    return ProbeArg(name, Reg("di"), type_, count=count, code=code + (("end",),))


def _field_code(pred: Any) -> tuple[tuple, str, int]:
    """A filter predicate's field as ``filter_pred_*()`` reads it: (code, type, count).
    A ``char[N]`` field is its N bytes (filter_pred_string() passes them all, with N as
    the length), a string elsewhere its text up to the NUL."""
    if pred.kind == "comm":
        return (("comm",), ("st_string", 0)), "string", 0
    kind = pred.kind
    off = pred.offset
    if kind == "rdyn":
        # filter_pred_strrelloc(): the string is after the u32 (get_event_field() takes
        # it from the field's own address): the same as a __data_loc relative to off + 4
        kind = "rdyn4"
    tp = ("tp_arg", pred.field, off, pred.size, pred.signed, kind)
    if kind == "static":
        return (tp, ("st_mem", 0, 1), ("lp_array", pred.size)), "u8", pred.size
    if kind in ("dyn", "rdyn4", "ptr"):
        return (tp, ("st_string", 0)), "string", 0
    return (tp, ("st_raw", 0, 8)), "x64", 0


def trigger_args(spec: ProbeSpec, site: CommitSite) -> tuple[ProbeArg, ...]:
    """The values :func:`triggered` needs, as fetch arguments at
    ``trace_event_buffer_commit(fbuffer)``: the trace instance, the event's ID, then each
    filter predicate's field (a ``cpu`` predicate reads the hit's CPU instead)."""
    out = [_arg("tr", "x64", (("reg", "di"), ("deref", site.file), ("deref", site.tr),
                              ("st_raw", 0, 8))),
           _arg("type", "u32", (("reg", "di"), ("deref", site.file), ("deref", site.call),
                                ("st_mem", site.type, 4)))]
    for i, pred in enumerate(spec.filter.predicates() if spec.filter is not None else []):
        if pred.kind == "ptr":      # the pointer too: test_string() takes kernel ones only
            out.append(_arg(f"p{i}", "x64", (("tp_arg", pred.field, pred.offset, 8, False,
                                              "int"), ("st_raw", 0, 8))))
        if pred.kind in ("dyn", "rdyn"):    # the u32 too: its high half is the length
            out.append(_arg(f"l{i}", "u32", (("tp_arg", pred.field, pred.offset, 4, False,
                                              "int"), ("st_raw", 0, 4))))
        if pred.kind != "cpu":
            code, t, n = _field_code(pred)
            out.append(_arg(f"f{i}", t, code, n))
    return tuple(out)


def _as_bytes(v: Any) -> bytes | None:
    """A u8 array's elements as bytes; None when an element did not read."""
    return bytes(v) if isinstance(v, list) and all(isinstance(x, int) for x in v) else None


def _sized(text: Any, length: int) -> tuple[bytes, int] | None:
    """(the bytes a string predicate passes, its length) from the text up to its NUL: the
    bytes after the NUL as zeros (the name's padding; a __data_loc string's NUL)."""
    if not isinstance(text, (bytes, bytearray)):
        return None
    return (bytes(text) + b"\0" * max(0, length - len(text)))[:max(length, len(text))], length


def triggered(spec: ProbeSpec, event_id: int, site: CommitSite, values: Sequence[Any],
              cpu: int) -> bool:
    """Whether the kernel's trigger for ``spec`` ran at this commit: the record is the
    attached event's in the top instance, and the filter matches it. ``values`` are
    :func:`trigger_args`' as ``evaluate()`` gave them."""
    if spec.filter is not None and spec.filter.tree is None:
        raise ValueError(f"{spec.text!r}: its filter was not parsed for the booted kernel")
    if values[0] != site.top or values[1] != event_id:
        return False
    preds = spec.filter.predicates() if spec.filter is not None else []
    if not preds:
        return True
    it = iter(values[2:])
    got: dict[int, Any] = {}
    for p in preds:
        if p.kind == "cpu":
            got[id(p)] = cpu
        elif p.kind == "ptr":
            # filter_pred_pchar(): test_string() copies with strncpy_from_kernel_nofault(),
            # which refuses a user address (copy_from_kernel_nofault_allowed()); a string
            # it cannot copy makes the predicate false, whatever its operator
            ptr, text = next(it), next(it)
            got[id(p)] = text if ptr >= TASK_SIZE_MAX and isinstance(text, bytes) else None
        elif p.kind in ("dyn", "rdyn"):
            # filter_pred_strloc()/strrelloc(): the length is the u32's high half
            item, text = next(it), next(it)
            got[id(p)] = _sized(text, item >> 16) if isinstance(item, int) else None
        elif p.kind == "static":
            # filter_pred_string(): the field's bytes, all of them, field->size the length
            raw = _as_bytes(next(it))
            got[id(p)] = None if raw is None else (raw, p.size)
        elif p.kind == "comm":
            got[id(p)] = _sized(next(it), TASK_COMM_LEN)    # filter_pred_comm()
        else:
            got[id(p)] = next(it)
    return spec.filter.match(lambda p: got[id(p)])
