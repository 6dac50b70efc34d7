"""A stand-in for the parts of SGLang 0.5.23 that the weight updates rely on.

sglang is not installed in the test environment (its server has its own, ``.venv-sglang``),
so these modules stand in for it under SGLang's own names, with its signatures, and do what
SGLang 0.5.23 does there:

- ``sglang.srt.utils.common.init_custom_process_group``: a server's end of a weight-update
  group (a ``tcp://`` rendezvous, ``PrefixStore(group_name)``, torch's process-group helper);
- ``sglang.srt.utils.common.MultiprocessingSerializer.deserialize`` with ``SafeUnpickler``:
  how a server reads a ``/update_weights_from_tensor`` payload (an allow-list of modules);
- ``...weight_updater.WeightUpdater.init_weights_update_group``: a TP rank joins at
  ``rank_offset + tp_rank``.

The trainer's ends are tested against them (test_sglang_weights.py, in receiver processes)
and ``sglang_api.compat.SGLANG``'s targets are checked against them (test_internals.py):
the declared contract and the one the weight tests exercise are the same.
"""

from __future__ import annotations

import types

VERSION = "0.5.23"
COMMON = "sglang.srt.utils.common"
UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"

COMMON_SOURCE = """
import base64
import io
import pickle


def init_custom_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name=None,
    pg_options=None,
    device_id=None,
):
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name,
        backend_options=pg_options, timeout=timeout, device_id=device_id,
    )
    return pg


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.split(".")[0] in ("torch", "builtins", "collections"):
            return super().find_class(module, name)
        raise RuntimeError(f"blocked {module}.{name}")


class MultiprocessingSerializer:
    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return SafeUnpickler(io.BytesIO(data)).load()
"""

UPDATER_SOURCE = """
import datetime


class WeightUpdater:
    def __init__(self, tp_rank=0):
        self.tp_rank = tp_rank
        self._model_update_group = {}

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        self._model_update_group[group_name] = init_custom_process_group(
            backend=backend,
            init_method=f"tcp://{master_address}:{master_port}",
            timeout=datetime.timedelta(seconds=60),
            world_size=world_size,
            rank=rank_offset + self.tp_rank,
            group_name=group_name,
        )
        return self._model_update_group[group_name]
"""

PACKAGES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.utils",
    "sglang.srt.model_executor",
    "sglang.srt.model_executor.model_runner_components",
)


def modules() -> dict[str, types.ModuleType]:
    """Fresh stand-in modules under SGLang's names, for ``sys.modules``."""
    made = {name: types.ModuleType(name) for name in (*PACKAGES, COMMON, UPDATER)}
    made["sglang"].__version__ = VERSION  # type: ignore[attr-defined]
    exec(compile(COMMON_SOURCE, COMMON, "exec"), vars(made[COMMON]))
    updater = vars(made[UPDATER])
    updater["init_custom_process_group"] = made[COMMON].init_custom_process_group
    exec(compile(UPDATER_SOURCE, UPDATER, "exec"), updater)
    return made
