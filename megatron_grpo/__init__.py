"""megatron_grpo: model-parallel GRPO on megatron-core with exact loss normalization.

``from megatron_grpo import train; train("run.yaml", reward_fn=fn)`` trains from Python
(megatron_grpo/api.py, docs/python_api.md).

``megatron_grpo.train`` is also the package of the training loop: an import of any of its
modules makes that package this package's ``train`` attribute. So the package is made
callable, as ``api.train``: ``megatron_grpo.train(...)`` and its modules
(``megatron_grpo.train.loop``) both work, whatever was imported first.
"""

import importlib
import inspect
import types

from megatron_grpo.api import TrainResult
from megatron_grpo.api import train as _train


class _CallableTrainPackage(types.ModuleType):
    """The ``megatron_grpo.train`` package, which is called as ``megatron_grpo.api.train``."""

    def __call__(self, *args, **kwargs):
        return _train(*args, **kwargs)


_package = importlib.import_module("megatron_grpo.train")  # its __init__ imports nothing
_package.__class__ = _CallableTrainPackage
_package.__signature__ = inspect.signature(_train)  # type: ignore[attr-defined]
_package.__doc__ = _package.__doc__ or _train.__doc__  # help(megatron_grpo.train) in a notebook
train = _package

__all__ = ["TrainResult", "train"]
