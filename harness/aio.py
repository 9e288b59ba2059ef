"""An asyncio loop on its own thread, with a sync ``call`` that always has a timeout.

The async core / sync edge split of ``qemu.qmp.legacy``: protocol code stays async (QMP
events arrive while nothing is being asked), callers stay blocking and simple.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[T], timeout: float) -> T:
        """Run ``coro`` on the loop; raise TimeoutError (after cancelling it) past ``timeout``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    def spawn(self, coro: Awaitable[Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(_cancel_all(), 2.0)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(2.0)
        if not self._thread.is_alive():
            self.loop.close()


async def qmp_connect(name: str, path: str, on_event: Callable[[str, dict[str, Any]], None]) -> Any:
    """A ``qemu.qmp.QMPClient`` connected to the UNIX socket ``path``, every event handed
    to ``on_event(name, data)`` on the loop, in order. Nothing is cleared from the
    listener: ``EventListener.clear()`` drops events still queued (a STOP that arrives
    with a GUEST_PANICKED was lost that way)."""
    from qemu.qmp import QMPClient

    client = QMPClient(name)
    await client.connect(path)

    async def pump() -> None:
        async for ev in client.events:
            on_event(ev["event"], dict(ev.get("data", {})))

    asyncio.get_running_loop().create_task(pump())
    return client
