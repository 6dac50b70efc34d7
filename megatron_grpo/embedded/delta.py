"""Delta weight updates for the embedded server (``rollout.sync.delta``): the wire format of
``/update_weights_from_delta`` and the two pure halves, encoding (the sender) and applying
(the engine).

A delta of one tensor is ``zstd(new_bytes XOR previous_bytes)`` in the dtype sent, with the
xxh3 checksum of ``new_bytes`` (``embedded.checksum``): the engine XORs it into its own bytes
of that weight in that dtype and loads the result only when its checksum is the sender's.
After a small optimizer step most high bytes of every value are unchanged, so the XOR is
mostly zeros and compresses well. Tensors whose bytes did not change are listed by name.

Body (``application/octet-stream``): a 4-byte little-endian header length, the JSON header
``{"base_version", "weight_version", "unchanged": [names], "tensors": [{"name", "dtype",
"shape", "checksum", "size"}]}``, then each tensor's zstd frame in the header's order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from torch import Tensor

DELTA_CONTENT_TYPE = "application/octet-stream"
ZSTD_LEVEL = 1
"""Level 1: XOR deltas are mostly zero bytes, which level 1 already packs; higher levels
cost several times the time for a few per cent."""


def raw_bytes(tensor: Tensor) -> np.ndarray:
    """A host copy of ``tensor``'s bytes in its dtype, C order, as uint8."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().copy()


def checksum_of(data: np.ndarray) -> str:
    """``embedded.checksum.tensor_checksum`` of the tensor whose bytes are ``data``."""
    return xxhash.xxh3_64_hexdigest(data.data)


def xor_frame(new: np.ndarray, previous: np.ndarray) -> bytes | None:
    """The zstd frame of ``new XOR previous`` (the same length); None when they are equal."""
    xor = np.bitwise_xor(new, previous)
    if not xor.any():
        return None
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xor.data)


@dataclass
class DeltaBucket:
    """One ``/update_weights_from_delta`` request."""

    base_version: str
    weight_version: str
    tensors: list[dict[str, Any]] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def add(self, name: str, dtype: str, shape: list[int], checksum: str, frame: bytes) -> None:
        self.tensors.append(
            {"name": name, "dtype": dtype, "shape": shape, "checksum": checksum, "size": len(frame)}
        )
        self.frames.append(frame)

    def body(self) -> bytes:
        header = json.dumps(
            {
                "base_version": self.base_version,
                "weight_version": self.weight_version,
                "unchanged": self.unchanged,
                "tensors": self.tensors,
            }
        ).encode()
        return b"".join([struct.pack("<I", len(header)), header, *self.frames])


def parse_body(blob: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """The header and the frames of a delta body; ValueError on a malformed one."""
    try:
        (size,) = struct.unpack_from("<I", blob)
        header = json.loads(blob[4 : 4 + size])
        frames, at = [], 4 + size
        for entry in header["tensors"]:
            frames.append(blob[at : at + int(entry["size"])])
            at += int(entry["size"])
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the request body is not a delta bucket: {err}") from err
    if at != len(blob):
        raise ValueError(f"the delta bucket holds {len(blob)} bytes, its header says {at}")
    return header, frames


def apply_delta(
    current: Mapping[str, Tensor], header: Mapping[str, Any], frames: list[bytes]
) -> tuple[dict[str, Tensor], list[str]]:
    """The new tensors (in the dtype sent) whose checksum matches, and the names whose frame
    did not decompress, does not fit or gives other bytes than the sender's."""
    loaded: dict[str, Tensor] = {}
    failed: list[str] = []
    decompressor = zstandard.ZstdDecompressor()
    for entry, frame in zip(header["tensors"], frames, strict=True):
        name = entry["name"]
        dtype = getattr(torch, str(entry["dtype"]), None)
        if name not in current or not isinstance(dtype, torch.dtype):
            failed.append(name)
            continue
        base = raw_bytes(current[name].to(dtype))
        try:
            xor = decompressor.decompress(frame, max_output_size=base.size)
        except zstandard.ZstdError:
            failed.append(name)
            continue
        if len(xor) != base.size:
            failed.append(name)
            continue
        new = np.bitwise_xor(base, np.frombuffer(xor, np.uint8))
        if checksum_of(new) != entry["checksum"]:
            failed.append(name)
            continue
        loaded[name] = torch.from_numpy(new).view(dtype).reshape(entry["shape"])
    return loaded, failed
