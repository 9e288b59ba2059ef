"""Progress of long work (boot, registering, the workload, collecting), for whoever shows it.

The library never prints (``harness.cli`` does). Long operations take a ``progress``
callable and call it with one short line per *phase*: ``progress("registering 2 probe
lines ...")``. A sink that can also show *live* updates (hit counts while the workload
runs) has a ``transient(text)`` method; plain callables (``print``, ``lambda s: None``)
only get the phases. ``harness.cli.Progress`` is that sink: on a terminal one line
rewritten in place, otherwise one plain line per phase.

A leaf module: it imports nothing from the package.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

ProgressFn = Callable[[str], None]


def say(progress: ProgressFn | None, text: str) -> None:
    """Report a phase (``progress`` may be None: nobody is listening)."""
    if progress is not None:
        progress(text)


def tick(progress: ProgressFn | None, text: str) -> None:
    """Report a live update; dropped unless the sink has ``transient``."""
    live = getattr(progress, "transient", None)
    if live is not None:
        live(text)


@contextlib.contextmanager
def ticking(progress: ProgressFn | None, what: Callable[[float], str], *,
            every: float = 0.5) -> Iterator[None]:
    """While the block runs, call ``tick(progress, what(elapsed_seconds))`` every
    ``every`` seconds from a daemon thread. ``what`` must not block on the guest (it runs
    while the workload does); an exception in it only ends the ticking."""
    if getattr(progress, "transient", None) is None:
        yield
        return
    stop = threading.Event()
    t0 = time.monotonic()

    def loop() -> None:
        while not stop.wait(every):
            try:
                tick(progress, what(time.monotonic() - t0))
            except Exception:   # noqa: BLE001 - a progress line must never break the run
                return

    th = threading.Thread(target=loop, name="kph-progress", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(timeout=every + 1)


def hits_text(counters: dict[str, Any]) -> str:
    """``12 hits (open 10, openret 2)`` from a ``{probe: Counters}`` dict."""
    total = sum(c.nhit for c in counters.values())
    per = ", ".join(f"{p.split('/')[-1]} {c.nhit}" for p, c in counters.items())
    return f"{total} hits" + (f" ({per})" if len(counters) > 1 else "")
