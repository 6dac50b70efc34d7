"""Async HTTP client for SGLang's native API (or the embedded server, which speaks the same).

One ``/generate`` request per prompt group, its samples in SGLang's batch form (see
``protocol.py``), spread round-robin over the servers, at most ``max_concurrency`` at a
time. Each request has a timeout (``request_timeout_s``); connection failures and HTTP
5xx are retried with exponential backoff on the next server
(``megatron_grpo.http.retrying``), HTTP 4xx is not retried, and a generation that times
out is aborted rather than retried. A batch in which some samples fail raises
``RolloutBatchError`` carrying the samples that finished. The control and weight-update
calls, and the HTTP session, come from ``EngineCalls`` (``engine_calls.py``).

Weight updates while samples are generating (partial rollouts): ``hold_generation``
before the update makes new requests wait, and the pause that follows (mode ``abort``)
ends the running ones with what they had generated; once ``release_generation`` is
called after the update, each is sent again as prompt + its tokens so far, with the
budget left. A sample thus has spans of tokens each generated whole by one weight
version (``Generation.version_spans``): its log-probs are exactly those of that version,
prefix included, which a resumed KV cache of old weights would not give.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

from megatron_grpo import http
from megatron_grpo.rollout.client_config import ClientConfig
from megatron_grpo.rollout.engine_calls import EngineCalls, decode_json
from megatron_grpo.rollout.partial import GroupFailed, Partial
from megatron_grpo.sglang_api.errors import (
    RolloutBatchError,
    RolloutError,
    RolloutHTTPError,
    RolloutTimeoutError,
    SampleFailure,
    ServerUnavailableError,
)
from megatron_grpo.sglang_api.protocol import (
    GenerateResult,
    build_batch_payload,
    build_generate_payload,
    parse_batch_response,
)
from megatron_grpo.sglang_api.types import FinishReason, Generation, RolloutRequest

__all__ = ["ClientConfig", "SGLangClient"]

logger = logging.getLogger(__name__)

SEGMENT_SEED_STRIDE = 1_000_003
"""A resumed sample's k-th segment samples with seed + k * this."""


