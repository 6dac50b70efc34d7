"""Building the pieces of a run from its config: weights, tokenizer, engines, data."""

from __future__ import annotations

import torch

from megatron_grpo.config import Config
from megatron_grpo.config.init_model import init_kind
from megatron_grpo.mcore import checkpoint
from megatron_grpo.mcore.parallel import ParallelContext


def load_initial_weights(model: list, cfg: Config, ctx: ParallelContext) -> None:
    """Load train.init into the model chunks (random init stays when it is None)."""
    if cfg.train.init is None:
        return
    kind = init_kind(cfg.train.init)
    if kind == "megatron":
        checkpoint.load_model(model, cfg.train.init)
        return
    import transformers

    from megatron_grpo.config.hf import check_hf_config
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state

    check_hf_config(transformers.AutoConfig.from_pretrained(cfg.train.init), cfg.model)
    with torch.no_grad():
        view = MegatronView(HFCheckpoint(cfg.train.init), cfg.model)
        load_full_state(model, view, cfg.model, ctx)


def _hf_init(cfg: Config) -> str | None:
    """train.init when it is a Hugging Face directory."""
    if cfg.train.init is not None and init_kind(cfg.train.init) == "hf":
        return cfg.train.init
    return None


def tokenizer_path(cfg: Config) -> str:
    path = cfg.tokenizer or _hf_init(cfg)
    if path is not None:
        return path
    raise ValueError("set tokenizer: a Hugging Face tokenizer directory (train.init is not one)")


def hf_model_path(cfg: Config) -> str | None:
    """What ``{model}`` means in rollout.engines.launch_command: the HF directory of
    train.init, else the tokenizer's (servers launched from it should load weights as
    ``--load-format dummy``: the trainer pushes the policy's before the first rollout)."""
    return _hf_init(cfg) or cfg.tokenizer
