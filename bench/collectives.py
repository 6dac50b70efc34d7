"""Collectives of a real ``train_on_rollout``, by phase; the denominator path in particular.

    python bench/collectives.py                  # DP2 x TP2 x PP2: 8 gloo processes
    python bench/collectives.py --layout 2x2x1   # DP2 x TP2: 4 processes
    python bench/collectives.py --quick          # DP2: 2 processes, smoke test

Every ``torch.distributed`` collective and point-to-point call made during
one ``train_on_rollout`` (several global batches, mu > 1, KL on, so that the
old- and reference-logprob passes run too) is recorded with the phase it
belongs to, its process group and the bytes of the tensors handed to it. The
phases are the trainer's own functions: the denominators
(``set_loss_weights``), the log-prob passes, the forward/backward schedule
(with DDP's gradient all-reduce), the optimizer step, the metric reduction.

Target: the denominator path costs exactly one all-reduce per global batch,
on the DP (x CP) group, on last-stage ranks only. Reported ratio: the
denominator path's share of the calls and bytes of the whole step.

A call is seen when it goes through the ``torch.distributed`` module's
attributes, as megatron-core's and this project's calls do. Pipeline
point-to-point traffic is seen through ``batch_isend_irecv`` (megatron-core's
default, ``batch_p2p_comm``); bare ``isend``/``irecv`` are not wrapped, since
``P2POp`` accepts only the original functions (interleaved pipelines use them).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from dataclasses import asdict
from typing import Any

from _common import Ratio, parser, run_at_layout, tiny_model, write_result

OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
    "all_to_all",
    "all_to_all_single",
)
GROUP_NAMES = ("dp_cp", "dp", "tp", "pp", "cp", "mp", "embd", "tp_dp_cp")
"""Named groups of the layout, most specific first for the same ranks (dp_cp == dp at CP 1)."""


class Spy:
    """Records (phase, op, group ranks, bytes) for every collective while installed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[int, ...], int]] = []
        self.phases: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()

    def labelled(self, name, fn):
        def call(*args, **kwargs):
            label = name(*args, **kwargs) if callable(name) else name
            with self.phase(label):
                return fn(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def installed(self):
        import torch.distributed as dist

        originals = {op: getattr(dist, op) for op in OPS}
        for op, fn in originals.items():
            setattr(dist, op, self._wrap(op, fn))
        try:
            yield self
        finally:
            for op, fn in originals.items():
                setattr(dist, op, fn)

    def _wrap(self, op: str, fn):
        import torch.distributed as dist

        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            if op == "batch_isend_irecv":
                for p2p in bound["p2p_op_list"]:
                    self._record(f"batched_{p2p.op.__name__}", p2p.group, _nbytes(p2p.tensor))
            else:
                self._record(op, bound.get("group"), _payload_bytes(bound))
            return fn(*args, **kwargs)

        self._dist = dist
        return call

    def _record(self, op: str, group, nbytes: int) -> None:
        dist = self._dist
        ranks = (
            dist.get_process_group_ranks(group)
            if group is not None
            else list(range(dist.get_world_size()))
        )
        phase = self.phases[0] if self.phases else "other"
        self.calls.append((phase, op, tuple(sorted(ranks)), nbytes))


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _payload_bytes(bound: dict[str, Any]) -> int:
    """Bytes of the tensor(s) this rank hands to the call; -1 for pickled objects."""
    import torch

    for key in ("tensor", "input_tensor", "input", "tensor_list", "input_tensor_list"):
        value = bound.get(key)
        if isinstance(value, torch.Tensor):
            return _nbytes(value)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return sum(_nbytes(t) for t in value)
    return -1 if ("object_list" in bound or "obj" in bound) else 0


def worker(*, tp: int, pp: int, model_cfg, shape, num_global_batches: int, mu: int) -> dict:
    import torch.distributed as dist
    from _workload import BatchShape, full_loss_config, make_samples

    from megatron_grpo.config import OptimConfig, ParallelDims
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train import step as train_step

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx)
    ref_model = build_model(model_cfg, ctx, wrap_ddp=False)
    optimizer, scheduler = build_optimizer(
        OptimConfig(optimizer="adam", lr=1e-6), model_cfg, model, ctx
    )
    rollout = BatchShape(**{**asdict(shape), "num_samples": shape.num_samples * num_global_batches})
    samples = make_samples(rollout, model_cfg.vocab_size)
    settings = train_step.StepSettings(
        global_batch_size=shape.num_samples,
        num_iterations=mu,
        max_tokens_per_micro_batch=shape.max_tokens_per_micro_batch,
        pack=shape.pack,
        vocab_size=model_cfg.vocab_size,
        max_len=shape.completion_len[1],
    )
    spy = Spy()
    patched = {
        "set_loss_weights": "denominators",
        "forward_logprobs": lambda m, *a, **k: (
            f"{'ref' if m is ref_model else 'old'} logprobs pass"
        ),
        "run_schedule": "forward_backward (DDP grad all-reduce included)",
        "reduce_metrics": "metrics",
    }
    originals = {name: getattr(train_step, name) for name in patched}
    for name, label in patched.items():
        setattr(train_step, name, spy.labelled(label, originals[name]))
    optimizer.step = spy.labelled("optimizer", optimizer.step)
    try:
        with spy.installed():
            train_step.train_on_rollout(
                model,
                optimizer,
                scheduler,
                ctx,
                samples,
                full_loss_config(),
                settings,
                ref_model=ref_model,
            )
    finally:
        for name, fn in originals.items():
            setattr(train_step, name, fn)
    groups = {(ctx.rank,): "self"}  # a group of one rank (e.g. TP at TP=1) moves nothing
    for name in GROUP_NAMES:
        group = getattr(ctx.pg, name, None)
        if group is not None:
            groups.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), name)
    groups.setdefault(tuple(range(ctx.world_size)), "world")
    return {
        "rank": ctx.rank,
        "last_stage": ctx.is_last_stage,
        "calls": [(ph, op, groups.get(r, f"ranks{list(r)}"), n) for ph, op, r, n in spy.calls],
        "dp_cp_group": groups.get(tuple(sorted(dist.get_process_group_ranks(ctx.dp_cp_group)))),
    }


