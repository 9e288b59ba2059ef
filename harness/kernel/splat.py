"""Kernel splats in console or ``dmesg`` text, as findings (issue 37 item 2).

A *splat* is what the kernel prints when it catches itself misbehaving: a ``WARN()``
(``__warn()``, kernel/panic.c: ``------------[ cut here ]------------`` then ``WARNING:
CPU: N PID: N at FILE:LINE FUNC+0x../0x..``, ended by ``---[ end trace ... ]---``), a
``BUG:`` line (``page_fault_oops()``/``show_fault_oops()`` of arch/x86/mm/fault.c, the
scheduler's ``__schedule_bug()``, ``__might_resched()``, the soft-lockup watchdog), an oops
(``__die()`` of arch/x86/kernel/dumpstack.c: ``Oops:``, ``general protection fault``,
``invalid opcode:``, after ``kernel BUG at FILE:LINE!``), a KASAN report
(mm/kasan/report.c: a line of ``=`` then ``BUG: KASAN: ...``), a lockdep report
(kernel/locking/lockdep.c: a line of ``=`` then ``WARNING: possible circular locking
dependency detected`` and the like), an RCU stall (kernel/rcu/tree_stall.h: ``rcu: INFO:
rcu_sched detected stalls on CPUs/tasks:``), a hung task (kernel/hung_task.c) or a panic
(``panic()``: ``Kernel panic - not syncing: ...``).

Each becomes a :class:`Splat` with a named verdict (:data:`VERDICTS`), its text from its
first line to its ``---[ end ...`` line (or :data:`MAX_LINES` lines, or the next splat),
where it was read (``console`` or ``dmesg``) and whether it was printed before the run's
window (``before``: at boot, not the probes' doing). A guest that stops answering while
QEMU runs it is the finding ``HANG`` (:class:`GuestHangError`); a panic during a run is
:class:`KernelPanicFinding`. Pure text functions; ``harness.machine.kwatch`` reads the
machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from ..errors import GuestPanicError, VMLostError

#: Each verdict, most severe first (a run's headline verdict is its most severe splat's).
VERDICTS: dict[str, str] = {
    "KERNEL-PANIC": "the kernel panicked (Kernel panic - not syncing)",
    "KERNEL-OOPS": "an oops: Oops, general protection fault, invalid opcode (kernel BUG at)",
    "KERNEL-KASAN": "a KASAN report (BUG: KASAN:)",
    "KERNEL-BUG": "a BUG: line without an oops (BUG: sleeping function called from "
                  "invalid context, scheduling while atomic, soft lockup, ...)",
    "KERNEL-LOCKDEP": "a lockdep report (a line of = then WARNING:/BUG:, e.g. possible "
                      "circular locking dependency detected)",
    "KERNEL-RCU-STALL": "an RCU stall (rcu: INFO: rcu_sched detected stalls ...)",
    "KERNEL-HUNG-TASK": "a task blocked for more than hung_task_timeout_secs",
    "KERNEL-WARNING": "a WARN() (WARNING: CPU: N PID: N at FILE:LINE FUNC)",
    "HANG": "the guest stopped answering while QEMU ran it (the workload or the guest "
            "agent timed out)",
}

#: A splat's text is cut after this many lines when no end line comes.
MAX_LINES = 80

# printk's prefixes: the time (CONFIG_PRINTK_TIME), the caller (CONFIG_PRINTK_CALLER),
# a level as /dev/kmsg or dmesg -r print it
_PREFIX = re.compile(r"^(?:<\d+>)?(?:\[\s*\d+\.\d+\])?\s?(?:\[\s*[TC]\d+\]\s?)?")
_CUT = re.compile(r"^-+\[ cut here \]-+$")
_END = re.compile(r"^---\[ end (?:trace|Kernel panic)")
_RULE = re.compile(r"^={20,}$")     # lockdep's and KASAN's header and footer lines

_STARTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^Kernel panic - not syncing"), "KERNEL-PANIC"),
    (re.compile(r"^BUG: KASAN: "), "KERNEL-KASAN"),
    (re.compile(r"^(?:\S+: )?BUG: "), "KERNEL-BUG"),     # "watchdog: BUG: soft lockup"
    (re.compile(r"^kernel BUG at "), "KERNEL-OOPS"),
    (re.compile(r"^(?:Oops|Oops - \w+)(?::| \[)|^general protection fault|^invalid opcode: "),
     "KERNEL-OOPS"),
    (re.compile(r"^WARNING: "), "KERNEL-WARNING"),
    (re.compile(r"^rcu: INFO: rcu_\w+ (?:self-)?detected (?:stalls?|expedited stalls)|"
                r"^INFO: rcu_\w+ (?:self-)?detected stall"), "KERNEL-RCU-STALL"),
    (re.compile(r"^INFO: task \S+ blocked for more than"), "KERNEL-HUNG-TASK"),
]
_OOPS_INSIDE = re.compile(r"^(?:Oops(?::| - )|general protection fault|invalid opcode: )")
_LOCKDEP = re.compile(r"^(?:WARNING|BUG): ")


@dataclass(frozen=True)
class Splat:
    """One kernel report. ``title`` is its first line (printk prefixes stripped),
    ``text`` its lines, ``source`` ``console``, ``dmesg``, ``console+dmesg`` (both had
    it) or ``agent`` (a hang), ``before`` whether it was printed before the run's window."""

    verdict: str
    title: str
    text: str
    source: str
    before: bool = False

    def headline(self) -> str:
        when = "before the run (boot): not the probes'" if self.before else "during the run"
        return f"{self.verdict}: {self.title} [{self.source}, {when}]"

    def to_json(self) -> dict[str, object]:
        return {"verdict": self.verdict, "title": self.title, "text": self.text,
                "source": self.source, "before": self.before}


def strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line.rstrip("\r"), count=1)


def _start(lines: list[str], i: int) -> str | None:
    """The verdict of a splat starting at line ``i``, or None."""
    line = lines[i]
    for pat, verdict in _STARTS:
        if pat.search(line):
            if verdict in ("KERNEL-WARNING", "KERNEL-BUG") and i > 0 and _RULE.match(lines[i - 1]) \
                    and _LOCKDEP.match(line):
                return "KERNEL-LOCKDEP"
            return verdict
    return None


def find_splats(text: str, *, source: str, before: bool = False,
                max_lines: int = MAX_LINES) -> list[Splat]:
    """Every splat in ``text`` (console or dmesg lines, with or without printk's time
    prefixes), in order."""
    lines = [strip_prefix(ln) for ln in text.replace("\r\n", "\n").split("\n")]
    out: list[Splat] = []
    i = 0
    while i < len(lines):
        first = i
        if _CUT.match(lines[i]) and i + 1 < len(lines) and _start(lines, i + 1):
            i += 1         # __warn()'s cut line belongs to the report that follows
        verdict = _start(lines, i)
        if verdict is None:
            i = first + 1
            continue
        if verdict in ("KERNEL-LOCKDEP", "KERNEL-KASAN") and first == i and i > 0 \
                and _RULE.match(lines[i - 1]):
            first = i - 1     # the header rule belongs to the report
        title = lines[i]
        j = i + 1
        while j < len(lines) and j - first < max_lines:
            ln = lines[j]
            if _END.match(ln):
                j += 1
                break
            if verdict == "KERNEL-KASAN" and _RULE.match(ln):
                j += 1
                break
            if _start(lines, j) and not (_OOPS_INSIDE.match(ln) or verdict == "KERNEL-OOPS"
                                         and ln.startswith("BUG: ")):
                break      # the next report (an oops line continues a BUG: line's)
            if (_CUT.match(ln) or _RULE.match(ln)) and j + 1 < len(lines) \
                    and _start(lines, j + 1):
                break
            if _OOPS_INSIDE.match(ln) and verdict in ("KERNEL-BUG", "KERNEL-WARNING"):
                verdict = "KERNEL-OOPS"   # BUG: kernel NULL pointer dereference + Oops:
            j += 1
        body = [ln for ln in lines[first:j]]
        while body and not body[-1].strip():
            body.pop()
        out.append(Splat(verdict, title, "\n".join(body), source, before))
        i = j
    return out


def merge(console: Iterable[Splat], dmesg: Iterable[Splat]) -> list[Splat]:
    """The console's splats and the dmesg's, one each: a splat both printed (same first
    line) is kept once, its source ``console+dmesg``, with the longer text."""
    out = list(console)
    for s in dmesg:
        k = next((n for n, c in enumerate(out) if c.title == s.title and c.before == s.before
                  and "dmesg" not in c.source), None)
        if k is None:
            out.append(s)
        else:
            c = out[k]
            out[k] = replace(c, source="console+dmesg",
                             text=c.text if len(c.text) >= len(s.text) else s.text)
    return out


def rank(verdict: str) -> int:
    names = list(VERDICTS)
    return names.index(verdict) if verdict in names else len(names)


def during(splats: Iterable[Splat]) -> list[Splat]:
    """The splats of the run's window (not those already printed at boot)."""
    return [s for s in splats if not s.before]


def headline(splats: Iterable[Splat]) -> str | None:
    """The most severe verdict of the run's window, or None when it had no splat."""
    now = during(splats)
    return min((s.verdict for s in now), key=rank) if now else None


class KernelFinding:
    """Mixed into the errors that end a run because of the kernel (a panic, a hang):
    ``splats`` holds what the kernel printed (the panic's, the hang's console tail)."""

    splats: tuple[Splat, ...] = ()

    @property
    def verdict(self) -> str:
        return headline(self.splats) or "KERNEL-PANIC"


class KernelPanicFinding(KernelFinding, GuestPanicError):
    """The guest kernel panicked during a run: a kernel finding (``KERNEL-PANIC`` or the
    oops that led to it), not a harness failure."""

    def __init__(self, msg: str, console_tail: str, splats: Iterable[Splat]) -> None:
        super().__init__(msg, console_tail)
        self.splats = tuple(splats)


class GuestHangError(KernelFinding, VMLostError):
    """The guest stopped answering while QEMU reported it running: ``HANG``. ``why``
    says what timed out (the workload past its timeout, or the guest agent)."""

    def __init__(self, msg: str, console_tail: str, splats: Iterable[Splat], why: str) -> None:
        super().__init__(msg, console_tail)
        self.splats = tuple(splats)
        self.why = why

    @property
    def verdict(self) -> str:
        return "HANG"
