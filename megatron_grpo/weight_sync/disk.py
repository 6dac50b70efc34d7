"""``rollout.sync.method=disk``: each stage writes its buckets as safetensors files into the
push's directory; the main rank then makes it a Hugging Face checkpoint (``write_disk_index``)
which the engines load with one ``/update_weights_from_disk``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import Tensor

from megatron_grpo.config import ModelConfig
from megatron_grpo.weight_sync.plan import StageReport, SyncPlan


def disk_method(plan: SyncPlan, report: StageReport, stage: int) -> tuple[Callable, Callable]:
    """``(prepare, deliver)`` for stage ``stage``: ``prepare`` writes a bucket's file,
    ``deliver`` records in ``report`` which weights it holds."""
    from megatron_grpo.embedded.weights import serialize_named_tensors

    assert plan.disk_dir is not None
    directory = Path(plan.disk_dir)
    count = iter(range(1 << 30))

    def prepare(bucket: dict[str, Tensor]) -> tuple[str, list[str]]:
        name = f"model-stage{stage:03d}-{next(count):05d}.safetensors"
        (directory / name).write_bytes(serialize_named_tensors(bucket))
        return name, list(bucket)

    async def deliver(written: tuple[str, list[str]]) -> None:
        report.files[written[0]] = written[1]

    return prepare, deliver


def write_disk_index(
    path: str | Path, reports: Sequence[StageReport], cfg: ModelConfig, family: str
) -> None:
    """``config.json`` and the safetensors index for the files the stages wrote in ``path``."""
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    path = Path(path)
    hf_config_from_model_config(cfg, family).save_pretrained(path)
    weight_map = {name: file for r in reports for file, names in r.files.items() for name in names}
    index = {"metadata": {"total_size": sum(r.nbytes for r in reports)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
