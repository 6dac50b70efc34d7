"""The third-party internals the package patches: declared, present, checked, and nowhere else.

- Every declared target of torch and megatron-core exists in the installed releases, with
  the parameters the patches rely on; SGLang's against a real sglang where there is one,
  and against the stand-in the weight tests join through (``sglang_standin.py``).
- The start-up check names what moved when a stand-in module renames a patched attribute or
  drops a parameter, warns on an untested release where nothing moved, and stops
  ``compat.install`` before it patches anything.
- No module outside the compat modules patches torch, megatron-core, transformers or
  SGLang, or reaches for their private names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import megatron_grpo.internals as internals
from megatron_grpo.internals import Library, MovedInternals, Target, UntestedRelease, check, moved
from megatron_grpo.mcore import device
from megatron_grpo.mcore.compat import MEGATRON_CORE
from megatron_grpo.sglang_api import compat as sglang_compat
from megatron_grpo.sglang_api.compat import SGLANG

sys.path.insert(0, str(Path(__file__).parent))
import sglang_standin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_grpo"
COMPAT_MODULES = {"mcore/compat.py", "mcore/device.py", "sglang_api/compat.py"}
"""Where patches of third-party internals may live (docs/architecture.md)."""
THIRD_PARTY = {"torch", "megatron", "transformers", "sglang"}


# --------------------------------------------------------------------------- declared targets


@pytest.mark.parametrize("library", [device.TORCH, MEGATRON_CORE], ids=lambda lib: lib.distribution)
def test_every_declared_target_exists_with_its_parameters(library):
    assert moved(library) == []


def test_the_sglang_targets_exist_in_a_real_sglang():
    sglang_python = ROOT / ".venv-sglang" / "bin" / "python"
    if sglang_compat._local_sglang() is None:  # (tests/sglang is a namespace package)
        if not sglang_python.exists():
            pytest.skip(
                "sglang is not importable here and .venv-sglang is absent "
                "(bash scripts/setup_sglang_venv.sh); the SGLang targets are checked against "
                "the stand-in instead (test_the_sglang_targets_hold_for_the_stand_in)"
            )
        done = subprocess.run(
            [str(sglang_python), "-m", "megatron_grpo.sglang_api.compat"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return
    assert moved(SGLANG) == []


@pytest.fixture
def standin_sglang(monkeypatch):
    """SGLang 0.5.23's stand-in modules in ``sys.modules``; returns them."""
    made = sglang_standin.modules()
    for name, module in made.items():
        monkeypatch.setitem(sys.modules, name, module)
    sglang_compat.check_server.cache_clear()
    yield made
    sglang_compat.check_server.cache_clear()


def test_the_sglang_targets_hold_for_the_stand_in(standin_sglang):
    assert sglang_standin.VERSION == SGLANG.tested
    assert moved(SGLANG) == []


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


def test_an_sglang_server_of_another_release_is_checked_where_sglang_is(
    monkeypatch, standin_sglang
):
    sglang_compat.check_server(SGLANG.tested)  # the tested release: nothing to do
    monkeypatch.setattr(sglang_compat, "_local_sglang", lambda: "0.6.0")
    updater = standin_sglang[sglang_standin.UPDATER].WeightUpdater
    updater.join_weights_update_group = updater.init_weights_update_group
    del updater.init_weights_update_group
    with pytest.raises(MovedInternals) as raised:
        sglang_compat.check_server("0.6.0")
    print(raised.value)
    assert "sglang 0.6.0 is installed" in str(raised.value)
    assert "WeightUpdater has no attribute 'init_weights_update_group'" in str(raised.value)


def test_an_sglang_server_of_another_release_is_flagged_where_sglang_is_not(monkeypatch):
    sglang_compat.check_server.cache_clear()
    monkeypatch.setattr(sglang_compat, "_local_sglang", lambda: None)
    with pytest.warns(UntestedRelease, match="unchecked") as seen:
        sglang_compat.check_server("0.6.1")
    assert all(t.name in str(seen[0].message) for t in SGLANG.targets)
    sglang_compat.check_server.cache_clear()


def test_the_server_side_check_reports_what_it_found(monkeypatch, standin_sglang, capsys):
    """``python -m megatron_grpo.sglang_api.compat``, as run in the server's environment."""
    monkeypatch.setattr(sglang_compat.importlib.metadata, "version", lambda name: "0.5.23")
    assert sglang_compat.main() == 0
    total = len(SGLANG.targets)
    assert f"{total} of {total} targets of {SGLANG.compat_module} found" in capsys.readouterr().out
    del standin_sglang[sglang_standin.COMMON].SafeUnpickler
    assert sglang_compat.main() == 1
    assert "moved: sglang.srt.utils.common.SafeUnpickler" in capsys.readouterr().out


# --------------------------------------------------------------------------- patch sites


def _chain(node: ast.AST) -> list[str] | None:
    """``["a", "b", "c"]`` for the expression ``a.b.c``; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def patch_sites(source: str) -> list[str]:
    """Where ``source`` patches a third-party library or reaches for its private names:
    an attribute of one of its modules or classes (or an alias of one) assigned or deleted,
    ``setattr``/``delattr`` on one, a private name imported from it, and any private
    attribute (``x._name``) of anything but ``self``/``cls`` and the standard library's or
    this package's modules, named as a string to ``getattr`` and its kin too."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # import a.b binds a; import a.b as x binds x to a.b
                root = alias.name.split(".")[0]
                bound[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):  # plain aliases: writer = fsa.FileSystemWriterAsync
        if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
            chain = _chain(node.value)
            if chain and chain[0] in bound:
                bound[node.targets[0].id] = ".".join([bound[chain[0]], *chain[1:]])  # type: ignore[attr-defined]

    def resolve(node: ast.AST) -> str | None:
        chain = _chain(node)
        return ".".join([bound[chain[0]], *chain[1:]]) if chain and chain[0] in bound else None

    def third_party(name: str | None) -> bool:
        return name is not None and name.split(".")[0] in THIRD_PARTY

    found = set()
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(one, ast.Attribute) and third_party(resolve(one.value)):
                    found.add((node.lineno, f"sets {resolve(one)}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            name, args = node.func.id, node.args
            if name in ("setattr", "delattr") and third_party(resolve(args[0])):
                found.add((node.lineno, f"{name} on {resolve(args[0])}"))
            if name in ("getattr", "setattr", "hasattr", "delattr") and len(args) > 1:
                if isinstance(args[1], ast.Constant) and _private(str(args[1].value)):
                    found.add((node.lineno, f"{name} of private {args[1].value!r}"))
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if _chain(node.value) in (["self"], ["cls"]):
                continue
            root = (resolve(node.value) or "").split(".")[0]
            if root in sys.stdlib_module_names or root == "megatron_grpo":
                continue
            found.add((node.lineno, f"private {ast.unparse(node)}"))
        if isinstance(node, ast.ImportFrom) and third_party(node.module):
            for alias in node.names:
                if _private(alias.name):
                    found.add((node.lineno, f"imports private {node.module}.{alias.name}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_patch_of_a_third_party_library_outside_the_compat_modules():
    sites = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in COMPAT_MODULES
        and (found := patch_sites(path.read_text()))
    }
    assert sites == {}


def test_the_compat_modules_are_where_the_patches_are():
    for module in ("mcore/compat.py", "mcore/device.py"):
        assert patch_sites((PACKAGE / module).read_text()), module


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\ntorch.cuda.Stream = object", "line 2: sets torch.cuda.Stream"),
        (
            "from megatron.core.transformer.moe import router\nrouter.TopKRouter.forward = f",
            "line 2: sets megatron.core.transformer.moe.router.TopKRouter.forward",
        ),
        (
            "from megatron.core.distributed import DistributedDataParallel as DDP\n"
            "def f():\n    DDP.start_param_sync = g",
            "line 3: sets megatron.core.distributed.DistributedDataParallel.start_param_sync",
        ),
        (
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa\n"
            "writer = fsa.FileSystemWriterAsync\nwriter.write_preloaded_data = g",
            "line 3: sets megatron.core.dist_checkpointing.strategies.filesystem_async."
            "FileSystemWriterAsync.write_preloaded_data",
        ),
        ("import transformers\nsetattr(transformers, 'x', 1)", "line 2: setattr on transformers"),
        (
            "import torch.distributed as dist\nstore = dist.distributed_c10d._get_default_store()",
            "line 2: private dist.distributed_c10d._get_default_store",
        ),  # fmt: skip
        (
            "def f(config):\n    config._attn_implementation = 'eager'",
            "line 2: private config._attn_implementation",
        ),  # fmt: skip
        (
            "from sglang.srt.utils import _helper",
            "line 1: imports private sglang.srt.utils._helper",
        ),
        (
            "def f(o):\n    return getattr(o, '_init_states', None)",
            "line 2: getattr of private '_init_states'",
        ),  # fmt: skip
    ],
)
def test_a_new_patch_site_is_caught(source, expected):
    assert expected in patch_sites(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nlast = torch.zeros(3)\nlast[torch.cumsum(x, 0)] = 1",
        "import os\nos._exit(0)",
        "class A:\n    def f(self):\n        self._x = 1\n        return self._x",
        "def f(spec):\n    spec.submodules.input_layernorm = None",  # a spec's public fields
    ],
)
def test_ordinary_code_is_not_a_patch_site(source):
    assert patch_sites(source) == []
