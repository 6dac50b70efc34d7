"""The SGLang-API engines of a rollout config, as a ``ServerGroup``: servers started from
``launch_command``, servers attached to at ``urls``, or embedded servers in processes of
their own (``rollout.engines.embedded_server: process``)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass

from megatron_grpo.config import EnginesConfig, ModelConfig, RolloutConfig
from megatron_grpo.rollout.client_config import api_key_from_env
from megatron_grpo.rollout.servers import (
    LaunchConfig,
    ServerGroup,
    attach_servers,
    launch_servers,
)

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""SGLang's server flag without which a request's ``return_routed_experts`` is refused."""
GIB = 2**30
ENGINE_WEIGHT_BYTES = 2
"""An engine's weights per parameter: bf16 (the recipes launch SGLang with ``--dtype
bfloat16``)."""


@dataclass(frozen=True)
class ColocatedEngines:
    """Engines launched on the learner's GPUs of this node (``rollout.placement:
    colocated``): ``num_engines`` of ``tp`` GPUs each."""

    num_engines: int
    tp: int
    mem_fraction_static: float

    def flags(self) -> list[tuple[str, str | None]]:
        """SGLang's server flags for it: the memory saver (without which
        ``/release_memory_occupation`` frees nothing), the share of the GPU, the GPUs."""
        return [
            ("--enable-memory-saver", None),
            ("--mem-fraction-static", f"{self.mem_fraction_static:g}"),
            ("--tp-size", str(self.tp)),
            ("--base-gpu-id", "{base_gpu_id}"),
        ]


def engine_weight_bytes(num_params: int) -> int:
    """bf16 weights of the whole model: what an engine's TP ranks share."""
    return num_params * ENGINE_WEIGHT_BYTES


def default_engine_tp(weight_bytes: float, gpus_per_node: int, pool_bytes: float) -> int:
    """``rollout.colocate.engine_tp: null``: the smallest power of two dividing
    ``gpus_per_node`` whose weight shard (``weight_bytes / tp``) takes at most half of an
    engine's static pool (``mem_fraction_static`` x the GPU's memory), leaving the other half
    at least for the KV cache. ValueError when even the largest such TP leaves too little."""
    tp = 1
    candidates = []
    while tp <= gpus_per_node:
        if gpus_per_node % tp == 0:
            candidates.append(tp)
            if weight_bytes / tp <= pool_bytes / 2:
                return tp
        tp *= 2
    widest = candidates[-1]
    raise ValueError(
        f"rollout.colocate: the engine does not fit: at engine TP {widest} (the most that "
        f"divides {gpus_per_node} GPUs per node) its weight shard is "
        f"{weight_bytes / widest / GIB:.1f} GiB, more than half of its static pool "
        f"({pool_bytes / GIB:.1f} GiB: rollout.colocate.mem_fraction_static x the GPU's "
        "memory). Raise rollout.colocate.mem_fraction_static, or place the engines on GPUs "
        "of their own (rollout.placement: disaggregated)"
    )


def check_engine_tp(tp: int, weight_bytes: float, gpus_per_node: int, pool_bytes: float) -> None:
    """A configured ``rollout.colocate.engine_tp``: it must divide the node's GPUs, and its
    weight shard must leave room for a KV cache in the static pool."""
    if gpus_per_node % tp:
        raise ValueError(
            f"rollout.colocate.engine_tp={tp} does not divide the {gpus_per_node} GPUs per node"
        )
    if weight_bytes / tp >= pool_bytes:
        raise ValueError(
            f"rollout.colocate: the engine does not fit: at engine_tp={tp} its weight shard is "
            f"{weight_bytes / tp / GIB:.1f} GiB, all of its static pool "
            f"({pool_bytes / GIB:.1f} GiB) and more, leaving no KV cache. Raise "
            "rollout.colocate.engine_tp or rollout.colocate.mem_fraction_static"
        )


