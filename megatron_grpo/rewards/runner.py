"""A reward function over a batch: async ones concurrently, sync ones inline or in workers.

- An async function (``async def``, or an object whose ``__call__`` is one) is
  awaited for every sample at once, at most ``max_concurrency`` at a time, each
  cancelled after ``timeout_s``. One event loop serves one batch, so the
  function must not keep loop-bound objects (an aiohttp session) across calls.
- A sync function runs in this process, one sample after another, with no
  limit but its own (the math reward has one); or, with ``num_workers``, in
  worker processes that are killed after ``timeout_s`` (rewards/pool.py).
- A batched function (``batched = True``: a TRL-style one, rewards/adapters.py) is called
  once with the whole batch, ``fn(responses, labels, metadatas)``, and returns one value per
  sample: inline; or awaited with ``timeout_s``; or, with ``num_workers``, in one worker
  process, the whole call under ``timeout_s``. When the call fails, every sample gets its
  exception.
Each result is the function's value or the exception it raised. With ``stop_if``, a
batch stops at the first result it holds true of: the samples still queued or running
are abandoned (tasks cancelled, worker processes killed) and get a ``RewardCancelled``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from megatron_grpo import http
from megatron_grpo.rewards.pool import RewardCancelled, RewardTimeout, WorkerPool

CANCEL_WAIT_S = 1.0
"""How long cancelled async calls get to unwind before the batch returns without them."""


def is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an instance of a class whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def is_batched(fn: Callable[..., Any]) -> bool:
    """A function that scores a whole batch in one call (its ``batched`` attribute)."""
    return getattr(fn, "batched", False) is True


async def gather(
    fn: Callable[..., Any],
    jobs: Sequence[tuple[Any, ...]],
    *,
    max_concurrency: int,
    timeout_s: float | None,
    stop_if: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """``await fn(*job)`` for every job concurrently; a value or an exception each."""
    slots = asyncio.Semaphore(max_concurrency)

    async def one(job: tuple[Any, ...]) -> Any:
        async with slots:  # the limit counts from the start, not from the queue
            try:
                return await asyncio.wait_for(fn(*job), timeout_s)
            except asyncio.TimeoutError:
                return RewardTimeout(f"reward function ran past {timeout_s:g} s (reward.timeout_s)")
            except Exception as e:
                return e

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    running = set(tasks)
    while running:
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        if stop_if is not None and any(stop_if(task.result()) for task in done):
            for task in running:
                task.cancel()
            if running:  # a function that ignores its cancellation is left behind
                await asyncio.wait(running, timeout=CANCEL_WAIT_S)
            break
    return [
        task.result() if task.done() and not task.cancelled() else RewardCancelled()
        for task in tasks
    ]


class RewardRunner:
    """Runs one reward function over batches of ``(response, label, metadata)`` jobs."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        max_concurrency: int = 64,
        num_workers: int = 0,
        timeout_s: float | None = None,
    ) -> None:
        """``timeout_s`` None: no limit of ours (the function has one, e.g. a remote reward)."""
        self.fn = fn
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.pool: WorkerPool | None = None
        if num_workers and not is_async(fn):
            self.pool = WorkerPool(fn, num_workers=num_workers, timeout_s=timeout_s or 1e9)

    def run(
        self, jobs: Sequence[tuple[Any, ...]], stop_if: Callable[[Any], bool] | None = None
    ) -> list[Any]:
        """Each job's value or exception; ``stop_if``: stop at the first result it holds
        true of, the jobs not done getting a ``RewardCancelled``."""
        if is_batched(self.fn):
            return self._run_batched(jobs)
        if is_async(self.fn):
            return http.run_sync(
                gather(
                    self.fn,
                    jobs,
                    max_concurrency=self.max_concurrency,
                    timeout_s=self.timeout_s,
                    stop_if=stop_if,
                )
            )
        if self.pool is not None:
            return self.pool.map(jobs, stop_if=stop_if)
        results: list[Any] = []
        for job in jobs:
            try:
                results.append(self.fn(*job))
            except Exception as e:
                results.append(e)
            if stop_if is not None and stop_if(results[-1]):
                return results + [RewardCancelled() for _ in range(len(jobs) - len(results))]
        return results

    def _run_batched(self, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """One call of a batched function on every job; its exception for each when it fails."""
        if not jobs:
            return []
        batch = tuple(list(column) for column in zip(*jobs, strict=True))
        if is_async(self.fn):
            [values] = http.run_sync(
                gather(self.fn, [batch], max_concurrency=1, timeout_s=self.timeout_s)
            )
        elif self.pool is not None:
            [values] = self.pool.map([batch])
        else:
            try:
                values = self.fn(*batch)
            except Exception as e:
                values = e
        if isinstance(values, Exception):
            return [values] * len(jobs)
        return values

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