class SGLangClient(EngineCalls):
    """A client for one or more servers; use as ``async with SGLangClient(config) as client``."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._retry = http.RetryPolicy(
            max_retries=config.max_retries,
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
        )
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._in_flight: dict[str, str] = {}  # rid -> url now generating it
        self._background: set[asyncio.Task[None]] = set()
        self._open = asyncio.Event()  # cleared while a weight update holds generation
        self._open.set()
        self._holds = 0  # weight updates that held generation so far

    async def settle(self) -> None:
        """Wait (up to ``control_timeout_s``) for the aborts this client asked for to reach
        their servers."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.control_timeout_s)

    async def close(self) -> None:
        await self.settle()
        await super().close()

    # ---- generation ----

    async def generate(
        self,
        request: RolloutRequest,
        on_sample: Callable[[Generation], None] | None = None,
    ) -> list[Generation]:
        """All samples of ``request``, prompt-major (prompt 0's samples first).

        Raises RolloutBatchError when any sample fails; its ``completed`` holds
        the samples that did finish. Samples aborted on the server (pause,
        ``abort_all``) come back normally with finish type ``abort``. ``on_sample`` is
        called with each sample as it finishes (on the event loop: it must not block).
        """
        batch_id = uuid.uuid4().hex[:12]
        outcomes = await asyncio.gather(
            *(
                self._generate_group(request, p, batch_id, on_sample)
                for p in range(len(request.prompts))
            ),
            return_exceptions=True,
        )
        completed: list[Generation] = []
        failures: list[SampleFailure] = []
        for p, outcome in enumerate(outcomes):
            if isinstance(outcome, list):
                completed += outcome
            elif isinstance(outcome, GroupFailed):
                completed += outcome.completed
                failures += [SampleFailure(p, s, outcome.error) for s in outcome.failed]
            else:
                raise outcome  # a bug, not a server failure: do not hide it
        completed.sort(key=lambda g: (g.prompt_index, g.sample_index))
        if failures:
            raise RolloutBatchError(completed, failures)
        return completed

    async def _generate_group(
        self,
        request: RolloutRequest,
        p: int,
        batch_id: str,
        on_sample: Callable[[Generation], None] | None,
    ) -> list[Generation]:
        """Prompt ``p``'s samples: one request for the group, then one for the samples a
        weight update cut (each with its tokens so far), until every sample is done."""
        prompt, budget = request.prompts[p], request.sampling.max_new_tokens
        pending = [Partial(s) for s in range(request.num_samples)]
        done: list[Generation] = []
        for segment in itertools.count():
            await self._open.wait()
            holds = self._holds
            rid_base = f"{batch_id}-p{p}-g{segment}"
            try:
                results = await self._generate_segments(request, p, pending, rid_base, segment)
            except RolloutError as err:
                raise GroupFailed(done, [x.sample_index for x in pending], err) from err
            cut_short: list[Partial] = []
            for item, result in zip(pending, results):
                item.add(result)
                cut = result.finish_reason.type == "abort" and self._holds != holds
                if cut and len(item.output) < budget:
                    cut_short.append(item)
                    continue
                # (stopped by the pause at the very last token: the budget is spent)
                finish = FinishReason(type="length", detail=budget) if cut else result.finish_reason
                done.append(item.generation(p, prompt, finish, result.weight_version))
                if on_sample is not None:
                    on_sample(done[-1])
            pending = cut_short
            if not pending:
                return done
        raise AssertionError("unreachable")

    async def _generate_segments(
        self,
        request: RolloutRequest,
        p: int,
        pending: list[Partial],
        rid_base: str,
        segment: int,
    ) -> list[GenerateResult]:
        """The group's pending samples in one request; through sglang-router (whose
        ``/generate`` takes one ``rid`` string) in one request each."""
        if self.config.group_requests:
            return await self._generate_segment(request, p, pending, rid_base, segment)
        each = await asyncio.gather(
            *(self._generate_segment(request, p, [x], rid_base, segment) for x in pending),
            return_exceptions=True,
        )
        results: list[GenerateResult] = []
        for outcome in each:
            if isinstance(outcome, BaseException):
                raise outcome
            results += outcome
        return results

    async def _generate_segment(
        self,
        request: RolloutRequest,
        p: int,
        pending: list[Partial],
        rid_base: str,
        segment: int,
    ) -> list[GenerateResult]:
        """One ``/generate`` of a group's pending samples: all of each, or what is left of
        it after a weight update (its tokens so far added to the prompt)."""
        items = []
        for x in pending:
            seed = request.sample_seed(p, x.sample_index)
            if seed is not None and segment:  # a resumed sample does not replay its draws
                seed += SEGMENT_SEED_STRIDE * segment
            left = request.sampling.max_new_tokens - len(x.output)
            sampling = dataclasses.replace(request.sampling, max_new_tokens=left)
            items.append((request.prompts[p] + tuple(x.output), sampling, seed))
        first_server = next(self._next_url)
        routes = self.config.return_routed_experts

        async def attempt(k: int) -> Any:
            # Fresh rids per attempt: the server may still hold the previous ones.
            rids = [f"{rid_base}-s{x.sample_index}-a{k}" for x in pending]
            if self.config.group_requests:
                payload = build_batch_payload(
                    [(ids, sampling, rid, seed) for (ids, sampling, seed), rid in zip(items, rids)],
                    return_routed_experts=routes,
                )
            else:
                ((ids, sampling, seed),) = items
                payload = build_generate_payload(
                    ids, sampling, rid=rids[0], seed=seed, return_routed_experts=routes
                )
            # Round-robin for the first attempt; each retry moves to the next server.
            url = self._urls[(first_server + k) % len(self._urls)]
            async with self._semaphore:
                return await self._post_generate(url, payload, rids)

        try:
            answer = await http.retrying(attempt, self._retry)
        except http.HTTPStatusError as err:  # 4xx: the request itself is wrong
            raise RolloutHTTPError(url=err.url, status=err.status, body=err.body) from err
        except http.RetriesExhausted as err:
            raise _gave_up(err) from err
        return parse_batch_response(
            answer,
            len(pending),
            num_layers=self.config.num_layers if routes else None,
            input_lengths=[len(ids) for ids, _, _ in items],
        )

    async def _post_generate(self, url: str, payload: dict[str, Any], rids: list[str]) -> Any:
        """One attempt: the decoded answer, or the error that ended it.

        An ``http.RequestError`` goes to the caller's retry loop (which retries
        all but 4xx); a ``RolloutError`` is final.
        """
        for rid in rids:
            self._in_flight[rid] = url
        try:
            reply = await http.request(
                "POST",
                f"{url}/generate",
                payload,
                timeout_s=self.config.request_timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
                session=self._require_session(),
            )
        except http.RequestTimedOut as err:
            # The server may still be generating: stop it there instead of retrying.
            for rid in rids:
                self._abort_in_background(url, rid)
            more = f" (and {len(rids) - 1} more)" if len(rids) > 1 else ""
            raise RolloutTimeoutError(
                f"{url}/generate rid={rids[0]}{more} took longer than "
                f"request_timeout_s={self.config.request_timeout_s}; asked the server to abort it"
            ) from err
        except asyncio.CancelledError:
            for rid in rids:
                self._abort_in_background(url, rid)
            raise
        finally:
            for rid in rids:
                self._in_flight.pop(rid, None)
        reply.raise_for_status()
        return decode_json(reply)

    # ---- holding generation for a weight update ----

    async def hold_generation(self) -> None:
        """Before a weight update: samples not yet sent wait, and those the pause aborts
        are sent again (with their tokens so far) after ``release_generation``."""
        self._holds += 1
        self._open.clear()

    async def release_generation(self) -> None:
        """After a weight update: held and aborted samples go on."""
        self._open.set()

    # ---- abort ----

    async def abort_request(self, rid: str, *, url: str | None = None) -> None:
        """Abort one request: on its server when in flight here, else on ``url`` or all."""
        target = url or self._in_flight.get(rid)
        urls = (target,) if target else self._urls
        await self._fan_out("POST", "/abort_request", {"rid": rid}, urls=urls)

    async def abort_all(self) -> None:
        """Abort every request on every server; they finish with type ``abort``."""
        await self._fan_out("POST", "/abort_request", {"abort_all": True})

    def _abort_in_background(self, url: str, rid: str) -> None:
        # A cancelled or timed-out request may still be running on the server.
        task = asyncio.get_running_loop().create_task(self._abort_quietly(url, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self._call("POST", url, "/abort_request", {"rid": rid})
        except RolloutError as err:
            logger.warning("could not abort rid=%s on %s: %s", rid, url, err)


def _gave_up(exhausted: http.RetriesExhausted) -> RolloutError:
    """The error of a request whose every attempt failed, naming how many there were."""
    last = exhausted.last
    if isinstance(last, http.HTTPStatusError):
        return RolloutHTTPError(
            url=last.url, status=last.status, body=last.body, attempts=exhausted.attempts
        )
    return ServerUnavailableError(f"gave up after {exhausted.attempts} attempts: {last}")
