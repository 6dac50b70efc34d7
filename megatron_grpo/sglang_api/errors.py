"""Errors of the rollout client: each names the server, the request and what went wrong."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.sglang_api.types import Generation


class RolloutError(RuntimeError):
    """Base class: a generation or control request to a server failed."""


class ServerUnavailableError(RolloutError):
    """The server could not be reached (connection refused or dropped) after every retry."""


class RolloutStoppedError(RolloutError):
    """Generation was asked for after the run stopped its engines' generation."""


class RolloutTimeoutError(RolloutError):
    """The server did not answer within the request's timeout."""


class RolloutHTTPError(RolloutError):
    """The server answered with an HTTP error status.

    4xx means the request itself is wrong and is never retried; 5xx is raised
    only once the retries are spent.
    """

    def __init__(self, *, url: str, status: int, body: str, attempts: int = 1) -> None:
        self.url = url
        self.status = status
        self.body = body
        self.attempts = attempts
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{url} answered HTTP {status}{tries}: {body.strip() or '<empty body>'}")


class RolloutProtocolError(RolloutError, ValueError):
    """The server's answer does not have the shape of SGLang's contract."""


@dataclass(frozen=True)
class SampleFailure:
    """One sample of a batch that did not come back, and why."""

    prompt_index: int
    sample_index: int
    error: RolloutError


class RolloutBatchError(RolloutError):
    """Some samples of a batch failed; the ones that finished are kept on the error."""

    def __init__(self, completed: list[Generation], failures: list[SampleFailure]) -> None:
        self.completed = completed
        self.failures = failures
        first = failures[0]
        super().__init__(
            f"{len(failures)} of {len(completed) + len(failures)} samples failed "
            f"({len(completed)} completed, kept on .completed); first failure, "
            f"prompt {first.prompt_index} sample {first.sample_index}: {first.error}"
        )
