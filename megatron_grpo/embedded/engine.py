"""The embedded server's generation engine: one worker thread that owns the model.

Requests queue up; the worker takes everything queued (up to
``max_batch_size`` sequences) as one round and decodes it with
``generate_batch``. Each sequence's future is resolved as soon as that
sequence finishes, not at the end of its round. A round admits nothing new
once started (no continuous batching): a request that misses it waits for
the round's longest sequence.

Control, with SGLang's meaning:
- ``abort(rid)`` / ``abort(abort_all=True)``: queued or running sequences
  finish with type ``abort`` and whatever they had generated.
- ``pause(abort_running=True)`` (SGLang's ``abort`` mode) aborts everything and returns
  once the aborted sequences have their answers; ``pause(abort_running=False)``
  (``in_place``/``retract``) freezes running sequences between two tokens; either way
  nothing new starts until ``resume``.
- ``update_weights`` waits for the running round to finish (or to be paused)
  and keeps new rounds from starting meanwhile, like SGLang's model-update lock.
- ``release_memory(tags)`` (``/release_memory_occupation``, ``sglang_api.memory``) only
  while no sequence runs and none is queued unless paused, as SGLang asks: ``weights``
  frees the parameters (``parameter_memory.py``); ``kv_cache`` and ``cuda_graph`` hold
  nothing here between rounds (a round's KV cache lives and dies with it, and there are
  no CUDA graphs), so they only return freed memory to the system and are recorded.
  While any tag is released nothing is admitted or started (``MemoryReleased``), and
  while ``weights`` is, no update lands; ``resume_memory(tags)`` gives them back.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from megatron_grpo.embedded.decode import Completion, SequenceSpec, generate_batch
from megatron_grpo.embedded.parameter_memory import (
    ReleasedParameters,
    release_parameters,
    return_freed_memory,
)
from megatron_grpo.sglang_api.memory import ALL_TAGS, RELEASE_PATH, RESUME_PATH, WEIGHTS
from megatron_grpo.sglang_api.types import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # every wait is a loop of short waits, so shutdown is always noticed
_MAX_WINDOWS = 20  # longest wait for a batch to fill, in batch windows


class MemoryReleased(RuntimeError):
    """Refused: memory the request needs is released (``/release_memory_occupation``)."""


class MemoryStateError(ValueError):
    """A release or resume that the engine's state does not allow; the message says why."""


def released_message(what: str, tags: tuple[str, ...]) -> str:
    """Why ``what`` is refused while ``tags`` are released."""
    return (
        f"{what} refused: the engine's {' and '.join(tags)} memory is released "
        f"({RELEASE_PATH}); {RESUME_PATH} first"
    )


@dataclass(frozen=True)
class Finished:
    """A finished sequence and the weight version it finished under."""

    completion: Completion
    weight_version: str


@dataclass
class _Job:
    rid: str
    spec: SequenceSpec
    future: concurrent.futures.Future[Finished] = field(default_factory=concurrent.futures.Future)
    abort_message: str | None = None


@dataclass
class EngineStats:
    rounds: int = 0
    """Decoding rounds run."""
    max_round_size: int = 0
    """Most sequences decoded together in one round."""
    finished: int = 0
    """Sequences finished, for any reason."""
    steps: int = 0
    """Checks for aborts and pauses between tokens: about one per decoding step."""


