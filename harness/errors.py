"""Every error the harness raises, in one leaf module.

An exception means the harness itself could not do what was asked; a kernel that
refuses a probe is a *result* (see ``harness.engines.gdbstub_engine``), not an error here.

::

    HarnessError                          root; never raised directly
     ├─ SetupError(.hint)                 missing QEMU, image, file: the fix is in .hint
     ├─ VMError(.console_tail)            QEMU failed to start, or the guest died
     │   ├─ GuestPanicError               the guest kernel panicked (pvpanic or console)
     │   ├─ GuestShutdownError            the guest powered off or reset on its own
     │   └─ VMLostError                   no reply from QMP or the guest agent in time
     │       └─ HostSlowedError           ... while the guest kept taking the host engine's
     │                                    probe stops: slowed by them, not hung; the run
     │                                    is not compared
     ├─ StateError(.state, .required)     a call made in the wrong VmState
     │   └─ GuestStoppedError(.reason)    it needs the guest running, and the guest is
     │                                    stopped (in a probe handler, by a debugger)
     ├─ HandlerError(.errors)             host-side probe handlers raised (the guest
     │                                    went on as if they had returned 0)
     ├─ GuestAgentError(.error_class)     the guest agent answered with an error
     ├─ GuestExecError(.exitcode, .stdout, .stderr)   a guest command failed (check=True)
     ├─ GdbMIError(.token, .msg)          GDB answered a command with ^error
     │   └─ MemoryFaultError(.address)    ... because the guest's page tables do not map
     │                                    the memory (the kernel's read would fault too)
     ├─ EngineReadError(.address, .size)  a host engine could not read guest memory for a
     │                                    reason the kernel would not fault on (GDB timed
     │                                    out or refused, a capture the plugin lacks): the
     │                                    hit has no value, and the run fails, never
     │                                    "equivalent"
     ├─ PluginRecordError(.counts, .ring_mib)    the plugin's records of a run are
     │                                    incomplete (ring overflow, truncated or refused
     │                                    records); .ring_mib: the ring that would hold them
     ├─ SymbolNotFoundError(.name)        also a KeyError
     ├─ ProbeRejectedError(.errno, .addr) the kernel's rules refuse this probe address
     ├─ ProbeSpecError(.text, .column, .errno)   a probe spec the kernel would not parse
     │   └─ NotMirroredError              a kind the kernel takes, the host does not mirror
     └─ ScenarioError(.path, .key)        a repro scenario file that does not validate
"""
from __future__ import annotations

import time
from typing import Any, Callable


class HarnessError(Exception):
    """Root of every error raised by kprobe-harness."""


class SetupError(HarnessError):
    """Something the harness needs is missing or unusable; ``hint`` says what to do."""

    def __init__(self, msg: str, hint: str = "") -> None:
        super().__init__(f"{msg}; {hint}" if hint else msg)
        self.hint = hint


class StaleImageError(SetupError):
    """An image built from another recipe than this kph's (``store.check_recipe``)."""


class VMError(HarnessError):
    """QEMU failed or the guest died; ``console_tail`` holds the last console lines."""

    def __init__(self, msg: str, console_tail: str = "") -> None:
        super().__init__(msg)
        self.console_tail = console_tail
        self.console_log: object = None  # where the whole console was kept, if it was

    def __str__(self) -> str:
        base = super().__str__()
        if self.console_tail:
            return f"{base}\n--- console tail ---\n{self.console_tail}"
        return base


class GuestPanicError(VMError):
    """The guest kernel panicked."""


class GuestShutdownError(VMError):
    """The guest powered off or reset while the harness still needed it."""


class VMLostError(VMError):
    """QMP or the guest agent stopped answering within the timeout; ``at`` is when the
    wait ran out (``time.monotonic()``), kept by a re-raise: what the guest was doing
    then (``Machine.host_busy``) is judged at that instant, not after the clean-up."""

    def __init__(self, msg: str, console_tail: str = "", at: float | None = None) -> None:
        super().__init__(msg, console_tail)
        self.at = time.monotonic() if at is None else at


class HostSlowedError(VMLostError):
    """A wait on the guest ran out while the guest kept taking a host engine's probe
    stops (``Machine.host_busy``): each halts the guest for a host round trip, and enough
    of them (16 probes inside a loop of the workload: tens of thousands of hits) outlast
    any timeout. The guest runs; nothing is measured of it, so the run is neither a hang
    nor compared. ``stops`` is how many stops the host handled in the run's machine.
    Not a hang the kernel made: ``harness.machine.kwatch`` never makes it a finding."""

    def __init__(self, msg: str, console_tail: str = "", stops: int = 0,
                 at: float | None = None) -> None:
        super().__init__(msg, console_tail, at)
        self.stops = stops


class StateError(HarnessError):
    """A call was made while the machine was in a state that does not allow it."""

    def __init__(self, msg: str, state: object = None, required: object = None) -> None:
        super().__init__(msg)
        self.state = state
        self.required = required


