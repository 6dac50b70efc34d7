"""Worker processes that run a synchronous reward function, each sample under a hard limit.

Checking an answer can be CPU-bound (sympy) and, on a pathological answer, stuck in C code
that no signal interrupts. Here the samples go, a chunk at a time, to ``num_workers``
spawned processes, which send each result back as soon as it is done; a worker still busy
``timeout_s`` after its last result (or after it took the chunk) is killed and replaced, the
sample it was on gets a ``RewardTimeout``, and the rest of its chunk goes to the workers
again. A batch told to stop at a failure (``map(stop_if=...)``) kills its busy workers
there and then, not after the rest of the batch. Spawned, not forked: the trainer holds
threads, sockets and torch state that a fork would copy half-way. The function travels
pickled, so it must be importable (a module-level function or an instance of a
module-level class); exceptions come back as raised.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any


class RewardTimeout(TimeoutError):
    """A reward function ran past its time limit on one sample."""


class RewardCancelled(Exception):
    """A sample left unscored: its batch stopped at another sample's failure."""

    def __init__(self) -> None:
        super().__init__("not scored: the batch stopped at another sample's failure")


CHUNKS_PER_WORKER = 4
"""With several workers, a batch is cut into about this many chunks per worker, to spread
uneven samples; one worker takes a batch whole."""


def _serve(fn: Callable[..., Any], conn: Connection) -> None:
    """A worker's loop: once started, ``READY`` out; then chunks of ``(index, args)`` in,
    ``(index, value or exception)`` out for each, in the chunk's order."""
    conn.send(READY)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if chunk is None:
            return
        for index, args in chunk:
            conn.send((index, _call(fn, args)))


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``fn(*args)``, or the exception it raised (as one that pickles)."""
    try:
        return fn(*args)
    except Exception as e:
        try:
            pickle.dumps(e)
            return e
        except Exception:
            return RuntimeError(f"{type(e).__name__}: {e}")


READY = "ready"
"""A worker's first message: its imports are done and its function unpickled."""

START_TIMEOUT_S = 300.0
"""Longest wait for a worker process to start (spawn imports the function's modules)."""


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[..., Any]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(fn, child), daemon=True)
        self.process.start()
        child.close()
        self.started = False
        self.chunk: deque[tuple[int, tuple[Any, ...]]] = deque()
        """The jobs sent to it whose results have not come back, in order."""
        self.deadline = math.inf
        """When the sample it is on has run past the limit, at the latest."""

    def wait_started(self) -> None:
        """Wait for the worker's READY: a sample's time limit counts from its start, not
        from the process's imports (seconds on a loaded machine)."""
        if self.started:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"a reward worker process did not start in {START_TIMEOUT_S:g} s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=1)
            raise RuntimeError(
                f"a reward worker process died while starting (exit code "
                f"{self.process.exitcode}): is the reward function importable?"
            ) from None
        assert message == READY, message
        self.started = True

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class WorkerPool:
    """``map(jobs)``: ``fn(*args)`` of each job, or the exception it raised, in order."""

    def __init__(self, fn: Callable[..., Any], *, num_workers: int, timeout_s: float) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}"
            )
        self.fn, self.num_workers, self.timeout_s = fn, num_workers, timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []  # started on first use

    def map(
        self, jobs: Sequence[tuple[Any, ...]], stop_if: Callable[[Any], bool] | None = None
    ) -> list[Any]:
        """``stop_if``: stop at the first result it holds true of; the busy workers are
        killed (started again by the next call) and the jobs not done get a
        ``RewardCancelled``."""
        results: list[Any] = [None] * len(jobs)
        pending = deque(enumerate(jobs))
        per_worker = CHUNKS_PER_WORKER if self.num_workers > 1 else 1
        size = max(1, math.ceil(len(jobs) / (self.num_workers * per_worker)))
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.fn))
        while pending or any(w.chunk for w in self._workers):
            for worker in self._workers:
                if not worker.chunk and pending:
                    worker.wait_started()
                    worker.chunk.extend(pending.popleft() for _ in range(min(size, len(pending))))
                    worker.conn.send(list(worker.chunk))
                    worker.deadline = self._deadline()
            busy = [w for w in self._workers if w.chunk]
            next_deadline = min(w.deadline for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(next_deadline - time.monotonic(), 0))
            done: list[int] = []
            for worker in busy:
                if worker.conn in ready:
                    done += self._receive(worker, results, pending)
                elif time.monotonic() >= worker.deadline:
                    done.append(worker.chunk[0][0])
                    results[done[-1]] = RewardTimeout(
                        f"reward function ran past {self.timeout_s:g} s (reward.timeout_s); "
                        "its worker process was killed"
                    )
                    self._replace(worker, pending)
            if stop_if is not None and any(stop_if(results[i]) for i in done):
                self._abandon(results, pending)
                break
        return results

    def _deadline(self) -> float:
        """The sample a worker is on began when it sent its last result, or before."""
        return time.monotonic() + self.timeout_s

    def _receive(self, worker: _Worker, results: list[Any], pending: deque) -> list[int]:
        """The results ``worker`` has sent so far; their indices."""
        done: list[int] = []
        while worker.chunk and worker.conn.poll():
            try:
                index, value = worker.conn.recv()  # the exception it raised, when it raised one
            except (EOFError, OSError):  # it died: killed by the OS, or a crash in C code
                worker.process.join(timeout=1)
                code = worker.process.exitcode
                done.append(worker.chunk[0][0])
                results[done[-1]] = RuntimeError(f"reward worker process died (exit code {code})")
                self._replace(worker, pending)
                return done
            got, _ = worker.chunk.popleft()
            assert got == index
            results[index] = value
            done.append(index)
        worker.deadline = self._deadline()
        return done

    def _replace(self, worker: _Worker, pending: deque) -> None:
        """Kill ``worker``, whose first job has its result; the rest go back to ``pending``."""
        worker.chunk.popleft()
        pending.extendleft(reversed(worker.chunk))
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.fn)

    def _abandon(self, results: list[Any], pending: deque) -> None:
        """Kill the busy workers; their jobs and the queued ones get a ``RewardCancelled``."""
        for worker in [w for w in self._workers if w.chunk]:
            pending.extend(worker.chunk)
            worker.kill()
            self._workers.remove(worker)
        for index, _ in pending:
            results[index] = RewardCancelled()
        pending.clear()

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []
