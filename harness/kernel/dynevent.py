"""What Linux 6.1's trace-event layer decides between a parsed line and ``register_kprobe()``.

:mod:`harness.kernel.grammar` is the parser (``__trace_kprobe_create()`` up to its last argument);
this module is the rest of writing a line to ``kprobe_events`` / ``uprobe_events``, the part
that depends on what exists already (pure: tables in, a :class:`Refusal` or None out):

- :func:`target_refusal`: ``number_of_same_symbols()`` for an unqualified ``SYM``
  (kernel/trace/trace_kprobe.c: ``__trace_kprobe_create()``): none is ENOENT "Invalid probed
  address or symbol", several EADDRNOTAVAIL "The symbol is not unique". The kernel counts in
  vmlinux *and* every loaded module (``module_kallsyms_on_each_symbol()``).
- :class:`EventTable`: ``register_trace_kprobe()`` / ``register_trace_uprobe()`` with
  ``append_trace_kprobe()``, ``trace_probe_compare_arg_type()`` (trace_probe.c) and
  ``trace_kprobe_has_same_kprobe()``: a line naming an existing event of the same kind is
  appended only when the probe type and every argument's name, type and array count
  match, else EEXIST with "Probe type is different from existing probe", "Argument type or
  name is different from existing probe" or "There is already the exact same probe event"
  (same target and every argument's text); an event name any other event uses is EEXIST
  "Given group/event name is already used by another event" (``trace_probe_register_
  event_call()``: ``find_trace_event_call()``).
- :func:`resolve_fetch_symbols`: ``traceprobe_update_arg()`` at register time: every
  ``@SYM[+|-OFFS]`` resolved once with ``kallsyms_lookup_name()``; an unknown (or empty)
  name is ENOENT, a bad offset EINVAL.
- :func:`registration_refusal`: what ``__trace_kprobe_create()`` logs for a failed
  ``register_trace_kprobe()`` (-ENOENT BAD_PROBE_ADDR, -EILSEQ BAD_INSN_BNDRY, other
  FAIL_REG_PROBE; -EEXIST and -ENOMEM log their own), and the ENOENT it forgives:
  ``!trace_kprobe_module_exist()`` (a raw address, or ``MOD:SYM`` of a module not loaded)
  keeps the event, unregistered ("This probe might be able to register after target
  module is loaded. Continue.").

Columns are those of the kernel's ``error_log`` caret (``__trace_probe_log_err()``: the
start of argument ``index`` of the line, or one past its end when there is no such
argument), taken in the line as written, its words joined by single spaces (the kernel
logs ``argv`` joined so). Each refusal is logged under the name of the parser of its
line's kind (:func:`subsystem_of`), or not at all (``Refusal.logged``); the few refusals
whose words a side cannot know are named in :data:`UNKNOWN_WORDS`.

All of this was checked in the booted 6.1.192 guest (``tests/vm/test_fidelity.py``).
"""
from __future__ import annotations

import dataclasses
import errno as _errno
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

from .grammar import (ProbeArg, ProbeSpec, format as format_spec, guest_line, render_body,
                      split_symbol_offset)
from .grammar.common import DYNEVENT_SUBSYSTEM, FILTER_SUBSYSTEM, SUBSYSTEM  # noqa: F401

__all__ = ["Refusal", "EventTable", "target_refusal", "resolve_fetch_symbols",
           "registration_refusal", "module_pending", "arg_column", "subsystem_of",
           "UNKNOWN_WORDS", "WORDS_MODULE", "events_file_of", "events_file", "line_files",
           "RELEASED"]