class GuestStoppedError(StateError):
    """A call that needs the guest running (``vm.run``, ``push``, ``pull``, the agent) was
    made while the guest is stopped: from a host-side probe handler, or while a debugger
    holds it. Raised at once, instead of a wait that could never end; ``reason`` says who
    holds the guest and what to do instead."""

    def __init__(self, msg: str, reason: str = "") -> None:
        super().__init__(msg, "stopped", "running")
        self.reason = reason


class HandlerError(HarnessError):
    """Host-side probe handlers raised; the guest went on as if each had returned 0.

    Raised by the next call on the engine (or its ``close()``) unless the caller took
    the errors with ``take_handler_errors()`` first; ``errors`` holds every exception,
    the first is also the ``__cause__``.
    """

    def __init__(self, msg: str, errors: list[BaseException] | None = None) -> None:
        super().__init__(msg)
        self.errors = list(errors or [])


class GuestAgentError(HarnessError):
    """The guest agent (qemu-ga) answered a command with an error."""

    def __init__(self, msg: str, error_class: str = "") -> None:
        super().__init__(msg)
        self.error_class = error_class


class GuestExecError(HarnessError):
    """A guest command exited non-zero where success was required."""

    def __init__(self, cmd: str, exitcode: int, stdout: str, stderr: str) -> None:
        super().__init__(f"guest command {cmd!r} exited {exitcode}: {stderr.strip()[-500:]}")
        self.exitcode = exitcode
        self.stdout = stdout
        self.stderr = stderr


class GdbMIError(HarnessError):
    """GDB answered an MI command with ``^error``."""

    def __init__(self, msg: str, token: int | None = None) -> None:
        super().__init__(msg)
        self.token = token
        self.msg = msg


class MemoryFaultError(GdbMIError):
    """GDB could not read guest memory because the guest does not map it (QEMU's stub
    answers ``E14`` when its page walk fails): the one read failure that is a *value*,
    the fault ``copy_from_kernel_nofault()`` would take in the guest."""

    def __init__(self, msg: str, address: int, token: int | None = None) -> None:
        super().__init__(msg, token)
        self.address = address


class EngineReadError(HarnessError):
    """A host engine could not read guest memory during a probe hit, for a reason that is
    not a fault the guest kernel would take: GDB timed out or refused, the VM was lost,
    the plugin did not capture what the fetch program needed. Never a value: the hit
    cannot be evaluated, so the run fails (``kph diff`` exit 3) and says why."""

    def __init__(self, msg: str, address: int = 0, size: int = 0) -> None:
        super().__init__(msg)
        self.address = address
        self.size = size

    @classmethod
    def raise_first(cls, errors: "list[tuple[str, EngineReadError]]") -> None:
        """Fail a run in which any hit could not be evaluated: one error whose message
        counts them per probe and gives the first (``errors``: (probe, error) pairs).

        :raise EngineReadError: when ``errors`` is not empty.
        """
        if not errors:
            return
        per: dict[str, int] = {}
        for name, _ in errors:
            per[name] = per.get(name, 0) + 1
        first = errors[0][1]
        counts = ", ".join(f"{n} of {p}" for p, n in per.items())
        raise cls(f"{len(errors)} host hit(s) could not be evaluated ({counts}); first: {first}",
                  first.address, first.size) from first


#: The largest ring per vCPU the plugin takes, in MiB (probes/plugin/kph_plugin.h:
#: RING_MAX_SIZE; ``kph diff --host-buffer``'s bound)
MAX_RING_MIB = 1024
#: :class:`PluginRecordError`'s count of the records dropped on a full ring
DROPPED = "dropped (ring full)"


class PluginRecordError(HarnessError):
    """The plugin's records of a run are incomplete: records dropped on a full ring,
    truncated records, or programs the plugin refused. ``counts`` has each kind's number.
    A run with any of them is not compared (``kph diff`` exit 2, 3 when the VM was lost
    under it). ``ring_mib``: with records dropped, the ring per vCPU that would have held
    them (:func:`ring_mib`; 0 when none the plugin takes would): the size to pass as
    ``kph diff --host-buffer``, which the message names (or, with records dropped and no
    such ring, that fewer hits are the way)."""

    def __init__(self, msg: str, counts: dict[str, int] | None = None,
                 ring_mib: int = 0) -> None:
        if ring_mib:
            hint = (f"; a ring of {ring_mib} MiB per vCPU would have held them (kph diff "
                    f"--host-buffer {ring_mib})")
        elif (counts or {}).get(DROPPED):
            hint = (f"; no ring the plugin takes ({MAX_RING_MIB} MiB per vCPU at most) "
                    "would have held them: fewer hits (a narrower probe or workload)")
        else:
            hint = ""
        super().__init__(msg + hint)
        self.msg = msg
        self.counts = dict(counts or {})
        self.ring_mib = ring_mib

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.counts, self.ring_mib)


