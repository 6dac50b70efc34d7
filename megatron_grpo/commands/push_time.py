"""Predicted time of one weight push, by arithmetic alone (the dry run's ``weight push`` lines).

A push (``weight_sync``): every pipeline stage's sender streams its stage's weights, whole
(gathered over TP and EP) under Hugging Face names in the params dtype, in buckets of at most
``rollout.sync.bucket_mb``; the stages send at once, each over its own link, and every engine
takes every stage's bytes. The predicted time is the larger of

- the slowest stage: the bytes it puts on its link / the link's bandwidth, plus a fixed cost
  per bucket and per tensor (a request, a shared-memory file; a tensor's mapping);
- an engine's side: the whole model's bytes / the same link's bandwidth (engines take
  their bytes at once, each over its own link).

What a stage puts on its link, by transport (``transport``): its bytes once when the engines
share one copy (a shared-memory file, a NCCL broadcast, files on a shared disk), once per
engine when each gets its own (a request body, CUDA IPC reads of the sender's copy). With
``rollout.sync.delta`` (embedded engines), the bytes sent are ``DELTA_SENT_FRACTION`` of a
full push's, and both ends pass every byte through XOR, zstd and a checksum at
``DELTA_CODEC_BYTES_PER_S``.

The bandwidths (``LINKS``) are stated constants, not measured at dry-run time. The GPU-side
links are nominal figures from the hardware's specifications, so the predictions there are
lower bounds: no GPU has run a push of this project. The host-memory link is the CPU path's
effective rate (the gather, the HF mapping, the copy into a shared-memory file and the
server's copy into its model, all counted), measured once on the machine named in its
source; measuring a memcpy at dry-run time instead would give a figure several times higher
than a push reaches and would vary from run to run, while a stated, sourced figure can be
checked against ``bench/weight_sync.py --sizes`` on any other machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_grpo.commands.memory_model import DTYPE_BYTES, stage_params
from megatron_grpo.config import ModelConfig, ParallelDims
from megatron_grpo.config.hf import head_dim, query_groups


@dataclass(frozen=True)
class Link:
    """A link a push crosses, and the bandwidth the prediction uses for it."""

    name: str
    bytes_per_s: float
    source: str
    """Where the figure comes from."""


LINKS = {
    "host_memory": Link(
        "host memory",
        0.76e9,
        "measured: bench/weight_sync.py --sizes, one stage to the embedded server through "
        "shared memory, 2 shared cores of an AMD EPYC (the whole CPU path, not a memcpy): "
        "the slope of push time over bytes between its 116 and 648 MB models",
    ),
    "pcie": Link("PCIe Gen5 x16", 64e9, "nominal, per direction"),
    "nvlink": Link("NVLink 4 (H100 SXM)", 450e9, "nominal, per GPU and direction"),
    "infiniband": Link("InfiniBand NDR", 50e9, "nominal, 400 Gb/s per GPU's NIC"),
    "ethernet": Link("Ethernet 100 GbE", 12.5e9, "nominal"),
    "disk": Link("shared disk", 2e9, "a local NVMe's sequential write, stated"),
}

BUCKET_S = {"host_memory": 3e-3}
"""Fixed cost of one bucket (a request, a shared-memory file), by link: on the CPU path, about
what is left of the smallest model's push time (``bench/weight_sync.py --sizes``: 20-30 ms
beyond its bytes) shared with ``TENSOR_S``; not known on the others (0)."""
TENSOR_S = {"host_memory": 0.4e-3}
"""Fixed cost of one tensor (its HF mapping, its entry in the bucket), by link; as
``BUCKET_S``."""
DELTA_SENT_FRACTION = {"float32": 0.82, "bfloat16": 0.52, "float16": 0.52}
"""``rollout.sync.delta``: bytes a delta push sends / a full push's, after one RL step of the
CPU demo at its learning rate of 1e-3 (``bench/weight_sync.py --delta``); smaller steps
change fewer bits and send less."""
DELTA_CODEC_BYTES_PER_S = 0.1e9
"""``rollout.sync.delta``: bytes per second one end passes through XOR, zstd level 1 and the
xxh3 checksum (measured encoding 64 MB of fp32 and of bf16 weights after an Adam-like step,
on the machine of ``LINKS["host_memory"]``); the engine's end is taken to cost the same."""


CALIBRATION_SIZES = {
    "small": (2, 256, 768, 8000),
    "mid": (4, 512, 1536, 16000),
    "default": (8, 1024, 3072, 32000),
}
"""Layers, hidden size, FFN size and vocabulary of the Qwen3-shaped models of 23, 116 and
648 MB in fp32 that ``bench/weight_sync.py --sizes`` pushes, against which the host-memory
constants above are checked."""


def calibration_model(size: str) -> ModelConfig:
    """The model of ``CALIBRATION_SIZES[size]``: heads of 64 channels, qk layernorm."""
    layers, hidden, ffn, vocab = CALIBRATION_SIZES[size]
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        num_attention_heads=hidden // 64,
        num_query_groups=4 if hidden > 256 else 2,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=512,
        qk_layernorm=True,
    )


@dataclass(frozen=True)
class Transport:
    """How a method's bytes reach the engines."""

    name: str
    link: str
    """A key of ``LINKS``."""
    per_engine: bool
    """Each engine gets its own copy from the sender (else one copy serves them all)."""


