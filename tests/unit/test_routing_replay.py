"""Routing replay's pure parts: routes through samples and micro-batches, the router's
token order, the replayed top-k and the agreement counts, and the config's refusals."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.algo.batch import Sample, SampleColumns, collate, collate_thd
from megatron_grpo.config import Config, ModelConfig, ParallelDims, RolloutConfig, TrainConfig
from megatron_grpo.mcore.routing_replay import LayerReplay, RoutingReplay, router_order

L, K = 2, 2


def _sample(sample_id: int, n: int) -> Sample:
    tokens = torch.arange(1, n + 1)
    routes = (torch.arange(n * L * K).view(n, L, K) + 100 * sample_id).to(torch.int16)
    routes[-1] = -1
    mask = torch.tensor([0.0] + [1.0] * (n - 1))
    return Sample(tokens, mask, 1.0, 0, sample_id, routes=routes)


def test_routes_must_have_a_row_per_token():
    with pytest.raises(ValueError, match=r"routes must be \[tokens, layers, top-k\]"):
        Sample(torch.arange(3), torch.zeros(3), 0.0, 0, 0, routes=torch.zeros(2, L, K))


def test_collate_places_routes_unshifted_with_minus_one_padding():
    a, b = _sample(0, 3), _sample(1, 2)
    mb = collate([[a], [b]], num_groups=1)
    assert mb.routes is not None and mb.routes.shape == (2, 3, L, K)
    assert torch.equal(mb.routes[0], a.routes)  # position t holds token t's routes
    assert torch.equal(mb.routes[1, :2], b.routes)
    assert bool((mb.routes[1, 2] == -1).all())
    packed = collate([[a, b]], num_groups=1, pad_to_multiple=2)
    assert torch.equal(packed.routes[0, :5], torch.cat([a.routes, b.routes]))
    assert bool((packed.routes[0, 5:] == -1).all())


def test_collate_thd_pads_each_sample():
    a, b = _sample(0, 3), _sample(1, 2)
    mb = collate_thd([a, b], num_groups=1, pad_to_multiple=4)
    assert mb.routes.shape == (1, 8, L, K)
    assert torch.equal(mb.routes[0, :3], a.routes) and torch.equal(mb.routes[0, 4:6], b.routes)
    assert bool((mb.routes[0, 3] == -1).all()) and bool((mb.routes[0, 6:] == -1).all())


def test_samples_without_routes_collate_without():
    plain = Sample(torch.arange(3), torch.tensor([0.0, 1, 1]), 1.0, 0, 0)
    assert collate([[plain], [_sample(1, 3)]], num_groups=1).routes is None


def test_columns_carry_routes_through_pickle():
    samples = [_sample(0, 3), _sample(1, 4)]
    back = pickle.loads(pickle.dumps(SampleColumns.of(samples))).samples()
    assert [torch.equal(x.routes, y.routes) for x, y in zip(back, samples)] == [True, True]
    assert back[0].routes.dtype == torch.int16
    with pytest.raises(ValueError, match="with and without routes"):
        SampleColumns.of([samples[0], Sample(torch.arange(3), torch.zeros(3), 0.0, 0, 2)])


def _ctx(tp: int = 1, tp_rank: int = 0, sp: bool = False):
    return SimpleNamespace(
        dims=ParallelDims(tp=tp, sequence_parallel=sp), tp_rank=tp_rank, world_size=1
    )


def test_router_order_is_sequence_major_and_sliced_under_sequence_parallelism():
    values = torch.tensor([[0, 1, 2], [10, 11, 12]])  # [B=2, S=3]
    assert router_order(values, 3, _ctx()).tolist() == [0, 10, 1, 11, 2, 12]
    # TP 2 with SP: S padded to 4, rank 1 routes positions 2 and 3
    assert router_order(values, 2, _ctx(2, 1, sp=True)).tolist() == [2, 12, -1, -1]
    assert router_order(values, 2, _ctx(2, 0, sp=True)).tolist() == [0, 10, 1, 11]


def _replay(mode: str, routes=None, recording: bool = False):
    replay = object.__new__(RoutingReplay)
    replay.mode, replay.ctx = mode, _ctx()
    replay.num_experts, replay._checked = 4, set()
    replay.records = recording
    replay.trains = not recording
    replay.layers = []
    replay.agree, replay.own, replay.total = (torch.zeros(L, dtype=torch.float64) for _ in range(3))
    tokens = torch.zeros(1, 3, dtype=torch.long)
    replay.set_batch(SimpleNamespace(tokens=tokens, routes=routes, learner_routes=None))
    return replay


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


SCORES = torch.tensor([[5.0, 4.0, 1.0, 0.0], [0.0, 1.0, 4.0, 5.0], [1.0, 5.0, 4.0, 0.0]])
"""Three tokens' scores over 4 experts: the router's own top-2 are {0,1}, {3,2}, {1,2}."""


def test_r3_replays_given_rows_and_routes_the_rest_itself():
    engine = torch.tensor([[[[2, 3], [0, 0]], [[3, 2], [0, 0]], [[-1, -1], [0, 0]]]])  # [1,3,L,K]
    layer = LayerReplay(_replay("r3", engine.to(torch.int16)), layer=1)
    with torch.enable_grad():
        values, indices = layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    assert indices.tolist() == [[2, 3], [3, 2], [1, 2]]
    assert values.tolist() == [[1.0, 0.0], [5.0, 4.0], [5.0, 4.0]]  # the router's own scores
    # the routers' own choice: token 0 differs, token 1 agrees (as a set); token 2 has no
    # engine route; the forward used the engine's for both
    replay = layer.replay
    assert replay.own.tolist() == [1.0, 0.0] and replay.total.tolist() == [2.0, 0.0]
    assert replay.agree.tolist() == [2.0, 0.0]
    assert replay.step_metrics() == {
        "router_agreement": 1.0,
        "router_agreement_min_layer": 1.0,
        "router_agreement_own": 0.5,
    }


def test_off_measures_agreement_without_replaying():
    engine = torch.tensor([[[[0, 1]] * L, [[0, 1]] * L, [[1, 2]] * L]], dtype=torch.int16)
    layer = LayerReplay(_replay("off", engine), layer=2)
    with torch.enable_grad():
        _, indices = layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    assert indices.tolist() == [[0, 1], [3, 2], [1, 2]]
    assert layer.replay.agree.tolist() == [0.0, 2.0] and layer.replay.total.tolist() == [0.0, 3.0]
    assert layer.replay.own.tolist() == [0.0, 2.0]  # without replay the same


def test_r2_records_the_routers_choice_then_replays_it():
    replay = _replay("r2", recording=True)
    LayerReplay(replay, layer=2).get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    recorded = replay.batch.learner_routes
    assert recorded.shape == (1, 3, L, 2) and bool((recorded[:, :, 0] == -1).all())
    assert recorded[0, :, 1].tolist() == [[0, 1], [3, 2], [1, 2]]
    replay.records = False
    moved = SCORES.flip(1)  # the routers would now choose others
    _, indices = LayerReplay(replay, layer=2).get_replay_topk(moved, 2, default_compute_topk=_topk)
    assert indices.tolist() == [[0, 1], [3, 2], [1, 2]]


def test_a_replayed_top_k_of_another_size_is_refused():
    engine = torch.zeros(1, 3, L, 3, dtype=torch.int16)
    layer = LayerReplay(_replay("r3", engine), layer=1)
    with pytest.raises(ValueError, match="replays 3 experts a token.*moe_router_topk=2"):
        layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)


MOE = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    vocab_size=100,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
)


def test_config_refuses_replay_of_a_dense_model():
    with pytest.raises(ValueError, match="routing_replay=r3 needs a mixture-of-experts model"):
        Config(train=TrainConfig(routing_replay="r3"))
    with pytest.raises(ValueError, match="must be off, r2 or r3"):
        TrainConfig(routing_replay="r4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="r3 replays the engines' routes"):
        Config(
            model=MOE,
            train=TrainConfig(routing_replay="r3"),
            rollout=RolloutConfig(return_routed_experts=False),
        )
    cfg = Config(model=MOE, train=TrainConfig(routing_replay="r3", recompute_granularity="full"))
    assert cfg.rollout.return_routed_experts is True
    assert Config(model=MOE).rollout.return_routed_experts is False


def test_recomputed_routers_replay_what_their_forward_replayed(monkeypatch):
    """Activation recomputation reruns a router in the backward pass, when the schedule may
    have run later micro-batches' forwards (1F1B): it replays its own forward's routes."""
    import megatron_grpo.mcore.routing_replay as module

    first = torch.tensor([[[[2, 3]] * L] * 3], dtype=torch.int16)
    second = torch.tensor([[[[0, 3]] * L] * 3], dtype=torch.int16)
    replay = _replay("r3", first)
    layer = LayerReplay(replay, layer=1)
    with torch.no_grad():  # checkpointed training forwards: no graph kept
        layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
        replay.set_batch(SimpleNamespace(tokens=replay.batch.tokens, routes=second))
        layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    monkeypatch.setattr(module.device, "in_backward", lambda: True)
    _, again = layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    assert again.tolist() == [[2, 3]] * 3  # the first micro-batch's, though the second ran last
    _, again = layer.get_replay_topk(SCORES, 2, default_compute_topk=_topk)
    assert again.tolist() == [[0, 3]] * 3
    assert not layer.pending


def test_routes_of_another_model_are_refused_by_name():
    replay = _replay("r3")
    tokens = torch.zeros(1, 3, dtype=torch.long)
    other = torch.full((1, 3, L, K), 7, dtype=torch.int16)
    with pytest.raises(ValueError, match="expert 7: the model has model.num_experts=4"):
        replay.set_batch(SimpleNamespace(tokens=tokens, routes=other))
    deeper = torch.zeros(1, 3, L + 1, K, dtype=torch.int16)
    with pytest.raises(ValueError, match="routes cover 3 layers, the model has"):
        replay.set_batch(SimpleNamespace(tokens=tokens, routes=deeper))