def ring_mib(size: int, dropped: int, record_bytes: float) -> int:
    """The plugin's ring per vCPU (MiB, a power of two, as the plugin takes it) that would
    have held ``dropped`` more records of ``record_bytes`` each beside the ``size`` bytes
    that were full, twice over: the records arrived while the drain was behind, so a ring
    that holds them too rides out a lag as long, and twice a lag as long or a guest that
    writes twice as fast (the same run's hits came 30% faster or slower from one run to
    the next on this machine under load). 0 past :data:`MAX_RING_MIB`."""
    need = (size + dropped * record_bytes) * 2
    mib = 1
    while (mib << 20) < need:
        mib <<= 1
    return mib if mib <= MAX_RING_MIB else 0


def needed_mib(size: int, kept: int, lost: int) -> int:
    """The buffer (MiB) that would have held ``kept + lost`` records where ``size``
    bytes held ``kept`` (a quarter more, for a run that differs a little the next time):
    the size a :class:`GuestLossError` suggests. 0 when nothing was kept
    to scale from."""
    if kept <= 0 or size <= 0:
        return 0
    return max(1, -(-size * (kept + lost) * 5 // (4 * kept) // (1 << 20)))


class GuestLossError(HarnessError):
    """An in-guest side's records of a run are incomplete: ``count`` records (or pages,
    as ``what`` says) lost on ``side`` (``events``, ``module``), ``what`` naming the loss
    and the kernel's source of the count (``per_cpu/cpu0/stats overrun``, the module's
    ``dropped`` counter, a read that stopped before the buffer was empty). Never a
    warning alone, never a divergence: the run is not compared (``kph diff`` exit 2).
    ``needed_mib``: the guest buffer that would have held the run, as the side estimates
    it from what it kept (MiB; 0 when it cannot say): the size to pass as ``kph diff
    --guest-buffer``."""

    def __init__(self, side: str, count: int, what: str, needed_mib: int = 0) -> None:
        hint = (f"; a guest buffer of {needed_mib} MiB would hold it "
                f"(kph diff --guest-buffer {needed_mib})" if needed_mib else "")
        super().__init__(f"{side}: {what}; the run is not compared{hint}")
        self.side = side
        self.count = count
        self.what = what
        self.needed_mib = needed_mib

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.side, self.count, self.what, self.needed_mib)


class SymbolNotFoundError(HarnessError, KeyError):
    """A kernel symbol is not in the symbol table in use. ``hint`` may be given as a
    function, called when the hint is first read: the close matches of a name among a
    kernel's ~150,000 symbols take ~1 s, and most misses are caught, not shown."""

    def __init__(self, name: str, hint: str | Callable[[], str] = "") -> None:
        super().__init__(name)
        self.name = name
        self._hint = hint

    @property  # type: ignore[override]
    def hint(self) -> str:
        if callable(self._hint):
            self._hint = self._hint()
        return self._hint

    @hint.setter
    def hint(self, value: str) -> None:
        self._hint = value

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return SymbolNotFoundError, (self.name, self.hint)    # a function does not pickle

    def __str__(self) -> str:
        return f"unknown symbol {self.name!r}" + (f"; {self.hint}" if self.hint else "")


class ProbeRejectedError(HarnessError):
    """A probe the kernel would refuse, with the errno ``register_kprobe`` would return.

    EINVAL: blacklisted, not kernel text, or reserved text (jump label, static call: 6.1's
    ``check_kprobe_address_safe`` says EINVAL for those too); ENOENT: unknown symbol or an
    address inside no symbol; EILSEQ: not an instruction boundary (x86 ``can_probe``).
    """

    def __init__(self, msg: str, errno: int, addr: int | None = None, *,
                 reason: str = "") -> None:
        super().__init__(msg)
        self.errno = errno
        self.addr = addr
        #: the rule in a few words (``blacklisted: do_int3``), for one-line verdicts
        self.reason = reason or msg


class ProbeSpecError(HarnessError):
    """A probe spec does not parse; ``column`` is the 0-based offset of the bad token.

    ``errno`` is what the kernel's write fails with (EINVAL unless it says otherwise),
    ``logged`` whether the kernel writes an ``error_log`` entry for it (some refusals,
    such as -E2BIG for too many arguments on 6.12, log nothing)."""

    def __init__(self, msg: str, text: str = "", column: int = 0, *, errno: int = 22,
                 logged: bool = True) -> None:
        super().__init__(msg)
        self.text = text
        self.column = column
        self.errno = errno
        self.logged = logged


class NotMirroredError(ProbeSpecError):
    """A probe kind or construct the booted kernel takes but a side of the harness does
    not mirror (``f:`` fprobe events, ``t:`` tracepoint probes; 7.3's ``$current`` in the
    module's programs, ...): refused, in one line; ``hint`` says what to do instead."""

    def __init__(self, msg: str, text: str = "", column: int = 0, *, errno: int = 95,
                 hint: str = "") -> None:
        super().__init__(msg, text, column, errno=errno, logged=False)
        self.hint = hint


class ScenarioError(HarnessError):
    """A scenario file is malformed; ``key`` is the TOML key at fault (dotted)."""

    def __init__(self, path: str, key: str, msg: str) -> None:
        super().__init__(f"{path}: {key}: {msg}" if key else f"{path}: {msg}")
        self.path = path
        self.key = key
