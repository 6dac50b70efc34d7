"""megatron-core optimizer (Adam or SGD, weight decay, grad clipping) and LR schedule."""

from __future__ import annotations

from megatron_grpo.config import ModelConfig, OptimConfig
from megatron_grpo.mcore.model import DTYPES
from megatron_grpo.mcore.parallel import ParallelContext


def build_optimizer(cfg: OptimConfig, model_cfg: ModelConfig, model: list, ctx: ParallelContext):
    """A megatron-core optimizer over ``model``'s chunks and its LR/WD scheduler.

    ``model`` must be built with the same ``cfg`` (``build_model(optim=cfg)``): the
    distributed optimizer needs DDP's sharded buffers.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    built_for = model[0].ddp_config.use_distributed_optimizer
    if built_for != cfg.use_distributed_optimizer:
        raise ValueError(
            f"the model's DDP was built with use_distributed_optimizer={built_for}, the optimizer "
            f"config says {cfg.use_distributed_optimizer}: build both from one OptimConfig"
        )

    dtype = DTYPES[model_cfg.params_dtype]
    ocfg = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=0.0,
        clip_grad=cfg.clip_grad,
        bf16=model_cfg.params_dtype == "bfloat16",
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(
        ocfg, model, use_gloo_process_groups=False, pg_collection=ctx.pg
    )
    # OptimizerParamScheduler needs a positive decay span even for a constant rate.
    decay_steps = max(cfg.lr_decay_steps or 1, cfg.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.lr_decay_style != "constant" else cfg.lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
