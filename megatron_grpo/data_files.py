"""Rows of prompt data: jsonl and parquet files, Arrow files and saved Hugging Face datasets.

jsonl is read line by line, so that a bad line is reported and skipped. The
others have a schema: parquet, Arrow files (``.arrow``: what
``Dataset.save_to_disk`` writes, or a plain Arrow IPC file) and dataset
folders (``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, read with
``datasets.load_from_disk``; of a DatasetDict, the ``data.split`` split). A
prompt or label column missing from a schema is an error that names the
columns there are, before any row is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_grpo.config import DataConfig

if TYPE_CHECKING:
    import pyarrow as pa

ROW_SUFFIXES = (".jsonl", ".parquet", ".arrow")
"""Files read as rows; any other path must be a saved dataset folder."""


class RowError(ValueError):
    """A row cannot be used; the message says why."""


def read_rows(path: str, config: DataConfig) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """``(line, row)`` for each row of a file or folder, or ``(line, RowError)`` for a bad one.

    ``line`` is the 1-based line (jsonl) or row (the others)."""
    if path.endswith(".jsonl"):
        yield from _read_jsonl(path)
        return
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # only parquet users need pyarrow

        table = pq.read_table(path)
    elif path.endswith(".arrow"):
        table = _read_arrow(path)
    else:
        table = _read_folder(path, config.split)
    if table.num_rows == 0:  # reported as "no rows" by the dataset
        return
    check_columns(path, table.column_names, config)
    yield from enumerate(table.to_pylist(), start=1)


def check_columns(path: str, columns: list[str], config: DataConfig) -> None:
    """A ValueError naming the missing column and the ones there are."""
    wanted = [("prompt", config.prompt_key)]
    if config.require_label:
        wanted.append(("label", config.label_key))
    for what, key in wanted:
        if key not in columns:
            hint = " (or data.require_label=false)" if what == "label" else ""
            raise ValueError(
                f"data.path {path!r} has no {what} column {key!r}: its columns are "
                f"{', '.join(columns) or 'none'}; set data.{what}_key{hint}"
            )


def _read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    # Binary mode: a text-mode reader would fail the whole file on the first bad byte.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, RowError(f"invalid UTF-8 at byte {e.start}")
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield line_no, RowError(f"invalid JSON: {e.msg} at column {e.colno}")
                continue
            if not isinstance(row, dict):
                yield line_no, RowError(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield line_no, row


def _read_arrow(path: str) -> pa.Table:
    """An Arrow stream (as ``datasets`` writes it) or an Arrow IPC file."""
    import pyarrow as pa

    try:
        from datasets import Dataset

        return Dataset.from_file(path).data.table
    except (pa.ArrowInvalid, OSError):
        pass
    try:
        with pa.ipc.open_file(path) as reader:
            return reader.read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"data.path {path!r} is not an Arrow stream or file: {e}") from None


def _read_folder(path: str, split: str) -> pa.Table:
    """The rows of a ``save_to_disk`` folder: a Dataset, or one split of a DatasetDict."""
    from datasets import DatasetDict, load_from_disk

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"data.path {path!r} is not a .jsonl, .parquet or .arrow file nor a saved "
            "dataset folder"
        )
    state = folder / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
        import pyarrow as pa

        return pa.table({})  # an empty Dataset, which load_from_disk cannot read
    try:
        loaded = load_from_disk(path)
    except FileNotFoundError as e:  # a folder that save_to_disk did not write
        raise ValueError(f"data.path {path!r}: {e}") from None
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"data.path {path!r} is a DatasetDict without the split {split!r} "
                f"(data.split); its splits are {', '.join(loaded)}"
            )
        loaded = loaded[split]
    return loaded.flatten_indices().data.table
