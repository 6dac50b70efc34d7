"""Where a run's weights and tokenizer come from, and loading its initial weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.config import Config, ModelConfig
from megatron_grpo.config.init_model import InitKind, init_kind
from megatron_grpo.mcore import checkpoint
from megatron_grpo.mcore.parallel import ParallelContext


@dataclass(frozen=True)
class RunInputs:
    """Where a run's weights and tokenizer come from: resolved once, at the top of
    ``train()``, and handed to what needs them."""

    init: str | None
    """``train.init``; None: random initial weights."""
    init_kind: InitKind | None
    """What ``init`` is: a Hugging Face model directory or a megatron checkpoint."""
    tokenizer: str
    """The tokenizer's directory: ``tokenizer``, else a Hugging Face ``train.init``."""
    model_path: str | None
    """What ``{model}`` means in rollout.engines.launch_command: the HF directory of
    train.init, else the tokenizer's (servers launched from it should load weights as
    ``--load-format dummy``: the trainer pushes the policy's before the first rollout)."""


def resolve_inputs(cfg: Config) -> RunInputs:
    """``cfg``'s run inputs; a ValueError when no tokenizer can be found."""
    kind = init_kind(cfg.train.init) if cfg.train.init is not None else None
    hf_init = cfg.train.init if kind == "hf" else None
    tokenizer = cfg.tokenizer or hf_init
    if tokenizer is None:
        raise ValueError(
            "set tokenizer: a Hugging Face tokenizer directory (train.init is not one)"
        )
    return RunInputs(
        init=cfg.train.init, init_kind=kind, tokenizer=tokenizer, model_path=hf_init or tokenizer
    )


def load_initial_weights(
    model: list, inputs: RunInputs, model_cfg: ModelConfig, ctx: ParallelContext
) -> None:
    """Load the run's initial weights into the model chunks (random init stays without)."""
    if inputs.init is None:
        return
    if inputs.init_kind == "megatron":
        checkpoint.load_model(model, inputs.init)
        return
    import transformers

    from megatron_grpo.config.hf import check_hf_config
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state

    check_hf_config(transformers.AutoConfig.from_pretrained(inputs.init), model_cfg)
    with torch.no_grad():
        view = MegatronView(HFCheckpoint(inputs.init), model_cfg)
        load_full_state(model, view, model_cfg, ctx)
