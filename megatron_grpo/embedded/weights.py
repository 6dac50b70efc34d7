"""Weights into the embedded server: from a Hugging Face directory or from named tensors.

``/update_weights_from_tensor`` on the embedded server takes the tensors in one of two
ways, never as base64 in JSON:
- in shared memory, from a sender on the same machine and of the same user: the sender
  copies the bucket into one file under ``/dev/shm``, in a directory only its user may
  enter (``shared_bucket``), and sends a small JSON body naming the file and each tensor's
  dtype, shape and offset (``{"shared_memory": ...}``); the server opens the file without
  following links, only if it is such a file (``map_shared_file``), maps it and copies each
  tensor straight into its parameter. One copy on each side.
- as the request body itself: one safetensors blob of ``{hf_name: tensor}`` (Content-Type
  ``application/octet-stream``), with ``weight_version`` and ``flush_cache`` as query
  parameters, from anywhere.
SGLang's own format (pickled ``MultiprocessingSerializer`` handles in JSON) is refused:
unpickling what a client sends is not something an HTTP server should do.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.hf_config import hf_config_from_model_config

TENSOR_CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class TensorUpdate:
    """A ``/update_weights_from_tensor`` request for the embedded server (one TP rank)."""

    body: bytes
    """The tensors, one safetensors blob."""
    query: dict[str, str]
    """``weight_version`` and ``flush_cache``."""


def serialize_named_tensors(named_tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Tensors to one safetensors blob. Only tensors that share memory with one already
    taken (tied embeddings) or are not contiguous are copied first."""
    plain: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in named_tensors.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        plain[name] = t
    return safetensors.torch.save(plain)


def deserialize_named_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(blob)
    except Exception as err:  # safetensors raises several types
        raise ValueError(f"the request body is not a safetensors blob: {err}") from err


def tensor_update(
    named_tensors: Mapping[str, torch.Tensor], *, weight_version: str, flush_cache: bool = True
) -> TensorUpdate:
    """The request that loads ``named_tensors`` into the embedded server."""
    return TensorUpdate(
        body=serialize_named_tensors(named_tensors),
        query={"weight_version": weight_version, "flush_cache": str(flush_cache).lower()},
    )


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "mgrpo_weights_"
BUCKET_FILE = "bucket"
_ALIGN = 64


@dataclass
class SharedBucket:
    """A bucket of tensors in one shared-memory file; ``close()`` removes it and its directory."""

    path: Path
    """``SHM_DIR/mgrpo_weights_*/bucket``, in a directory of its own (mode 0700)."""
    entries: list[dict[str, Any]]
    """Per tensor: name, dtype (``float32``), shape and byte offset in the file."""
    buffer: torch.Tensor

    def request(self, *, weight_version: str, flush_cache: bool = True) -> dict[str, Any]:
        """The JSON body of ``/update_weights_from_tensor`` that loads this bucket."""
        return {
            "shared_memory": {"path": str(self.path), "tensors": self.entries},
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.parent.rmdir()


def shared_memory_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def shared_bucket(named_tensors: Mapping[str, torch.Tensor]) -> SharedBucket:
    """``named_tensors`` copied into a new file under ``/dev/shm``, each at an aligned offset.

    The file lies in a directory of its own that only this user may enter (``mkdtemp``
    makes it mode 0700), which is what the server asks of a file before it reads it
    (``load_shared``): nobody else can put a file or a link there.
    """
    entries, offset = [], 0
    for name, t in named_tensors.items():
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
            }
        )
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    directory = tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}_", dir=SHM_DIR)
    path = Path(directory) / BUCKET_FILE
    try:
        buffer = torch.from_file(str(path), shared=True, size=max(offset, 1), dtype=torch.uint8)
    except BaseException:
        os.rmdir(directory)
        raise
    bucket = SharedBucket(path, entries, buffer)
    try:
        for entry, t in zip(entries, named_tensors.values()):
            _view(buffer, entry).copy_(t.detach())
    except BaseException:
        bucket.close()
        raise
    return bucket


