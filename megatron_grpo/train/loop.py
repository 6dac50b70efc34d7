"""The GRPO loop: rollout -> reward -> advantages -> optimizer steps -> weight sync.

Every rank runs this. Generation, scoring and the data cursor live on global
rank 0, which broadcasts each step's training samples; the train step and
the weight push (every pipeline stage sends its own layers) are collective.
With ``rollout.placement: colocated`` the learner and the engines take turns on the same
GPUs (``train.colocation``), and a step's checkpoint is written before its weight push.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any

from megatron_grpo.config import Config, dump_config, to_dict
from megatron_grpo.eval import runner as evaluation
from megatron_grpo.heap import freeze_startup_objects
from megatron_grpo.mcore.layers import have_transformer_engine
from megatron_grpo.mcore.model import build_model, sync_params
from megatron_grpo.mcore.optim import build_optimizer
from megatron_grpo.mcore.parallel import broadcast_object, init_parallel
from megatron_grpo.metrics import MetricsLogger, namespaced, over_optimizer_steps
from megatron_grpo.rollout import stage as rollout_stage
from megatron_grpo.rollout.parts import RolloutParts, RolloutSettings
from megatron_grpo.rollout.producer import ProducerSpec, RolloutProducer
from megatron_grpo.train import gates, run_start, save_hf, sources
from megatron_grpo.train import state as train_state
from megatron_grpo.train.colocation import (
    LEARNER_AFTER_PUSH,
    LEARNER_BEFORE_PUSH,
    Colocation,
)
from megatron_grpo.train.main_wait import MainRankWork
from megatron_grpo.train.run_lock import HELD_ENV, RunLock, RunLockedError
from megatron_grpo.train.step import StepSettings, train_on_rollout
from megatron_grpo.weight_sync.engines import refuse_delta_to_sglang
from megatron_grpo.weight_sync.push import WeightPush


def train(cfg: Config) -> None:
    start = run_start.plan_start(cfg)  # every rank, from the files; a refusal raises here
    if start.kind == "complete":
        if os.environ.get("RANK", "0") == "0":
            print(start.describe(cfg), flush=True)
        return
    ctx = init_parallel(
        cfg.parallel, seed=cfg.seed, timeout_minutes=cfg.train.collective_timeout_s / 60
    )
    lock = _lock_output_dir(cfg, ctx)
    try:
        _train(cfg, ctx, start)
    finally:
        if lock is not None:
            lock.release()


def _lock_output_dir(cfg: Config, ctx) -> RunLock | None:
    """Global rank 0 takes the output directory's lock, unless the launcher holds it for
    this run; every rank raises the same error when it is taken. Collective."""
    lock, error = None, None
    if ctx.is_main and os.environ.get(HELD_ENV) is None:
        try:
            lock = RunLock(cfg.output_dir).acquire()
        except RunLockedError as e:
            error = str(e)
    error = broadcast_object(error, ctx)
    if error is not None:
        raise RunLockedError(error)
    return lock


def _train(cfg: Config, ctx, start: run_start.RunStart) -> None:
    out = Path(cfg.output_dir)
    if ctx.is_main:
        _start_output_dir(cfg, out, start)
    inputs = sources.resolve_inputs(cfg)  # once: every part below is handed these
    model, optimizer, scheduler, ref_model = _learner(cfg, inputs, ctx)
    start_step, extra = 0, dict[str, Any]()
    latest = train_state.latest_checkpoint(out)
    if latest is not None:
        start_step, extra = train_state.load(
            latest, model=model, optimizer=optimizer, scheduler=scheduler, ctx=ctx
        )
    main_work = MainRankWork(
        is_main=ctx.is_main, world_size=ctx.world_size, stall_s=cfg.train.collective_timeout_s
    )
    rollout, colocation = None, None
    if cfg.rollout.replay_dir is None:
        if cfg.rollout.placement == "colocated":
            colocation = _colocation(cfg, model, optimizer, ctx)
        rollout = _RolloutSide(
            cfg,
            inputs,
            ctx,
            model,
            extra,
            start_step=start_step,
            main_work=main_work,
            colocation=colocation,
        )
    settings = step_settings(cfg)
    logger = MetricsLogger(
        out,
        cfg.metrics,
        enabled=ctx.is_main,
        run_config=to_dict(cfg),
        total_steps=cfg.train.total_steps,
        start_step=start_step,
    )
    try:
        evaluator = evaluation.build(cfg.eval, RolloutSettings.of(cfg), rollout, ctx)
        total = cfg.train.total_steps

        def evaluate(step: int) -> dict:
            run = lambda: evaluation.maybe_run(evaluator, cfg.eval, step, total)  # noqa: E731
            return main_work.run("evaluation", run) or {}

        if start_step == 0 and (initial := evaluate(0)):
            logger.log(0, namespaced("eval", initial))
        freeze_startup_objects()

        def save(step: int) -> None:
            nonlocal extra
            last = step == cfg.train.total_steps
            if last or (cfg.train.save_interval and step % cfg.train.save_interval == 0):
                extra = broadcast_object(rollout.state(step) if rollout else {}, ctx)
                train_state.save(out, step, model=model, optimizer=optimizer,
                                 scheduler=scheduler, ctx=ctx, extra=extra,
                                 keep_last=cfg.train.keep_last)  # fmt: skip
            if save_hf.due(cfg.train, step):
                save_hf.save_hf(model, cfg, ctx, step)

        for step in range(start_step + 1, cfg.train.total_steps + 1):
            t0 = time.perf_counter()
            if colocation is not None:
                colocation.step = step
            batch = _step_batch(cfg, ctx, rollout, main_work, step)
            t1 = time.perf_counter()
            if colocation is not None:
                colocation.learner_in()
            gate = None  # replayed samples: another run's engines made them
            if rollout is not None:
                first, resumed = step == start_step + 1, start_step > 0
                gate = gates.for_step(cfg.train.gates, step=step, first=first, resumed=resumed)
            history = train_on_rollout(
                model,
                optimizer,
                scheduler,
                ctx,
                batch.samples,
                cfg.loss,
                settings,
                ref_model=ref_model,
                gate=gate,
            )
            t2 = time.perf_counter()
            if colocation is not None:  # the learner is whole until the push: save it now
                sync_params(model)
                save(step)
            # Weight sync and checkpoints read the full parameters: the push brings them up
            # to date first (model.sync_params), once.
            if rollout is not None:
                rollout.sync(model, step)
            else:
                sync_params(model)
            t3 = time.perf_counter()
            perf = _perf(batch.samples, settings, t0, t1, t2, t3)
            logger.log(
                step,
                {
                    **namespaced("rollout", batch.stats),
                    **namespaced("train", over_optimizer_steps(history)),
                    **namespaced("perf", perf),
                    **namespaced("eval", evaluate(step) or {}),
                },
            )
            if colocation is None:
                save(step)
    except BaseException:  # the engines stop and no request is left running; the error stays
        with contextlib.suppress(Exception):
            _close(logger, rollout)
        raise
    _close(logger, rollout)


def _start_output_dir(cfg: Config, out: Path, start: run_start.RunStart) -> None:
    """The main rank's start: the output directory, the config kept in it, a line saying
    how the run starts and a summary of the config (all of it with
    ``metrics.print_config``)."""
    out.mkdir(parents=True, exist_ok=True)
    train_state.remove_partial_saves(out)  # this run holds the directory's lock
    run_start.record_start(cfg, start)
    print(start.describe(cfg), flush=True)
    shown = dump_config(cfg) if cfg.metrics.print_config else run_start.config_summary(cfg)
    print(shown, flush=True)
    _warn_if_uncorrected(cfg)


def _warn_if_uncorrected(cfg: Config) -> None:
    """Stale samples with no off-policy correction in the loss: say so at start."""
    corrected = cfg.loss.tis_level is not None or cfg.loss.old_logprobs == "rollout"
    if cfg.rollout.max_staleness and not corrected:
        print(
            "megatron-grpo: warning: rollout.max_staleness >= 1 without loss.tis_level "
            "or loss.old_logprobs=rollout: the loss does not correct for the older "
            "policies that generated the samples (docs/async.md)",
            flush=True,
        )


def _learner(cfg: Config, inputs: sources.RunInputs, ctx) -> tuple[list, Any, Any, list | None]:
    """The policy with its initial weights, its optimizer and scheduler, and the frozen
    reference model when the loss has a KL term."""
    model = build_model(cfg.model, ctx, optim=cfg.optim, train=cfg.train)
    sources.load_initial_weights(model, inputs, cfg.model, ctx)
    # after the weights: bf16 and the distributed optimizer copy them into fp32 master weights
    optimizer, scheduler = build_optimizer(cfg.optim, cfg.model, model, ctx)
    ref_model = None
    if cfg.loss.kl_coef:  # frozen copy of the initial policy, forward only
        ref_model = build_model(cfg.model, ctx, wrap_ddp=False)
        sources.load_initial_weights(ref_model, inputs, cfg.model, ctx)
    return model, optimizer, scheduler, ref_model


def _colocation(cfg: Config, model: list, optimizer, ctx) -> Colocation:
    """``rollout.placement: colocated``: the learner's offload, checked against the nodes'
    host memory (refused at start when it cannot fit), and its first turn out: optimizer
    states and gradients go to host before the engines start."""
    import torch.distributed as dist

    from megatron_grpo.mcore.offload import LearnerOffload
    from megatron_grpo.train.host_memory import check_host_memory

    colocate = cfg.rollout.colocate
    offload = LearnerOffload(model, optimizer, colocate.offload)
    check_host_memory(
        offload.host_bytes(), colocate.offload, colocate.host_memory_headroom_gib, dist.group.WORLD
    )
    colocation = Colocation(colocate, offload, is_main=ctx.is_main)
    colocation.learner_out(LEARNER_BEFORE_PUSH)
    return colocation


def _step_batch(cfg: Config, ctx, rollout: _RolloutSide | None, main_work, step: int):
    """This step's samples on every rank: replayed, or the main rank's rollout (which the
    other ranks wait for outside collectives)."""
    if cfg.rollout.replay_dir is not None:
        batch = rollout_stage.replay(cfg.rollout.replay_dir, step) if ctx.is_main else None
    else:
        assert rollout is not None
        batch = main_work.run("rollout", functools.partial(rollout.collect, step))
    return broadcast_object(batch, ctx)


def _perf(
    samples: list, settings: StepSettings, t0: float, t1: float, t2: float, t3: float
) -> dict[str, float]:
    """Times of one step's rollout, train and sync phases (t0..t3), and train throughput."""
    num_tokens = sum(len(s) for s in samples)
    return {
        "time_rollout_s": t1 - t0,
        "time_train_s": t2 - t1,
        "time_sync_s": t3 - t2,
        "train_tokens_per_s": num_tokens * settings.num_iterations / max(t2 - t1, 1e-9),
    }