#: The probe families (:func:`_family`) a ``-:`` line written to each tracefs file frees:
#: the file's own ``dyn_event_operations`` (kernel/trace/trace_kprobe.c:
#: create_or_delete_trace_kprobe() -> dyn_event_release(raw_command, &trace_kprobe_ops),
#: trace_uprobe.c: create_or_delete_trace_uprobe() with &trace_uprobe_ops), every kind
#: through ``dynamic_events`` (trace_dynevent.c: create_dyn_event() ->
#: dyn_event_release(raw_command, NULL)); Debian's 6.12.117 and 7.3.4.
RELEASED = {"kprobe_events": frozenset("k"), "uprobe_events": frozenset("u"),
            "dynamic_events": frozenset("kufe")}


def events_file_of(line: str, defined: Mapping[str, Collection[str]] | None = None) -> str:
    """The tracefs file a written line goes to, by its first word as
    trace_parse_run_command() splits it (leading blanks skipped): ``dynamic_events`` for
    an ``f``, ``t`` or ``e`` line; ``uprobe_events`` for a path target; else
    ``kprobe_events``. A ``-:`` line goes where the events it names were defined
    (``defined``: ``GROUP/EVENT`` -> the files of its lines, :func:`line_files`), since
    each file frees its own kind only (:data:`RELEASED`), and to ``dynamic_events`` when
    they were defined in more than one; naming none of them, by its arguments as above."""
    toks = line.split()
    head = toks[0] if toks else ""
    if head[:1] in "fte":
        return "dynamic_events"
    if head.startswith("-:") and defined:
        group, _, event = head[2:].rpartition("/")
        files = {f for name, fs in defined.items()
                 if (not event or name.rpartition("/")[2] == event)
                 and (not group or name.rpartition("/")[0] == group) for f in fs}
        if files:
            return files.pop() if len(files) == 1 else "dynamic_events"
    return "uprobe_events" if len(toks) > 1 and "/" in toks[1] else "kprobe_events"


def events_file(spec: ProbeSpec, defined: Mapping[str, Collection[str]] | None = None) -> str:
    """:func:`events_file_of` the line written for ``spec`` (:func:`guest_line`)."""
    return events_file_of(guest_line(spec), defined)


def line_files(specs: Sequence[ProbeSpec]) -> dict[str, set[str]]:
    """``GROUP/EVENT`` -> the files its defining lines of ``specs`` go to (refused ones
    too: ``e:G/E`` then ``p:G/E``, EEXIST, is two files): where a batch's ``-:`` lines go
    (:func:`events_file_of`), the same on every side."""
    out: dict[str, set[str]] = {}
    for s in specs:
        if s.kind != "-":
            out.setdefault(f"{s.group}/{s.event}", set()).add(events_file(s))
    return out


#: The error_log texts (``ERRORS`` in kernel/trace/trace_probe.h) this module uses.
BAD_PROBE_ADDR = "Invalid probed address or symbol"
NON_UNIQ_SYMBOL = "The symbol is not unique"
EVENT_EXIST = "Given group/event name is already used by another event"
BAD_INSN_BNDRY = "Probe point is not an instruction boundary"
FAIL_REG_PROBE = "Failed to register probe event"
DIFF_PROBE_TYPE = "Probe type is different from existing probe"
DIFF_ARG_TYPE = "Argument type or name is different from existing probe"
SAME_PROBE = "There is already the exact same probe event"
#: validate_ref_ctr_offset() only pr_warn()s this; error_log has no entry.
REF_CTR_MISMATCH = "Reference counter offset mismatch."

_SPACE = re.compile(r"[^ \t\n\v\f\r]+")


#: The refusals whose ``error_log`` words one side cannot know, by the name an
#: ``Outcome.words`` gives (``harness.records.Outcome``), each with the kernel source that
#: makes them unknowable there. Every other refusal carries the kernel's words on both
#: sides (read from the guest's ``error_log``, or predicted host-side), and they are
#: compared exactly.
WORDS_MODULE = "module-errno"
UNKNOWN_WORDS = {
    WORDS_MODULE: (
        "the module backend (kph_kprobes.ko) calls register_kprobe()/register_kretprobe() "
        "itself (kernel/kprobes.c): they return an errno and log nothing to error_log; "
        "what kprobe_events would log around them is the trace layer's prediction, not the "
        "kernel's word (harness.backends.module)"),
}


