"""The handler context: what runs while the guest is stopped, and what it may not call.

A host-side probe handler runs while the guest is stopped at a breakpoint, as a kernel
kprobe handler runs with preemption off. The kernel's rule is that a handler must not
sleep; the host's is its twin: **a handler must not wait on the guest.** Anything that
needs the guest to run before it can answer (``vm.run``, ``vm.push``, ``vm.pull``,
``vm.write_file``, the guest agent) would wait for ever, because the guest resumes only
when the handler returns.

What a handler may call: ``regs`` (read and write), ``vm.host.read`` / ``read_string`` /
``write`` (guest memory through the stub), the engine's helpers (``current_task``,
``task_comm``, ``task_pid``, ``function_args``), ``vm.symbols`` and everything else in
``vm.facts`` (files on the host). What it may not: anything on the guest agent. Record
what you need in the handler and act on it after ``vm.run()`` returns.

This module marks the threads on which the guest is stopped (the engine's dispatcher
thread, for its whole life: it runs only with the guest halted) so that ``Machine``
refuses those calls at once with ``GuestStoppedError`` instead of hanging. Calls from
other threads while a handler runs are caught by the machine's stall check
(``harness.vmctl``): they fail once a handler has held the guest for
``HANDLER_STUCK_TIMEOUT``.

A leaf module: it imports nothing of the package but its errors.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import HandlerError

_log = logging.getLogger("harness.engines.gdbstub_engine")

_local = threading.local()


def mark_thread(reason: str) -> None:
    """Declare that the guest is stopped whenever the current thread runs; ``reason``
    names who holds it (it ends up in the error message)."""
    _local.reason = reason


def stopped_reason() -> str | None:
    """Why the guest cannot run while the current thread waits, or None."""
    return getattr(_local, "reason", None)


ADVICE = ("record what you need in the handler (regs, vm.host.read) and act on it after "
          "vm.run() returns")


class HandlerErrors:
    """What every host-side engine does with a handler that raises (mixed into
    ``harness.engines.gdbstub_engine.HostEngine`` and ``harness.engines.plugin_engine.PluginEngine``).

    The exception is logged at WARNING with the probe and, the first time for that
    handler and exception type, the traceback; the guest goes on as if the handler had
    returned 0 (a kernel handler cannot raise; the host must not stop the guest either).
    The next call on the engine from outside a handler raises ``HandlerError`` with every
    such exception (teardown calls raise after they have done their work), unless the
    caller took them (``take_handler_errors``). ``raise_on_handler_error = False`` opts
    out: they are then only logged and kept in ``handler_errors``.
    """

    #: False: handler exceptions are only logged and kept, never raised by later calls.
    raise_on_handler_error = True

    def _init_handler_errors(self) -> None:
        #: Every exception a handler raised (kept; ``take_handler_errors`` takes the ones
        #: not yet raised or taken).
        self.handler_errors: list[BaseException] = []
        self._pending_errors: list[BaseException] = []
        self._logged_errors: set[tuple[int, type]] = set()

    def _run_handler(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (``args[0]`` the probe); a raise is logged, kept and treated as
        returning 0."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the guest must go on
            self.handler_errors.append(exc)
            self._pending_errors.append(exc)
            stats = getattr(self, "stats", None)
            if stats is not None:
                stats["handler_errors"] += 1
            key = (id(fn), type(exc))
            first = key not in self._logged_errors
            self._logged_errors.add(key)
            _log.warning("probe handler %s of %s raised %r; the guest went on as if it "
                         "returned 0%s", getattr(fn, "__name__", repr(fn)),
                         probe_name(args[0]) if args else "?", exc,
                         "" if first else " (traceback logged at its first time)",
                         exc_info=exc if first else None)
            return 0

    def take_handler_errors(self) -> list[BaseException]:
        """The handler exceptions not yet raised or taken; taking them means no later
        call raises ``HandlerError`` for them."""
        out, self._pending_errors = self._pending_errors, []
        return out

    def raise_handler_errors(self) -> None:
        """Raise ``HandlerError`` for the handler exceptions not yet raised or taken
        (nothing with ``raise_on_handler_error`` False)."""
        if not self.raise_on_handler_error or not self._pending_errors:
            return
        errs = self.take_handler_errors()
        raise HandlerError(f"{len(errs)} host-side probe handler error(s); first: {errs[0]!r} "
                           "(logged with its traceback; take_handler_errors() to handle "
                           "them yourself)", errs) from errs[0]


def probe_name(p: Any) -> str:
    """``Kprobe(do_sys_openat2+0x5)`` for log lines (a kretprobe instance names its probe)."""
    p = getattr(p, "rp", p)
    where = getattr(p, "symbol_name", None)
    if where:
        off = getattr(p, "offset", 0) or 0
        where += f"+{off:#x}" if off else ""
    else:
        addr = getattr(p, "addr", None)
        where = f"{addr:#x}" if isinstance(addr, int) else "?"
    return f"{type(p).__name__}({where})"
