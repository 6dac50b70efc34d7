"""What the weight updates rebuild of SGLang's internals, and the check that it still holds.

SGLang is never imported by the trainer (the server has its own environment), but two of
its internals are mirrored here, in ``update_group`` and in ``weight_sync.sglang_tensor``,
and both fail late if SGLang changes them: the broadcast group would hang until its
timeout, a tensor update would be refused by the server's unpickler.

- The store of the weight-update group (``update_group_store``): SGLang's end joins
  through ``init_custom_process_group``, which wraps its ``tcp://`` rendezvous store in
  ``PrefixStore(group_name)`` and hands it to torch's ``_new_process_group_helper``, which
  prefixes it again with ``"{group_name}/"`` and ``"{device}/"``. The trainer's end is
  built from the same prefixes, without registering anything with torch.distributed.
- The ``/update_weights_from_tensor`` payload (``weight_sync.sglang_tensor.serialize_for_sglang``):
  what ``MultiprocessingSerializer.deserialize`` reads, through ``SafeUnpickler``.

``check_server`` runs when the trainer first learns an SGLang server's release (from its
``/server_info``, ``weight_sync.server_kinds``): on the tested release it does nothing; on another
it checks ``SGLANG``'s targets where sglang is importable at that release, and warns
that they are unchecked where it is not (``python -m megatron_grpo.sglang_api.compat``
in the server's environment checks them there).
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from typing import Any

from megatron_grpo.internals import Library, Target, UntestedRelease, check, moved, release

_COMMON = "sglang.srt.utils.common"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"

SGLANG = Library(
    distribution="sglang",
    tested="0.5.23",
    compat_module="megatron_grpo/sglang_api/compat.py",
    targets=(
        Target(
            _UPDATER,
            "WeightUpdater.init_weights_update_group",
            "/init_weights_update_group: joins as rank_offset + its TP rank (weight_sync)",
            params=("master_address", "master_port", "rank_offset", "world_size", "group_name"),
        ),
        Target(
            _UPDATER,
            "init_custom_process_group",
            "the weight updater builds its end of the group with it",
            kind="global",
        ),
        Target(
            _COMMON,
            "init_custom_process_group",
            "wraps the tcp:// rendezvous store in PrefixStore(group_name): update_group_store",
            params=("backend", "init_method", "world_size", "rank", "group_name"),
        ),
        Target(
            "torch.distributed.distributed_c10d",
            "_new_process_group_helper",
            "SGLang's end builds its backend with it, which prefixes the store with "
            "'{group_name}/' and '{device}/': update_group_store (torch of the server's env)",
            params=("store", "group_name", "timeout"),
        ),
        Target(
            _COMMON,
            "MultiprocessingSerializer.deserialize",
            "reads /update_weights_from_tensor payloads: sglang_tensor.serialize_for_sglang",
            params=("data",),
        ),
        Target(
            _COMMON,
            "SafeUnpickler",
            "the allow-list the payload's torch rebuild functions pass through",
        ),
    ),
)
"""SGLang's internals that the weight updates rebuild or rely on."""


def update_group_store(store: Any, group_name: str, backend: str) -> Any:
    """The store under which SGLang's end of a weight-update group meets ours: ``store``
    (the group's ``TCPStore``) with SGLang's and torch's prefixes (module docstring)."""
    import torch.distributed as dist

    device_type = "cuda" if backend == "nccl" else "cpu"
    # init_custom_process_group: PrefixStore(group_name, rendezvous store); torch's
    # _new_process_group_helper: f"{group_name}/", then f"{device}/" for the backend.
    nested = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{device_type}/", nested)


@functools.cache
def check_server(version: str) -> None:
    """An SGLang server of release ``version`` receives weights: on an untested release,
    check ``SGLANG``'s targets (``internals.check``: raises ``MovedInternals`` naming what
    moved) where sglang is importable at that release, else warn that they are unchecked.
    Once per release."""
    if release(version) == release(SGLANG.tested):
        return
    if _local_sglang() == release(version):
        check(SGLANG, installed=version)
        return
    unchecked = "\n  - ".join(t.name for t in SGLANG.targets)
    warnings.warn(
        f"an SGLang {version} server receives the weights; megatron_grpo was tested with "
        f"{SGLANG.tested}, and sglang {version} is not importable here, so the internals of "
        f"it that the weight updates rebuild are unchecked:\n  - {unchecked}\nCheck them in "
        "the server's environment: python -m megatron_grpo.sglang_api.compat",
        UntestedRelease,
        stacklevel=2,
    )


def _local_sglang() -> str | None:
    """The release of the sglang importable here, if any."""
    try:
        return release(importlib.metadata.version("sglang"))
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    """Check ``SGLANG``'s targets against the sglang importable here, whatever its release."""
    installed = importlib.metadata.version("sglang")
    problems = moved(SGLANG)
    for line in problems:
        print(f"moved: {line}")
    print(
        f"sglang {installed}: {len(SGLANG.targets) - len(problems)} of {len(SGLANG.targets)} "
        f"targets of {SGLANG.compat_module} found"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