class GenerationEngine:
    """Owns ``model`` (fp32, eval mode); all its forwards run on the engine's thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: frozenset[int],
        weight_version: str = "default",
        seed: int = 0,
        max_batch_size: int = 64,
        batch_window_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.stats = EngineStats()
        self._weight_version = weight_version
        self._seeds = random.Random(seed)  # seeds of the samples sent without one
        self._cond = threading.Condition(threading.RLock())  # guards the fields below
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._paused = False
        self._stopping = False
        self._updates_waiting = 0
        self._released: set[str] = set()  # memory tags released
        self._released_params: ReleasedParameters | None = None
        self._memory_lock = threading.Lock()  # one release or resume at a time
        # Held by the worker while a round runs, except while paused: a weight
        # update takes it, so it never lands in the middle of a forward.
        self._model_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="embedded-generation", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def num_running(self) -> int:
        """Sequences of the running round that have not finished yet."""
        with self._cond:
            return sum(not job.future.done() for job in self._running)

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    @property
    def released_tags(self) -> tuple[str, ...]:
        """The memory tags released, in ``ALL_TAGS`` order."""
        with self._cond:
            return tuple(t for t in ALL_TAGS if t in self._released)

    def submit(
        self,
        rid: str,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        *,
        return_routed_experts: bool = False,
    ) -> concurrent.futures.Future[Finished]:
        """Queue one sequence (with its routed experts: the model must have MoE layers);
        cancelling the future aborts it."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the generation engine is stopped")
            if self._released:
                raise MemoryReleased(released_message("generation", self.released_tags))
            seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
            spec = SequenceSpec(prompt_ids, sampling, seed, return_routed_experts)
            job = _Job(rid=rid, spec=spec)
            self._queue.append(job)
            self._cond.notify_all()
            return job.future

    def abort(self, rid: str = "", *, abort_all: bool = False, message: str = "Aborted") -> int:
        """Abort the sequences whose rid starts with ``rid`` (or all); returns how many."""
        if not abort_all and not rid:
            return 0  # as SGLang: an empty rid would match everything
        with self._cond:
            count = 0
            for job in (*self._running, *self._queue):
                if job.abort_message is None and (abort_all or job.rid.startswith(rid)):
                    job.abort_message = message
                    count += 1
            self._finish_aborted_queued()
            self._cond.notify_all()
            return count

    def pause(self, *, abort_running: bool) -> None:
        """With ``abort_running`` this returns once the aborted sequences have their answer,
        as SGLang's ``abort`` mode does (a release may follow at once)."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        if abort_running:
            self.abort(abort_all=True, message="Aborted by pause_generation")
            with self._cond:
                while not self._stopping and any(not j.future.done() for j in self._running):
                    self._cond.wait(timeout=_POLL_S)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update_weights(
        self,
        apply: Callable[[PreTrainedModel], None],
        *,
        weight_version: str | None,
        timeout_s: float,
    ) -> None:
        """Run ``apply(model)`` between rounds (or while paused); None keeps the version."""
        with self._cond:
            self._updates_waiting += 1
        try:
            if not self._model_lock.acquire(timeout=timeout_s):
                raise TimeoutError(
                    f"running requests did not finish within {timeout_s} s; "
                    "pause_generation first to update weights at once"
                )
            try:
                if WEIGHTS in self._released:
                    raise MemoryReleased(released_message("a weight update", (WEIGHTS,)))
                with torch.inference_mode():
                    apply(self.model)
                if weight_version is not None:
                    self._weight_version = weight_version
            finally:
                self._model_lock.release()
        finally:
            with self._cond:
                self._updates_waiting -= 1
                self._cond.notify_all()

    def release_memory(self, tags: tuple[str, ...], *, timeout_s: float) -> None:
        """Free the memory of ``tags`` (known tags, ``sglang_api.memory.memory_tags``);
        returns once it is freed. MemoryStateError if one is released already, or while a
        sequence runs or (unless paused) waits; TimeoutError if a weight update holds the
        model longer than ``timeout_s``."""
        with self._memory_lock:
            with self._cond:
                again = [t for t in tags if t in self._released]
                if again:
                    raise MemoryStateError(
                        f"{RELEASE_PATH}: {' and '.join(again)} already released; "
                        f"{RESUME_PATH} first"
                    )
                running = sum(not job.future.done() for job in self._running)
                queued = 0 if self._paused else len(self._queue)
                if running or queued:
                    raise MemoryStateError(
                        f"{RELEASE_PATH} while {running} sequence(s) run and {queued} wait "
                        "(SGLang asks for an idle engine): pause_generation first"
                    )
                self._released.update(tags)  # from here no round starts
                self._cond.notify_all()
            if WEIGHTS not in tags:
                return_freed_memory()
                return
            if not self._model_lock.acquire(timeout=timeout_s):
                with self._cond:
                    self._released.difference_update(tags)
                    self._cond.notify_all()
                raise TimeoutError(f"a weight update held the model for longer than {timeout_s} s")
            try:
                self._released_params = release_parameters(self.model)
            finally:
                self._model_lock.release()

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Take back the memory of ``tags``: resumed weights are zeros until the next weight
        update. MemoryStateError if one of them is not released."""
        with self._memory_lock:
            with self._cond:
                awake = [t for t in tags if t not in self._released]
                if awake:
                    raise MemoryStateError(
                        f"{RESUME_PATH}: {' and '.join(awake)} not released (released: "
                        f"{', '.join(self.released_tags) or 'none'})"
                    )
            if WEIGHTS in tags:
                assert self._released_params is not None
                with self._model_lock:
                    self._released_params.resume()
                self._released_params = None
            with self._cond:
                self._released.difference_update(tags)
                self._cond.notify_all()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything and end the worker thread."""
        with self._cond:
            self._stopping = True
        self.abort(abort_all=True, message="server shutting down")
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.error("generation thread did not stop within %s s", timeout_s)

    # ---- worker thread ----

    def _run(self) -> None:
        while (batch := self._next_round()) is not None:
            self._decode(batch)

    def _next_round(self) -> list[_Job] | None:
        """Wait for work (None once stopping) and take it as the running round."""
        with self._cond:
            while not self._stopping and (
                self._paused or self._released or self._updates_waiting or not self._queue
            ):
                self._cond.wait(timeout=_POLL_S)
            # The samples of a rollout arrive one HTTP request at a time: keep
            # collecting while they keep coming (each within batch_window_s of
            # the previous one), so that they decode together.
            give_up = time.monotonic() + _MAX_WINDOWS * self.batch_window_s
            seen = len(self._queue)
            while not self._stopping and seen < self.max_batch_size:
                if time.monotonic() > give_up:
                    break
                self._cond.wait(timeout=self.batch_window_s)
                if len(self._queue) == seen:
                    break
                seen = len(self._queue)
            if self._stopping:
                return None
            size = min(len(self._queue), self.max_batch_size)
            self._running = [self._queue.popleft() for _ in range(size)]
            return self._running

    def _decode(self, batch: list[_Job]) -> None:
        try:
            with self._model_lock:
                generate_batch(
                    self.model,
                    [job.spec for job in batch],
                    eos_token_ids=self.eos_token_ids,
                    before_step=self._before_step,
                    on_finish=lambda row, done: self._resolve(batch[row], done),
                )
        except Exception as err:  # a model failure must fail its requests, not the thread
            logger.exception("generation round failed")
            for job in batch:
                _set(job.future, exception=err)
        finally:
            with self._cond:
                self._running = []
                self.stats.rounds += 1
                self.stats.max_round_size = max(self.stats.max_round_size, len(batch))

    def _before_step(self) -> dict[int, str]:
        """Runs on the worker with the model lock held: report aborts, hold while paused."""
        with self._cond:
            self.stats.steps += 1
            if self._paused and not self._stopping and not self._undelivered_aborts():
                self._model_lock.release()  # let a weight update in while frozen
                try:
                    while self._paused and not self._stopping and not self._undelivered_aborts():
                        self._cond.wait(timeout=_POLL_S)
                finally:
                    # Re-acquired without holding the condition, so that an update
                    # finishing meanwhile can take it to decrement its counter.
                    self._cond.release()
                    self._model_lock.acquire()
                    self._cond.acquire()
            return {
                row: job.abort_message or "client disconnected"
                for row, job in enumerate(self._running)
                if job.abort_message is not None or job.future.cancelled()
            }

    def _undelivered_aborts(self) -> bool:
        """An aborted sequence still waits for its answer (a paused round must deliver it)."""
        return any(job.abort_message is not None and not job.future.done() for job in self._running)

    def _finish_aborted_queued(self) -> None:
        """Answer aborted queued jobs at once (caller holds the condition)."""
        kept: deque[_Job] = deque()
        for job in self._queue:
            if job.abort_message is None:
                kept.append(job)
                continue
            aborted = FinishReason(type="abort", detail=job.abort_message)
            self._resolve(job, Completion([], [], aborted))
        self._queue = kept

    def _resolve(self, job: _Job, done: Completion) -> None:
        with self._cond:  # re-entrant: also called with it held
            self.stats.finished += 1
        _set(job.future, result=Finished(done, self._weight_version))


def _set(
    future: concurrent.futures.Future[Finished],
    *,
    result: Finished | None = None,
    exception: BaseException | None = None,
) -> None:
    # The waiting side may cancel at any moment; a cancelled future takes nothing.
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:
        pass