def _close(logger: MetricsLogger, rollout: _RolloutSide | None) -> None:
    logger.close()
    if rollout is not None:
        rollout.close()


def step_settings(cfg: Config) -> StepSettings:
    """Batch sizes and packing of the optimizer steps (packed unless Transformer Engine runs)."""
    pack = cfg.train.pack_sequences
    assert cfg.train.global_batch_size is not None  # Config resolves its default
    return StepSettings(
        global_batch_size=cfg.train.global_batch_size,
        num_iterations=cfg.train.num_iterations,
        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
        pack=pack if pack is not None else not have_transformer_engine(),
        vocab_size=cfg.model.vocab_size,
        max_len=cfg.rollout.max_new_tokens,
    )


class _RolloutSide:
    """Data, rewards and engines on global rank 0; weight pushes from every stage."""

    def __init__(
        self,
        cfg: Config,
        inputs: sources.RunInputs,
        ctx,
        model: list,
        extra: dict,
        *,
        start_step: int,
        main_work: MainRankWork,
        colocation: Colocation | None = None,
    ) -> None:
        self.cfg, self.inputs, self.ctx = cfg, inputs, ctx
        self.main_work, self.colocation = main_work, colocation
        self.runtime: Any = None
        # Starting or attaching to the engines may take minutes: not inside a collective.
        main_work.run("engine start", lambda: self._start(cfg, extra, start_step))
        if colocation is not None:
            main_work.run(
                "release of the engines' memory",
                lambda: colocation.engines_started(self.runtime),
            )
        self.weight_push = WeightPush(cfg.model, cfg.rollout, ctx)  # collective
        # The engines load their weights elsewhere (a random embedded model, a server's
        # model path, which need not be the policy's: a Megatron train.init, a resumed
        # run); the first rollout uses the learner's.
        self.producer: RolloutProducer | None = None
        self.sync(model, start_step)
        if ctx.is_main and cfg.rollout.max_staleness:
            self.producer = self._producer(start_step)

    def _producer(self, start_step: int) -> RolloutProducer:
        """The rollouts of the steps after ``start_step``, made ahead in a process of their
        own; a weight push holds its generation."""
        producer = RolloutProducer(
            ProducerSpec(
                settings=RolloutSettings.of(self.cfg),
                tokenizer_path=self.inputs.tokenizer,
                sampler_state=self.parts.sampler.state_dict(),
                engine_urls=self.runtime.engine_urls,
                first_step=start_step + 1,
                last_step=self.cfg.train.total_steps,
                weight_version=start_step,
            )
        )
        self.runtime.holders.append(producer)
        print(
            f"megatron-grpo: rollout producer process {producer.pid}: the rollouts of up to "
            f"{self.cfg.rollout.max_staleness + 1} steps ahead",
            flush=True,
        )
        return producer

    def _start(self, cfg: Config, extra: dict, start_step: int) -> None:
        from megatron_grpo.embedded.weights import hf_model_from_config
        from megatron_grpo.rollout.runtime import RolloutRuntime

        settings = RolloutSettings.of(cfg)
        self.parts = RolloutParts.build(settings, self.inputs.tokenizer, extra.get("sampler"))
        embedded = cfg.rollout.engines.type == "embedded" and not cfg.rollout.embedded_process
        self.runtime = RolloutRuntime(
            cfg.rollout,
            hf_model=hf_model_from_config(cfg.model) if embedded else None,
            tokenizer=self.parts.tokenizer,
            seed=cfg.seed,
            weight_version=str(start_step),
            model_path=self.inputs.model_path,
            model_cfg=cfg.model,
            routed_layers=settings.routed_layers,
        )
        if cfg.rollout.return_routed_experts:  # refused now, not at the first forward
            self.runtime.check_routes(cfg.model)
        if cfg.rollout.sync.delta and cfg.rollout.engines.type == "sglang":
            refuse_delta_to_sglang(self.runtime)  # refused now, not at the first push

    def collect(self, step: int):
        """Step ``step``'s batch on the main rank: made now, or taken from the producer."""
        if not self.ctx.is_main:
            return None
        if self.producer is not None:
            return self.producer.get(step)
        batch = self.parts.collect(step, self.runtime)
        if self.colocation is not None:
            self.colocation.release_engines()
        return batch

    def sync(self, model: list, step: int) -> None:
        """Push the policy to the engines as weight version ``step``. Collective."""
        colocation = self.colocation
        if colocation is not None:
            colocation.step = step
            colocation.learner_out(LEARNER_BEFORE_PUSH)
            self.main_work.run("wake-up of the engines' weights", colocation.resume_weights)
        self.weight_push(model, str(step), self.runtime)
        if colocation is not None:
            colocation.learner_out(LEARNER_AFTER_PUSH)
            self.main_work.run("wake-up of the engines' KV cache", colocation.resume_kv_cache)
        if self.producer is not None:
            self.producer.weights_pushed(step)

    def state(self, step: int) -> dict:
        """What a checkpoint of step ``step`` keeps: the prompt sampler once that step's
        batch was drawn (rollouts produced for later steps are made again on resume)."""
        if not self.ctx.is_main:
            return {}
        if self.producer is not None:
            sampler = self.producer.sampler_state(step)
        else:
            sampler = self.parts.sampler.state_dict()
        return {"sampler": sampler}

    def close(self) -> None:
        if self.producer is not None:
            self.runtime.holders.remove(self.producer)
            self.producer.close()
        self.weight_push.close()
        if self.ctx.is_main:
            self.parts.close()
            self.runtime.close()
