"""An asyncio event loop on a thread of its own, which any other thread can run coroutines on.

The rollout runtime's HTTP clients live on one loop for their whole life (aiohttp sessions
are bound to the loop that made them). With the loop on its own thread, one thread can
wait for generations on the clients while another uses them too: the rollout producer's
main thread generates while its control thread holds and releases that generation for the
learner's weight pushes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CANCEL_WAIT_S = 30.0
"""How long ``run`` waits for a coroutine it cancelled (on Ctrl-C) to finish cancelling."""

WAKE_S = 0.2
"""How often a thread waiting in ``run`` wakes: a signal that lands just before it blocks
(its handler runs only between bytecodes) is then handled within this, not lost."""


class IOLoop:
    def __init__(self, name: str = "rollout-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._running: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, call: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``call`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(call, self.loop)

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        """Run ``call`` on the loop and wait for its result, from any other thread.

        An exception in the waiting thread (Ctrl-C) cancels ``call`` and waits for it to
        finish cancelling (what it does then, such as aborting requests, is done) before the
        exception goes on."""
        task = _result(self.submit(_started(call)))
        self._running.add(task)
        try:
            return _result(self.submit(_awaited(task)))
        except BaseException:
            self.cancel(task)
            raise
        finally:
            self._running.discard(task)

    def cancel(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` (one that ``run`` runs) and wait for it to finish cancelling."""
        if not task.done():
            cancelled = self.submit(_cancelled(task))
            concurrent.futures.wait([cancelled], timeout=CANCEL_WAIT_S)

    def cancel_running(self) -> None:
        """Cancel what ``run`` runs now, for every thread waiting in it."""
        for task in list(self._running):
            self.cancel(task)

    def close(self) -> None:
        """Stop the loop and its thread; coroutines still running are cancelled."""
        if self.loop.is_closed():
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        if self._thread.is_alive():
            self.run(cancel_rest())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


def _result(future: concurrent.futures.Future[T]) -> T:
    """``future.result()``, waited for in slices of WAKE_S so that Ctrl-C is never missed."""
    while not future.done():
        concurrent.futures.wait([future], timeout=WAKE_S)
    return future.result()


async def _started(call: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    return asyncio.ensure_future(call)


async def _awaited(task: asyncio.Task[T]) -> T:
    return await task


async def _cancelled(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