def _view(buffer: torch.Tensor, entry: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{entry['name']}: unknown dtype {entry['dtype']!r}")
    shape = [int(n) for n in entry["shape"]]
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    start = int(entry["offset"])
    if start < 0 or start % _ALIGN or start + nbytes > buffer.numel():
        raise ValueError(f"{entry['name']}: offset {start} and size {nbytes} lie outside the file")
    return buffer[start : start + nbytes].view(dtype).view(shape)


def load_shared(spec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a ``shared_memory`` request, as views of the mapped file (no copy).

    Only a file ``shared_bucket`` could have made is read; see ``map_shared_file``.
    """
    buffer = map_shared_file(Path(str(spec.get("path", ""))))
    return {str(e["name"]): _view(buffer, e) for e in spec.get("tensors", [])}


class SharedFileRefused(ValueError):
    """A ``shared_memory.path`` the server will not read; the message says why."""


def map_shared_file(path: Path) -> torch.Tensor:
    """The bytes of the bucket file at ``path``, mapped copy-on-write.

    ``/dev/shm`` is writable by every user, so the file is trusted only as ``shared_bucket``
    leaves it: ``SHM_DIR/mgrpo_weights_*/<file>``, the directory owned by this process's
    user with no access for anyone else, the file a regular file of that user. Each step
    is opened relative to the last, never following a link, and checked on the open
    descriptor (no window to swap a name in between). Anything else raises
    ``SharedFileRefused`` naming the reason, before a byte is read.
    """
    directory, name = path.parent, path.name
    if (
        not path.is_absolute()
        or directory.parent != SHM_DIR
        or not directory.name.startswith(SHM_PREFIX)
        or name in ("", ".", "..")
    ):
        raise SharedFileRefused(
            f"refused shared_memory.path {path}: it must be a "
            f"{SHM_DIR}/{SHM_PREFIX}*/<file> made by shared_bucket"
        )
    shm_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dir_fd = _open_checked(directory.name, shm_fd, path, directory=True)
    finally:
        os.close(shm_fd)
    try:
        fd = _open_checked(name, dir_fd, path, directory=False)
    finally:
        os.close(dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise SharedFileRefused(f"refused shared_memory.path {path}: the file is empty")
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # keeps ``mapped`` alive


def _open_checked(name: str, dir_fd: int, path: Path, *, directory: bool) -> int:
    """``name`` under ``dir_fd`` opened read-only without following a link, checked to be a
    directory private to this user (``directory``) or a regular file of this user."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if directory:
        flags |= os.O_DIRECTORY
    what = "its directory" if directory else "the file"
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        reason = _open_failure(err, name, dir_fd)
        raise SharedFileRefused(f"refused shared_memory.path {path}: {what} {reason}") from None
    st = os.fstat(fd)
    uid = os.getuid()
    if directory and not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif not directory and not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not by this server's uid {uid}"
    elif directory and st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}, open to other users (want 700)"
    else:
        return fd
    os.close(fd)
    raise SharedFileRefused(f"refused shared_memory.path {path}: {what} {problem}")


def _open_failure(err: OSError, name: str, dir_fd: int) -> str:
    link = "is a symbolic link (links are not followed)"
    if err.errno == errno.ELOOP:
        return link
    if err.errno == errno.ENOTDIR:  # O_DIRECTORY | O_NOFOLLOW on a link says so
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return link
    if err.errno == errno.ENOENT:
        return "does not exist (is the sender on this host?)"
    if err.errno == errno.ENOTDIR:
        return "is not a directory"
    return f"cannot be opened: {err.strerror}"


def load_hf_model(model_path: str) -> PreTrainedModel:
    """A causal LM from a Hugging Face directory, fp32, eval mode."""
    # Loaded in the checkpoint's dtype and then upcast (exact from bf16/fp16):
    # the dtype keyword changed name between transformers 4 and 5.
    return AutoModelForCausalLM.from_pretrained(model_path).float().eval()


def hf_model_from_config(cfg: ModelConfig) -> PreTrainedModel:
    """A transformers model of ``cfg``'s family and shape with random weights (the
    embedded engine's copy of the policy until the first push)."""
    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    return AutoModelForCausalLM.from_config(hf_cfg).float().eval()


def hf_model_from_state(named: Mapping[str, torch.Tensor], cfg: ModelConfig) -> PreTrainedModel:
    """A transformers model holding ``named`` (the embedded engine's copy of the policy)."""
    hf_cfg = hf_config_from_model_config(cfg, cfg.hf_family)
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(named, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"HF model mismatch: missing {missing}, unexpected {unexpected}")
    return model


def hf_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's weights under the names of a saved checkpoint, as views of its
    parameters: a MoE model's fused in-memory experts (transformers 5) split per expert."""
    from megatron_grpo.convert.experts import split_hf_experts

    return split_hf_experts(model.state_dict(keep_vars=True))


def copy_into_model(
    model: PreTrainedModel, named_tensors: Mapping[str, torch.Tensor], *, require_all: bool
) -> None:
    """Copy tensors into the parameters and buffers of the same (HF) name.

    Raises ValueError, before changing anything, on an unknown name, a shape
    mismatch, or (with ``require_all``) a missing name.
    """
    targets = hf_weights(model)
    unknown = sorted(set(named_tensors) - set(targets))
    if unknown:
        raise ValueError(f"no such weights in the model: {unknown[:10]}")
    if require_all:
        missing = sorted(set(targets) - set(named_tensors))
        if missing:
            raise ValueError(f"weights missing from the update: {missing[:10]}")
    for name, tensor in named_tensors.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                f"{tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in named_tensors.items():
            targets[name].copy_(tensor)
