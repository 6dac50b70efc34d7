"""SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``: the engine's
memory, released so that a colocated learner can use the GPU, and taken back.

Read from sglang 0.5.23 (``srt/constants.py``, ``srt/managers/io_struct.py``,
``srt/entrypoints/http_server.py``, ``srt/managers/scheduler_components/weight_updater.py``):

- Both are ``POST`` (``GET`` is routed too) with the body ``{"tags": [...]}``; ``tags`` may
  be absent, null or empty, which means every tag. The tags of 0.5.23 are ``kv_cache``,
  ``weights`` and ``cuda_graph`` (``GPU_MEMORY_ALL_TYPES``); per-tag release came with
  sgl-project/sglang#7099 (June 2025, "multi-stage awake"): before it a release took no
  tags and released everything at once. An unknown tag is accepted and does nothing.
- The HTTP handler waits for the scheduler to finish: the answer comes once the memory is
  released (the scheduler synchronizes the device before answering) or resumed. Success
  is HTTP 200 with the JSON body ``null``; a failure is HTTP 400
  ``{"error": {"message": ...}}``.
- Releasing ``kv_cache`` flushes the prefix cache and unmaps the KV pool; ``weights``
  keeps a copy of the model's buffers (not its parameters) and unmaps the parameters;
  ``cuda_graph`` unmaps the graphs' memory. The virtual addresses stay, so CUDA graphs and
  tensor pointers remain valid after a resume.
- Resuming ``weights`` maps fresh memory: the parameters' content is undefined until the
  next weight update (unless the server runs with ``--enable-weights-cpu-backup``, which
  copies them to host memory on release); the buffers are restored from the copy. The
  order that avoids a peak is: resume ``weights``, push the new weights, resume
  ``kv_cache`` (and ``cuda_graph``).
- Unmapping needs ``--enable-memory-saver`` (torch_memory_saver); without it both calls
  only record the tags and free nothing.
- A release must come while the scheduler is idle: no running request (a waiting one is
  tolerated only while generation is paused). Otherwise an assertion fails inside the
  scheduler, which takes the whole server down. So does resuming a tag that is not
  released (a ``KeyError`` in the scheduler). Nothing refuses a generation or a weight
  update while a tag is released: on unmapped memory they fail on the GPU.

The trainer's client (``rollout.engine_calls.EngineCalls``) sends these; the embedded
server (``embedded.memory_routes``) serves them on CPU, refusing by name what SGLang would
crash on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RELEASE_PATH = "/release_memory_occupation"
RESUME_PATH = "/resume_memory_occupation"

KV_CACHE = "kv_cache"
WEIGHTS = "weights"
CUDA_GRAPH = "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""SGLang 0.5.23's ``GPU_MEMORY_ALL_TYPES``, in its order: what no tags means."""


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a release or resume with ``tags`` acts on: all of them for None.

    Raises ValueError for a tag SGLang does not know (SGLang would accept it and do
    nothing) and for an empty sequence, which SGLang reads as every tag: a caller that
    means every tag says None.
    """
    if tags is None:
        return ALL_TAGS
    if isinstance(tags, str):
        raise ValueError(f"tags must be a sequence of tags, not the string {tags!r}")
    if not tags:
        raise ValueError(
            "tags=[] means every tag to SGLang; pass None for every tag, or name them "
            f"({', '.join(ALL_TAGS)})"
        )
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; SGLang's are {list(ALL_TAGS)}")
    return tuple(dict.fromkeys(tags))


def memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
    """The JSON body of a release or resume of ``tags`` (None: every tag)."""
    if tags is None:
        return {}
    return {"tags": list(memory_tags(tags))}
