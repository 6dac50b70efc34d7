"""Bodies the GPU tier runs in processes of their own (``launch.run_workers``), loaded by path:
each builds megatron-core on the GPU with nccl, so none of this runs at collection time.

- ``nccl_probe``: two ranks on cuda:0, one NCCL all-reduce: may one device host two ranks?
- ``spec_comparison``: the Transformer Engine layer spec against the local one, same weights:
  logits and gradients, dense and MoE, fp32 and bf16; and packed (THD) rows in Transformer
  Engine against the local spec's dense block mask.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

SEQ_LEN = 48
ROWS = 4


def nccl_probe() -> dict[str, Any]:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="env://", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    version = ".".join(str(v) for v in torch.cuda.nccl.version())
    dist.destroy_process_group()
    return {"sum": float(x), "nccl": version}


# --------------------------------------------------------------------------- layer specs


def _model(kind: str, dtype: str):
    import dataclasses

    from megatron_grpo.commands.invariance.cases import default_model, default_moe_model

    cfg = default_model() if kind == "dense" else default_moe_model()
    return dataclasses.replace(cfg, params_dtype=dtype, max_position_embeddings=256)


def _errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |delta| / max |ref| and ||delta|| / ||ref|| over all tensors, and the tensor where
    the max is worst."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    scale = max(float(t.abs().max()) for t in ref.values())
    norm = sum(float(t.double().square().sum()) for t in ref.values()) ** 0.5
    deltas = {k: (got[k].double() - ref[k].double()) for k in ref}
    worst = max(deltas, key=lambda k: float(deltas[k].abs().max()))
    return {
        "max_rel": max(float(d.abs().max()) for d in deltas.values()) / max(scale, 1e-30),
        "norm_rel": sum(float(d.square().sum()) for d in deltas.values()) ** 0.5 / max(norm, 1e-30),
        "worst_tensor": worst,  # type: ignore[dict-item]
    }


def _forward_backward(model: list, ctx, cfg, batch, targets: torch.Tensor, mask: torch.Tensor):
    """Log-probs of ``targets`` (and the logits) and the gradient of -sum(mask * logp)."""
    from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
    from megatron_grpo.mcore.full_state import gather_full_state
    from megatron_grpo.mcore.schedule import run_schedule, zero_grads

    zero_grads(model)
    kept: dict[str, torch.Tensor] = {}

    def loss_fn(_batch, logits):
        logp, _ = vocab_parallel_logprobs(
            logits, targets, tp_group=ctx.tp_group, vocab_size=cfg.vocab_size
        )
        kept["logits"] = logits[..., : cfg.vocab_size].detach().float().cpu()
        kept["logp"] = logp.detach().cpu()
        loss = -(logp * mask).sum()
        return loss, mask.sum().to(torch.int), {}

    run_schedule(model, ctx, [batch], loss_fn)
    grads = gather_full_state(model, ctx, vocab_size=cfg.vocab_size, grads=True)
    assert grads is not None
    return kept, grads


def _rows(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, vocab_size, (ROWS, SEQ_LEN), generator=g)
    targets = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    mask = torch.ones(ROWS, SEQ_LEN)
    mask[:, -1] = 0
    return tokens, targets, mask


def _per_sample(values: torch.Tensor, seg: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Each sample's values in order, end to end (padding left out)."""
    seg = seg.cpu()
    return torch.cat([values[seg == i] for i in range(num_samples)])


