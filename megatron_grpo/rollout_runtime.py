"""The main rank's handle on the rollout engines: a client, and the embedded server if any.

It owns one event loop for the client's whole life (aiohttp sessions are
bound to the loop that made them), and offers the two things the training
loop does with the engines: generate groups of completions, and push new
weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from megatron_grpo.rollout_stage import RolloutConfig


class RolloutRuntime:
    def __init__(self, cfg: RolloutConfig, *, hf_model=None, tokenizer=None, seed: int = 0):
        from megatron_grpo.rollout.client import ClientConfig, SGLangClient
        from megatron_grpo.rollout.embedded_server import start_embedded_server

        self.cfg = cfg
        self.server = None
        urls = list(cfg.urls)
        if cfg.engine == "embedded":
            if hf_model is None:
                raise ValueError("the embedded rollout engine needs the policy as a HF model")
            self.server = start_embedded_server(
                hf_model,
                tokenizer=tokenizer,
                weight_version="0",
                seed=seed,
                max_batch_size=max(cfg.prompts_per_step * cfg.samples_per_prompt, 1),
            )
            urls = [self.server.url]
        self.loop = asyncio.new_event_loop()
        self.client = SGLangClient(
            ClientConfig(
                urls=tuple(urls),
                max_concurrency=cfg.max_concurrency,
                request_timeout_s=cfg.request_timeout_s,
            )
        )
        self.loop.run_until_complete(self.client.__aenter__())

    def generate_groups(
        self, prompts: list[list[int]], cfg: RolloutConfig, *, seed: int, stop_token_ids: list[int]
    ) -> list[list[Any]]:
        """cfg.samples_per_prompt completions of each prompt, grouped by prompt."""
        from megatron_grpo.rollout.types import RolloutRequest, SamplingParams

        request = RolloutRequest(
            prompts=tuple(tuple(p) for p in prompts),
            num_samples=cfg.samples_per_prompt,
            sampling=SamplingParams(
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=tuple(stop_token_ids),
                seed=seed,
            ),
        )
        flat = self.loop.run_until_complete(self.client.generate(request))
        groups: list[list[Any]] = [[None] * cfg.samples_per_prompt for _ in prompts]
        for s in flat:
            groups[s.prompt_index][s.sample_index] = s
        return groups

    def push_weights(
        self, named: Mapping[str, torch.Tensor], *, weight_version: str, **kwargs
    ) -> None:
        from megatron_grpo import weight_sync

        self.loop.run_until_complete(
            weight_sync.push(
                self.client,
                named,
                method=self.cfg.sync_method,
                weight_version=weight_version,
                bucket_bytes=self.cfg.sync_bucket_mb << 20,
                **kwargs,
            )
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        if self.server is not None:
            self.server.stop()