def colocated_engines(cfg: RolloutConfig, model_cfg: ModelConfig) -> ColocatedEngines:
    """The engines to launch on this node's GPUs: ``rollout.colocate.engine_tp`` (or its
    default for this GPU's memory, ``default_engine_tp``) GPUs each."""
    import torch

    from megatron_grpo.config.param_count import total_params

    if not torch.cuda.is_available():
        raise ValueError(
            "rollout.placement: colocated with launched SGLang engines needs the node's GPUs "
            "(none is visible here); on a CPU machine use rollout.engines.type: embedded"
        )
    colocate = cfg.colocate
    gpus = torch.cuda.device_count()
    pool = colocate.mem_fraction_static * torch.cuda.get_device_properties(0).total_memory
    weights = engine_weight_bytes(total_params(model_cfg))
    if colocate.engine_tp is None:
        tp = default_engine_tp(weights, gpus, pool)
    else:
        tp = colocate.engine_tp
        check_engine_tp(tp, weights, gpus, pool)
    return ColocatedEngines(
        num_engines=gpus // tp, tp=tp, mem_fraction_static=colocate.mem_fraction_static
    )


def with_flags(command: str, flags: list[tuple[str, str | None]]) -> str:
    """``command`` with each of ``flags`` appended unless the command has it already."""
    words = command.split()
    for flag, value in flags:
        if flag not in words and not any(w.startswith(f"{flag}=") for w in words):
            command += f" {flag}" if value is None else f" {flag} {value}"
    return command


def start_or_attach(
    cfg: EnginesConfig,
    model_path: str | None,
    *,
    routed_experts: bool = False,
    colocated: ColocatedEngines | None = None,
) -> ServerGroup:
    """The SGLang servers of ``cfg``: started from ``launch_command`` (with
    ``ROUTED_EXPERTS_FLAG`` added for ``routed_experts``, and ``colocated``'s flags, unless
    the command has them), or attached at ``urls``."""
    if cfg.launch_command is None:
        return attach_servers(cfg.urls, router_url=cfg.router_url, timeout_s=cfg.startup_timeout_s)
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="mgrpo_sglang_logs_")
    flags: list[tuple[str, str | None]] = [(ROUTED_EXPERTS_FLAG, None)] if routed_experts else []
    if colocated is not None:
        flags += colocated.flags()
    command = with_flags(cfg.launch_command, flags)
    return launch_servers(
        LaunchConfig(
            command=command,
            num_servers=cfg.num_servers if colocated is None else colocated.num_engines,
            gpus_per_server=1 if colocated is None else colocated.tp,
            host=cfg.host,
            model=model_path,
            log_dir=log_dir,
            startup_timeout_s=cfg.startup_timeout_s,
            router_url=cfg.router_url,
            api_key=api_key_from_env(cfg.api_key_env),
        )
    )


def launch_embedded(
    cfg: RolloutConfig, model_cfg: ModelConfig, *, seed: int
) -> tuple[ServerGroup, str]:
    """``cfg.engines.num_servers`` embedded servers in processes of their own, started as launched
    SGLang servers are, from the policy's config with random weights (the first push
    gives them the policy's); and the directory of that config."""
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    model_dir = tempfile.mkdtemp(prefix="mgrpo_embedded_model_")
    hf_config_from_model_config(model_cfg, model_cfg.hf_family).save_pretrained(model_dir)
    batch = cfg.prompts_per_step * cfg.samples_per_prompt
    command = (
        f"{sys.executable} -m megatron_grpo.embedded --model-path {{model}} "
        f"--host {{host}} --port {{port}} --load-format dummy --seed {seed} "
        f"--max-batch-size {batch}"
    )
    engines = cfg.engines
    if engines.api_key_env is not None:
        api_key_from_env(engines.api_key_env)  # set here, so that the servers inherit it
        # The variable's name, not the key: a command line is readable by every user.
        command += f" --api-key-env {engines.api_key_env}"
    try:
        return launch_servers(
            LaunchConfig(
                command=command,
                num_servers=engines.num_servers,
                host=engines.host,
                model=model_dir,
                log_dir=engines.log_dir or tempfile.mkdtemp(prefix="mgrpo_embedded_logs_"),
                startup_timeout_s=engines.startup_timeout_s,
            )
        ), model_dir
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
