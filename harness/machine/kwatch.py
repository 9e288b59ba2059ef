"""The kernel-side oracles of a run: the guest's console and ``dmesg`` watched over the
run's window, and a guest that stops answering told from a QEMU that died.

Every verb's run goes through :class:`KernelWatch` (``harness.diff.runner``,
``harness.diff.worlds``, ``harness.apps.fuzz``, ``harness.apps.repro``)::

    watch = KernelWatch(vm)
    with watch.watching():          # a panic or a hang inside is re-raised as a finding
        ... register, run the workload, collect ...
    splats = watch.finish()         # what the kernel printed: console, then dmesg

Two sources, because the default command line has ``quiet``: the console's loglevel is
then 4, and a message is printed on the console only below it: ``BUG:``, ``Oops`` and the
panic (KERN_ALERT, KERN_EMERG) reach it, a ``WARN()``'s ``WARNING:`` (KERN_WARNING, 4)
does not. So the kernel's log is read too, before the window (its last line is the mark)
and after it, as ``dmesg`` prints it (``Machine.kernel_log``: the guest's kph-reader, no
guest process). The splats themselves are found by ``harness.kernel.splat``.
"""
from __future__ import annotations

import contextlib
import logging
import re
from typing import TYPE_CHECKING, Iterator

from ..errors import GuestPanicError, HarnessError, HostSlowedError, VMLostError
from ..kernel.splat import (GuestHangError, KernelFinding, KernelPanicFinding, Splat,
                            find_splats, merge)

if TYPE_CHECKING:
    from ..vmctl import Machine

log = logging.getLogger(__name__)

#: How long the agent may take to print ``dmesg`` (and to answer after a lost command)
DMESG_TIMEOUT = 20.0
_TS = re.compile(r"^\[\s*(\d+)\.(\d+)\]")


def _stamp(line: str) -> tuple[int, int] | None:
    m = _TS.match(line)
    return (int(m.group(1)), int(m.group(2))) if m else None


def dmesg_after(before: str | None, after: str) -> str:
    """The lines of ``after`` (a later ``dmesg``) that ``before`` did not hold: those
    after ``before``'s last line, found by its text, else those with a later time stamp
    (the ring buffer dropped that line); all of ``after`` when there was no ``before``."""
    if not before or not before.strip():
        return after
    last = before.rstrip("\n").splitlines()[-1]
    lines = after.rstrip("\n").splitlines()
    for k in range(len(lines) - 1, -1, -1):
        if lines[k] == last:
            return "\n".join(lines[k + 1:])
    mark = _stamp(last)
    return "\n".join(ln for ln in lines if mark is None or (_stamp(ln) or (0, 0)) > mark)


