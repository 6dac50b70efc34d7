"""Lets SGLang 0.5.23 keep routed experts on a CPU-only machine (``--device cpu``).

SGLang keeps the routes of every KV slot in a host buffer it allocates with
``ALLOC_MEMORY_FUNCS[device]`` (``sglang.srt.mem_cache.pool_host.common``), pinned;
the table has entries for npu, musa and xpu, and any other device, cpu included, gets
``alloc_with_host_register``, which calls ``cudaHostRegister`` and so fails without an
NVIDIA driver. This adds the missing ``cpu`` entry: plain, unpinned host memory (pinning
needs an accelerator). Nothing else in SGLang changes.

On ``PYTHONPATH``, Python imports this module in every SGLang process at start-up (the
scheduler's too: it is a spawned interpreter); the entry is added once SGLang has
imported that module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def alloc_on_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    import torch

    return torch.zeros(dims, dtype=dtype, device=device)


class AddCpuEntry(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loading of TARGET to add the entry after it ran."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_on_cpu

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, AddCpuEntry())
