"""The turns that the learner and the engines take on shared GPUs (``rollout.placement:
colocated``).

One step, every transition complete before the next begins::

    generate -> release the engines' memory -> reload the learner -> train
    -> offload the learner's optimizer states and gradients -> resume the engines' weights
    -> push the new weights -> offload the learner's parameters (where configured)
    -> resume the engines' KV cache and CUDA graphs -> (evaluate) -> generate ...

A checkpoint of the step is written after the training and before the offload (the learner
is whole then). At start, the learner's optimizer states and gradients go to host first,
then the engines start (awake), then they release their memory, then the first push
follows the order above.

The learner's transitions run on every rank (``mcore.offload.LearnerOffload``); the
engines' on the main rank, through its ``RolloutRuntime``, as SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` by tag
(``sglang_api.memory``). Each takes at most ``rollout.colocate.transition_timeout_s``; one
that fails or does not complete in time stops the run with a ``ColocationError`` naming the
transition (and the step), and nothing after it runs: an engine is never pushed to asleep,
the learner never trains offloaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from megatron_grpo.config import ColocateConfig
from megatron_grpo.sglang_api.memory import CUDA_GRAPH, KV_CACHE, WEIGHTS


class ColocationError(RuntimeError):
    """A transition between the learner's turn and the engines' failed or timed out."""


LEARNER_BEFORE_PUSH = ("optimizer", "grads")
"""What of the learner leaves before the engines wake (the push reads the parameters)."""
LEARNER_AFTER_PUSH = ("params",)
ENGINE_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)
"""What the engines release; the weights come back first (the push needs them), the KV cache
and the CUDA graphs' memory after the push."""


class Colocation:
    """Built on every rank; ``runtime`` is the main rank's ``RolloutRuntime`` (None
    elsewhere, and until the engines have started)."""

    def __init__(self, cfg: ColocateConfig, offload: Any, *, is_main: bool) -> None:
        self.cfg, self.offload, self.is_main = cfg, offload, is_main
        self.runtime: Any = None
        self.step = 0
        self.engines_awake: tuple[str, ...] = ()
        """The tags the engines hold now (main rank): all after start, none after a release."""

    # ---- the learner (every rank) ----

    def learner_out(self, parts: Sequence[str]) -> None:
        """Offload those of ``parts`` that ``rollout.colocate.offload`` names."""
        wanted = [p for p in parts if p in self.cfg.offload]
        if wanted:
            self._learner(
                f"offload the learner's {', '.join(wanted)} to host", self.offload.offload, wanted
            )

    def learner_in(self) -> None:
        """Everything offloaded back on the learner's devices."""
        self._learner("reload the learner", self.offload.reload)

    def _learner(self, what: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:
            raise ColocationError(self._failed(what, f"{type(err).__name__}: {err}")) from err

    # ---- the engines (main rank) ----

    def engines_started(self, runtime: Any) -> None:
        """The engines are up (awake, as launched): they release their memory."""
        self.runtime = runtime
        self.engines_awake = ENGINE_TAGS
        self.release_engines()

    def release_engines(self) -> None:
        self._engines("release", ENGINE_TAGS, "release the engines' memory")

    def resume_weights(self) -> None:
        self._engines("resume", (WEIGHTS,), "resume the engines' weights")

    def resume_kv_cache(self) -> None:
        self._engines("resume", (KV_CACHE, CUDA_GRAPH), "resume the engines' KV cache")

    def _engines(self, action: str, tags: tuple[str, ...], what: str) -> None:
        if not self.is_main:
            return
        assert self.runtime is not None, "the engines have not started"
        client = self.runtime.weight_client
        call = (
            client.release_memory_occupation
            if action == "release"
            else client.resume_memory_occupation
        )
        timeout = self.cfg.transition_timeout_s
        try:
            self.runtime.io.run(asyncio.wait_for(call(list(tags)), timeout))
        except TimeoutError as err:
            raise ColocationError(
                self._failed(
                    what,
                    f"not complete after {timeout:g} s (rollout.colocate.transition_timeout_s)",
                )
            ) from err
        except Exception as err:
            raise ColocationError(self._failed(what, f"{type(err).__name__}: {err}")) from err
        if action == "release":
            self.engines_awake = tuple(t for t in self.engines_awake if t not in tags)
        else:
            self.engines_awake = (
                *self.engines_awake,
                *(t for t in tags if t not in self.engines_awake),
            )

    def _failed(self, what: str, why: str) -> str:
        at = f" at step {self.step}" if self.step else " at start"
        return f"rollout.placement: colocated: {what}{at} failed: {why}; the run stops here"
