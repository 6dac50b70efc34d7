"""Mixture-of-experts routing replay (R3, R2) and the routers' agreement with the engine.

A router picks each token's top-k experts from its scores; the rollout engine's router,
in other kernels and often another dtype, can pick others for the same weights (about 10%
of the decisions at Qwen3-30B-A3B scale, Megatron-LM #4168), so the learner would train a
policy that did not make the data. Replay makes the learner's forward passes route each
token to given experts instead: the engine's (R3, ``MicroBatch.routes``) or those the
learner chose in the behaviour log-prob pass (R2, ``MicroBatch.learner_routes``,
recorded there). The gates stay the router's own: megatron-core gathers the router's
scores at the replayed experts, so the routers keep their gradient.

Each router gets a ``LayerReplay`` as its ``router_replay`` (``compat.set_router_replay``;
megatron-core calls it for the top-k), built here per router rather than through
megatron-core's class-level list. Before each micro-batch's forward (``set_batch``, from
the schedule's ``on_forward``) the replay learns which routes it holds; a router then
takes its layer's routes of this rank's tokens, in its own [S, B] order and, under
sequence parallelism, this TP rank's share of the sequence (``router_order``). A token
without routes (-1: padding, the last token of a sample, tool output added after the
engine's last turn) is routed by the learner's router.

Every training forward with the engine's routes also counts, per layer, the tokens whose
top-k set the learner's router would have chosen is the engine's (``step_metrics``:
``router_agreement`` and its worst layer), whether or not they are replayed.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.mcore import compat, device
from megatron_grpo.mcore.parallel import ParallelContext


def router_order(values_BS: Tensor, local_positions: int, ctx: ParallelContext, fill: int = -1):
    """``values_BS`` [B, S, ...] of the router tokens of this rank, in the router's [S, B]
    order flattened: the schedule pads S to a multiple of TP under sequence parallelism
    (with ``fill``), and each TP rank then routes its slice of the positions."""
    sp = ctx.dims.uses_sequence_parallel
    full = local_positions * (ctx.dims.tp if sp else 1)
    pad = full - values_BS.shape[1]
    if pad:
        widths = [0, 0] * (values_BS.ndim - 2) + [0, pad]
        values_BS = F.pad(values_BS, widths, value=fill)
    start = ctx.tp_rank * local_positions if sp else 0
    local = values_BS[:, start : start + local_positions].transpose(0, 1)
    return local.reshape(-1, *values_BS.shape[2:])


def router_pass(trains: bool) -> str:
    """Which pass runs a router now: ``recompute`` (activation recomputation in the backward
    pass), ``checkpointed`` (a training forward whose activations are dropped, under
    no_grad, to be recomputed), ``training`` (a training forward that keeps its graph) or
    ``inference`` (a forward-only log-prob pass). ``trains``: an optimizer step runs. The
    backward passes of a chunk's micro-batches run in the order of their forwards, so what
    a ``checkpointed`` forward saves in order its ``recompute`` takes in order."""
    if device.in_backward():
        return "recompute"
    if torch.is_grad_enabled():
        return "training"
    return "checkpointed" if trains else "inference"


class RoutingReplay:
    """The routers of one model (all its chunks): what they replay, what they record."""

    def __init__(
        self, model: list, mode: str, ctx: ParallelContext, num_layers: int, num_experts: int
    ) -> None:
        if mode not in ("off", "r2", "r3"):
            raise ValueError(f"routing replay mode must be off, r2 or r3, got {mode!r}")
        self.mode, self.ctx = mode, ctx
        self.num_experts = num_experts
        self._checked: set[int] = set()
        """The micro-batches whose routes were checked (by id)."""
        self.batch: Any = None
        self.records = False
        self.trains = False
        """An optimizer step's forwards run (not a forward-only log-prob pass)."""
        self.agree = torch.zeros(num_layers, dtype=torch.float64)
        """Per layer, the engine-routed tokens the forward sent to the engine's experts."""
        self.own = torch.zeros(num_layers, dtype=torch.float64)
        """Per layer, those the learner's routers would have sent there themselves."""
        self.total = torch.zeros(num_layers, dtype=torch.float64)
        self.layers: list[LayerReplay] = []

        def make(layer: int) -> LayerReplay:
            self.layers.append(LayerReplay(self, layer))
            return self.layers[-1]

        compat.set_router_replay(model, make)

    def set_batch(self, batch) -> None:
        """The micro-batch the next forward runs (``routes``, ``learner_routes``); the
        engine's routes are checked against the model the first time."""
        self.batch = batch
        routes = getattr(batch, "routes", None)
        if routes is not None and id(batch) not in self._checked:
            self._checked.add(id(batch))
            if routes.numel() and int(routes.max()) >= self.num_experts:
                raise ValueError(
                    f"the engine routed tokens to expert {int(routes.max())}: the model has "
                    f"model.num_experts={self.num_experts} (the engines serve another model?)"
                )
            if routes.shape[2] != len(self.total):
                raise ValueError(
                    f"the engine's routes cover {routes.shape[2]} layers, the model has "
                    f"model.num_layers={len(self.total)}"
                )

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        """An optimizer step's forward and backward passes: they count the agreement, and
        recomputed routers replay what their forward replayed."""
        for counts in (self.agree, self.own, self.total):
            counts.zero_()
        for layer in self.layers:
            layer.pending.clear()
        self.trains = True
        try:
            yield
        finally:
            self.trains = False
            self.batch = None
            self._checked.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """R2: the forwards inside record the routers' own choices in ``learner_routes``."""
        self.records = self.mode == "r2"
        try:
            yield
        finally:
            self.records = False

    def targets(self) -> Tensor | None:
        """[B, S, L, K] what the forward being run replays; None: the routers choose."""
        batch = self.batch
        if batch is None or self.records:
            return None
        if self.mode == "r3":
            return batch.routes
        if self.mode == "r2":
            return batch.learner_routes
        return None

    def record(self, layer: int, chosen: Tensor) -> None:
        """R2: this router's choices [S_local B, K] into the micro-batch's ``learner_routes``."""
        batch = self.batch
        B, S = batch.tokens.shape
        K = chosen.shape[1]
        if batch.learner_routes is None:
            num_layers = len(self.total)
            batch.learner_routes = torch.full(
                (B, S, num_layers, K), -1, dtype=torch.int16, device=chosen.device
            )
        positions = chosen.shape[0] // B
        sp = self.ctx.dims.uses_sequence_parallel
        start = self.ctx.tp_rank * positions if sp else 0
        stop = min(start + positions, S)
        if stop > start:
            view = chosen.view(positions, B, K).transpose(0, 1)[:, : stop - start]
            batch.learner_routes[:, start:stop, layer - 1] = view.to(torch.int16)

    def count(self, layer: int, used: Tensor, own: Tensor, engine: Tensor) -> None:
        """Token-layer agreement over the rows the engine routed (>= 0): those whose top-k
        set in the forward (``used``) and that of the learner's routers (``own``) equal the
        engine's."""
        routed = (engine >= 0).all(dim=1)
        engine_set = engine.sort(dim=1).values
        for counts, chosen in ((self.agree, used), (self.own, own)):
            same = (chosen.sort(dim=1).values == engine_set).all(dim=1)
            counts[layer - 1] += float((same & routed).sum())
        self.total[layer - 1] += float(routed.sum())

    def step_metrics(self) -> dict[str, float | None]:
        """Of the token-layer top-k sets the engine chose: the fraction the forward passes
        used (over all layers and in the worst layer; 1 under R3) and the fraction the
        learner's routers chose themselves (replay or not); none without the engine's
        routes. Collective (world)."""
        totals = torch.cat([self.agree, self.own, self.total])
        if self.ctx.world_size > 1:
            from megatron_grpo.mcore.device import compute_device

            on_device = totals.to(compute_device())  # nccl reduces GPU tensors only
            dist.all_reduce(on_device)
            totals = on_device.cpu()
        agree, own, total = totals.chunk(3)
        names = ("router_agreement", "router_agreement_min_layer", "router_agreement_own")
        if not float(total.sum()):
            return {}
        measured = total > 0
        figures = (
            agree.sum() / total.sum(),
            (agree[measured] / total[measured]).min(),
            own.sum() / total.sum(),
        )
        return {name: float(x) for name, x in zip(names, figures)}


