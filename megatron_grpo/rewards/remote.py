"""A reward model behind HTTP: POST the sample as JSON, read a number back.

One sample: ``{"response", "label", "metadata"}`` -> ``{<field>: float}``.
A batch: ``{"batch": [<sample>, ...]}`` -> ``{<field>: [float, ...]}``.
Connection errors, timeouts and 5xx answers are retried with doubling
back-off (``megatron_grpo.http.retrying``); a 4xx answer means the request
itself is wrong and is not.

The scoring methods are synchronous, each request on its own short-lived
event loop; ``score_async`` and ``score_batch_async`` are the same for
callers that run an event loop, optionally on their own aiohttp session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_grpo import http

if TYPE_CHECKING:
    import aiohttp


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or gave an unusable answer."""


class RemoteReward:
    """Reward function that asks an HTTP server."""

    def __init__(
        self, url: str, *, field: str, timeout: float, retries: int, backoff: float
    ) -> None:
        self.url = url
        self.field = field
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def __call__(self, response: str, label: Any, metadata: dict[str, Any]) -> float:
        return http.run_sync(self.score_async(response, label, metadata))

    def score_batch(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict[str, Any]],
    ) -> list[float]:
        return http.run_sync(self.score_batch_async(responses, labels, metadatas))

    async def score_async(
        self,
        response: str,
        label: Any,
        metadata: dict[str, Any],
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> float:
        payload = {"response": response, "label": label, "metadata": metadata}
        answer = await self._post(payload, session)
        return self._number(answer.get(self.field))

    async def score_batch_async(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict[str, Any]],
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> list[float]:
        batch = [
            {"response": r, "label": lb, "metadata": m}
            for r, lb, m in zip(responses, labels, metadatas, strict=True)
        ]
        values = (await self._post({"batch": batch}, session)).get(self.field)
        if not isinstance(values, list) or len(values) != len(batch):
            raise RemoteRewardError(
                f"{self.url}: expected {self.field!r} to be a list of {len(batch)} numbers, "
                f"got {values!r:.200}"
            )
        return [self._number(v) for v in values]

    def _number(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RemoteRewardError(f"{self.url}: field {self.field!r} is not a number: {value!r}")
        return float(value)

    async def _post(
        self, payload: dict[str, Any], session: aiohttp.ClientSession | None
    ) -> dict[str, Any]:
        async def attempt(_: int) -> http.Reply:
            reply = await http.request(
                "POST",
                self.url,
                payload,
                timeout_s=self.timeout,
                session=session,
                # Metadata from parquet may hold dates or other non-JSON values.
                json_default=str,
            )
            reply.raise_for_status()
            return reply

        policy = http.RetryPolicy(max_retries=self.retries, initial_s=self.backoff)
        try:
            answer = (await http.retrying(attempt, policy)).json()
        except (http.RequestError, ValueError) as err:  # 4xx, retries spent, or not JSON
            raise RemoteRewardError(str(err)) from err
        if not isinstance(answer, dict):
            raise RemoteRewardError(f"{self.url} answered {answer!r:.200}, not a JSON object")
        return answer
