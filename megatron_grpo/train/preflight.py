"""What can be checked before any worker starts, without building the model.

``megatron-grpo train`` first runs ``check_paths`` in its own process: ``train.init`` and
the tokenizer, on the file system only (a fraction of a second, nothing heavy imported).
With ``--nproc`` it then runs ``preflight`` in a short-lived process of its own before it
starts torchrun (so that the launcher, alive for the whole run, holds none of what it
imports), and each torchrun worker runs both again before its process group: the layout
against the world size and the model's heads, query groups and widths, context parallelism
against the layer spec (it needs Transformer Engine), the global batch
against DP, the tokenizer, a usable prompt in the data files (every prompt with
``data.overlong_prompts=error``), the reward function, the tool loop's tools (the
``python`` tool's box). A failure raises ValueError (or
FileNotFoundError) naming the config key; the command exits 2 with that one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from megatron_grpo.config import Config
from megatron_grpo.config.hf import query_groups
from megatron_grpo.config.init_model import describe_path, init_kind

TOKENIZER_KIND = "a Hugging Face tokenizer directory (with tokenizer.json or tokenizer_config.json)"

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub repository, ``namespace/name``: a path-like value of that form is
taken from the hub's local cache when it is there."""


def check_paths(cfg: Config) -> None:
    """``train.init`` and the tokenizer exist, as what they must be; a ValueError or
    FileNotFoundError names the key, the path as given, where it was looked for and what
    was expected. A path that looks local (``.``, ``/``, ``~``, a separator) and exists
    nowhere is refused here, never handed to the Hugging Face hub."""
    kind = init_kind(cfg.train.init) if cfg.train.init is not None else None
    if cfg.tokenizer is not None:
        check_tokenizer(cfg.tokenizer)
    elif kind != "hf":
        init = "not set" if kind is None else "a megatron checkpoint"
        raise ValueError(f"tokenizer is not set and train.init is {init}: give {TOKENIZER_KIND}")


def check_tokenizer(path: str) -> None:
    """A tokenizer directory, or a hub repository id, which ``transformers`` resolves."""
    if os.path.isdir(path):
        return
    where = f"tokenizer={describe_path(path)}"
    if os.path.exists(path):
        raise ValueError(f"{where} is a file: give {TOKENIZER_KIND}")
    if not (path.startswith((".", "/", "~")) or os.sep in path):
        return  # a hub id like gpt2
    if HUB_ID.fullmatch(path):
        import huggingface_hub.constants

        cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
        if (cache / f"models--{path.replace('/', '--')}").is_dir():
            return
        raise ValueError(
            f"{where} does not exist, nor is it in the Hugging Face cache ({cache}): give "
            f"{TOKENIZER_KIND}, or download the repository first"
        )
    raise ValueError(f"{where} does not exist: give {TOKENIZER_KIND}")


def check_layout(cfg: Config, world_size: int) -> int:
    """The data-parallel size of ``cfg`` on ``world_size`` processes; a ValueError names what
    does not divide (world size, layers, heads, query groups, FFN width) or a global batch
    smaller than DP."""
    m, dims = cfg.model, cfg.parallel
    dp = dims.data_parallel_size(world_size)
    dims.validate_model(
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=query_groups(m),
        num_experts=m.num_experts,
    )
    if m.ffn_hidden_size % dims.tp:
        raise ValueError(
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by TP={dims.tp}"
        )
    gbs = cfg.train.global_batch_size
    assert gbs is not None  # Config resolves its default
    if gbs < dp:
        raise ValueError(
            f"train.global_batch_size={gbs} is below DP={dp}: every DP rank needs a sample"
        )
    return dp


def preflight(cfg: Config, world_size: int) -> None:
    check_layout(cfg, world_size)
    check_packing(cfg)
    if cfg.rollout.replay_dir is not None:
        return
    from transformers import AutoTokenizer

    from megatron_grpo.data import PromptDataset
    from megatron_grpo.rewards import RewardScorer
    from megatron_grpo.train import sources

    path = sources.resolve_inputs(cfg).tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {path!r} does not load: {e}") from None
    # Every prompt when a long one refuses the run: it is refused now, not when it is drawn.
    first_only = cfg.data.overlong_prompts == "filter"
    try:
        PromptDataset(cfg.data, tokenizer, first_only=first_only)
    except ValueError as e:
        raise ValueError(f"data: {e}") from None
    from megatron_grpo.eval.runner import dataset_config

    for spec in cfg.eval.datasets:
        try:
            PromptDataset(dataset_config(cfg.data, spec), tokenizer, first_only=first_only)
        except ValueError as e:
            raise ValueError(f"eval.datasets[{spec.name}]: {e}") from None
    try:
        RewardScorer(cfg.reward, label_key=cfg.data.label_key)  # imports a custom function
    except ValueError as e:
        raise ValueError(f"reward.{cfg.reward.type}: {e}") from None
    check_tools(cfg)


def check_packing(cfg: Config) -> None:
    """Context parallelism and packed sequences where Transformer Engine runs need what its
    attention takes them in (here, not in the dry run: that plans for another machine)."""
    from megatron_grpo.mcore.layers import THD_DTYPES, check_spec, have_transformer_engine

    check_spec("auto", cfg.parallel.cp, cfg.model.params_dtype)
    packed = cfg.train.pack_sequences and have_transformer_engine()
    if packed and cfg.model.params_dtype not in THD_DTYPES:
        raise ValueError(
            "train.pack_sequences=true with Transformer Engine needs model.params_dtype=bfloat16: "
            "packed sequences run in its fused and flash attention (THD format), which take "
            f"16-bit inputs (got {cfg.model.params_dtype}); or leave pack_sequences unset"
        )


def check_tools(cfg: Config) -> None:
    """The tool loop's tools can be built here: user tools import, and the ``python`` tool's
    box can be made on this machine (isolation.py), or the run is refused naming why."""
    if cfg.rollout.hook != "tools":
        return
    from megatron_grpo.rollout.tools.registry import build_tools

    try:
        build_tools(cfg.rollout.tools)
    except ValueError as e:
        raise ValueError(f"rollout.tools: {e}") from None


def main(argv: list[str]) -> int:
    """``python -m megatron_grpo.train.preflight NPROC CONFIG``: ``preflight`` of a resolved
    config file for NPROC processes, what the ``--nproc`` launcher runs in a process of its
    own; exit 2 with one line when refused."""
    import sys

    from megatron_grpo.config import load_config
    from megatron_grpo.console import quiet_third_party_warnings

    quiet_third_party_warnings()  # its stderr is printed when it refuses
    try:
        preflight(load_config(argv[1]), int(argv[0]))
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-grpo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
