"""A training run on the CPU demo's assets (see conftest.assets): its command line, and
worker functions that read its results (loaded by path in their own processes, so this
module imports nothing from the tests)."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "cpu_demo" / "grpo.yaml"


def demo_argv(out: Path, assets: Path, *overrides: str, nproc: int = 2) -> list[str]:
    """``megatron-grpo train --nproc`` on the demo, 4 prompts x 4 samples per step."""
    args = [
        sys.executable,
        "-m",
        "megatron_grpo.cli",
        "train",
        "--config",
        str(CONFIG),
        "--nproc",
        str(nproc),
        "--set",
        f"output_dir={out}",
        "--set",
        f"tokenizer={assets / 'model'}",
        "--set",
        f"train.init={assets / 'model'}",
        "--set",
        f"data.path={assets / 'train.jsonl'}",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "rollout.samples_per_prompt=4",
        "--set",
        "metrics.tensorboard=false",
    ]
    return args + [x for o in overrides for x in ("--set", o)]


def full_params(ckpt: str, config: str) -> dict:
    """Worker: one process loads a checkpoint and returns its layout-free parameters."""
    from megatron_grpo.config import ParallelDims, load_config
    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.full_state import gather_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel

    cfg = load_config(config)
    ctx = init_parallel(ParallelDims())
    model = build_model(cfg.model, ctx)
    checkpoint.load_model(model, ckpt)
    return gather_full_state(model, ctx, vocab_size=cfg.model.vocab_size)


def reference_update(init: str, dump: str, lr: float) -> dict:
    """Worker: one plain-PyTorch SGD step of the token-mean GRPO loss on a transformers model."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.rollout.stage import replay

    hf = AutoModelForCausalLM.from_pretrained(init).float()
    hf.model.embed_tokens.padding_idx = None  # the learner's embedding has no frozen pad row
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    samples = replay(dump, 1).samples
    num_tokens = sum(s.num_loss_tokens for s in samples)
    for s in samples:
        logits = hf(input_ids=s.tokens[None]).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, s.tokens[1:, None])[:, 0]
        ratio = torch.exp(logp - logp.detach())  # on-policy: ratio 1, gradient of logp
        (-(s.advantage * ratio * s.loss_mask[1:]).sum() / num_tokens).backward()
    return {k: -lr * p.grad for k, p in hf.named_parameters()} | {"_before": before}