@dataclass(frozen=True)
class Refusal:
    """The kernel refusing a line: the write's errno, the ``error_log`` text, the caret.

    ``subsystem`` names the logger when it is not the parser of the line's kind
    (:func:`subsystem_of`): an event filter, 7.3's ``dynevent``. ``logged`` is False when
    the kernel writes no ``error_log`` entry (``message`` is then the write's
    ``strerror()`` text; the reason, where the side knows one, goes elsewhere)."""

    errno: int
    message: str
    column: int = 0
    subsystem: str = ""
    logged: bool = True

    @property
    def errno_name(self) -> str:
        return _errno.errorcode.get(self.errno, str(self.errno))

    @classmethod
    def silent(cls, errno: int) -> "Refusal":
        """A refusal the kernel logs nothing for: the write fails with ``errno``."""
        return cls(errno, os.strerror(errno), -1, "", False)

    def words(self, spec: ProbeSpec) -> tuple[str, str, int]:
        """(subsystem, message, column) as ``error_log`` shows this refusal of ``spec``
        (``("", strerror, -1)`` when it logs nothing)."""
        if not self.logged:
            return "", os.strerror(self.errno), -1
        return self.subsystem or subsystem_of(spec), self.message, self.column


def subsystem_of(spec: ProbeSpec) -> str:
    """The name ``trace_probe_log_init()`` gives the parser of ``spec``'s kind: a uprobe
    line ``trace_uprobe``, an ``f`` or ``t`` line ``trace_fprobe``, an ``e`` line
    ``event_probe``, a ``p``/``r`` line ``trace_kprobe`` (``-:`` lines log nothing)."""
    return SUBSYSTEM[_family(spec)]


def _text(spec: ProbeSpec) -> str:
    return (spec.text or format_spec(spec)).split("#", 1)[0]


def arg_column(spec: ProbeSpec, index: int) -> int:
    """Where ``__trace_probe_log_err()`` puts the caret for argument ``index`` of the line
    (0 the ``p:...`` head, 1 the target, 2 the first fetch arg): its first character in the
    line's words joined by single spaces (as the kernel joins ``argv``), or one past the
    end of that command when the line has fewer arguments."""
    toks = _SPACE.findall(_text(spec))
    return sum(len(t) + 1 for t in toks[:index]) if index < len(toks) else \
        len(" ".join(toks)) + 1


def target_refusal(spec: ProbeSpec, count: Callable[[str], int]) -> Refusal | None:
    """``number_of_same_symbols()`` for an unqualified kprobe target (``count`` counts the
    rows of that name in vmlinux and the loaded modules, as /proc/kallsyms lists them)."""
    if spec.is_uprobe or spec.symbol is None or spec.module is not None or spec.kind == "-":
        return None
    n = count(spec.symbol)
    if n > 1:
        return Refusal(_errno.EADDRNOTAVAIL, NON_UNIQ_SYMBOL, arg_column(spec, 1))
    if n == 0:
        return Refusal(_errno.ENOENT, BAD_PROBE_ADDR, arg_column(spec, 1))
    return None


def _compare_arg_type(a: ProbeSpec, b: ProbeSpec) -> int:
    """``trace_probe_compare_arg_type(a, b)``: the smallest 1-based index of an argument
    whose type, array count or name differs (or the first missing one), 0 if none."""
    if len(a.args) < len(b.args):
        return len(a.args) + 1
    if len(a.args) > len(b.args):
        return len(b.args) + 1
    for i, (x, y) in enumerate(zip(a.args, b.args)):
        # probe_arg.type points into probe_fetch_types[]: one entry per type name (a
        # bitfield's type is its container's, so b4@0/32 and u32 are the same type).
        if x.type != y.type or x.count != y.count or x.name != y.name:
            return i + 1
    return 0


