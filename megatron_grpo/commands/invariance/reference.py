"""The gradient of the first pass computed outside megatron-core.

The same weights in the Hugging Face model (transformers), one sample at a time, and
the objective written out from its definition (docs/loss_normalization.md):

    J = sum_i w_i sum_t m_it l_it

with w_i from the counts of the whole batch and l_it the PPO-clipped surrogate times
the truncated importance weight, plus the KL penalty, minus the entropy bonus; for a
mixture-of-experts model, plus the routers' balance loss of each sample from
transformers' router logits, coeff / N sum_layers E sum_i f_i P_i; under rollout routing
replay (R3) its routers send each token to the sample's routes (``_replayed``). Nothing
of the trainer's loss code, planner or megatron-core takes part, so a factor that the
trainer applies in every layout alike (which the layouts' agreement cannot see) shows
here. The first pass is on-policy: the behaviour log-probs equal the current ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_grpo.algo.batch import Sample
from megatron_grpo.config import LossConfig, ModelConfig


def _weights(samples: list[Sample], mode: str, max_len: int) -> list[float]:
    """w_i of each sample under ``mode``: the table of docs/loss_normalization.md."""
    n = [s.num_loss_tokens for s in samples]
    live = [i for i, k in enumerate(n) if k > 0]
    groups = sorted({samples[i].group for i in live})
    tokens_of = {g: sum(n[i] for i in live if samples[i].group == g) for g in groups}
    seqs_of = {g: sum(1 for i in live if samples[i].group == g) for g in groups}
    total, num_seqs, num_groups = sum(n), len(live), len(groups)
    out = []
    for i, s in enumerate(samples):
        if n[i] == 0:
            out.append(0.0)
        elif mode == "token-mean":
            out.append(1 / total)
        elif mode == "seq-mean-token-mean":
            out.append(1 / (num_seqs * n[i]))
        elif mode == "seq-mean-token-sum-norm":
            out.append(1 / (num_seqs * max_len))
        elif mode == "group-token-mean":
            out.append(1 / (num_groups * tokens_of[s.group]))
        else:  # group-seq-mean
            out.append(1 / (num_groups * seqs_of[s.group] * n[i]))
    return out


def _token_terms(logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """log p of each next token and the entropy of each position's distribution."""
    logp_all = torch.log_softmax(logits[:-1].float(), dim=-1)
    logp = logp_all.gather(-1, tokens[1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _sample_loss(
    s: Sample, logp: Tensor, entropy: Tensor, ref_logp: Tensor, cfg: LossConfig
) -> Tensor:
    """sum_t m_t l_t of one sample (positions t predict token t + 1)."""
    m = s.loss_mask[1:].float()
    assert s.rollout_logprobs is not None
    rollout = s.rollout_logprobs[1:].float()
    log_ratio = logp - (rollout if cfg.old_logprobs == "rollout" else logp.detach())
    if cfg.ratio_level == "sequence":  # GSPO: the sequence's mean log-ratio on every token
        mean = (log_ratio * m).sum() / m.sum().clamp(min=1)
        log_ratio = mean.detach() + log_ratio - log_ratio.detach()
    ratio, adv = log_ratio.exp(), s.advantage
    surrogate = torch.maximum(
        -adv * ratio, -adv * ratio.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
    )
    if cfg.dual_clip is not None and adv < 0:
        surrogate = torch.minimum(surrogate, torch.full_like(surrogate, -adv * cfg.dual_clip))
    log_w = (logp.detach() - rollout) * m
    if cfg.tis_level == "sequence":
        log_w = log_w.sum().expand_as(log_w)
    w = log_w.exp()
    if cfg.tis_level is not None:
        if cfg.tis_mode == "truncate":
            w = w.clamp(max=cfg.tis_upper)
        else:
            keep = (w <= cfg.tis_upper) & (w >= (cfg.tis_lower or 0.0))
            w = torch.where(keep, w, torch.zeros_like(w))
    else:
        w = torch.ones_like(w)
    per_token = surrogate * w
    if cfg.kl_coef:
        d = ref_logp - logp
        kl = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
        per_token = per_token + cfg.kl_coef * kl
    per_token = per_token - cfg.entropy_coef * entropy
    return (per_token * m).sum()


def hf_model(state: dict[str, Tensor], cfg: ModelConfig):
    """The transformers model of ``cfg`` holding the megatron ``state``."""
    from megatron_grpo.convert.weights import megatron_to_hf
    from megatron_grpo.embedded.weights import hf_model_from_state

    hf_state = megatron_to_hf(state, cfg, cfg.hf_family)
    if not cfg.is_moe:
        return hf_model_from_state(hf_state, cfg)
    import transformers

    from megatron_grpo.convert.experts import fuse_hf_experts
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float()
    model.load_state_dict(fuse_hf_experts(hf_state, cfg.num_layers), strict=True)
    return model


def _chosen(probs: Tensor, topk: int, routes: Tensor | None) -> Tensor:
    """[S, K] the experts of each token: ``routes`` [S, K] where given (>= 0), else the top-k."""
    chosen = probs.topk(topk, dim=-1).indices
    if routes is None:
        return chosen
    given = (routes >= 0).all(dim=1, keepdim=True)
    return torch.where(given, routes.long(), chosen)


@contextlib.contextmanager
def _replayed(model, routes: Tensor | None) -> Iterator[None]:
    """transformers' Qwen3-MoE routers send each token of the one sample being run to its
    ``routes`` [S, L, K] (where given): gates softmax(logits) at those experts, renormalized
    over them (``norm_topk_prob``), as the router computes them for its own top-k."""
    if routes is None:
        yield
        return

    def hook(layer: int):
        def replace(gate, args, output):
            logits, _, _ = output
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            chosen = _chosen(probs, gate.top_k, routes[:, layer])
            top = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        return replace

    handles = [
        layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _balance(router_logits: tuple[Tensor, ...], topk: int, routes: Tensor | None) -> Tensor:
    """sum over layers of E sum_i f_i P_i for one sample: f_i the fraction of its k-fold
    routed tokens that went to expert i (replayed ``routes`` [S, L, K] where given), P_i
    its mean router probability."""
    total = torch.zeros(())
    for layer, logits in enumerate(router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        num_tokens, num_experts = probs.shape
        chosen = _chosen(probs, topk, None if routes is None else routes[:, layer])
        counts = torch.nn.functional.one_hot(chosen, num_experts).sum(dim=(0, 1)).float()
        f = counts / (topk * num_tokens)
        total = total + num_experts * (f * probs.mean(dim=0)).sum()
    return total


def reference_gradient(
    state: dict[str, Tensor],
    ref_state: dict[str, Tensor],
    samples: list[Sample],
    model_cfg: ModelConfig,
    loss_cfg: LossConfig,
    *,
    max_len: int,
    replay: bool = False,
) -> dict[str, Tensor]:
    """dJ/dtheta of the first pass, under megatron-core's (TP=1, PP=1) parameter names;
    ``replay``: the policy routes each token to the sample's ``routes`` (R3; R2 replays the
    first pass's own routes, which the routers choose anyway)."""
    from megatron_grpo.convert.experts import split_hf_experts
    from megatron_grpo.convert.weights import (
        MEGATRON_EMBEDDING,
        MEGATRON_OUTPUT,
        canonical_megatron_name,
        hf_to_megatron,
    )

    policy, ref = hf_model(state, model_cfg), hf_model(ref_state, model_cfg).eval()
    policy.train()
    moe = {"output_router_logits": True} if model_cfg.is_moe else {}
    aux_weight = model_cfg.moe_aux_loss_coeff / len(samples)
    weights = _weights(samples, loss_cfg.mode, loss_cfg.max_len or max_len)
    total = torch.zeros(())
    for s, w in zip(samples, weights):
        tokens = s.tokens.long()
        routes = s.routes if replay else None
        with _replayed(policy, routes):
            out = policy(tokens[None], **moe)
        logp, entropy = _token_terms(out.logits[0], tokens)
        with torch.no_grad():
            ref_logp, _ = _token_terms(ref(tokens[None]).logits[0], tokens)
        total = total + w * _sample_loss(s, logp, entropy, ref_logp, loss_cfg)
        if aux_weight:
            total = total + aux_weight * _balance(
                out.router_logits, model_cfg.moe_router_topk, routes
            )
    total.backward()
    grads = {k: p.grad for k, p in policy.named_parameters() if p.grad is not None}
    grads = split_hf_experts(grads)
    if model_cfg.tie_embeddings:
        grads.pop("lm_head.weight", None)
    out = {canonical_megatron_name(k): v for k, v in hf_to_megatron(grads, model_cfg).items()}
    for key in (MEGATRON_EMBEDDING, MEGATRON_OUTPUT):  # padding rows: the gather drops them too
        if key in out:
            out[key] = out[key][: model_cfg.vocab_size]
    return out
