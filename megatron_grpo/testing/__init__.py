"""Tiny random Hugging Face models for tests, benchmarks and examples (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
}
_ROPE_THETA = {"llama": 500000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "qwen3_moe": 1e6}
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
"""Qwen3-MoE's experts: 4, top-2 renormalized, narrower than the dense width (as in the
real models)."""


def tiny_hf_config(family: str, *, tied: bool = False, vocab_size: int = 200, **overrides: Any):
    """A tiny config of ``family`` (llama, qwen2, qwen3, qwen3_moe) with GQA; Qwen3's head_dim
    is not hidden / heads, so that layouts which assume it are caught."""
    import transformers

    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_theta=_ROPE_THETA[family],
    )
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32
    if family == "qwen3_moe":
        kwargs |= _MOE
    return getattr(transformers, _CONFIG_CLASSES[family])(**(kwargs | overrides))


def random_hf_model(hf_config, seed: int = 0):
    """A random fp32 model in eval mode; norms and biases random too (ones would hide swaps)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def char_tokenizer(corpus: list[str]):
    """A word-level tokenizer with one token per character of ``corpus`` (plus pad, unk and
    eos), and a chat template that joins the messages' contents: lengths count characters."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        chat_template=PLAIN_CHAT_TEMPLATE,
    )


def tool_tokenizer(corpus: list[str], words: list[str]):
    """``char_tokenizer`` whose decoding joins tokens without spaces, with each of ``words``
    (tool-call tags, tool names) one token of its own."""
    from tokenizers import decoders

    tokenizer = char_tokenizer(corpus)
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens(list(words))
    return tokenizer


def tiny_qwen2_for(tokenizer, seed: int, family: str = "qwen2"):
    """A freshly initialized tiny fp32 Qwen2 (the CPU examples' model) for ``tokenizer``;
    ``family="qwen3_moe"`` makes the same size of Qwen3-MoE (4 experts, top-2)."""
    import transformers

    config = tiny_hf_config(
        family,
        vocab_size=len(tokenizer),
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def perturb_weights(model: list, ctx, cfg, seed: int) -> None:
    """New weights that are still a sensible model: seeded noise on the full tensors.

    Collective. Made on global rank 0 and loaded by every rank, so that tensors replicated
    over TP (norms, row-parallel biases) stay equal on all ranks.
    """
    import torch.distributed as dist

    from megatron_grpo.mcore.full_state import gather_full_state, load_full_state

    full = gather_full_state(model, ctx, vocab_size=cfg.vocab_size)
    if full is not None:
        gen = torch.Generator().manual_seed(seed)
        full = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())}
    box = [full]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    load_full_state(model, box[0], cfg, ctx)


def megatron_logits(model: list, ctx, tokens: torch.Tensor, vocab_size: int):
    """A megatron model's logits for ``tokens``, gathered over TP, on the last pipeline
    stage (None elsewhere). Collective."""
    import torch.distributed as dist

    from megatron_grpo.mcore.schedule import TokenBatch, run_schedule

    out: list[torch.Tensor] = []

    def keep(batch, logits):
        parts = [torch.empty_like(logits) for _ in range(ctx.dims.tp)]
        dist.all_gather(parts, logits.contiguous(), group=ctx.tp_group)
        out.append(torch.cat(parts, dim=-1)[..., :vocab_size])
        return logits.sum() * 0, torch.tensor(1), {}

    with torch.no_grad():
        run_schedule(model, ctx, [TokenBatch.of(tokens)], keep, forward_only=True)
    return out[0] if out else None


def checkpoint_logits(ctx, cfg, megatron_dir: str, tokens: torch.Tensor):
    """``megatron_logits`` of a fresh model loaded from a megatron checkpoint; its
    parameters start as NaN, so anything the load misses shows."""
    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.model import build_model

    model = build_model(cfg, ctx)
    for chunk in model:
        for p in chunk.parameters():
            p.data.fill_(float("nan"))
    checkpoint.load_model(model, megatron_dir)
    return megatron_logits(model, ctx, tokens, cfg.vocab_size)
