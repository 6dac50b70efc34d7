"""What each rollout engine in use is (the embedded server or SGLang, its TP size, its
host), from its ``/server_info``, and so how a tensor update reaches it. An SGLang server's
release is checked there (``sglang_compat.check_server``), before any weights are sent."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, NamedTuple


class ServerKind(NamedTuple):
    embedded: bool
    """The embedded server, not SGLang."""
    tp_size: int
    host: str | None

    def tensor_way(self) -> str:
        """How ``/update_weights_from_tensor`` reaches this engine from this process."""
        from megatron_grpo.rollout.embedded.weights import shared_memory_available

        if not self.embedded:
            return "sglang"
        local = self.host == socket.gethostname() and shared_memory_available()
        return "shm" if local else "body"


async def server_kinds(client: Any) -> dict[str, ServerKind]:
    """What each engine in use is, from its ``/server_info``."""
    from megatron_grpo.rollout.embedded.server import SERVER_VERSION
    from megatron_grpo.rollout.sglang_compat import check_server

    infos = await asyncio.gather(*(client.server_info(url) for url in client.urls))
    kinds = {
        url: ServerKind(
            embedded=info.get("version") == SERVER_VERSION,
            tp_size=int(info.get("tp_size", 1)),
            host=info.get("hostname"),
        )
        for url, info in zip(client.urls, infos)
    }
    for info, kind in zip(infos, kinds.values()):
        if not kind.embedded:  # the weights reach it through SGLang's internals
            check_server(str(info.get("version", "unknown")))
    return kinds
