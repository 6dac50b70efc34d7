"""``rollout.sync.delta`` against full pushes of the same weights, after small optimizer steps.

    python bench/weight_sync_delta.py
    python bench/weight_sync_delta.py --quick
    python bench/weight_sync_delta.py --body    # full pushes as an engine on another host gets them

One process holds a stage's sender per mode and two embedded servers (in-process, on
their own threads), one fed full pushes and one deltas. Each repeat moves every weight by an
Adam-like step (``lr x sign(noise)``, lr 1e-5 with weights of scale 0.02) and pushes it to
both, in alternating order. Reported per dtype sent (fp32, bf16): bytes of tensor data a
delta push sends / a full push's, and delta / full push time (wall and CPU, the server's
included: it runs in this process). The first push of each sender is a full one and is not
counted. The full pushes go through shared memory, as to an embedded server on the same
host; with ``--body``, as a safetensors request body, as to one on another host.
"""

from __future__ import annotations

import functools

import torch
from _common import Ratio, measure, parser, summary, write_result

LR = 1e-5


def hf_config(quick: bool):
    from megatron_grpo.testing import tiny_hf_config

    if quick:
        return tiny_hf_config("qwen3")
    return tiny_hf_config(
        "qwen3",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        vocab_size=8192,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )


class Side:
    """An embedded server and a long-lived sender (its delta state lasts across pushes)."""

    def __init__(self, config, *, delta: bool) -> None:
        from megatron_grpo.config import RolloutConfig, WeightSyncConfig
        from megatron_grpo.config.hf import model_config_from_hf
        from megatron_grpo.mcore import device
        from megatron_grpo.rollout.runtime import RolloutRuntime, client_config
        from megatron_grpo.testing import random_hf_model
        from megatron_grpo.weight_sync.sender import StageSender

        cfg = RolloutConfig(sync=WeightSyncConfig(delta=delta, bucket_mb=64))
        self.runtime = RolloutRuntime(
            cfg, hf_model=random_hf_model(config, seed=0), model_cfg=model_config_from_hf(config)
        )
        self.sender = StageSender(
            functools.partial(client_config, self.runtime.cfg),
            0,
            backend=device.distributed_backend(),
        )
        self.sent: list[int] = []

    def push(self, named: dict[str, torch.Tensor], version: str) -> None:
        from megatron_grpo.weight_sync.engines import begin_push, finish_push

        plan = begin_push(self.runtime, version)
        report = self.sender.send(iter([named]), plan)
        assert report.error is None and finish_push(self.runtime, plan, [report])
        self.sent.append(report.sent_bytes if plan.delta else report.nbytes)

    def close(self) -> None:
        self.sender.close()
        self.runtime.close()


def run(config, dtype: torch.dtype, repeats: int) -> dict:
    from megatron_grpo.testing import random_hf_model

    weights = {
        k: v.detach().clone() for k, v in random_hf_model(config, seed=1).state_dict().items()
    }
    gen = torch.Generator().manual_seed(2)
    full, delta = Side(config, delta=False), Side(config, delta=True)
    times: dict[str, list] = {"full": [], "delta": []}
    try:
        for step in range(repeats + 1):
            for w in weights.values():
                w -= LR * torch.randn(w.shape, generator=gen).sign()
            named = {k: v.to(dtype) for k, v in weights.items()}
            order = [("full", full), ("delta", delta)][:: 1 if step % 2 else -1]
            for name, side in order:
                timing = measure(functools.partial(side.push, named, str(step + 1)))
                if step:
                    times[name].append(timing)
    finally:
        full.close()
        delta.close()
    total = sum(v.numel() * v.element_size() for v in named.values())
    byte_ratios = [d / f for d, f in zip(delta.sent[1:], full.sent[1:], strict=True)]
    return {
        "bytes_full": total,
        "bytes": Ratio.of(f"{dtype} delta/full [bytes sent]", byte_ratios),
        "wall": Ratio.of(
            f"{dtype} delta/full [push wall]",
            [d.wall / f.wall for d, f in zip(times["delta"], times["full"], strict=True)],
        ),
        "cpu": Ratio.of(
            f"{dtype} delta/full [push cpu, server included]",
            [d.cpu / f.cpu for d, f in zip(times["delta"], times["full"], strict=True)],
        ),
        "full_wall_s": summary([t.wall for t in times["full"]]),
        "delta_wall_s": summary([t.wall for t in times["delta"]]),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int)
    p.add_argument("--body", action="store_true", help="full pushes as a request body, not shm")
    args = p.parse_args()
    if args.body:
        from megatron_grpo.embedded import weights

        weights.shared_memory_available = lambda: False  # type: ignore[assignment]
    repeats = args.repeats or (2 if args.quick else 5)
    config = hf_config(args.quick)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = run(config, dtype, repeats)
        for key in ("bytes", "wall", "cpu"):
            print(out[key].line())
        print(
            f"  {out['bytes_full'] / 1e6:.1f} MB full; push wall median full "
            f"{out['full_wall_s']['median']:.3f} s, delta {out['delta_wall_s']['median']:.3f} s"
        )
        results[str(dtype).removeprefix("torch.")] = out
    write_result(
        "weight_sync_delta",
        args.out,
        {"quick": args.quick, "body": args.body, "repeats": repeats, **results},
    )


if __name__ == "__main__":
    main()
