"""The routers' load-balancing loss under the loss contract, and routing statistics.

megatron-core's own auxiliary loss is computed per micro-batch (its expert counts are
those of the micro-batch's tokens) and scaled per micro-batch, so its gradient changes
with the micro-batch count and the DP split. It is switched off (``mcore.model``), and
this module attaches the per-sequence balance loss of ``algo.normalization`` instead:
a hook after every router's forward (``compat.hook_routers``) computes it from the
router's scores and routing for the micro-batch being run (its sequences are set by
``set_batch`` just before the forward) and attaches it with megatron-core's
``MoEAuxLossAutoScaler`` (``compat.attach_aux_loss``), which adds its gradient in the
backward pass on whichever pipeline stage holds the layer. The schedule sets that
autoscaler's scale to 1 under ``calculate_per_token_loss`` (fp32 and bf16 alike), so the
term enters J exactly once.

Only an optimizer step's passes count: the forward-only log-prob passes neither add the
loss nor the statistics. Under activation recomputation a router's training forward runs
without a graph and its recomputation in the backward pass, when 1F1B may have run later
micro-batches' forwards: the forward hands its micro-batch to its recomputation, which
attaches the loss (``routing_replay.router_pass``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.algo.normalization import aux_loss_weight, sequence_balance_loss
from megatron_grpo.config import ModelConfig
from megatron_grpo.mcore import compat
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.routing_replay import router_order, router_pass
from megatron_grpo.mcore.wrappers import unwrap


class RouterBalance:
    """Hooks on this rank's routers: the balance loss and per-layer expert loads."""

    def __init__(self, model: list, cfg: ModelConfig, ctx: ParallelContext) -> None:
        assert cfg.num_experts is not None
        self.cfg, self.ctx = cfg, ctx
        self.weight = 0.0
        """v of ``aux_loss_weight`` for the global batch being trained."""
        self._seg: Tensor | None = None
        self._num_seqs = 0
        self.trains = False
        self._pending: dict[int, collections.deque[tuple[Tensor, int]]] = {}
        """Per layer, the micro-batches of checkpointed forwards, for their recomputation."""
        self.loss = torch.zeros((), dtype=torch.float64)
        self.loads = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64)
        compat.hook_routers(model, self._on_route)

    def set_batch(self, batch) -> None:
        """The micro-batch the next forward runs (``seg`` [B, S], ``num_samples``)."""
        self._seg, self._num_seqs = batch.seg, batch.num_samples

    @contextlib.contextmanager
    def training_step(self, num_sequences: int) -> Iterator[None]:
        """An optimizer step on a global batch of ``num_sequences`` sequences."""
        self.weight = aux_loss_weight(self.cfg.moe_aux_loss_coeff, num_sequences)
        self.loss.zero_()
        self.loads.zero_()
        self._pending.clear()
        self.trains = True
        try:
            yield
        finally:
            self.trains = False
            self._seg = None

    def _on_route(self, router, hidden: Tensor, probs: Tensor, routing_map: Tensor):
        """The router's balance loss attached to its ``probs`` (None: unchanged), in the
        forward that keeps its graph: a checkpointed forward leaves it to its recomputation,
        handing it its micro-batch (``router_pass``)."""
        layer = compat.router_layer(router)
        run = router_pass(self.trains)
        if run == "recompute":
            seg_BS, num_seqs = self._pending[layer].popleft()
        elif run == "checkpointed":
            assert self._seg is not None
            self._pending.setdefault(layer, collections.deque()).append((self._seg, self._num_seqs))
            return None
        elif run == "training" and self._seg is not None:
            seg_BS, num_seqs = self._seg, self._num_seqs
        else:
            return None
        return self._attach(layer, router, hidden, probs, routing_map, seg_BS, num_seqs)

    def _attach(self, layer, router, hidden, probs, routing_map, seg_BS: Tensor, num_seqs: int):
        seg = router_order(seg_BS.to(hidden.device), hidden.shape[0], self.ctx)
        live = seg >= 0
        routed = routing_map.new_zeros(num_seqs, routing_map.shape[1], dtype=torch.float32)
        routed.index_add_(0, seg[live], routing_map[live].float())
        if self.ctx.dims.uses_sequence_parallel:  # each TP rank routed a slice of each sequence
            dist.all_reduce(routed, group=self.ctx.tp_group)
        seq_len = torch.bincount(seg_BS[seg_BS >= 0], minlength=num_seqs)
        self.loads[layer - 1] += routing_map[live].sum(0).double().cpu()
        if not self.cfg.moe_aux_loss_coeff:
            return None
        logits = compat.router_logits(router, hidden).reshape(-1, routing_map.shape[1])
        scores = torch.softmax(logits.float(), dim=-1)
        loss = sequence_balance_loss(
            scores,
            seg,
            routed,
            seq_len.to(hidden.device),
            self.weight,
            topk=self.cfg.moe_router_topk,
        )
        self.loss += loss.detach().double().cpu()
        return compat.attach_aux_loss(probs, loss)

    def step_metrics(self) -> dict[str, float]:
        """The balance loss of the step (summed over layers) and the busiest expert's load
        relative to the mean, worst layer; the same on every rank. Collective (world)."""
        totals = torch.cat([self.loss.reshape(1), self.loads.reshape(-1)])
        if self.ctx.world_size > 1:
            from megatron_grpo.mcore.device import compute_device

            on_device = totals.to(compute_device())  # nccl reduces GPU tensors only
            dist.all_reduce(on_device)
            totals = on_device.cpu()
        loads = totals[1:].reshape(self.loads.shape)
        mean = loads.mean(dim=1).clamp(min=1e-30)
        return {
            "moe_aux_loss": float(totals[0]),
            "moe_max_load": float((loads.max(dim=1).values / mean).max()),
        }


def router_balance(model: list) -> RouterBalance | None:
    """The ``RouterBalance`` that ``mcore.model.build_model`` installed on a MoE model."""

    return getattr(unwrap(model[0]), "router_balance", None)