def tally(calls) -> dict[str, dict[str, dict[str, int]]]:
    """phase -> "op@group" -> {calls, bytes}."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for phase, op, group, nbytes in calls:
        entry = out[phase].setdefault(f"{op}@{group}", {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += max(nbytes, 0)
    return dict(out)


def launch(args):
    """Run ``worker`` at the requested layout; (layout, model config, batch shape, per-rank)."""
    from _workload import BatchShape

    from megatron_grpo.commands.invariance import Layout

    layout = Layout.parse(args.layout or ("2x1x1" if args.quick else "2x2x2"))
    model_cfg = tiny_model(
        vocab_size=500, make_vocab_size_divisible_by=8, max_position_embeddings=256
    )
    shape = BatchShape(
        num_samples=8,
        group_size=4,
        prompt_len=(4, 12),
        completion_len=(4, 24),
        max_tokens_per_micro_batch=48,
        pack=True,
    )
    ranks = run_at_layout(
        __file__,
        layout,
        timeout=args.timeout or (150.0 if args.quick else 600.0),
        model_cfg=model_cfg,
        shape=shape,
        num_global_batches=args.global_batches,
        mu=args.mu,
    )
    return layout, model_cfg, shape, ranks


def denominator_shares(ranks, num_batches: int):
    """Per-rank tallies, the denominator path's share of calls and bytes, and what broke
    the target (exactly one all-reduce per global batch on the DP group, last stage only)."""
    per_rank, problems = {}, []
    share_calls, share_bytes = [], []
    for r in ranks:
        per_rank[r["rank"]] = tally(r["calls"])
        den = [c for c in r["calls"] if c[0] == "denominators"]
        expected = [("denominators", "all_reduce", r["dp_cp_group"])] * num_batches
        if not r["last_stage"]:
            expected = []
        if [c[:3] for c in den] != expected:
            problems.append(f"rank {r['rank']}: denominator calls {den}, expected {expected}")
        if r["last_stage"] and r["calls"]:
            share_calls.append(len(den) / len(r["calls"]))
            total = sum(max(c[3], 0) for c in r["calls"])
            share_bytes.append(sum(c[3] for c in den) / total if total else 0.0)
    calls = Ratio.of("denominator calls / all calls", share_calls)
    bytes_ = Ratio.of("denominator bytes / all bytes", share_bytes)
    return per_rank, calls, bytes_, problems


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layout", help="DPxTPxPP (default 2x2x2; 2x1x1 with --quick)")
    p.add_argument("--global-batches", type=int, default=2)
    p.add_argument("--mu", type=int, default=2, help="optimizer passes per rollout batch")
    p.add_argument(
        "--timeout", type=float, help="seconds per launch (default 600; 150 with --quick)"
    )
    args = p.parse_args()
    layout, model_cfg, shape, ranks = launch(args)
    num_batches = args.global_batches
    per_rank, calls_share, bytes_share, problems = denominator_shares(ranks, num_batches)
    last = next(r for r in ranks if r["last_stage"])
    den_calls = [c for c in last["calls"] if c[0] == "denominators"]
    per_batch = len(den_calls) / num_batches
    met = not problems
    print(
        f"RATIO denominator all-reduces per global batch ({layout}, {num_batches} global batches, "
        f"mu={args.mu}): {per_batch:g} on group {den_calls[0][2] if den_calls else None} "
        f"({den_calls[0][3] if den_calls else 0} bytes each); "
        f"target exactly 1 on the DP group: {'met' if met else 'NOT met'}"
    )
    print(
        f"RATIO denominator path / whole train_on_rollout, over the {calls_share.repeats} "
        f"last-stage ranks: calls {calls_share.min:.3f}-{calls_share.max:.3f}, "
        f"bytes {bytes_share.min:.2e}-{bytes_share.max:.2e}"
    )
    for problem in problems:
        print("  " + problem)
    print(f"rank {last['rank']} (last stage), whole train_on_rollout:")
    for phase, ops in tally(last["calls"]).items():
        for key, v in sorted(ops.items()):
            print(f"  {phase:50s} {key:36s} {v['calls']:5d} calls {v['bytes']:12d} bytes")
    write_result(
        "collectives",
        args.out,
        {
            "quick": args.quick,
            "layout": str(layout),
            "global_batches": num_batches,
            "mu": args.mu,
            "target": {
                "denominator all-reduces per global batch": "exactly 1, DP group",
                "met": met,
            },
            "denominator_all_reduces_per_global_batch": per_batch,
            "denominator_bytes_per_call": den_calls[0][3] if den_calls else 0,
            "denominator_share_of_calls": calls_share,
            "denominator_share_of_bytes": bytes_share,
            "problems": problems,
            "per_rank": per_rank,
            "model": asdict(model_cfg),
            "batch": asdict(shape),
        },
    )


if __name__ == "__main__":
    main()
