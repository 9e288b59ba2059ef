"""In-guest probes through the guest kernel's own tracefs ``kprobe_events`` (and
``uprobe_events`` for uprobe lines, with ``uprobe_profile`` for their counts).

Each spec line is appended to ``/sys/kernel/tracing/kprobe_events`` as written (the
grammar is the kernel's, so the kernel is the judge: a refusal comes back as the write's
errno and the ``error_log`` text), its event enabled. The events are read back from the
binary ring buffer (``per_cpu/cpuN/trace_pipe_raw``, decoded by ``harness.kernel.ringbuf`` with
each event's ``format``), not from the ``trace`` text: the text prints a string's bytes
raw, so a newline in a string splits its record and bytes that are not UTF-8 are
whatever the reader makes of them; the records keep the bytes the kernel stored.
``kprobe_profile`` gives nhit/nmissed and ``/sys/kernel/debug/kprobes/list`` the mode of
each probe (ftrace, optimized or int3).

What the text trace prints and the records do not hold is taken as the text takes it: the
comm of a pid from ``saved_cmdlines`` at read time (``trace_find_cmdline()``: ``<idle>`` for
pid 0, ``<...>`` for a pid not there), an address as ``%pS`` with the guest's symbols
(``vm.symbols``, module symbols from the running guest).
"""
from __future__ import annotations

import base64
import errno as _errno
import dataclasses
import heapq
import logging
import os
import shlex
from operator import itemgetter
from typing import Any, Sequence

from ..errors import GuestAgentError, GuestLossError, HarnessError, needed_mib
from ..kernel.grammar.fetch import escape_bytes, format_ip, format_value
from ..kernel.kprobes import kernel_rethook_trampoline
from ..kernel.symbols import remembered_symbolizer
from ..kernel.dynevent import events_file, events_file_of, line_files
from ..kernel.grammar import ProbeSpec, guest_line
from ..machine.memo import PerMachine
from ..records import DECODED_MAX, Counters, Hit, Outcome, gc_paused
from ..kernel.ringbuf import (TYPE_PID, EventFormat, PAGE_SIZE, RawRecord, RingLoss,
                              decode_args, format_args, page_events, parse_format, parse_stats,
                              record_excess, ring_loss, fixed_size)
from .tracelayer import GuestWrite, TraceLayer, write_switch
from ..vmctl import Machine

log = logging.getLogger(__name__)

TRACING = "/sys/kernel/tracing"
KPROBES_LIST = "/sys/kernel/debug/kprobes/list"
#: glibc's strerror() text -> errno, for the shell's "write error: ..." message.
STRERROR = {os.strerror(n): n for n in range(1, 134)}
_CMD = "  Command: "          # kernel/trace/trace.c: CMD_PREFIX of an error_log entry
#: Each CPU's ring buffer, in KiB (``buffer_size_kb``): 16 MiB unless a caller asks less.
BUFFER_KB = 16384


def probe_modes(listing: str) -> dict[int, str]:
    """address -> ftrace / optimized / int3 (or disabled), from the debugfs kprobes list."""
    modes: dict[int, str] = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            addr = int(parts[0], 16)
        except ValueError:
            continue
        mode = "ftrace" if "[FTRACE]" in line else "optimized" if "[OPTIMIZED]" in line else "int3"
        modes.setdefault(addr, mode)
    return modes


def _context(flags: int) -> str:
    """The context of the probed call, ``irq`` or ``task``, from a trace entry's
    ``common_flags`` (include/linux/trace_events.h: TRACE_FLAG_HARDIRQ 0x08,
    TRACE_FLAG_SOFTIRQ 0x10, TRACE_FLAG_NMI 0x40, the same in 6.1, 6.12 and 7.3). An
    int3-based kprobe's handler runs in ``irqentry_nmi_enter()``, which sets NMI and
    HARDIRQ: there only SOFTIRQ (the caller's) tells."""
    if flags & 0x10 or (flags & 0x08 and not flags & 0x40):
        return "irq"
    return "task"


#: :func:`_context` of each ``common_flags`` byte (a run looks up 100,000 of them)
_CONTEXT = tuple(_context(f) for f in range(256))


def logged_words(detail: Sequence[str]) -> tuple[str, str, str, int] | None:
    """(subsystem, message, command, caret) of an ``error_log`` entry as ``kph_log`` prints
    it in :meth:`EventsBackend.register` (the entry's first line, its ``  Command: `` line,
    ``caret N`` with N the caret line's length), or None when there is none."""
    if not detail or ": error: " not in detail[0]:
        return None
    head, _, msg = detail[0].partition(": error: ")
    sub = head.split("] ", 1)[1] if head.startswith("[") and "] " in head else head
    cmd = detail[1][len(_CMD):] if len(detail) > 1 and detail[1].startswith(_CMD) else ""
    caret = -1
    if len(detail) > 2 and detail[2].startswith("caret "):
        try:
            caret = int(detail[2][6:]) - len(_CMD) - 1     # the prefix's spaces, then "^"
        except ValueError:
            caret = -1
    return sub, msg, cmd, caret


def written_column(spec: ProbeSpec, command: str, column: int) -> int:
    """The caret ``column`` of ``command`` (what the kernel logged for the line this
    backend wrote, :func:`harness.kernel.grammar.guest_line`: an explicit ``GROUP/EVENT``
    head, a uprobe line's canonical words) as a column of the line as written, its words
    joined by single spaces, where the host predicts it (``harness.records.Outcome``):
    the same word, the same offset in it. The logged words after the head are the
    kernel's (rewritten ones too: 6.12's ``%pd``), except a uprobe line's canonical words,
    mapped back by their tails (a ``NAME=`` added in front). One past the end of the
    command stays one past the end."""
    user = (spec.text or "").split("#", 1)[0].split()
    if column < 0 or not user:
        return column
    logged = command.split(" ")
    starts, at = [], 0
    for w in logged:
        starts.append(at)
        at += len(w) + 1
    words = (user + logged[len(user):]) if spec.is_uprobe else [user[0]] + logged[1:]
    if column >= at:                # past the last word (__trace_probe_log_err())
        return len(" ".join(words)) + 1
    k = max(j for j, st in enumerate(starts) if st <= column)
    off = column - starts[k]
    if spec.is_uprobe and k < len(user) and off and logged[k] != user[k]:
        off = max(0, off - (len(logged[k]) - len(user[k])))
    if k == 0:
        off = min(off, len(words[0]))
    return sum(len(w) + 1 for w in words[:k]) + off


def write_error(text: str) -> str:
    """The ``strerror()`` text of a failed ``echo ... > FILE`` as busybox's shell says it:
    ``sh: write error: TEXT`` (echo's write), or ``sh: can't create FILE: TEXT`` (the
    open; shell/ash.c: openredirect(), its errmsg() saying ``nonexistent directory`` for
    ENOENT and ENOTDIR); any other text as it is."""
    if "write error: " in text:
        return text.rsplit("write error: ", 1)[-1]
    if "can't create " in text and ": " in text:
        msg = text.rsplit(": ", 1)[-1]
        return os.strerror(_errno.ENOENT) if msg == _ASH_ENOENT else msg
    return text


#: what busybox's shell says for an open() that failed with ENOENT or ENOTDIR
_ASH_ENOENT = "nonexistent directory"


