"""Bodies run on several gloo processes by tests/distributed/test_loss_*.py."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def planted_bug_layout(*, bug: str, **kwargs):
    """run_layout with a bug planted in the trainer's code, to show the check catches it.

    The normalization bugs are ones peers shipped; the planner bug deals one sample
    to two DP ranks, and ``rank-local-group-ids`` has each DP rank number the prompt
    groups it holds 0, 1, ... (the count vector keeps the batch's size, so the all-reduce
    adds different groups' counts together without an error); ``token-count-division``
    scales every layout alike (only the reference outside megatron-core sees it);
    ``unreduced-norm-grad`` leaves one TP rank's sequence-parallel norm gradients
    unreduced (the replica comparison sees it).
    """
    import megatron_grpo.algo.loss as loss
    import megatron_grpo.train.plan as planner
    import megatron_grpo.train.step as step
    from megatron_grpo.commands.invariance.worker import run_layout

    if bug == "local-denominator":  # verl#5625, open-instruct#1161, prime-rl#583
        original = loss.global_counts

        def local_counts(seq_tokens, group_ids, num_groups, *, group, **kw):
            return original(seq_tokens, group_ids, num_groups, group=None, **kw)

        loss.global_counts = local_counts
    elif bug == "uncancelled-microbatch-mean":  # AReaL#1273: loss / M left in the gradient
        original_scaled = loss.scaled_loss
        num_mb = {"n": 1}
        original_set = step.set_loss_weights

        def remember(micro_batches, *args, **kw):
            num_mb["n"] = len(micro_batches)
            return original_set(micro_batches, *args, **kw)

        step.set_loss_weights = remember
        loss.scaled_loss = lambda *a: original_scaled(*a) / num_mb["n"]
    elif bug == "planner-duplicates-sample":
        original_balance = planner.balance

        def balance(lengths, dp_size):
            ranks = original_balance(lengths, dp_size)
            if dp_size > 1:
                ranks[-1] = sorted(ranks[-1] + [ranks[0][0]])
            return ranks

        planner.balance = balance
    elif bug == "rank-local-group-ids":
        original_plan = step.plan_micro_batches

        def plan_numbering_groups_per_rank(batch, ctx, settings):
            micro_batches = original_plan(batch, ctx, settings)
            held = sorted({int(g) for mb in micro_batches for g in mb.group_ids})
            local = {g: i for i, g in enumerate(held)}
            for mb in micro_batches:
                mb.group_ids = torch.tensor([local[int(g)] for g in mb.group_ids], dtype=torch.long)
            return micro_batches

        step.plan_micro_batches = plan_numbering_groups_per_rank
    elif bug == "token-count-division":  # megatron's per-token division let through
        import megatron_grpo.mcore.compat as mcore_compat

        def finalize_dividing(
            model, num_tokens=None, pg_collection=None, force_all_reduce=False, *, pg
        ):
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg)

        mcore_compat.finalize_grads = finalize_dividing
    elif bug == "unreduced-norm-grad":  # TP rank 1 keeps its partial norm gradients (SP)
        import megatron_grpo.mcore.compat as mcore_compat

        original_finalize = mcore_compat.finalize_grads

        def finalize_skipping(model, *args, pg, **kw):
            norms = [
                p
                for chunk in model
                for name, p in chunk.named_parameters()
                if name.endswith("layernorm.weight") and dist.get_rank(pg.tp) == 1
            ]
            partial = [p.main_grad.clone() for p in norms]
            original_finalize(model, *args, pg=pg, **kw)
            for p, g in zip(norms, partial):
                p.main_grad.copy_(g)

        mcore_compat.finalize_grads = finalize_skipping
    else:
        raise ValueError(bug)
    return run_layout(**kwargs)


def denominator_collectives(tp: int, pp: int) -> dict:
    """Count the collectives the trainer spends before its first optimizer step (the
    denominators, with no old or reference log-probs to freeze), and check TP log-probs."""
    from megatron_grpo.commands.invariance import MAX_COMPLETION, default_loss, fixed_batch
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train.step import StepSettings, plan_micro_batches, prepare_global_batch

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    samples = fixed_batch(vocab_size=100)
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=40,
        pack=False,
        vocab_size=100,
        max_len=MAX_COMPLETION,
    )
    mbs = plan_micro_batches(samples, ctx, settings)

    calls: list[tuple[str, list[int]]] = []
    with recording_collectives(calls):
        prepare_global_batch(
            [], ctx, mbs, default_loss("group-seq-mean"), settings, freeze_old=False
        )
    weights = torch.cat([mb.loss_weights for mb in mbs]) if ctx.is_last_stage else None
    return {
        "rank": ctx.rank,
        "last": ctx.is_last_stage,
        "calls": calls,
        "dp_cp_ranks": dist.get_process_group_ranks(ctx.dp_cp_group),
        "tp_ranks": dist.get_process_group_ranks(ctx.tp_group),
        "pp_ranks": dist.get_process_group_ranks(ctx.pp_group),
        "weights": weights,
        "num_micro_batches": len(mbs),
        "sample_ids": torch.cat([mb.sample_ids for mb in mbs]),
        **tp_logprob_errors(ctx, tp),
    }


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
    "barrier",
)


@contextlib.contextmanager
def recording_collectives(calls: list[tuple[str, list[int]]]):
    """Append (collective, ranks of its group) to ``calls`` for each call made inside."""
    originals = {n: getattr(dist, n) for n in COLLECTIVES}

    def spy(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            ranks = (
                dist.get_process_group_ranks(group)
                if group is not None
                else list(range(dist.get_world_size()))
            )
            calls.append((name, ranks))
            return originals[name](*args, **kwargs)

        return call

    for n in COLLECTIVES:
        setattr(dist, n, spy(n))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)


def tp_logprob_errors(ctx, tp: int) -> dict[str, float]:
    """Vocab-parallel log-probs and entropy against a single-process log_softmax, with
    gradients: the largest differences."""
    from megatron_grpo.algo.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 24, generator=g)
    targets = torch.randint(0, 21, (3, 5), generator=g)
    local = full.chunk(tp, dim=-1)[ctx.tp_rank].clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs(
        local, targets, tp_group=ctx.tp_group, vocab_size=21, with_entropy=True
    )
    (logp.sum() + 0.5 * ent.sum()).backward()
    ref_in = full.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_in[..., :21], dim=-1)
    ref_logp = ref.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
    return {
        "logp_err": float((logp - ref_logp).abs().max()),
        "ent_err": float((ent - ref_ent).abs().max()),
        "grad_err": float((local.grad - ref_in.grad.chunk(tp, dim=-1)[ctx.tp_rank]).abs().max()),
    }


def toy_constant_loss(num_sequences_per_rank: int) -> dict:
    """The GRPO-normalization toy: per-token loss is a parameter theta = 1.

    Sequences have lengths 1..8; the global batch is the same 8 sequences
    however many ranks share it. Returns the loss and d loss / d theta summed
    over ranks (what DDP's sum all-reduce gives).
    """
    from megatron_grpo.algo.loss import scaled_loss
    from megatron_grpo.algo.normalization import global_counts, sequence_weights
    from megatron_grpo.config import MODES

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = torch.arange(1, 9, dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    mine = slice(rank * num_sequences_per_rank, (rank + 1) * num_sequences_per_rank)
    out = {}
    for mode in MODES:
        theta = torch.ones((), requires_grad=True)
        n, g = lengths[mine], groups[mine]
        counts = global_counts(n, g, 3, group=dist.group.WORLD)
        w = sequence_weights(mode, counts, n, g, max_len=8)
        mask = (torch.arange(8)[None, :] < n[:, None]).float()
        loss = scaled_loss(theta * torch.ones_like(mask), mask, w[:, None].expand_as(mask))
        loss.backward()
        total = torch.stack([loss.detach(), theta.grad])
        dist.all_reduce(total)
        out[mode] = total.tolist()
    dist.destroy_process_group()
    return {"world": int(os.environ["WORLD_SIZE"]), "results": out}
