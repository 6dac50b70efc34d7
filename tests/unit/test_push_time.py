"""The dry run's push-time model (``commands.push_time``): tensors and bytes per stage against
Hugging Face models, the predicted time by hand, against the CPU push measured by
``bench/weight_sync.py --sizes``, and the dry run's ``weight push`` lines."""

from __future__ import annotations

import pytest

from megatron_grpo import cli
from megatron_grpo.commands import push_time
from megatron_grpo.commands.push_time import (
    Link,
    calibration_model,
    predict_push,
    stage_hf_tensors,
    transport,
)
from megatron_grpo.config import ParallelDims, load_config
from megatron_grpo.config.hf import model_config_from_hf
from megatron_grpo.testing import random_hf_model, tiny_hf_config

# The CPU demo's model with q/k/v biases: h=64, f=128, 4 heads of 16, 2 groups, 15 tokens.
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.vocab_size=15",
    "model.make_vocab_size_divisible_by=1",
    "model.add_qkv_bias=true",
]
# One layer under HF names: q 64x64, k and v 32x64 each, o 64x64 (12288), their three biases
# (128), two norms (128), gate, up and down 64x128 each (24576): 37120 in 12 tensors.
TINY_LAYER = 37120
EMBEDDING = 15 * 64


@pytest.mark.parametrize(
    ("family", "tied"), [("qwen2", True), ("qwen3", False), ("qwen3_moe", False)]
)
def test_stage_tensors_and_bytes_are_the_hugging_face_models(family, tied):
    hf_config = tiny_hf_config(family, tied=tied)
    named = random_hf_model(hf_config).state_dict()
    if tied:  # one tensor in the model, one sent (the embedding)
        named.pop("lm_head.weight")
    m = model_config_from_hf(hf_config)
    num_tensors = len(named)
    if m.num_experts is not None:  # transformers fuses each layer's experts into 2 tensors;
        # the push sends them as saved, 3 per expert (convert.experts)
        num_tensors += m.num_layers * (3 * m.num_experts - 2)
    assert stage_hf_tensors(m, ParallelDims()) == [
        (num_tensors, sum(t.numel() * 4 for t in named.values()))
    ]


def test_stage_tensors_by_hand_at_pp2():
    m = load_config(None, TINY).model
    # stage 0: layer 0 and the embedding; stage 1: layer 1, the final norm and the output layer
    assert stage_hf_tensors(m, ParallelDims(tp=2, pp=2)) == [
        (13, 4 * (TINY_LAYER + EMBEDDING)),
        (14, 4 * (TINY_LAYER + 64 + EMBEDDING)),
    ]


def test_transports():
    assert transport("tensor", "embedded", across_nodes=False) == push_time.Transport(
        "shared memory", "host_memory", per_engine=False
    )
    assert transport("tensor", "embedded", across_nodes=True).per_engine
    assert transport("tensor", "sglang", across_nodes=False) == push_time.Transport(
        "CUDA IPC", "nvlink", per_engine=True
    )
    assert transport("distributed", "sglang", across_nodes=False).link == "nvlink"
    assert transport("distributed", "sglang", across_nodes=True).link == "infiniband"
    assert transport("disk", "sglang", across_nodes=True).link == "disk"


@pytest.fixture
def round_constants(monkeypatch):
    """Round bandwidths and costs, so that the sums below can be done by hand."""
    links = {
        "host_memory": Link("host memory", 1e8, "test"),
        "nvlink": Link("NVLink", 1e9, "test"),
    }
    monkeypatch.setattr(push_time, "LINKS", links)
    monkeypatch.setattr(push_time, "BUCKET_S", {"host_memory": 1e-3})
    monkeypatch.setattr(push_time, "TENSOR_S", {"host_memory": 1e-4})
    monkeypatch.setattr(push_time, "DELTA_SENT_FRACTION", {"bfloat16": 0.5})
    monkeypatch.setattr(push_time, "DELTA_CODEC_BYTES_PER_S", 1e8)


def test_shared_memory_push_by_hand(round_constants):
    m = load_config(None, TINY).model
    p = predict_push(m, ParallelDims(pp=2), method="tensor", bucket_mb=1, engine_type="embedded")
    assert p.stage_bytes == (152320, 152576) and p.stage_buckets == (1, 1)
    # bytes / 1e8 + a bucket's 1 ms + 13 or 14 tensors' 0.1 ms
    assert p.stage_seconds == pytest.approx((0.0015232 + 0.001 + 0.0013, 0.00152576 + 0.0024))
    assert p.engine_seconds == pytest.approx(0.00304896)  # both stages' bytes into the engine
    assert p.seconds == pytest.approx(0.00392576)  # the slowest stage