def reader_script_text(text: str, files: Sequence[tuple[str, str]]) -> str:
    """kph-reader's answer to the registration's ``w`` request (probes/progs/reader.c)
    as the shell script's text: ``@errw ERRNO`` and ``@erro ERRNO`` in the words
    busybox's shell uses (:func:`write_error` reads both). ``files``: each ``L`` op's
    file and ``enable`` file as the script names them, in order; an ``@erro`` names the
    line's file, or its enable file when ``enable: error: failed`` follows it."""
    lines = text.split("\n")
    n = -1
    for i, line in enumerate(lines):
        if line.startswith("@ok") or line.startswith("@err"):
            n += 1
        if line.startswith("@errw ") and line[6:].isdigit():
            lines[i] = f"@err sh: write error: {os.strerror(int(line[6:]))}"
        elif line.startswith("@erro ") and line[6:].isdigit():
            err = int(line[6:])
            what = _ASH_ENOENT if err in (_errno.ENOENT, _errno.ENOTDIR) else os.strerror(err)
            file, enable = files[n] if 0 <= n < len(files) else ("?", "?")
            on_enable = i + 1 < len(lines) and lines[i + 1] == _ENABLE_FAILED
            lines[i] = f"@err sh: can't create {enable if on_enable else file}: {what}"
    return "\n".join(lines)


#: what the registration prints after an enable's error (``logged_words``: subsystem
#: ``enable``)
_ENABLE_FAILED = "enable: error: failed"


def refusal_outcome(name: str, spec: ProbeSpec, status: str, detail: Sequence[str], *,
                    index: int) -> Outcome:
    """The Outcome of a line the guest refused: the write's errno (the shell's ``write
    error: TEXT``) and, when the kernel logged the refusal, its ``error_log`` entry
    (:func:`logged_words`), the caret taken back to the line as written
    (:func:`written_column`; an event filter's caret is in the filter, a ``dynevent``
    one at 0). Nothing logged: the write's ``strerror()`` text, no subsystem, column -1;
    so for an enable that failed (uprobe_register() at ``echo 1 > enable``)."""
    msg = write_error(status[5:].strip())
    errno = STRERROR.get(msg, _errno.EINVAL)
    got = logged_words(detail)
    if got is None or got[0] == "enable":
        reason = "enabling it failed" if got is not None else ""
        return Outcome.rejected(name, errno, msg, index=index, reason=reason)
    sub, text, command, caret = got
    if sub not in ("event filter parse error", "dynevent"):
        caret = written_column(spec, command, caret)
    return Outcome.rejected(name, errno, text, index=index, subsystem=sub, column=caret)


def _dyn_kind(line: str) -> tuple[str, str] | None:
    """(``k`` or ``u``, ``GROUP/EVENT``) of a ``dynamic_events`` line of a kprobe or a
    uprobe event (``trace_kprobe_show()``: ``p:GROUP/EVENT SYM...`` or ``rN:...``;
    ``trace_uprobe_show()``: ``p:GROUP/EVENT PATH:0xOFFS``), None for any other kind."""
    parts = line.split()
    if len(parts) < 2 or ":" not in parts[0]:
        return None
    kind, _, name = parts[0].partition(":")
    if kind[:1] not in ("p", "r") or (kind[1:] and not kind[1:].isdigit()) or "/" not in name:
        return None
    return ("u" if parts[1].startswith("/") else "k"), name