def spec_comparison(models: list[str], dtypes: list[str]) -> dict[str, Any]:
    """Per model kind and dtype: TE spec vs local spec on identical weights (plain causal
    rows); per model kind in bf16: TE's THD-packed rows vs the local spec's masked packing."""
    from megatron_grpo.algo.batch import collate, collate_thd
    from megatron_grpo.commands.invariance.cases import fixed_batch
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.full_state import gather_full_state, load_full_state
    from megatron_grpo.mcore.layers import have_transformer_engine
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.mcore.schedule import TokenBatch

    assert have_transformer_engine(), "transformer_engine is not importable"
    ctx = init_parallel(ParallelDims())
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "cases": {}}
    import transformer_engine

    out["transformer_engine"] = transformer_engine.__version__
    for kind in models:
        for dtype in dtypes:
            cfg = _model(kind, dtype)
            local = build_model(cfg, ctx, spec="local")
            weights = gather_full_state(local, ctx, vocab_size=cfg.vocab_size)
            assert weights is not None
            te = build_model(cfg, ctx, spec="transformer_engine")
            load_full_state(te, weights, cfg, ctx)
            tokens, targets, mask = (t.to(device) for t in _rows(cfg.vocab_size))
            rows = TokenBatch.of(tokens)
            ref, ref_grads = _forward_backward(local, ctx, cfg, rows, targets, mask)
            got, got_grads = _forward_backward(te, ctx, cfg, rows, targets, mask)
            case = {
                "logits": _errors({"l": got["logits"]}, {"l": ref["logits"]}),
                "logprobs": _errors({"p": got["logp"]}, {"p": ref["logp"]}),
                "grads": _errors(got_grads, ref_grads),
            }
            if dtype != "float32":  # THD runs in TE's fused or flash attention: 16-bit only
                samples = fixed_batch(cfg.vocab_size)
                dense = collate([samples], num_groups=4).to(device)  # one row, block mask
                thd = collate_thd(samples, num_groups=4).to(device)
                ref, ref_grads = _forward_backward(
                    local, ctx, cfg, dense, dense.targets, dense.loss_mask
                )
                got, got_grads = _forward_backward(te, ctx, cfg, thd, thd.targets, thd.loss_mask)
                n = len(samples)
                case["thd_logprobs"] = _errors(
                    {"p": _per_sample(got["logp"][0], thd.seg[0], n)},
                    {"p": _per_sample(ref["logp"][0], dense.seg[0], n)},
                )
                case["thd_grads"] = _errors(got_grads, ref_grads)
            out["cases"][f"{kind}/{dtype}"] = case
            del local, te
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- SGLang on the GPU


def _learner_logprobs(model: list, ctx, cfg, tokens: list[int]) -> dict[str, list]:
    """Per-position log-prob of the next token and the argmax, from one forward pass."""
    from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
    from megatron_grpo.mcore.schedule import TokenBatch, run_schedule

    ids = torch.tensor([tokens], device="cuda")
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    out: dict[str, list] = {}

    def keep(_batch, logits):
        logp, _ = vocab_parallel_logprobs(
            logits, targets, tp_group=ctx.tp_group, vocab_size=cfg.vocab_size
        )
        out["logprobs"] = logp[0].float().cpu().tolist()
        out["argmax"] = logits[0, :, : cfg.vocab_size].argmax(dim=-1).cpu().tolist()
        return logits.sum() * 0, torch.tensor(1), {}

    with torch.no_grad():
        run_schedule(model, ctx, [TokenBatch.of(ids)], keep, forward_only=True)
    return out


def _sglang_phase(runtime, model, ctx, cfg, rollout_cfg, prompts) -> dict[str, Any]:
    """The server's samples and, for the same tokens, the learner's log-probs: the mismatch
    |logp_learner - logp_sglang| per token, and how often the learner's argmax is the token."""
    groups = runtime.generate_groups(prompts, rollout_cfg, seed=0, stop_token_ids=[])
    deltas, agree, versions = [], [], set()
    for sample in (s for g in groups for s in g):
        prompt, output = list(sample.prompt_ids), list(sample.output_ids)
        fwd = _learner_logprobs(model, ctx, cfg, prompt + output)
        start = len(prompt) - 1  # the position that predicts the first output token
        learner = fwd["logprobs"][start : start + len(output)]
        deltas += [abs(a - b) for a, b in zip(learner, sample.rollout_logprobs)]
        agree += [a == t for a, t in zip(fwd["argmax"][start : start + len(output)], output)]
        versions.add(sample.weight_version)
    deltas_t = torch.tensor(deltas)
    return {
        "tokens": len(deltas),
        "mismatch_mean": float(deltas_t.mean()),
        "mismatch_max": float(deltas_t.max()),
        "mismatch_p99": float(deltas_t.quantile(0.99)),
        "argmax_is_sampled_fraction": sum(agree) / max(len(agree), 1),
        "weight_versions": sorted(str(v) for v in versions),
        "first_tokens": [list(s.output_ids[:8]) for g in groups for s in g],
    }