def _comm(arg: ProbeArg) -> str:
    """``probe_arg.comm``: the argument's text after ``NAME=`` as written."""
    return arg.comm or render_body(arg)


@dataclass
class EventTable:
    """The dynamic events one side has defined, and the names of every other trace event.

    ``other`` holds ``GROUP/EVENT`` names that exist already (the guest's
    ``/sys/kernel/tracing/events``, read before anything is registered). ``identity`` gives
    a uprobe target's file identity (the inode the kernel compares); by default its path.
    """

    other: set[str] = field(default_factory=set)
    identity: Callable[[ProbeSpec], object] | None = None
    defined: dict[tuple[str, str], list[ProbeSpec]] = field(default_factory=dict)

    def _ident(self, spec: ProbeSpec) -> object:
        return self.identity(spec) if self.identity is not None else spec.path

    def _same_target(self, a: ProbeSpec, b: ProbeSpec) -> bool:
        if a.is_uprobe:     # trace_uprobe_has_same_uprobe(): inode and offset
            return self._ident(a) == self._ident(b) and a.offset == b.offset
        if a.is_fprobe:     # trace_fprobe_has_same_fprobe(): the filter as written
            return a.symbol == b.symbol
        # trace_kprobe_has_same_kprobe(): trace_kprobe_symbol() is "unknown" for a raw
        # address (so two address probes at different places compare equal), and the
        # offset is kp.offset (0 for a raw address). Checked in the guest.
        sa = a.symbol_name if a.symbol is not None else "unknown"
        sb = b.symbol_name if b.symbol is not None else "unknown"
        oa = a.offset if a.symbol is not None else 0
        ob = b.offset if b.symbol is not None else 0
        return sa == sb and oa == ob

    def check(self, spec: ProbeSpec) -> Refusal | None:
        """What ``register_trace_kprobe()`` / ``register_trace_uprobe()`` say before they
        register anything; None when the line makes a new event or is appended."""
        if spec.is_uprobe and spec.offset is not None:
            for olds in self.defined.values():     # validate_ref_ctr_offset()
                for old in olds:
                    if (old.is_uprobe and self._ident(old) == self._ident(spec)
                            and old.offset == spec.offset
                            and (old.ref_ctr_offset or 0) != (spec.ref_ctr_offset or 0)):
                        # pr_warn() only: the write fails, error_log has nothing
                        return Refusal(_errno.EINVAL, REF_CTR_MISMATCH, -1, logged=False)
        olds = self.defined.get((spec.group, spec.event), [])
        # find_trace_kprobe(), find_trace_uprobe(), find_trace_fprobe(): a line joins an
        # event of its own kind; another kind's event of that name is EVENT_EXIST
        same_kind = [o for o in olds if _family(o) == _family(spec)]
        if same_kind and not spec.is_eprobe:    # an event probe is never appended to
            old = same_kind[0]
            # append_trace_fprobe(): an exit or a tracepoint probe is another type too
            if spec.is_return != old.is_return or spec.is_tprobe != old.is_tprobe:
                return Refusal(_errno.EEXIST, DIFF_PROBE_TYPE, 0)
            i = _compare_arg_type(spec, old)
            if i:
                # "Note that argument starts index = 2": argument i is argv[i + 1].
                return Refusal(_errno.EEXIST, DIFF_ARG_TYPE, arg_column(spec, i + 1))
            for o in same_kind:
                if self._same_target(o, spec) and all(
                        _comm(x) == _comm(y) for x, y in zip(o.args, spec.args)):
                    return Refusal(_errno.EEXIST, SAME_PROBE, 0)
            return None
        if olds or f"{spec.group}/{spec.event}" in self.other:
            return Refusal(_errno.EEXIST, EVENT_EXIST, 0)
        return None

    def add(self, spec: ProbeSpec) -> None:
        """Record an accepted line (``dyn_event_add()``)."""
        self.defined.setdefault((spec.group, spec.event), []).append(spec)

    def release(self, spec: ProbeSpec, file: str) -> list[ProbeSpec]:
        """A ``-:[GROUP/]EVENT [MATCH...]`` line written to ``file``:
        ``dyn_event_release()`` (kernel/trace/trace_dynevent.c) frees every event of the
        families ``file`` frees (:data:`RELEASED`) that the family's ``match()`` takes:
        the name (or any, for ``GROUP/``), the group when written, then its command head
        (:func:`_match_head`) and ``NAME=COMM`` of the first arguments
        (``trace_probe_match_command_args()``). The freed lines leave the table and are
        returned; none is the kernel's -ENOENT (the caller's, with no error_log entry)."""
        families = RELEASED[file]
        gone = []
        for key, olds in list(self.defined.items()):
            keep = []
            for old in olds:
                if (_family(old) in families and (not spec.event or old.event == spec.event)
                        and (not spec.group or old.group == spec.group)
                        and _match_head(old, spec.match)):
                    gone.append(old)
                else:
                    keep.append(old)
            if keep:
                self.defined[key] = keep
            else:
                del self.defined[key]
        return gone

    def specs(self) -> list[ProbeSpec]:
        """Every line defined now."""
        return [s for olds in self.defined.values() for s in olds]

    def appended(self, spec: ProbeSpec) -> bool:
        """Whether ``spec`` would join an event that exists (a multi-probe event)."""
        return bool(self.defined.get((spec.group, spec.event)))