def transport(method: str, engine_type: str, *, across_nodes: bool) -> Transport:
    """How ``method`` reaches engines of ``engine_type`` (``rollout.engines.type``);
    ``across_nodes``: the senders are on other nodes than the engines."""
    if method == "disk":
        return Transport("safetensors files", "disk", per_engine=False)
    if method == "distributed":
        link = "infiniband" if across_nodes else "nvlink"
        if engine_type == "embedded":
            return Transport("gloo broadcast", "ethernet" if across_nodes else "host_memory", False)
        return Transport("NCCL broadcast", link, per_engine=False)
    if method != "tensor":
        raise ValueError(f"unknown weight sync method {method!r}")
    if engine_type == "embedded":
        if across_nodes:
            return Transport("safetensors request body", "ethernet", per_engine=True)
        return Transport("shared memory", "host_memory", per_engine=False)
    # SGLang takes tensors from its own machine only: CUDA IPC handles to the sender's copy.
    return Transport("CUDA IPC", "nvlink", per_engine=True)


def layer_hf_tensors(m: ModelConfig) -> tuple[int, int]:
    """(tensors, elements) of one decoder layer under HF names, whole."""
    h, d, a, g = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m)
    tensors, elements = 4, (a + 2 * g) * d * h + a * d * h  # q, k, v, o
    if m.add_qkv_bias:
        tensors, elements = tensors + 3, elements + (a + 2 * g) * d
    if m.qk_layernorm:
        tensors, elements = tensors + 2, elements + 2 * d
    tensors, elements = tensors + 2, elements + 2 * h  # input and post-attention norms
    if m.num_experts is None:
        return tensors + 3, elements + 3 * h * m.ffn_hidden_size
    experts = m.num_experts * 3
    return (
        tensors + 1 + experts,
        elements + m.num_experts * h + experts * h * m.expert_ffn_hidden_size,
    )


def stage_hf_tensors(m: ModelConfig, dims: ParallelDims) -> list[tuple[int, int]]:
    """Per pipeline stage, (tensors, bytes) its sender pushes: its layers, the embedding on
    the first, the final norm and (untied) the output layer on the last; vocabulary unpadded."""
    per_tensors, per_elements = layer_hf_tensors(m)
    vocab = m.vocab_size * m.hidden_size
    out = []
    for p in stage_params(m, dims):
        tensors, elements = p.num_layers * per_tensors, p.num_layers * per_elements
        if p.embedding:
            tensors, elements = tensors + 1, elements + vocab
        if p.final_norm:
            tensors, elements = tensors + 1, elements + m.hidden_size
            if not m.tie_embeddings:
                tensors, elements = tensors + 1, elements + vocab
        out.append((tensors, elements * DTYPE_BYTES[m.params_dtype]))
    return out


@dataclass(frozen=True)
class PushPrediction:
    """One push of one method, as predicted."""

    method: str
    transport: Transport
    link: Link
    num_engines: int
    delta: bool
    stage_bytes: tuple[int, ...]
    """Bytes each stage sends to one engine (after delta)."""
    stage_buckets: tuple[int, ...]
    stage_seconds: tuple[float, ...]
    engine_seconds: float

    @property
    def engine_bytes(self) -> int:
        """Bytes each engine takes: every stage's."""
        return sum(self.stage_bytes)

    @property
    def seconds(self) -> float:
        return max(max(self.stage_seconds), self.engine_seconds)


def predict_push(
    m: ModelConfig,
    dims: ParallelDims,
    *,
    method: str,
    bucket_mb: int,
    delta: bool = False,
    engine_type: str = "sglang",
    num_engines: int = 1,
    across_nodes: bool = False,
) -> PushPrediction:
    """The predicted time of one push (see the module docstring)."""
    way = transport(method, engine_type, across_nodes=across_nodes)
    link = LINKS[way.link]
    sent = DELTA_SENT_FRACTION[m.params_dtype] if delta else 1.0
    codec = 1 / DELTA_CODEC_BYTES_PER_S if delta else 0.0
    copies = num_engines if way.per_engine else 1
    bucket_bytes = bucket_mb << 20
    stages = stage_hf_tensors(m, dims)
    stage_bytes = tuple(round(nbytes * sent) for _, nbytes in stages)
    buckets = tuple(math.ceil(nbytes / bucket_bytes) for _, nbytes in stages)
    seconds = tuple(
        sent_bytes * copies / link.bytes_per_s
        + nbytes * codec
        + num_buckets * BUCKET_S.get(way.link, 0.0)
        + tensors * TENSOR_S.get(way.link, 0.0)
        for (tensors, nbytes), sent_bytes, num_buckets in zip(
            stages, stage_bytes, buckets, strict=True
        )
    )
    total = sum(nbytes for _, nbytes in stages)
    engine = sum(stage_bytes) / link.bytes_per_s + total * codec
    return PushPrediction(
        method=method,
        transport=way,
        link=link,
        num_engines=num_engines,
        delta=delta,
        stage_bytes=stage_bytes,
        stage_buckets=buckets,
        stage_seconds=seconds,
        engine_seconds=engine,
    )