def test_cuda_ipc_sends_a_copy_per_engine_by_hand(round_constants):
    m = load_config(None, TINY).model
    p = predict_push(m, ParallelDims(pp=2), method="tensor", bucket_mb=1, num_engines=4)
    assert p.stage_seconds == pytest.approx((4 * 152320 / 1e9, 4 * 152576 / 1e9))
    assert p.seconds == pytest.approx(0.000610304)


def test_delta_sends_a_fraction_and_pays_the_codec_by_hand(round_constants):
    m = load_config(None, [*TINY, "model.params_dtype=bfloat16"]).model
    p = predict_push(
        m, ParallelDims(), method="tensor", bucket_mb=1, delta=True, engine_type="embedded"
    )
    # 152448 bytes (2 layers, embedding, norm, output layer in bf16), half of them sent
    assert p.stage_bytes == (76224,)
    # sent / 1e8 + every byte through the codec at 1e8 + a bucket + 27 tensors
    assert p.seconds == pytest.approx(0.00076224 + 0.00152448 + 0.001 + 0.0027)
    assert p.engine_seconds == pytest.approx(0.00076224 + 0.00152448)


def test_buckets_of_a_stage_by_hand():
    m = calibration_model("default")
    p = predict_push(m, ParallelDims(), method="tensor", bucket_mb=64, engine_type="embedded")
    assert p.stage_bytes == (648_093_696,)
    assert p.stage_buckets == (10,)  # 648093696 / 67108864 = 9.66


# bench/weight_sync.py --sizes: one stage to the embedded server in its own process through
# shared memory, 64 MiB buckets, fp32, 2 shared cores of an AMD EPYC; wall medians of 5
# pushes (the run that the constants were not taken from).
MEASURED_S = {"small": 0.054, "mid": 0.142, "default": 0.795}


@pytest.mark.parametrize("size", sorted(MEASURED_S))
def test_prediction_is_within_30_percent_of_the_measured_cpu_push(size):
    p = predict_push(
        calibration_model(size),
        ParallelDims(),
        method="tensor",
        bucket_mb=64,
        engine_type="embedded",
    )
    assert 0.7 <= MEASURED_S[size] / p.seconds <= 1.3


def test_dry_run_prints_a_weight_push_line_per_method(capsys):
    urls = '["http://10.0.0.2:30000","http://10.0.0.3:30000"]'
    sets = [
        *TINY,
        "rollout.engines.type=sglang",
        f"rollout.engines.urls={urls}",
        "rollout.sync.method=distributed",
    ]
    assert cli.main(["train", *[f"--set={s}" for s in sets], "--dry-run", "--world-size", "1"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("weight push, ")]
    assert [x.split(":")[0] for x in lines[1:]] == [
        "weight push, tensor",
        "weight push, disk",
        "weight push, distributed (rollout.sync.method)",
    ]
    m = load_config(None, TINY).model
    ib = predict_push(
        m, ParallelDims(), method="distributed", bucket_mb=512, num_engines=2, across_nodes=True
    )
    assert lines[-1] == (
        "weight push, distributed (rollout.sync.method): 297.8 KiB from the largest of 1 "
        "stage(s), 297.8 KiB into each of 2 engine(s); 1 bucket(s) of 512 MiB; NCCL broadcast "
        f"over InfiniBand NDR at 50 GB/s: predicted {ib.seconds:.3g} s"
    )


def test_dry_run_prices_a_delta_to_the_embedded_engine_only(capsys):
    sets = [*TINY, "rollout.sync.delta=true"]
    assert cli.main(["train", *[f"--set={s}" for s in sets], "--dry-run", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    tensor = next(x for x in out.splitlines() if x.startswith("weight push, tensor"))
    # 304896 bytes x 0.82 (fp32) = 250015 bytes, 244.2 KiB
    assert tensor.startswith(
        "weight push, tensor (rollout.sync.method): 244.2 KiB (rollout.sync.delta) from the "
    )
    assert "shared memory over host memory" in tensor
