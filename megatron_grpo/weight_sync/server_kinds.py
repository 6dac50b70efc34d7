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
    device: str = "cpu"
    """Where the engine holds its weights (SGLang's resolved ``device``, e.g. "cuda")."""

    def tensor_way(self) -> str:
        """How ``/update_weights_from_tensor`` reaches this engine from this process: SGLang
        on a GPU by CUDA IPC handles when this process has a GPU too (the engine on this
        machine, as for the shared-memory way), SGLang otherwise through shared memory."""
        from megatron_grpo.embedded.weights import shared_memory_available

        if not self.embedded:
            cuda_here = self.device == "cuda" and _cuda_available()
            return "sglang_cuda" if cuda_here else "sglang"
        local = self.host == socket.gethostname() and shared_memory_available()
        return "shm" if local else "body"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


async def server_kinds(client: Any) -> dict[str, ServerKind]:
    """What each engine in use is, from its ``/server_info``."""
    from megatron_grpo.embedded.server import SERVER_VERSION
    from megatron_grpo.sglang_api.compat import check_server

    infos = await asyncio.gather(*(client.server_info(url) for url in client.urls))
    kinds = {
        url: ServerKind(
            embedded=info.get("version") == SERVER_VERSION,
            tp_size=int(info.get("tp_size", 1)),
            host=info.get("hostname"),
            device=str(info.get("device") or "cpu"),
        )
        for url, info in zip(client.urls, infos)
    }
    for info, kind in zip(infos, kinds.values()):
        if not kind.embedded:  # the weights reach it through SGLang's internals
            check_server(str(info.get("version", "unknown")))
    return kinds