def sglang_scenario(
    hf_dir: str,
    url: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    methods: list[str],
    mem_fraction_static: float,
) -> dict[str, Any]:
    """One GPU learner (TE spec, bf16) holding the served checkpoint: the mismatch with the
    server's log-probs, then per method a weight push of perturbed weights (version = step)
    and the mismatch again. A push that fails is reported, not raised."""
    import dataclasses
    import functools
    import time

    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import (
        EngineClientConfig,
        EnginesConfig,
        ParallelDims,
        RolloutConfig,
        SamplingConfig,
        WeightSyncConfig,
    )
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.hf_export import stage_hf_layers
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.testing import perturb_weights
    from megatron_grpo.weight_sync.push import WeightPush

    ctx = init_parallel(ParallelDims())
    cfg = dataclasses.replace(resolve_hf_model(hf_dir), params_dtype="bfloat16")
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    nbytes = sum(
        t.numel() * t.element_size() for u in stage_hf_layers(model, cfg, ctx) for t in u.values()
    )

    def rollout_cfg(method: str) -> RolloutConfig:
        return RolloutConfig(
            engines=EnginesConfig(type="sglang", urls=[url]),
            prompts_per_step=len(prompts),
            samples_per_prompt=2,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=1.0),
            client=EngineClientConfig(weight_update_timeout_s=120.0),
            sync=WeightSyncConfig(method=method, bucket_mb=64),  # type: ignore[arg-type]
        )

    result: dict[str, Any] = {"bytes": nbytes, "phases": {}, "pushes": {}}
    runtime = RolloutRuntime(rollout_cfg("tensor"), model_cfg=cfg)
    result["phases"]["initial"] = _sglang_phase(
        runtime, model, ctx, cfg, rollout_cfg("tensor"), prompts
    )
    runtime.close()
    for step, method in enumerate(methods, start=1):
        perturb_weights(model, ctx, cfg, seed=step)
        colocated = method == "colocated"  # the tensor push inside a colocated turn
        method_cfg = rollout_cfg("tensor" if colocated else method)
        runtime = RolloutRuntime(method_cfg, model_cfg=cfg)
        push = WeightPush(cfg, method_cfg, ctx)
        try:
            if colocated:
                result["colocated"] = {"mem_fraction_static": mem_fraction_static}
                result["colocated"] |= _colocated_turn(
                    runtime, functools.partial(push, model, str(step), runtime)
                )
            else:
                start = time.perf_counter()
                push(model, str(step), runtime)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                result["pushes"][method] = {"s": seconds, "gb_per_s": nbytes / seconds / 1e9}
            result["phases"][method] = _sglang_phase(runtime, model, ctx, cfg, method_cfg, prompts)
        except Exception as err:  # noqa: BLE001 - reported: NCCL may refuse a shared device
            result["pushes"][method] = {"error": f"{type(err).__name__}: {err}"[-3000:]}
        finally:
            push.close()
            runtime.close()
    return result


def _colocated_turn(runtime, push) -> dict[str, Any]:
    """The engine's side of a colocated step through the trainer's ``Colocation``: release
    everything, resume the weights, push, resume the KV cache and CUDA graphs. The device's
    free memory (``torch.cuda.mem_get_info`` on the server's GPU) is read awake, asleep and
    after each resume."""
    import time

    from megatron_grpo.config import ColocateConfig
    from megatron_grpo.train.colocation import Colocation

    device = torch.cuda.device_count() - 1  # the server's GPU (the second one when there are two)

    def free() -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.mem_get_info(device)[0]

    turn = Colocation(ColocateConfig(offload=[], transition_timeout_s=60), None, is_main=True)
    seconds: dict[str, float] = {}

    def timed(name: str, call) -> None:
        start = time.perf_counter()
        call()
        seconds[name] = time.perf_counter() - start

    figures = {"free_awake": free()}
    timed("release_s", lambda: turn.engines_started(runtime))
    figures["free_asleep"] = free()
    timed("resume_weights_s", turn.resume_weights)
    figures["free_weights_resumed"] = free()
    timed("push_s", push)
    timed("resume_kv_cache_s", turn.resume_kv_cache)
    figures["free_all_resumed"] = free()
    return {
        **figures,
        **seconds,
        "total_memory": torch.cuda.get_device_properties(device).total_memory,
    }
