"""What ``check-invariance`` can switch on, and its bf16 tolerance: no torch here, so that
the command line parser can name them without importing it."""

from __future__ import annotations

FEATURES = {
    "distopt": "distributed optimizer (ZeRO-1) over DP, overlapped grad reduce and param "
    "gather; every layout then runs Adam with a large eps (updates stay proportional to g) "
    "and raw gradients, held only on each rank's shard, are not compared",
    "sp": "sequence parallelism over TP",
    "recompute": "full activation recomputation (uniform, one layer per group)",
    "selective": "selective activation recomputation (core_attn)",
    "vpp": "2 virtual pipeline stages per rank (a 4-layer model), the interleaved 1F1B "
    "schedule with each rank's micro-batch count a multiple of PP",
    "bf16": "bfloat16 parameters, against the float32 reference within BF16_TOLERANCE",
    "r3": "rollout routing replay (MoE): every sample carries an engine's routes (random "
    "top-k sets, none on its last token), replayed in every forward pass of the policy",
    "r2": "routing replay (MoE) of the experts the behaviour log-prob pass chose, in the "
    "training passes (the second runs on moved weights, whose routers would choose others)",
}
"""What ``--features`` can switch on, beyond DP, TP and PP themselves."""


BF16_TOLERANCE = 2e-2
"""max |delta| / max |g| allowed for a bfloat16 run against the float32 reference."""

TF32_TOLERANCE = 5e-3
"""max |delta| / max |g| allowed in float32 when Transformer Engine's layers run: its GEMMs
of float32 tensors compute in TF32 (cuBLASLt ``CUBLAS_COMPUTE_32F_FAST_TF32``: inputs rounded
to 10 mantissa bits), so float32 runs agree to about 1e-3, not 1e-5."""
