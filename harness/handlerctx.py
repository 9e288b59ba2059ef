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

A leaf module: it imports nothing of the package.
"""
from __future__ import annotations

import threading

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