def profile_counters(dynamic_events: str, kprobe_profile: str, uprobe_profile: str
                     ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """``GROUP/EVENT -> [nhit, nmissed]`` from the profile files, and the names whose
    lines could not be attributed (with why).

    ``kprobe_profile`` prints the event name only (``probes_profile_seq_show()``,
    kernel/trace/trace_kprobe.c: ``trace_probe_name()``, 6.1, 6.12, 7.3), and so does
    ``uprobe_profile`` after the file (trace_uprobe.c), so ``g1/x`` and ``g2/x`` print
    alike. Both walk the kernel's ``dyn_event_list`` (``dyn_event_seq_start()``), as
    ``dynamic_events`` does (printing ``GROUP/EVENT``): the n-th kprobe line of the
    profile is the n-th kprobe line of ``dynamic_events``. Where the two lists do not
    line up (an event made or freed between the reads), a name that one group alone
    holds is attributed by name, and a name two groups share is not attributed at all.
    An event with several probes (appended lines) has a line per probe: summed."""
    dyn: dict[str, list[str]] = {"k": [], "u": []}
    for line in dynamic_events.splitlines():
        got = _dyn_kind(line)
        if got is not None:
            dyn[got[0]].append(got[1])
    prof: dict[str, list[tuple[str, int, int]]] = {"k": [], "u": []}
    for line in kprobe_profile.splitlines():
        p = line.split()
        if len(p) == 3 and p[1].isdigit() and p[2].isdigit():
            prof["k"].append((p[0], int(p[1]), int(p[2])))
    for line in uprobe_profile.splitlines():    # "PATH EVENT NHIT": uprobes count no misses
        p = line.split()
        if len(p) >= 3 and p[-1].isdigit():
            prof["u"].append((p[-2], int(p[-1]), 0))
    sums: dict[str, list[int]] = {}
    unclear: dict[str, str] = {}
    for kind, lines in prof.items():
        names = dyn[kind]
        if len(names) == len(lines) and all(n.rsplit("/", 1)[1] == ev
                                            for n, (ev, _, _) in zip(names, lines, strict=True)):
            pairs = [(n, h, m) for n, (_, h, m) in zip(names, lines, strict=True)]
        else:
            groups: dict[str, set[str]] = {}
            for n in names:
                groups.setdefault(n.rsplit("/", 1)[1], set()).add(n)
            pairs = []
            for ev, h, m in lines:
                owners = groups.get(ev, set())
                if len(owners) == 1:
                    pairs.append((next(iter(owners)), h, m))
                for n in owners if len(owners) > 1 else ():
                    unclear[n] = (f"dynamic_events and the profile list differ, and "
                                  f"{', '.join(sorted(owners))} share the event name")
        for name, h, m in pairs:
            if name in unclear:
                continue
            c = sums.setdefault(name, [0, 0])
            c[0] += h
            c[1] += m
    for name in unclear:
        sums.pop(name, None)
    return sums, unclear


#: The registration script's shell functions (busybox's builtins only: a fork costs ~5 ms
#: under TCG). kph_err prints the write's error as the shell said it; kph_log prints the
#: last error_log entry whole (kernel/trace/trace.c: tracing_err_log_seq_show(): "[ts]
#: SUBSYSTEM: error: MSG", "  Command: CMD", the caret line), the caret line as its length.
#: kph-reader's "w" request prints the same (probes/progs/reader.c: last_error()).
_SH_FUNCS = ("kph_err() { read -r e < /tmp/kph.err; echo \"@err $e\"; }",
             "kph_log() { x=; c=; p=; n=0; while IFS= read -r l; do case $n$l in "
             "[012]'['*': error: '*) x=$l; n=1;; "
             "1*) c=$l; n=2;; 2*) p=${#l}; n=0;; esac; done < error_log; "
             "[ -n \"$x\" ] && { echo \"$x\"; echo \"$c\"; echo \"caret $p\"; }; }")


def _fates(text: str, n: int) -> list[tuple[str, list[str]]]:
    """Each of ``n`` lines' fate in a registration's text: its status line (``@ok`` or
    ``@err ...``; ``@err unknown`` for a line the text does not reach) and the up to three
    lines after it (kph_log's, or ``enable: error: failed``)."""
    out, lines, i = [], text.splitlines(), 0
    for _ in range(n):
        while i < len(lines) and not lines[i].startswith("@"):
            i += 1
        status = lines[i] if i < len(lines) else "@err unknown"
        i += 1
        detail = []
        while i < len(lines) and not lines[i].startswith("@") and len(detail) < 3:
            detail.append(lines[i])
            i += 1
        out.append((status, detail))
    return out


def try_lines(vm: Machine, lines: Sequence[str], *, timeout: float = 30
              ) -> list[tuple[bool, int, str | None, int | None]]:
    """Each line as written (no parsing of ours) to its tracefs file
    (:func:`events_file_of`), alone: ``error_log`` emptied before it, and an accepted line
    removed again (its file emptied, ``echo > FILE``). For each, (accepted, errno, the
    ``error_log`` message or None, its caret column or None). kph-reader's ``T`` ops in
    one request (probes/progs/reader.c), else one guest shell script; ``timeout`` grows
    by half a second a line."""
    files = [events_file_of(ln) for ln in lines]
    wait = timeout + 0.5 * len(lines)
    text = vm.reader_writes([["T", f"{TRACING}/{f}", ln] for f, ln in zip(files, lines)],
                            timeout=wait) if lines else ""
    if text is not None:
        text = reader_script_text(text, [(f, "") for f in files])
    else:
        text = vm.run("\n".join([f"cd {TRACING}", *_SH_FUNCS, *(
            f": > error_log; if echo {shlex.quote(ln)} 2>/tmp/kph.err >> {f}; then "
            f"echo '@ok'; echo > {f}; else kph_err; kph_log; fi"
            for f, ln in zip(files, lines)), "true"]), timeout=wait, check=True).stdout
    out: list[tuple[bool, int, str | None, int | None]] = []
    for status, detail in _fates(text, len(lines)):
        if status == "@ok":
            out.append((True, 0, None, None))
            continue
        code = STRERROR.get(write_error(status[5:].strip()), _errno.EINVAL)
        got = logged_words(detail)
        out.append((False, code, None, None) if got is None else
                   (False, code, got[1], got[3] if got[3] >= 0 else None))
    return out


def _scaled(base: float, lines: int) -> float:
    """A guest script's timeout that grows with the probe lines it handles: each
    registration or removal of a kprobe event waits for the kernel (a removal's
    synchronize_rcu(); under TCG a removal took ~0.1 s, 1,000 of them past a fixed
    60 s: bench/scale.py)."""
    return base + 0.5 * lines


#: files read in one pipelined read (each an open file of qemu-ga until the read's last
#: wave: its descriptors are limited, 1,024 by default)
FILES_AT_ONCE = 256
#: how qemu-ga's failed open of a missing file ends (strerror(ENOENT), qga/commands-posix.c)
_NO_SUCH_FILE = os.strerror(_errno.ENOENT)


#: machine -> {format file: its format}: a built-in event's format, read once a machine
_BUILTIN_FORMATS: PerMachine[str, EventFormat] = PerMachine()


def builtin_format(vm: Any, path: str) -> EventFormat:
    """The format of a built-in event (``task:task_rename``, ``ftrace:kernel_stack``):
    read through the agent once per machine (it is the kernel's, the same as long as the
    kernel runs), where each run read it again (three agent round trips).

    :raise HarnessError: it cannot be read; ValueError: it is not a format."""
    return _BUILTIN_FORMATS.get(
        vm, path, lambda: parse_format(vm.pull(path).decode("utf-8", "replace")))


class EventsBackend:
    """``kprobe_events`` in the guest. One instance per Machine and run."""

    side = "events"
    #: write the lines with the guest's shell even where kph-reader could (its ``w``
    #: request: :meth:`register`); the two ways give the same outcomes
    #: (tests/vm/test_events_register.py; bench/scale.py's side ``events-shell``)
    shell_writes = False

    def __init__(self, vm: Machine, *, buffer_kb: int | None = None) -> None:
        """``buffer_kb``: each CPU's ring buffer (``buffer_size_kb``, default
        :data:`BUFFER_KB`); a run that loses events to it fails
        (:class:`harness.errors.GuestLossError`)."""
        self.vm = vm
        self.buffer_kb = buffer_kb or BUFFER_KB
        #: pages read per CPU at most: the buffer's pages and some (a writer still
        #: writing); reaching it before the buffer is empty fails the run
        self.max_pages = self.buffer_kb * 1024 // PAGE_SIZE + 64
        self.specs: dict[str, ProbeSpec] = {}
        self.outcomes: list[Outcome] = []
        self._formats: dict[int, tuple[str, ProbeSpec, EventFormat]] = {}
        self._args: dict[int, tuple[Any, ...]] = {}
        self._tr: tuple[int, int, int, int] | None = None
        self._cpus: list[int] = []
        #: ``{GROUP/EVENT: count}`` of stacktrace triggers to put on our events
        #: (``harness.backends.triggers``; -1: no count), and where the kernel_stack
        #: entries they write keep their frames: (its ID, size offset, caller offset)
        self.triggers: dict[str, int] = {}
        self._stack_fmt: tuple[int, int, int] | None = None
        #: ``task:task_rename``'s (ID, pid field, newcomm field): the guest's own record
        #: of each rename, the evidence the diff's ``comm-change`` rule needs
        self._rename_fmt: tuple[int, Any, Any] | None = None
        self._trigger_files: dict[str, int] = {}
        #: (event, counter, address): its per-cpu nhit words and its nmissed words
        self._nhit_ptrs: list[tuple[str, str, int]] | None | bool = False  # False: not looked
        self._nhit_marks: list[dict[tuple[str, str], int] | None] = []

    def _sh(self, cmd: str, *, check: bool = True, timeout: float = 60) -> str:
        return self.vm.run(cmd, check=check, timeout=timeout).stdout

    #: the files read after a run's drain (name -> path; relative paths are tracefs's)
    _AFTER = (("saved_cmdlines", "saved_cmdlines"), ("dynamic_events", "dynamic_events"),
              ("kprobe_profile", "kprobe_profile"), ("uprobe_profile", "uprobe_profile"),
              ("preempt", "/sys/kernel/debug/sched/preempt"))
    _OPTIONAL = frozenset({"uprobe_profile", "preempt"})

    def _read_after(self, cpus: Sequence[int]) -> dict[str, bytes]:
        """Every text the run's end needs, through the agent's file API: each CPU's
        ``stats`` (read after the drain, as :meth:`check_losses` needs),
        ``saved_cmdlines``, ``dynamic_events``, ``kprobe_profile``, ``uprobe_profile`` and
        the preemption model. No guest process: a ``cat`` is a fork and an exec, ~15 ms
        each under TCG, where a file read is ~4 ms (issue 39's fuzzing rate), and all of
        them in three pipelined waves (``Machine.pull_many``). A file the
        kernel may lack (``uprobe_profile`` without uprobe events, ``preempt`` without
        debugfs or PREEMPT_DYNAMIC) is left out; any other failed read is raised.

        :raise GuestAgentError: a stats, saved_cmdlines, dynamic_events or kprobe_profile
            read failed."""
        files = [(f"stats{c}", f"per_cpu/cpu{c}/stats") for c in cpus] + list(self._AFTER)
        got = self.vm.pull_many([p if p.startswith("/") else f"{TRACING}/{p}" for _, p in files],
                                timeout=_scaled(60, len(self.specs)))
        out: dict[str, bytes] = {}
        for (name, _), data in zip(files, got):
            if isinstance(data, GuestAgentError):
                if name not in self._OPTIONAL:
                    raise data
                continue
            out[name] = data
        return out

    def after_text(self, name: str) -> str | None:
        """A text of this run's :meth:`_read_after`, or None outside a run's collection."""
        if self._after is None or name not in self._after:
            return None
        return self._after[name].decode("utf-8", "replace")

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """All specs in one request, each line's fate reported: kph-reader's ``w``
        request (plain syscalls, no process) where the machine has the reader, else one
        guest shell script through the agent, the same steps either way.

        ``error_log`` is emptied before each line, so a refusal's text is that line's (or
        none: some refusals, -ECANCELED for one, log nothing)."""
        self._after = None
        TraceLayer(self.vm).sync_modules(specs)     # module addresses of this boot
        kb = int(self.buffer_kb)
        script = [f"cd {TRACING}", "echo 0 > tracing_on", "echo > trace",
                  f"read -r kb rest < buffer_size_kb; [ \"$kb\" = {kb} ] || "
                  f"echo {kb} > buffer_size_kb"]
        # Shell builtins only on a refusal's path (read, case: a fork costs ~5 ms under
        # TCG, and multiple_kprobes.tc writes thousands of lines the kernel refuses), in
        # two functions: the script is one argument of at most 128 KiB (MAX_ARG_STRLEN).
        script += list(_SH_FUNCS)
        err, last_error = "kph_err", "kph_log"
        defined = line_files(specs)
        # the same steps as kph-reader ops (probes/progs/reader.c: "w"): no process, and
        # no shell reading error_log a byte a read() (a refused line cost ~9 ms of the
        # guest under TCG, ~2 ms with the reader: multiple_kprobes.tc writes thousands)
        ops: list[list[str]] = [["P", TRACING, str(kb)]]
        files: list[tuple[str, str]] = []
        for spec in specs:
            text = guest_line(spec)
            line = shlex.quote(text)
            # quoted: an event name the kernel made from a symbol keeps any character
            # sanitize_event_name() leaves (only ':', '.' and '*' become '_')
            enable_file = f"events/{spec.group}/{spec.event}/enable"
            enable = shlex.quote(enable_file)
            # stderr redirected first: an open that fails says so into /tmp/kph.err
            if spec.kind == "-":        # dyn_event_release(): nothing to enable after it
                file = events_file(spec, defined)
                script.append(
                    f": > error_log; if echo {line} 2>/tmp/kph.err >> {file}; "
                    f"then echo '@ok'; else {err}; {last_error}; fi")
                ops.append(["L", f"{TRACING}/{file}", text, "", ""])
                files.append((file, ""))
                continue
            file = events_file(spec)
            remove = f"-:{spec.group}/{spec.event}"
            script.append(
                f": > error_log; if echo {line} 2>/tmp/kph.err >> {file}; then "
                f"if echo 1 2>/tmp/kph.err > {enable}; then echo 0 > {enable}; echo '@ok'; "
                f"else {err}; echo '{_ENABLE_FAILED}'; "
                f"echo {shlex.quote(remove)} >> {file}; "
                f"fi; else {err}; {last_error}; fi")
            ops.append(["L", f"{TRACING}/{file}", text, f"{TRACING}/{enable_file}", remove])
            files.append((file, enable_file))
        # the CPUs by a glob (a shell builtin: no process)
        script.append("echo '@cpus'; for d in per_cpu/cpu*; do echo \"${d##*/}\"; done")
        ops.append(["C", f"{TRACING}/per_cpu"])
        # the formats of every event ours after these lines
        names = list(dict.fromkeys([*self.specs, *(f"{s.group}/{s.event}" for s in specs
                                                    if s.kind != "-")]))
        timeout = _scaled(120, len(specs) + len(names))
        text = None if self.shell_writes else self.vm.reader_writes(ops, timeout=timeout)
        text = reader_script_text(text, files) if text is not None else \
            self._sh("\n".join(script), timeout=timeout)
        results, _, cpus = text.partition("@cpus\n")
        # sorted as the shell's glob sorts (C locale)
        self._cpus = [int(c[3:]) for c in sorted(cpus.split())
                      if c.startswith("cpu") and c[3:].isdigit()]
        # each line's fate first: an event the script added is ours (close() removes
        # it) even when a read below fails
        out = []
        for n, (spec, (status, detail)) in enumerate(zip(specs, _fates(results, len(specs)))):
            name = f"{spec.group}/{spec.event}"
            if status == "@ok":
                if spec.kind != "-":
                    self.specs.setdefault(name, spec)
                out.append(Outcome(name, True, index=n))
            else:
                out.append(refusal_outcome(name, spec, status, detail, index=n))
        # The kprobes list and the formats after the script, through the agent's file
        # API in pipelined reads: a cat, an ls and a grep in the script were three
        # guest processes, ~5 ms each under TCG (issue 39's fuzzing rate). A format that
        # is not there is an event that is not (refused, or freed by a later ``-:``
        # line); any other failed read is raised, never taken for a missing event.
        paths = [KPROBES_LIST] + [f"{TRACING}/events/{n}/format" for n in names]
        got: list[bytes | GuestAgentError] = []
        for k in range(0, len(paths), FILES_AT_ONCE):
            got += self.vm.pull_many(paths[k:k + FILES_AT_ONCE],
                                     timeout=_scaled(60, FILES_AT_ONCE))
        listing = b"" if isinstance(got[0], GuestAgentError) else got[0]
        formats: dict[str, str | None] = {}
        for n, d in zip(names, got[1:]):
            if isinstance(d, GuestAgentError):
                if _NO_SUCH_FILE not in str(d):
                    raise d
                formats[n] = None
            else:
                formats[n] = d.decode("utf-8", "replace")
        modes = probe_modes(listing.decode("utf-8", "replace"))
        self.outcomes = [self._with_mode(o, specs[o.index], modes) for o in out]
        self._formats = self._parse_formats(formats)
        return self.outcomes

    def _set_triggers(self) -> None:
        """``echo 'stacktrace[:N]' > events/GROUP/EVENT/trigger`` for each trigger on an
        event of ours, through the agent's file API (no shell: a fork would run a count
        down on a probe of ``kernel_clone``), and the ``ftrace/kernel_stack`` entry's
        format (the stack trace the trigger writes after each record: ``struct
        stack_entry``, kernel/trace/trace.h). The last thing the agent does before the
        recording window; what the agent's own operations run down is read back in the
        window's halt (:meth:`trigger_counts`)."""
        mine = {n: c for n, c in self.triggers.items() if n in self.specs}
        if not mine:
            return
        if self._stack_fmt is None:
            fmt = builtin_format(self.vm, f"{TRACING}/events/ftrace/kernel_stack/format")
            self._stack_fmt = (fmt.id, fmt.fields["size"].offset, fmt.fields["caller"].offset)
        for name, count in mine.items():
            cmd = "stacktrace" + (f":{count}" if count > 0 else "")
            self.vm.write_file(f"{TRACING}/events/{name}/trigger", f"{cmd}\n".encode())

    def _find_trigger_files(self) -> None:
        """The ``struct trace_event_file`` of each event with a counted trigger, in the
        top trace instance (``global_trace.events``, found by the event's ID), so that
        :meth:`trigger_counts` can read what is left of the count in a halt."""
        counted = {n for n, c in self.triggers.items() if c > 0 and n in self.specs}
        self._trigger_files = {}
        if not counted:
            return
        ids = {fmt.id: name for name, _, fmt in self._formats.values() if name in counted}
        btf, read = self.vm.btf, self.vm.host.read
        off = {k: btf.offset(*k.split(":")) for k in (
            "trace_array:events", "trace_event_file:list", "trace_event_file:event_call",
            "trace_event_file:triggers", "trace_event_call:event.type",
            "event_trigger_data:list", "event_trigger_data:count")}
        self._trigger_offs = off
        head = self.vm.symbols.lookup("global_trace").addr + off["trace_array:events"]
        node = int.from_bytes(read(head, 8), "little")
        seen = 0
        while node and node != head and seen < 100000 and len(self._trigger_files) < len(ids):
            file = node - off["trace_event_file:list"]
            call = int.from_bytes(read(file + off["trace_event_file:event_call"], 8), "little")
            etype = int.from_bytes(read(call + off["trace_event_call:event.type"], 4), "little")
            if etype in ids:
                self._trigger_files[ids[etype]] = file
            node = int.from_bytes(read(node, 8), "little")
            seen += 1

    #: the most per-cpu ``nhit`` words read in one halt (probes x CPUs); more, and ``nhit``
    #: is not counted over the window (each read is a round trip to the stub)
    NHIT_READS = 256

    def _find_nhits(self) -> None:
        """Each of our kprobe events' ``trace_kprobe.nhit`` (a per-cpu counter that
        ``kprobe_dispatcher()`` and ``kretprobe_dispatcher()`` increment at every hit, the
        sum of which ``kprobe_profile`` prints: kernel/trace/trace_kprobe.c of 6.1, 6.12,
        7.3), and the addresses of its per-cpu words: ``dyn_event_list`` walked as
        ``for_each_trace_kprobe()`` does (``dyn_event.ops == &trace_kprobe_ops``), the
        event named by ``tp.event->class.system`` and ``tp.event->call.name``, each
        possible CPU's word at ``nhit + __per_cpu_offset[cpu]``; and the words the
        profile's ``nmissed`` sums (``probes_profile_seq_show()``: ``rp.kp.nmissed``,
        and ``rp.nmissed`` for a return probe). Offsets from the kernel's BTF. ``None``
        when the kernel's symbols or types do not allow it (logged)."""
        self._nhit_ptrs = None
        btf, syms, read = self.vm.btf, self.vm.symbols, self.vm.host.read
        head_s, ops_s = syms.get("dyn_event_list"), syms.get("trace_kprobe_ops")
        pco, mask_s = syms.get("__per_cpu_offset"), syms.get("__cpu_possible_mask")
        if None in (head_s, ops_s, pco, mask_s) or btf is None:
            log.info("nhit not counted over the window: the kernel lacks dyn_event_list, "
                     "trace_kprobe_ops, __per_cpu_offset or __cpu_possible_mask")
            return
        try:
            off = {k: btf.offset(*k.split(":")) for k in (
                "dyn_event:list", "dyn_event:ops", "trace_kprobe:devent", "trace_kprobe:nhit",
                "trace_kprobe:tp",
                "trace_probe:event", "trace_probe_event:class", "trace_probe_event:call",
                "trace_event_class:system", "trace_event_call:name")}
        except KeyError as exc:
            log.info("nhit not counted over the window: %s", exc)
            return
        try:
            miss = {k: btf.offset(*k.split(":")) for k in (
                "trace_kprobe:rp", "kretprobe:kp", "kretprobe:nmissed", "kprobe:nmissed")}
        except KeyError as exc:
            log.info("nmissed not counted over the window: %s", exc)
            miss = None

        def word(addr: int) -> int:
            return int.from_bytes(read(addr, 8), "little")

        def cstr(addr: int) -> str:
            return read(addr, 64).split(b"\0", 1)[0].decode("utf-8", "replace")
        mask = word(mask_s.addr)
        offsets = [word(pco.addr + 8 * cpu) for cpu in range(64) if mask >> cpu & 1]
        found: list[tuple[str, str, int]] = []
        head = head_s.addr
        node, seen = word(head), 0
        while node and node != head and seen < 100000:
            if word(node + off["dyn_event:ops"]) == ops_s.addr:
                tk = node - off["dyn_event:list"] - off["trace_kprobe:devent"]
                ev = word(tk + off["trace_kprobe:tp"] + off["trace_probe:event"])
                group = cstr(word(ev + off["trace_probe_event:class"]
                                  + off["trace_event_class:system"]))
                event = cstr(word(ev + off["trace_probe_event:call"]
                                  + off["trace_event_call:name"]))
                name = f"{group}/{event}"
                if name in self.specs:
                    ptr = word(tk + off["trace_kprobe:nhit"])
                    found += [(name, "nhit", (ptr + o) & ((1 << 64) - 1)) for o in offsets]
                    # probes_profile_seq_show(): nmissed is rp.kp.nmissed, plus rp.nmissed
                    # for a return probe (kernel/trace/trace_kprobe.c of 6.1 and 6.12, read;
                    # 7.3's BTF has the same members, its text was not available here)
                    if miss is not None:
                        rp = tk + miss["trace_kprobe:rp"]
                        found.append((name, "nmissed",
                                      rp + miss["kretprobe:kp"] + miss["kprobe:nmissed"]))
                        if self.specs[name].is_return:
                            found.append((name, "nmissed", rp + miss["kretprobe:nmissed"]))
            node = word(node)
            seen += 1
        if len(found) > self.NHIT_READS:
            log.info("nhit not counted over the window: %d per-cpu words to read in a halt "
                     "(at most %d)", len(found), self.NHIT_READS)
            return
        self._nhit_ptrs = found

    def nhit_words(self) -> list[int]:
        """The addresses of our kprobe events' per-cpu ``nhit`` words (:meth:`_find_nhits`),
        for a host engine that reads them at the window's edges itself (the plugin's
        ``window(reads=)``); [] when they cannot be known."""
        if self._nhit_ptrs is False:
            self._find_nhits()
        return [addr for _, _, addr in self._nhit_ptrs or ()]

    def add_nhit_mark(self, values: Sequence[int] | None) -> None:
        """One edge of the window: the words of :meth:`nhit_words` read there (None: not
        read; the window's nhit is then not known)."""
        if values is None or not self._nhit_ptrs or len(values) != len(self._nhit_ptrs):
            self._nhit_marks.append(None)
            return
        marks: dict[tuple[str, str], int] = {}
        for (name, what, _), v in zip(self._nhit_ptrs, values, strict=True):
            marks[(name, what)] = marks.get((name, what), 0) + v
        self._nhit_marks.append(marks)

    def mark_nhits(self, engine: Any = None) -> None:
        """Read every kprobe event's ``nhit`` now: for a caller holding the guest halted at
        the window's start and at its end (``counters(window=True)`` gives the
        difference). ``engine``: the host engine that holds it halted and reads (default
        the machine's, ``vm.host``)."""
        words = self.nhit_words()
        if words:
            read = (engine if engine is not None else self.vm.host).read
            self.add_nhit_mark([int.from_bytes(read(a, 8), "little") for a in words])

    def trigger_counts(self) -> dict[str, int]:
        """What is left of each counted trigger's count (``event_trigger_data->count``:
        ``event_trigger_count()`` runs it down at every hit of the enabled event, the
        agent's own while the harness set things up included), read from guest memory:
        for a caller holding the guest halted at the start of the window."""
        out: dict[str, int] = {}
        read = self.vm.host.read
        for name, file in self._trigger_files.items():
            off = self._trigger_offs
            head = file + off["trace_event_file:triggers"]
            first = int.from_bytes(read(head, 8), "little")
            if first == head:
                continue
            data = first - off["event_trigger_data:list"]
            count = int.from_bytes(read(data + off["event_trigger_data:count"], 8), "little")
            out[name] = -1 if count == (1 << 64) - 1 else count
        return out

    def _parse_formats(self, formats: dict[str, str | None]
                       ) -> dict[int, tuple[str, ProbeSpec, EventFormat]]:
        """Each event's format text (None: the event is not there, and leaves ``specs``):
        event id -> (GROUP/EVENT, its first spec, its format) of each event still ours."""
        out: dict[int, tuple[str, ProbeSpec, EventFormat]] = {}
        for name, text in formats.items():
            if text is None:
                self.specs.pop(name, None)
                continue
            if name not in self.specs:
                continue
            try:
                fmt = parse_format(text)
            except ValueError:
                log.warning("no format for %s", name)
                continue
            out[fmt.id] = (name, self.specs[name], fmt)
            try:
                # The guest's own names and types: a 6.12+ kernel types $retval and
                # names BTF arguments itself (harness.kernel.ringbuf.format_args).
                self._args[fmt.id] = tuple(format_args(fmt))
            except ValueError as exc:
                log.warning("%s: arguments read as the spec says: %s", name, exc)
        return out

    def _with_mode(self, o: Outcome, spec: ProbeSpec, modes: dict[int, str]) -> Outcome:
        if not o.accepted or spec.kind == "-":
            return o
        if spec.is_uprobe:
            return Outcome(o.probe, True, mode="uprobe", index=o.index)
        if spec.is_eprobe:      # a trigger on the attached event
            return Outcome(o.probe, True, mode="eprobe", index=o.index)
        if spec.is_fprobe:      # an ftrace_ops, not in kprobes/list
            return Outcome(o.probe, True, mode="tprobe" if spec.is_tprobe else "fprobe",
                           index=o.index)
        try:
            addr = spec.addr if spec.addr is not None else \
                self.vm.symbols.lookup(spec.symbol_name).addr + spec.offset
        except KeyError:
            return o
        # An IBT kernel places SYM+0 at +4, past the ENDBR (arch_adjust_kprobe_addr).
        if addr not in modes and not spec.offset and addr + 4 in modes:
            addr += 4
        if addr not in modes:       # accepted, not registered (a module not loaded, ...)
            return Outcome(o.probe, True, mode="", index=o.index,
                           pending="not in the kprobes list: accepted, not registered")
        return Outcome(o.probe, True, mode=modes[addr], index=o.index)

    def switch_writes(self, on: bool) -> list[GuestWrite]:
        """``echo 1|0 > tracing_on`` as guest memory writes, for a host engine that makes
        them at one instant (``switch``; the plugin's recording window):
        ``tracer_tracing_on()``/``_off()`` (kernel/trace/trace.c) are
        ``ring_buffer_record_on()``/``_off()`` on ``global_trace``'s buffer (the
        ``RB_BUFFER_OFF`` bit, 1 << 20, of ``record_disabled`` in
        kernel/trace/ring_buffer.c of 6.1, 6.12 and 7.3) and ``buffer_disabled``. Offsets
        from the kernel's BTF."""
        eng, btf = self.vm.host, self.vm.btf
        if self._tr is None:
            gt = self.vm.symbols.lookup("global_trace").addr
            self._tr = (gt, btf.offset("trace_array", "array_buffer.buffer"),
                        btf.offset("trace_array", "buffer_disabled"),
                        btf.offset("trace_buffer", "record_disabled"))
        gt, buf_off, dis_off, rd_off = self._tr
        buf = int.from_bytes(eng.read(gt + buf_off, 8), "little")
        off = 1 << 20
        return [(buf + rd_off, 4, 0 if on else off, off if on else 0),
                (gt + dis_off, 4, 0 if on else 1, 0xFFFFFFFF)]

    def switch(self, on: bool) -> None:
        """``switch_writes`` made through a host engine that holds the guest halted
        (``harness.engines.gdbstub_engine.HostEngine.halted``)."""
        write_switch(self.vm.host, self.switch_writes(on))

    def enable(self, *, tracing: bool = True) -> None:
        """Enable our events, then tracing. Through the agent's file API, not a shell: the
        only process touching tracefs is then qemu-ga, whose hits the diff leaves out on
        both sides, and no harness process exits through a probed do_exit while the
        events are enabled. (register() enables each event once to see it can be, then
        disables it again, as kprobe_events leaves a new event.)"""
        self._nhit_marks = []
        self._after = None
        # tracing is off here (register() and disable() leave it off), so clearing the
        # buffer as the writes' first open does, before the events are on, loses nothing
        self.vm.write_files([(f"{TRACING}/events/{name}/enable", b"1\n") for name in self.specs]
                            + self._renames_switch(True) + [(f"{TRACING}/trace", b"\n")])
        self._find_trigger_files()
        self._set_triggers()
        if tracing:             # else the caller switches it on (:meth:`switch`)
            self.vm.write_file(f"{TRACING}/tracing_on", b"1\n")

    def disable(self) -> None:
        self.vm.write_files([(f"{TRACING}/tracing_on", b"0\n")]
                            + [(f"{TRACING}/events/{name}/enable", b"0\n") for name in self.specs]
                            + self._renames_switch(False))

    #: what :meth:`collect` read after its drain (:meth:`_read_after`: name -> bytes),
    #: for :meth:`counters`, :meth:`after_text` and the comm lookup of the same run; None
    #: outside a run's collection (reset by register(), enable() and close())
    _after: dict[str, bytes] | None = None
    _RENAME = f"{TRACING}/events/task/task_rename"
    _rename_fmt: tuple[int, Any, Any] | None = None     # set by __init__; None: not read

    def _renames_switch(self, on: bool) -> list[tuple[str, bytes]]:
        """Record the guest's renames (``task:task_rename``, fired by ``__set_task_comm()``
        before it copies the new comm: fs/exec.c of 6.1, 6.12 and 7.3) beside our events,
        so that each hit carries the comms its pid took after it *as the guest saw them*
        (``Hit.comm_alts``): the diff's ``comm-change`` rule asks both sides for it. Our
        probes' hits only, when a spec is ours; a kernel without the event records none
        (and ``comm-change`` then never applies). The write that switches it, if any."""
        if not self.specs:
            return []
        if on and self._rename_fmt is None:
            try:
                fmt = builtin_format(self.vm, f"{self._RENAME}/format")
                self._rename_fmt = (fmt.id, fmt.fields["pid"], fmt.fields["newcomm"])
            except (HarnessError, ValueError, KeyError) as exc:
                log.warning("no task_rename event: comm-change has no guest evidence (%s)", exc)
                return []
        if self._rename_fmt is None:
            return []
        return [(f"{self._RENAME}/enable", b"1\n" if on else b"0\n")]

    def _raw_pages(self, cpu: int) -> tuple[list[bytes], bool]:
        """Drain ``per_cpu/cpuN/trace_pipe_raw``, a page per read, and whether the drain
        reached the end (False: :attr:`max_pages` read and the buffer not empty). The
        agent opens files O_NONBLOCK, so the read after the last page fails with EAGAIN
        instead of waiting for more events (``tracing_buffers_read()``). A buffer that
        holds more than the first window's pages goes through the machine's data port
        (:meth:`_bulk_pages`). With the image's kph-reader, all of it is one request of
        the reader (``Machine.read_pieces``: a page a read, no process, raw bytes)."""
        path = f"{TRACING}/per_cpu/cpu{cpu}/trace_pipe_raw"
        read_pieces = getattr(self.vm, "read_pieces", None)
        got = read_pieces(path, self.max_pages, timeout=_scaled(30, self.max_pages // 64)) \
            if read_pieces is not None else None
        if got is not None:
            return got
        agent = self.vm.agent
        bulk = getattr(self.vm, "has_data_port", False)
        opens = [("guest-file-open", {"path": path, "mode": "r"})]
        if bulk:
            opens.append(("guest-file-open", {"path": f"{TRACING}/per_cpu/cpu{cpu}/stats",
                                              "mode": "r"}))
        opened = agent.pipeline(opens, timeout=30)
        if isinstance(opened[0], GuestAgentError):
            for h in opened[1:]:
                if not isinstance(h, GuestAgentError):
                    agent.execute("guest-file-close", {"handle": h}, timeout=30)
            raise opened[0]
        handle = opened[0]
        stats = opened[1] if bulk and not isinstance(opened[1], GuestAgentError) else None
        pages: list[bytes] = []
        window = 4
        try:
            while True:
                if len(pages) >= self.max_pages:
                    return pages, False
                # ``window`` reads pipelined (GuestAgent.pipeline: ~55 a round trip), each a page,
                # the window doubling while every read brings one: each answer is taken in
                # order, and the drain ends when a window's last read found the buffer
                # empty (a page written after an earlier empty read is kept). A read
                # asks for one page only: qemu-ga's read is one fread(), which loses what it
                # read when a later read() of it fails (EAGAIN), and a read of
                # trace_pipe_raw returns at most a page (tracing_buffers_read()).
                n = min(window, self.max_pages - len(pages))
                wave: list[tuple[str, dict[str, Any] | None]] = \
                    [("guest-file-read", {"handle": handle, "count": PAGE_SIZE})] * n
                if stats is not None:   # read after the first window's pages
                    wave += [("guest-file-read", {"handle": stats, "count": PAGE_SIZE}),
                             ("guest-file-close", {"handle": stats})]
                answers = agent.pipeline(wave, timeout=30)
                left = answers[n] if stats is not None else None
                stats = None
                empty = False
                for r in answers[:n]:
                    if isinstance(r, GuestAgentError):
                        if "temporarily unavailable" not in str(r):
                            raise r
                        empty = True                # EAGAIN: the buffer was empty
                    elif r.get("count"):
                        pages.append(base64.b64decode(r.get("buf-b64", "")))
                        empty = False               # written after an empty read: keep on
                    else:
                        empty = True
                if empty:
                    break
                if isinstance(left, dict):
                    text = base64.b64decode(left.get("buf-b64", "")).decode("utf-8", "replace")
                    pages += self._bulk_pages(cpu, min(self.max_pages - len(pages),
                                                       parse_stats(text).get("bytes", 0)
                                                       // PAGE_SIZE))
                window = min(window * 2, 64)
        finally:
            closes = [("guest-file-close", {"handle": handle})]
            if stats is not None:
                closes.append(("guest-file-close", {"handle": stats}))
            agent.pipeline(closes, timeout=30)
        return pages, True

    #: fewer whole pages than this left after the first window: the agent reads them
    BULK_MIN_PAGES = 16

    def _bulk_pages(self, cpu: int, n: int) -> list[bytes]:
        """``n`` pages of ``cpu``'s buffer through the machine's data port
        (``Machine.read_stream``: raw bytes, ~8x faster than the agent's base64 in JSON
        under TCG); none when ``n`` < :attr:`BULK_MIN_PAGES` (a process costs ~15 ms).
        ``n`` is what ``bytes`` of ``per_cpu/cpuN/stats`` says is left, by whole pages:
        the data not read yet (``ring_buffer_bytes_cpu()``: ``entries_bytes`` less
        ``read_bytes``), of which a page holds at most ``BUF_PAGE_SIZE``, 4,080 bytes
        (kernel/trace/ring_buffer.c of 6.1, 6.12, 7.3), so ``n`` pages are there and
        ``dd`` never waits for one more; each ``read()`` of trace_pipe_raw is one whole
        page (``tracing_buffers_read()``)."""
        if n < self.BULK_MIN_PAGES:
            return []
        data = self.vm.read_stream(
            f"dd if={TRACING}/per_cpu/cpu{cpu}/trace_pipe_raw of=\"$KPH_DATA\" bs={PAGE_SIZE} "
            f"count={n} 2>/dev/null", n * PAGE_SIZE, timeout=_scaled(30, n // 64))
        return [data[i:i + PAGE_SIZE] for i in range(0, len(data), PAGE_SIZE)]

    def _stats(self, cpus: Sequence[int]) -> dict[int, dict[str, int]]:
        """Each CPU's ``per_cpu/cpuN/stats`` (:func:`harness.kernel.ringbuf.parse_stats`),
        as :meth:`_read_after` read them."""
        out: dict[int, dict[str, int]] = {}
        for c in cpus:
            text = self.after_text(f"stats{c}")
            if text is not None:
                out[c] = parse_stats(text)
        return out

    def check_losses(self, losses: Sequence[RingLoss], unread: dict[int, int],
                     kept: dict[int, int] | None = None) -> None:
        """Fail the run on events the guest's ring buffer lost over it, or left unread.

        The buffer is emptied when the window opens (``enable()`` writes ``trace``:
        ``tracing_reset_online_cpus()`` -> ``rb_reset_cpu()`` sets the counters to 0), so
        the counters read after the drain are the run's. ``unread``: CPU -> entries the
        stats still count after a drain that stopped at :attr:`max_pages`. ``kept``: CPU
        -> the run's records its buffer did hold, for the size the error suggests.

        :raise GuestLossError: with the count and where the kernel gave it.
        """
        lost = [x for x in losses if x.count]
        if lost:
            n = sum(x.count for x in lost)
            # each CPU's buffer scaled by what it lost over what it kept (the largest)
            need = max((needed_mib(self.buffer_kb << 10, (kept or {}).get(x.cpu, 0), x.count)
                        for x in lost), default=0)
            raise GuestLossError(self.side, n, f"the guest's ring buffer lost {n} event(s) "
                                 f"({'; '.join(x.describe() for x in lost)}; buffer_size_kb "
                                 f"{self.buffer_kb})", needed_mib=need)
        if unread:
            n = sum(unread.values())
            where = ", ".join(f"cpu{c} {k}" for c, k in unread.items())
            raise GuestLossError(self.side, n, f"the read of the guest's ring buffer stopped "
                                 f"at {self.max_pages} page(s) per CPU with {n} event(s) "
                                 f"unread (per_cpu/cpuN/stats entries: {where})")

    def _cmdlines(self) -> dict[int, str]:
        """``saved_cmdlines`` (as :meth:`_read_after` read it): pid -> comm, escaped as
        every side escapes bytes."""
        out = {}
        for line in (self._after or {}).get("saved_cmdlines", b"").split(b"\n"):
            pid, _, comm = line.partition(b" ")
            if pid.strip().isdigit():
                out[int(pid)] = escape_bytes(comm)
        return out

    @gc_paused()
    def collect(self) -> list[Hit]:
        """Every record of our events, in time order across CPUs, as the trace would show
        it (``print_kprobe_event()``, ``print_kretprobe_event()``, ``print_uprobe_event()``)."""
        cpus = getattr(self, "_cpus", None) or [0]
        if not self._formats:
            self._after = self._read_after(cpus)
            return []
        per_cpu, pages, truncated = [], {}, []
        stack_id = self._stack_fmt[0] if self._stack_fmt is not None else -1
        rename_id = self._rename_fmt[0] if self._rename_fmt is not None else -1
        # (ts, cpu, bytes) of our events' records: a RawRecord is made only of one decoded
        # (a hot probe's records repeat a few payloads) or a special one
        wanted = {*self._formats, stack_id, rename_id}
        for cpu in cpus:
            pages[cpu], complete = self._raw_pages(cpu)
            if not complete:
                truncated.append(cpu)
            mine: list[tuple[int, int, bytes]] = []
            for page in pages[cpu]:
                got, _ = page_events(page)
                mine += [(ts, cpu, d) for ts, d in got if (d[0] | d[1] << 8) in wanted]
            per_cpu.append(mine)
        self._after = self._read_after(cpus)
        stats = self._stats(cpus)
        self.check_losses([ring_loss(c, stats.get(c, {}), pages[c]) for c in cpus],
                          {c: max(1, stats.get(c, {}).get("entries", 0)) for c in truncated},
                          {c: len(mine) for c, mine in zip(cpus, per_cpu)})
        # Merged by time stamp, each CPU's own order kept: a CPU's buffer is in commit
        # order, and an event written from an interrupt that nested inside another
        # event's write can carry an earlier stamp than the one before it.
        recs = per_cpu[0] if len(per_cpu) == 1 else \
            list(heapq.merge(*per_cpu, key=itemgetter(0)))
        comms = self._cmdlines()
        table = self.vm.symbols

        symbolize = remembered_symbolizer(table)
        ktramp = kernel_rethook_trampoline(table)

        modes = {o.probe: o.mode for o in self.outcomes}
        templates: dict[int, Hit] = {}
        decoded: dict[tuple[int, bytes], tuple[Hit, bool]] = {}
        sizes: dict[int, int] = {}          # an event's ID -> where its fixed fields end
        hits: list[Hit] = []
        add = hits.append
        renames: dict[int, list[tuple[int, str]]] = {}     # pid -> (hits before it, comm)
        formats = self._formats
        comms[0] = "<idle>"
        type_pid = TYPE_PID.unpack_from       # struct trace_entry: type, pid
        for ts, cpu, data in recs:
            rtype, pid = type_pid(data)
            if rtype == rename_id:
                _, fpid, fcomm = self._rename_fmt
                pid = int.from_bytes(data[fpid.offset:fpid.offset + 4], "little", signed=True)
                raw = data[fcomm.offset:fcomm.offset + fcomm.size].split(b"\0", 1)[0]
                renames.setdefault(pid, []).append((len(hits), escape_bytes(raw)))
                continue
            if rtype not in formats:                # a stack trace: the last hit's here
                self._attach_stack(hits, RawRecord(cpu, ts, data))
                continue
            # what a record's payload decodes to (its ip, arguments, size) depends on its
            # bytes after struct trace_entry alone: decoded once per distinct payload
            # (a hot probe's records repeat a few payloads: vfs_read's count=1)
            key = (rtype, data[8:])
            got = decoded.get(key)
            if got is None:
                if len(decoded) >= DECODED_MAX:
                    decoded.clear()
                got = decoded[key] = (self._decode(RawRecord(cpu, ts, data), templates, sizes,
                                                   modes, symbolize, ktramp),
                                      formats[rtype][1].is_uprobe)
            base, up = got
            add(base.placed(len(hits), cpu, pid, comms.get(pid, "<...>"),
                            "" if up else _CONTEXT[data[2]]))
        # a hit carries the comms its pid took after it (those renames recorded after
        # it): no hit from its pid's last rename on does, so the hits before the latest
        # rename of all are the ones looked at (an exec at a run's start: a few)
        end = min(len(hits), max((n for rs in renames.values() for n, _ in rs), default=0))
        for i in range(end):
            rs = renames.get(hits[i].pid)
            later = tuple(c for n, c in rs if n > i) if rs is not None else ()
            if later:
                hits[i] = hits[i].changed(comm_alts=later)
        return hits

    def _decode(self, rec: Any, templates: dict[int, Hit], sizes: dict[int, int],
                modes: dict[str, str], symbolize: Any, ktramp: Any) -> Hit:
        """What one record's payload says, as a hit without its place (seq, cpu, pid,
        comm and context: :meth:`Hit.placed`)."""
        name, spec, fmt = self._formats[rec.type]
        fields = fmt.fields
        if spec.is_uprobe:
            if "__probe_ret_ip" in fields:
                ip, ret_from = (f"0x{rec.u64(fields['__probe_ret_ip']):x}",
                                f"0x{rec.u64(fields['__probe_func']):x}")
            else:
                ip, ret_from = f"0x{rec.u64(fields['__probe_ip']):x}", None
        elif spec.is_eprobe:        # print_eprobe_event(): "(SYSTEM.EVENT)"
            ip, ret_from = "{}.{}".format(*(spec.attach or ("", ""))), None
        elif "__probe_ret_ip" in fields:
            text = format_ip(rec.u64(fields["__probe_ret_ip"]), symbolize,
                             rec.u64(fields["__probe_func"]), kretprobe_trampoline=ktramp)
            ip, _, ret_from = text.partition(" <- ")
        else:
            ip, ret_from = format_ip(rec.u64(fields["__probe_ip"]), symbolize), None
        gargs = self._args.get(rec.type, spec.args)
        values = decode_args(rec, fmt, gargs)
        fixed = sizes.get(rec.type)
        if fixed is None:
            fixed = sizes[rec.type] = fixed_size(fmt)
        excess, reach = record_excess(rec, fmt, gargs, fixed)
        args = tuple((a.name, format_value(a, v, symbolize)) for a, v in zip(gargs, values))
        tpl = templates.get(rec.type)
        if tpl is None:
            tpl = templates[rec.type] = Hit.template(
                self.side, name, "r" if spec.is_return else "p", mode=modes.get(name, ""))
        return tpl.changed(ip=ip, ret_from=ret_from or None, args=args, excess=excess,
                           reach=reach)

    def _attach_stack(self, hits: list[Hit], rec: Any) -> None:
        """A ``kernel_stack`` entry: the frames of the stacktrace trigger of the event
        just before it on its CPU (a post trigger runs right after the event's commit),
        up to ``size`` entries or ULONG_MAX (``trace_stack_print()``)."""
        assert self._stack_fmt is not None
        _, size_off, caller_off = self._stack_fmt
        n = int.from_bytes(rec.data[size_off:size_off + 4], "little")
        names = []
        for i in range(n):
            at = caller_off + 8 * i
            if at + 8 > len(rec.data):
                break
            addr = int.from_bytes(rec.data[at:at + 8], "little")
            if addr == (1 << 64) - 1:
                break
            names.append(self.vm.symbols.frame_name(addr))
        for j in range(len(hits) - 1, -1, -1):
            if hits[j].cpu == rec.cpu:
                if hits[j].stack is None and self.triggers.get(hits[j].probe):
                    hits[j] = dataclasses.replace(hits[j], stack=tuple(names))
                return
        log.warning("cpu%d: a stack trace with no event before it", rec.cpu)

    def counters(self, *, window: bool = False) -> dict[str, Counters]:
        """nhit/nmissed of our events, keyed ``GROUP/EVENT`` as the host's are
        (:func:`profile_counters`). A probe kind the guest counts nowhere (fprobe, tprobe
        and eprobe events have no profile line) is left absent, and so is an event whose
        lines cannot be told apart from another group's (logged).

        ``window``: a kprobe event's ``nhit`` and ``nmissed`` are what it counted between
        the two :meth:`mark_nhits` of the window's halts (``Counters.window``), when both
        were read; the profile's counts from the event's enabling otherwise. (A host side
        counts misses while its probes are armed, over the window: a miss of the guest's
        before it, say a kfree() in an interrupt while a kprobe handler ran as the harness
        set up, is not the run's.)"""
        if self._after is not None:     # read with this run's collection
            dyn, kprobes, uprobes = (self.after_text(n) or "" for n in
                                     ("dynamic_events", "kprobe_profile", "uprobe_profile"))
        else:
            text = self._sh(f"cd {TRACING}; cat dynamic_events; echo @k; cat kprobe_profile; "
                            "echo @u; cat uprobe_profile")
            dyn, _, rest = text.partition("@k\n")
            kprobes, _, uprobes = rest.partition("@u\n")
        sums, unclear = profile_counters(dyn, kprobes, uprobes)
        for name in sorted(n for n in unclear if n in self.specs):
            log.warning("%s: no counters: its kprobe_profile/uprobe_profile lines name the "
                        "event only and could not be matched to its group (%s)", name,
                        unclear[name])
        out = {name: Counters(name, nhit, nmissed)
               for name, (nhit, nmissed) in sums.items() if name in self.specs}
        if window and len(self._nhit_marks) == 2 and None not in self._nhit_marks:
            start, end = self._nhit_marks
            for (name, what), n in end.items():
                if what != "nhit":
                    continue
                missed = out[name].nmissed if name in out else 0
                if (name, "nmissed") in end:        # else the profile's, from the enabling
                    missed = end[(name, "nmissed")] - start.get((name, "nmissed"), 0)
                out[name] = Counters(name, n - start.get((name, "nhit"), 0), missed, window=True)
        return out

    def close(self) -> None:
        """Disable and delete our events; tracing is left on, the buffer empty."""
        self._after = None
        if self.vm.aborting:  # interrupted: the guest is about to vanish
            self.specs.clear()
            return
        cmds = []
        for name in self.triggers:
            if name in self.specs:      # an event with a trigger cannot be removed
                cmds.append(f"echo '!stacktrace' > {shlex.quote(f'{TRACING}/events/{name}/trigger')}")
        for spec in self.specs.values():
            cmds.append(f"echo 0 > {shlex.quote(f'{TRACING}/events/{spec.group}/{spec.event}/enable')}")
            cmds.append(f"echo {shlex.quote(f'-:{spec.group}/{spec.event}')} >> {TRACING}/{events_file(spec)}")
        cmds.append(f"echo > {TRACING}/trace; echo 1 > {TRACING}/tracing_on")
        self.vm.run("; ".join(cmds), timeout=_scaled(60, len(self.specs)))
        self.specs.clear()
