"""Where the SGLang servers are and how patiently the client talks to them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where the servers are and how patiently to talk to them."""

    urls: tuple[str, ...]
    """Base URLs of the servers (or of one sglang-router), e.g. ``http://127.0.0.1:30000``."""
    max_concurrency: int = 64
    """Most ``/generate`` requests in flight at once, over all servers."""
    group_requests: bool = True
    """Send a prompt group's samples in one request (SGLang's batch form); False sends
    one per sample, as sglang-router takes them."""
    request_timeout_s: float = 600.0
    """Limit for one ``/generate`` request, from sending to the whole answer."""
    connect_timeout_s: float = 10.0
    """Limit for opening a connection; a connect timeout is retried like a refusal."""
    control_timeout_s: float = 60.0
    """Limit for health, cache, pause, abort and info calls."""
    weight_update_timeout_s: float = 600.0
    """Limit for the weight-update calls, which may wait for running requests."""
    max_retries: int = 3
    """Retries after the first attempt, on connection errors and HTTP 5xx."""
    backoff_initial_s: float = 0.5
    """Wait before the first retry; it doubles on each further retry."""
    backoff_max_s: float = 8.0
    """Longest wait between retries."""
    api_key: str | None = field(default=None, repr=False)
    """Sent with every request as ``Authorization: Bearer <key>`` (SGLang's ``--api-key``);
    None sends none. Left out of ``repr`` so that it stays out of logs."""
    return_routed_experts: bool = False
    """Ask for each token's routed experts (``Generation.routed_experts``): needs a
    mixture-of-experts model on servers started with ``--enable-return-routed-experts``."""
    num_layers: int | None = None
    """The model's layer count, which every answer's routes must have; required with
    ``return_routed_experts``."""

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request carries."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("ClientConfig.urls is empty: give at least one server URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        timeouts = {
            "request_timeout_s": self.request_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "control_timeout_s": self.control_timeout_s,
            "weight_update_timeout_s": self.weight_update_timeout_s,
        }
        for name, value in timeouts.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.return_routed_experts and (self.num_layers is None or self.num_layers < 1):
            raise ValueError(
                f"return_routed_experts needs num_layers >= 1 (the model's layer count), "
                f"got {self.num_layers}"
            )
        key = self.api_key
        if key is not None and not (key and key.isascii() and key.isprintable()):
            raise ValueError("ClientConfig.api_key must be a non-empty string of printable ASCII")


def api_key_from_env(name: str | None) -> str | None:
    """The API key held by environment variable ``name`` (``rollout.engines.api_key_env``); None
    when ``name`` is None. A variable that is unset or empty is a ValueError."""
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ValueError(
            f"rollout.engines.api_key_env names the environment variable {name}, which is not set "
            "(or empty) in this process: export the rollout servers' API key in it"
        )
    return key
