"""Hugging Face models written during training: when, and how the stages' files are named.

The writes from a live model at TP2 x PP2 (x EP2) are checked in
tests/distributed/test_convert*.py, and a run's against its export in tests/e2e/test_export.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_grpo.config import TrainConfig
from megatron_grpo.convert.hf_files import StreamingWriter
from megatron_grpo.train.save_hf import due, hf_dir, name_files


@pytest.mark.parametrize(
    ("interval", "steps"),
    [(None, []), (0, []), (3, [3, 6, 7]), (7, [7]), (1, [1, 2, 3, 4, 5, 6, 7])],
)
def test_models_are_written_every_interval_and_at_the_last_step(interval, steps):
    train = TrainConfig(total_steps=7, save_hf_interval=interval)
    assert [s for s in range(1, 8) if due(train, s)] == steps


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="train.save_hf_interval must be >= 0, got -1"):
        TrainConfig(save_hf_interval=-1)


def test_the_folder_is_named_as_the_steps_checkpoint(tmp_path):
    assert hf_dir(tmp_path, 40) == tmp_path / "hf" / "step_00000040"


def test_each_stage_fills_its_own_files_which_are_named_in_stage_order(tmp_path):
    stages = []
    for stage, names in enumerate([["a", "b", "c"], ["d"]]):
        writer = StreamingWriter(tmp_path, f"stage{stage:05d}", max_bytes=2048)
        for i, name in enumerate(names):
            writer.add({name: torch.full((256,), float(stage * 10 + i))})  # 1 KB each
        stages.append(writer.close())
    assert [len(files) for files in stages] == [2, 1]  # a and b, then c; d
    name_files(tmp_path, stages)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00001-of-00003.safetensors",
        "c": "model-00002-of-00003.safetensors",
        "d": "model-00003-of-00003.safetensors",
    }
    assert index["metadata"]["total_size"] == 4 * 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert load_file(tmp_path / "model-00003-of-00003.safetensors")["d"].eq(10).all()


def test_one_file_in_all_is_model_safetensors_without_an_index(tmp_path):
    writer = StreamingWriter(tmp_path, "stage00000", max_bytes=10**9)
    writer.add({"a": torch.ones(4), "b": torch.zeros(4)})
    name_files(tmp_path, [writer.close(), []])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert set(load_file(tmp_path / "model.safetensors")) == {"a", "b"}
