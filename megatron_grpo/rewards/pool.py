"""Worker processes that run a synchronous reward function, each sample under a hard limit.

Checking an answer can be CPU-bound (sympy) and, on a pathological answer, stuck
in C code that no signal interrupts. Here each sample goes to one of
``num_workers`` spawned processes; a worker still busy ``timeout_s`` after it
took a sample is killed and replaced, and the sample's result is a
``RewardTimeout``. Spawned, not forked: the trainer holds threads, sockets and
torch state that a fork would copy half-way. The function travels pickled, so
it must be importable (a module-level function or an instance of a module-level
class); exceptions come back as raised.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any


class RewardTimeout(TimeoutError):
    """A reward function ran past its time limit on one sample."""


def _serve(fn: Callable[..., Any], conn: Connection) -> None:
    """A worker's loop: once started, ``READY`` out; then ``(index, args)`` in,
    ``(index, ok, value or exception)`` out."""
    conn.send(READY)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if job is None:
            return
        index, args = job
        try:
            conn.send((index, True, fn(*args)))
        except Exception as e:
            try:
                conn.send((index, False, e))
            except Exception:  # an exception that does not pickle
                conn.send((index, False, RuntimeError(f"{type(e).__name__}: {e}")))


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
        self.job: tuple[int, float] | None = None
        """``(sample index, deadline)`` of the sample it is running."""

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

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        results: list[Any] = [None] * len(jobs)
        pending = deque(enumerate(jobs))
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.fn))
        while pending or any(w.job for w in self._workers):
            for worker in self._workers:
                if worker.job is None and pending:
                    worker.wait_started()
                    index, args = pending.popleft()
                    worker.conn.send((index, args))
                    worker.job = (index, time.monotonic() + self.timeout_s)
            busy = [w for w in self._workers if w.job is not None]
            next_deadline = min(w.job[1] for w in busy if w.job is not None)
            ready = wait([w.conn for w in busy], timeout=max(next_deadline - time.monotonic(), 0))
            for worker in busy:
                assert worker.job is not None
                index, deadline = worker.job
                if worker.conn in ready:
                    results[index] = self._receive(worker, index)
                elif time.monotonic() >= deadline:
                    results[index] = RewardTimeout(
                        f"reward function ran past {self.timeout_s:g} s (reward.timeout_s); "
                        "its worker process was killed"
                    )
                    self._replace(worker)
        return results

    def _receive(self, worker: _Worker, index: int) -> Any:
        try:
            got, _ok, value = worker.conn.recv()
        except (EOFError, OSError):  # it died: killed by the OS, or a crash in C code
            worker.process.join(timeout=1)
            code = worker.process.exitcode
            self._replace(worker)
            return RuntimeError(f"reward worker process died (exit code {code})")
        assert got == index
        worker.job = None
        return value  # the exception it raised when not ok

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.fn)

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
