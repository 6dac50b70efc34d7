"""A reward model behind HTTP: POST the sample as JSON, read a number back.

One sample: ``{"response", "label", "metadata"}`` -> ``{<field>: float}``.
A batch: ``{"batch": [<sample>, ...]}`` -> ``{<field>: [float, ...]}``.
Connection errors, timeouts and 5xx answers are retried with doubling
back-off; a 4xx answer means the request itself is wrong and is not.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any


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
        answer = self._post({"response": response, "label": label, "metadata": metadata})
        return self._number(answer.get(self.field))

    def score_batch(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict[str, Any]],
    ) -> list[float]:
        batch = [
            {"response": r, "label": lb, "metadata": m}
            for r, lb, m in zip(responses, labels, metadatas, strict=True)
        ]
        values = self._post({"batch": batch}).get(self.field)
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

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        # default=str: metadata from parquet may hold dates or other non-JSON values.
        body = json.dumps(payload, default=str).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    raw = reply.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:200].decode(errors="replace")
                if e.code < 500:
                    raise RemoteRewardError(
                        f"{self.url} answered HTTP {e.code}: {detail}"
                    ) from None
                last_error = f"HTTP {e.code}: {detail}"
                continue
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                last_error = f"{type(e).__name__}: {e}"
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise RemoteRewardError(f"{self.url} answered non-JSON: {raw[:200]!r}") from None
            if not isinstance(answer, dict):
                raise RemoteRewardError(f"{self.url} answered {answer!r:.200}, not a JSON object")
            return answer
        raise RemoteRewardError(
            f"{self.url} failed after {self.retries + 1} attempts; last error: {last_error}"
        )