def _family(spec: ProbeSpec) -> str:
    return "u" if spec.is_uprobe else "f" if spec.is_fprobe else "e" if spec.is_eprobe else "k"


def _match_head(old: ProbeSpec, argv: tuple[str, ...]) -> bool:
    """The family's ``*_match_command_head()``: ``trace_kprobe_match_command_head()``
    (``SYM``, ``SYM+OFFS`` in decimal; a raw-address probe prints as ``0x%p``, hashed: no
    text a user writes matches it), ``trace_uprobe_match_command_head()``
    (``PATH:0x%016lx``, with ``(0x%lx)`` of a reference counter: the offset as the
    probe line wrote it, ``0x1139``, does not match), ``eprobe_dyn_event_match()``."""
    if not argv:
        return True
    if old.is_eprobe:
        return _match_eprobe(old, argv)
    if old.is_uprobe:
        head = f"{old.path}:0x{old.offset:016x}" + (
            f"(0x{old.ref_ctr_offset:x})" if old.ref_ctr_offset else "")
    elif old.symbol is None:
        return False
    else:
        head = old.symbol_name + (f"+{old.offset}" if old.offset else "")
    if argv[0] != head or len(argv) - 1 > len(old.args):
        return False
    return all(a == f"{p.name}={_comm(p)}" for a, p in zip(argv[1:], old.args))


def _match_eprobe(old: ProbeSpec, argv: tuple[str, ...]) -> bool:
    """``eprobe_dyn_event_match()`` (kernel/trace/trace_eprobe.c, Debian's 6.12.117 and
    7.3.4) past the name: the first word is the attached ``SYSTEM/EVENT`` (or
    ``SYSTEM.EVENT``), both parts whole (the ``strncmp()`` of the system is followed by a
    check of its end, a stable fix: ``sch/EVENT`` does not match ``sched.EVENT``; kph fuzz
    found the harness taking the prefix), then ``NAME=COMM`` of the first arguments."""
    word = argv[0]
    cut = word.find("/")
    if cut < 0:
        cut = word.find(".")
    if cut < 0 or old.attach is None:
        return False
    system, event = old.attach
    if system != word[:cut] or event != word[cut + 1:]:
        return False
    if len(argv) - 1 > len(old.args):
        return False
    return all(a == f"{p.name}={_comm(p)}" for a, p in zip(argv[1:], old.args))


