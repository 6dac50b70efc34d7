"""The third-party internals the package patches: declared, present and checked.

- Every declared target of torch and megatron-core exists in the installed releases, with
  the parameters the patches rely on.
- The start-up check names what moved when a stand-in module renames a patched attribute or
  drops a parameter, warns on an untested release where nothing moved, and stops
  ``compat.install`` before it patches anything.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest

import megatron_grpo.internals as internals
from megatron_grpo.internals import Library, MovedInternals, Target, UntestedRelease, check, moved
from megatron_grpo.mcore import device
from megatron_grpo.mcore.compat import MEGATRON_CORE

# --------------------------------------------------------------------------- declared targets


@pytest.mark.parametrize("library", [device.TORCH, MEGATRON_CORE], ids=lambda lib: lib.distribution)
def test_every_declared_target_exists_with_its_parameters(library):
    assert moved(library) == []


# --------------------------------------------------------------------------- the check


def standin(monkeypatch, name: str, **changes) -> types.ModuleType:
    """A copy of module ``name`` in ``sys.modules``, with ``changes`` applied (None deletes)."""
    import importlib

    copy = types.ModuleType(name)
    vars(copy).update(vars(importlib.import_module(name)))
    for attr, value in changes.items():
        if value is None:
            delattr(copy, attr)
        else:
            setattr(copy, attr, value)
    monkeypatch.setitem(sys.modules, name, copy)
    return copy


def test_a_renamed_patched_attribute_fails_the_check_by_name(monkeypatch):
    random = "megatron.core.tensor_parallel.random"
    moved_out = standin(monkeypatch, random, _get_cuda_rng_state=None)
    moved_out._get_device_rng_state = lambda *a, **k: None  # what an upgrade might call it
    with pytest.raises(MovedInternals) as raised:
        check(MEGATRON_CORE, installed="0.17.0")
    message = str(raised.value)
    print(message)
    assert "megatron-core 0.17.0 is installed" in message and "tested with 0.16.1" in message
    assert ", 1 moved:" in message
    assert f"{random}._get_cuda_rng_state: {random} has no attribute '_get_cuda_rng_state'" in (
        message
    )
    assert "megatron_grpo/mcore/compat.py" in message


def test_a_dropped_parameter_fails_the_check_by_name(monkeypatch):
    module = "megatron.core.dist_checkpointing.strategies.filesystem_async"

    class FileSystemWriterAsync:  # write_preloaded_data without use_fsync
        @staticmethod
        def write_preloaded_data(transform_list, local_proc_idx, write_bucket, results_queue,
                                 count_queue, **kwargs): ...  # fmt: skip

        @staticmethod
        def write_preloaded_data_multiproc(transform_list, use_msc, rank, write_buckets,
                                           global_results_queue): ...  # fmt: skip

    standin(monkeypatch, module, FileSystemWriterAsync=FileSystemWriterAsync)
    with pytest.raises(MovedInternals) as raised:
        check(MEGATRON_CORE, installed="0.17.0")
    message = str(raised.value)
    print(message)
    assert f"{module}.FileSystemWriterAsync.write_preloaded_data: parameter 'use_fsync' " in message


def test_instance_and_global_targets_are_read_from_the_code(monkeypatch):
    source = (
        "class Group:\n"
        "    def __init__(self):\n"
        "        self.dispatched = False\n"
        "def gate(x):\n"
        "    return gemm(x) if gemm is not None else x\n"
    )
    module = types.ModuleType("standin_lib")
    exec(compile(source, "standin_lib", "exec"), vars(module))
    monkeypatch.setitem(sys.modules, "standin_lib", module)
    present = [
        Target("standin_lib", "Group.dispatched", "reset", kind="instance"),
        Target("standin_lib", "gemm", "set to None when absent", kind="global"),
    ]
    assert [internals.problem(t) for t in present] == [None, None]
    renamed = [
        Target("standin_lib", "Group.gather_dispatched", "reset", kind="instance"),
        Target("standin_lib", "te_gemm", "set to None when absent", kind="global"),
    ]
    assert internals.problem(renamed[0]) == (
        "no method of Group sets self.gather_dispatched any more"
    )
    assert internals.problem(renamed[1]) == (
        "no function of standin_lib reads the global 'te_gemm' any more"
    )


def test_an_untested_release_with_everything_in_place_warns():
    with pytest.warns(UntestedRelease, match="megatron-core 0.17.0 is installed"):
        assert check(MEGATRON_CORE, installed="0.17.0") == []


def test_the_tested_release_is_not_looked_into():
    gone = Library("torch", "2.13.0", "nowhere.py", (Target("no_such_module", "x", "gone"),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check(gone, installed="2.13.0+cu128") == []  # a local build label is the same
    with pytest.raises(MovedInternals, match="module no_such_module cannot be imported"):
        check(gone, installed="2.14.0")


def test_compat_install_stops_before_patching_when_something_moved(monkeypatch):
    """install is where the start-up check runs: it raises before any patch is made."""
    import torch

    from megatron_grpo.mcore import compat

    standin(monkeypatch, "megatron.core.tensor_parallel.random", _set_cuda_rng_state=None)
    real_version = internals.installed_version
    monkeypatch.setattr(
        internals,
        "installed_version",
        lambda library: "99.0" if library is MEGATRON_CORE else real_version(library),
    )
    current_device = torch.cuda.current_device
    with pytest.raises(MovedInternals, match="_set_cuda_rng_state"):
        compat.install()
    assert torch.cuda.current_device is current_device