class LayerReplay:
    """One router's replay: megatron-core's ``router_replay`` interface for its top-k."""

    def __init__(self, replay: RoutingReplay, layer: int) -> None:
        self.replay, self.layer = replay, layer
        self.pending: collections.deque[Tensor | None] = collections.deque()
        """What each training forward replayed, in order, for its recomputation: the
        backward passes of a chunk's micro-batches run in the order of their forwards."""

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        """(values, indices) of the top-k: the router's own choice, or the replayed experts'
        scores where the micro-batch has routes for the token."""
        assert default_compute_topk is not None
        values, chosen = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        run = router_pass(self.replay.trains)
        if run == "recompute":
            return self._apply(scores, values, chosen, self.pending.popleft())
        wanted = self._wanted(chosen, topk)
        if run == "checkpointed":
            self.pending.append(wanted)
        values, indices = self._apply(scores, values, chosen, wanted)
        self._count(chosen, indices)
        return values, indices

    @staticmethod
    def _apply(scores: Tensor, values: Tensor, chosen: Tensor, wanted: Tensor | None):
        if wanted is None:
            return values, chosen
        given = (wanted >= 0).all(dim=1, keepdim=True)
        indices = torch.where(given, wanted, chosen)
        return scores.gather(1, indices), indices

    def _local(self, routes_BSLK: Tensor, positions: int) -> Tensor:
        """This router's layer of ``routes_BSLK`` for its tokens, in its order."""
        return router_order(routes_BSLK[:, :, self.layer - 1], positions, self.replay.ctx).long()

    def _wanted(self, chosen: Tensor, topk: int) -> Tensor | None:
        """[S_local B, K] the experts this forward replays (-1 rows: the router's own), or
        None; records them on the way (R2)."""
        replay = self.replay
        if replay.batch is None:
            return None
        if replay.records:
            replay.record(self.layer, chosen)
            return None
        for routes in (replay.batch.routes, replay.targets()):
            if routes is not None and routes.shape[-1] != topk:
                raise ValueError(
                    f"layer {self.layer} replays {routes.shape[-1]} experts a token, the "
                    f"router picks model.moe_router_topk={topk}"
                )
        targets = replay.targets()
        if targets is None:
            return None
        return self._local(targets, chosen.shape[0] // replay.batch.tokens.shape[0])

    def _count(self, own: Tensor, used: Tensor) -> None:
        """The agreement with the engine's routes, in a training forward that has them."""
        replay = self.replay
        batch = replay.batch
        if batch is None or batch.routes is None or not replay.trains or replay.records:
            return
        engine = self._local(batch.routes, own.shape[0] // batch.tokens.shape[0])
        replay.count(self.layer, used, own, engine)


def routing_replay(model: list) -> RoutingReplay | None:
    """The ``RoutingReplay`` that ``mcore.model.build_model`` installed on a MoE model."""
    from megatron_grpo.mcore.wrappers import unwrap

    return getattr(unwrap(model[0]), "routing_replay", None)