def resolve_fetch_symbols(spec: ProbeSpec, lookup: Callable[[str], int | None]
                          ) -> ProbeSpec | Refusal:
    """``traceprobe_update_arg()`` for every argument: each ``@SYM[+|-OFFS]`` becomes the
    immediate ``kallsyms_lookup_name(SYM) + OFFS``, once, at register time.

    :param lookup: ``kallsyms_lookup_name()`` (vmlinux first, then modules; ``MOD:SYM``
        too): the address, or None (0 in the kernel) when there is none.
    :return: the spec with resolved programs, or the refusal: EINVAL "Failed to register
        probe event" for an offset ``kstrtol()`` refuses, ENOENT "Invalid probed address or
        symbol" for an unknown or empty name; both with the caret on the target, where
        ``__trace_kprobe_create()`` puts it.
    """
    args = []
    changed = False
    for arg in spec.args:
        code = arg.code
        # @SYM is a leaf, so FETCH_NOP_SYMBOL is always the program's first instruction,
        # followed by the FETCH_OP_IMM it fills in.
        if code and code[0][0] == "nop_symbol":
            name, off = split_symbol_offset(code[0][1])
            if off is None:
                return Refusal(_errno.EINVAL, FAIL_REG_PROBE, arg_column(spec, 1))
            addr = lookup(name) if name else None
            if not addr:
                return Refusal(_errno.ENOENT, BAD_PROBE_ADDR, arg_column(spec, 1))
            code = (("imm", (addr + off) & ((1 << 64) - 1)),) + tuple(code[2:])
            arg = dataclasses.replace(arg, code=code)
            changed = True
        args.append(arg)
    return dataclasses.replace(spec, args=tuple(args)) if changed else spec


def registration_refusal(spec: ProbeSpec, errno: int, module_loaded: Callable[[str], bool]
                         ) -> Refusal | None:
    """How ``__trace_kprobe_create()`` reports ``register_trace_kprobe()`` failing with
    ``-errno`` after the event checks passed (``__register_trace_kprobe()``: the fetch
    symbols, then ``register_kprobe()``/``register_kretprobe()``).

    :return: None when the kernel keeps the event anyway: -ENOENT and
        ``!trace_kprobe_module_exist()``, i.e. a raw address or ``MOD:SYM`` of a module that
        is not loaded (the probe stays unregistered; it never fires until the module loads).
    """
    if errno == _errno.ENOENT and module_pending(spec, module_loaded):
        return None
    if errno in (_errno.ENOMEM, _errno.EEXIST):
        # "else if (ret != -ENOMEM && ret != -EEXIST)": the event checks log their own
        # EEXIST; here neither is logged (trace_kprobe.c, trace_fprobe.c; 6.1 to 7.3)
        return Refusal.silent(errno)
    col = arg_column(spec, 1)
    if errno == _errno.EILSEQ:
        return Refusal(errno, BAD_INSN_BNDRY, col)
    if errno == _errno.ENOENT:
        return Refusal(errno, BAD_PROBE_ADDR, col)
    return Refusal(errno, FAIL_REG_PROBE, col)


def module_pending(spec: ProbeSpec, module_loaded: Callable[[str], bool]) -> bool:
    """``!trace_kprobe_module_exist(tk)``: true for a raw-address probe (no symbol) and for
    ``MOD:SYM`` when no module MOD is loaded; false for a plain ``SYM``."""
    if spec.symbol is None:
        return True
    return spec.module is not None and not module_loaded(spec.module)


def other_event_names(listing: str) -> set[str]:
    """``GROUP/EVENT`` names from ``ls -d /sys/kernel/tracing/events/*/*/`` output."""
    out = set()
    for line in listing.split():
        parts = line.rstrip("/").split("/")
        if len(parts) >= 2:
            out.add(f"{parts[-2]}/{parts[-1]}")
    return out


def kprobe_spec_texts(specs: Iterable[ProbeSpec]) -> list[str]:
    """The lines as written, for messages."""
    return [_text(s) for s in specs]