class KernelWatch:
    """What the kernel printed from :meth:`start` on (``watching()`` starts it)."""

    def __init__(self, vm: Machine, *, dmesg: bool = True,
                 timeout: float = DMESG_TIMEOUT) -> None:
        self.vm = vm
        self.dmesg = dmesg
        self.timeout = timeout
        self.mark: int | None = None
        self._dmesg_before: str | None = None
        self._before: list[Splat] = []

    def _read_dmesg(self) -> str | None:
        if not self.dmesg or self.vm.aborting:
            return None
        try:
            return self.vm.kernel_log(timeout=self.timeout)
        except HarnessError as exc:     # a guest that cannot answer: the console still tells
            log.info("dmesg not read: %s", str(exc).splitlines()[0])
            return None

    def start(self) -> None:
        """Mark the console and read ``dmesg``: what they hold now was printed before the
        window (boot, or an earlier run on this machine), and is reported as such."""
        self.mark = self.vm.console_mark()
        self._dmesg_before = self._read_dmesg()
        self._before = merge(
            find_splats(self.vm.console_since(0, self.mark or 0), source="console",
                        before=True),
            find_splats(self._dmesg_before or "", source="dmesg", before=True))

    def _during_console(self) -> list[Splat]:
        return find_splats(self.vm.console_since(self.mark or 0), source="console")

    def finish(self, *, dmesg: bool = True) -> tuple[Splat, ...]:
        """Every splat: those printed before the window, then those during it (console and
        ``dmesg``, each once; ``dmesg=False``: the console only, for a guest known gone)."""
        if self.mark is None:
            self.start()
        now = self._read_dmesg() if dmesg else None
        fresh = [] if now is None else find_splats(dmesg_after(self._dmesg_before, now),
                                                   source="dmesg")
        return tuple(self._before + merge(self._during_console(), fresh))

    @contextlib.contextmanager
    def watching(self) -> Iterator["KernelWatch"]:
        """Start the watch; a panic or a hang of the guest inside is re-raised as the
        finding it is (:meth:`lost`), whatever error it surfaced as."""
        if self.mark is None:
            self.start()
        try:
            yield self
        except HarnessError as exc:
            found = self.lost(exc)
            if found is exc:
                raise
            raise found from exc

    def lost(self, exc: BaseException) -> BaseException:
        """``exc`` as a kernel finding when it is one: a panic in the window
        (:class:`KernelPanicFinding`, its splats from the console), or a guest that
        stopped answering while QEMU reports it running (:class:`GuestHangError`, verdict
        ``HANG``). A guest still taking the host engine's probe stops when the wait ran
        out is neither (:class:`HostSlowedError`: slowed by the host, the run not
        compared). Anything else (QEMU died, QMP silent, a guest held stopped) is
        returned as it is: a harness failure."""
        if isinstance(exc, KernelFinding) or self.mark is None:
            return exc
        vm = self.vm
        tail = vm.console_tail()
        state = getattr(getattr(vm, "state", None), "value", "")
        # a panicked guest is seen first by whatever talked to it next (a backend's
        # clean-up raising "is panicked" over the panic itself)
        if isinstance(exc, GuestPanicError) or state == "panicked":
            splats = self._during_console()
            if not any(s.verdict == "KERNEL-PANIC" for s in splats):
                first = str(exc.args[0]) if exc.args else "guest kernel panicked"
                splats.append(Splat("KERNEL-PANIC", first.split(": ", 2)[-1], tail, "console"))
            return KernelPanicFinding(str(exc.args[0]) if exc.args else "guest kernel panicked",
                                      tail, self._before + splats)
        if not isinstance(exc, VMLostError) or vm.aborting:
            return exc
        if vm.proc is None or vm.proc.poll() is not None:
            return exc
        try:
            status = str(vm.qmp("query-status", timeout=2.0).get("status"))
        except HarnessError:
            return exc
        if status != "running":
            return exc
        first = str(exc.args[0]) if exc.args else "no answer"
        if isinstance(exc, HostSlowedError):
            return exc
        if vm.host_busy(getattr(exc, "at", None)):
            # it still takes the host engine's probe stops: a guest slowed by the host's
            # probes, whose work outlasted the timeout (each stop is a host round trip), runs
            return HostSlowedError(
                f"{vm.name}: not compared: the host's probes slowed the guest past the "
                f"timeout ({first}; the guest was still taking host probe stops, "
                f"{vm.host_stops} in all): a busy guest, not a hang; probe fewer or colder "
                "places, give a longer --timeout, or use --host plugin (its stops cost no "
                "round trip to GDB)",
                vm.console_tail(), stops=vm.host_stops)
        fresh: list[Splat] = []
        try:
            vm.run("true", timeout=5.0)
            answers = True
        except HarnessError:
            answers = False
        if answers:
            # what ran out may be the workload or any request before or after it (its
            # own words say which): not "the workload" unless it was
            why = f"the guest did not finish in time ({first}); the guest agent still answers"
            now = self._read_dmesg()
            if now is not None:
                fresh = find_splats(dmesg_after(self._dmesg_before, now), source="dmesg")
        else:
            why = f"the guest agent stopped answering ({first}) while QEMU reports the guest running"
        splats = merge(self._during_console(), fresh)
        splats.append(Splat("HANG", why, tail, "agent"))
        return GuestHangError(f"{vm.name}: guest hang: {why}", tail, self._before + splats, why)
