"""Prompt datasets: rows from files or saved datasets, tokenized once, sampled by seeded epochs.

Rows come from jsonl, parquet and Arrow files and saved Hugging Face dataset
folders (data_files.py).

``PromptDataset`` reads every row up front, applies the chat template,
tokenizes, and keeps the prompts that fit ``max_prompt_length`` (by default
the room the model's context leaves; a longer prompt is dropped and counted, or
refuses the run with ``data.overlong_prompts=error``). A bad row is reported
(file, line, reason) and skipped, never fatal: one malformed line in a
million-row file should not stop a run; a file without rows among several is
named in a warning. Only a dataset with no usable row is an error.

``PromptSampler`` walks the dataset in epochs whose order depends only on
``(seed, epoch)``, so its whole state is ``{epoch, position, seed}`` and a
resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from megatron_grpo.config import DataConfig
from megatron_grpo.data_files import RowError, read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One usable prompt."""

    index: int
    """Position in the dataset (over all files, after skipping bad and long rows)."""
    prompt_ids: list[int]
    prompt_text: str
    """The text the ids encode (after templating)."""
    label: Any
    metadata: dict[str, Any]
    """The row's other columns, passed through to the reward function."""


class Problem(NamedTuple):
    """A row that was skipped; ``line`` is the 1-based line (jsonl) or row (the others)."""

    file: str
    line: int
    reason: str


# --------------------------------------------------------------------------- prompts


def to_messages(prompt: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat a prompt stands for: a string is one user message, a list is used as is."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if not prompt:
            raise RowError("empty prompt (no messages)")
        for i, m in enumerate(prompt):
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise RowError(f"message {i} is not a {{role, content}} mapping of strings")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if not any(m["content"].strip() for m in messages):
            raise RowError("empty prompt (every message is empty)")
    else:
        raise RowError(
            f"prompt must be a string or a list of messages, got {type(prompt).__name__}"
        )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(
    prompt: Any, tokenizer: PreTrainedTokenizerBase, config: DataConfig
) -> tuple[list[int], str]:
    """``(ids, text)`` of a prompt, templated or not as the config says."""
    if not config.apply_chat_template:
        if not isinstance(prompt, str):
            raise RowError(
                f"prompt is a {type(prompt).__name__}; only string prompts work "
                "with data.apply_chat_template=false"
            )
        if not prompt.strip():
            raise RowError("empty prompt")
        return list(tokenizer(prompt)["input_ids"]), prompt
    from jinja2 import TemplateError  # installed with transformers' chat-template support

    messages = to_messages(prompt, config.system_prompt)
    try:
        # return_dict=False: transformers 5 returns a BatchEncoding by default, 4.x a list.
        ids: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as e:  # templates reject some chats, e.g. roles out of order
        raise RowError(f"chat template failed: {e}") from None
    return [int(i) for i in ids], str(text)


def split_row(row: dict[str, Any], config: DataConfig) -> tuple[Any, Any, dict[str, Any]]:
    """``(prompt, label, metadata)`` of a row, or a RowError naming the missing field."""
    if config.prompt_key not in row or row[config.prompt_key] is None:
        raise RowError(f"missing prompt key {config.prompt_key!r}")
    label = row.get(config.label_key)
    if label is None and config.require_label:
        raise RowError(f"missing label key {config.label_key!r}")
    metadata = {k: v for k, v in row.items() if k not in (config.prompt_key, config.label_key)}
    return row[config.prompt_key], label, metadata


class PromptDataset:
    """Every usable prompt of the configured files, tokenized.

    ``problems`` lists the skipped rows; ``num_too_long`` counts the prompts
    dropped by ``max_prompt_length``.
    """

    def __init__(
        self, config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, first_only: bool = False
    ) -> None:
        """``first_only`` stops at the first usable prompt: a check that the files hold one,
        which raises as a full read would when they hold none."""
        if not config.paths:
            raise ValueError(
                "data.path is empty: give a .jsonl, .parquet or .arrow file or a saved "
                "dataset folder"
            )
        if config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.apply_chat_template is true but the tokenizer has no chat_template"
            )
        self.config = config
        self.items: list[PromptItem] = []
        self.problems: list[Problem] = []
        self.num_too_long = 0
        num_rows = 0
        for path in config.paths:
            if not Path(path).exists():
                raise ValueError(f"data.path {path!r} does not exist")
            rows_before = num_rows
            for line, row in read_rows(path, config):
                num_rows += 1
                try:
                    if isinstance(row, RowError):
                        raise row
                    prompt, label, metadata = split_row(row, config)
                    ids, text = encode_prompt(prompt, tokenizer, config)
                except RowError as e:
                    self.problems.append(Problem(path, line, str(e)))
                    logger.warning("%s:%d: skipping row: %s", path, line, e)
                    continue
                if config.max_prompt_length is not None and len(ids) > config.max_prompt_length:
                    if config.overlong_prompts == "error":
                        raise ValueError(
                            f"{path}:{line}: the prompt has {len(ids)} tokens, more than "
                            f"data.max_prompt_length={config.max_prompt_length} "
                            "(data.overlong_prompts=error; 'filter' drops such prompts)"
                        )
                    self.num_too_long += 1
                    continue
                self.items.append(PromptItem(len(self.items), ids, text, label, metadata))
                if first_only:
                    return
            if num_rows == rows_before and len(config.paths) > 1:
                logger.warning("data.path %s has no rows; the other files are read", path)
        if self.num_too_long:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                "(data.overlong_prompts=filter)",
                self.num_too_long,
                num_rows,
                config.max_prompt_length,
            )
        if not self.items:
            raise ValueError(self._empty_reason(num_rows))

    def _empty_reason(self, num_rows: int) -> str:
        files = ", ".join(self.config.paths)
        if num_rows == 0:
            return f"no rows in {files}"
        if self.problems and not self.num_too_long:
            first = self.problems[0]
            return (
                f"every row of {files} is bad ({len(self.problems)} rows); "
                f"first: {first.file}:{first.line}: {first.reason}"
            )
        return (
            f"no usable prompt in {files}: {len(self.problems)} bad rows, {self.num_too_long} "
            f"longer than data.max_prompt_length={self.config.max_prompt_length}"
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


# --------------------------------------------------------------------------- sampling


def epoch_order(num_items: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order of one epoch: a function of (seed, epoch) only."""
    if not shuffle:
        return list(range(num_items))
    rng = np.random.default_rng([seed, epoch])
    return [int(i) for i in rng.permutation(num_items)]


class PromptSampler:
    """Batches of prompts across epochs, with a resumable cursor."""

    def __init__(self, dataset: PromptDataset, *, shuffle: bool, seed: int) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        """Items of the current epoch already handed out."""
        self._order: list[int] | None = None

    @classmethod
    def from_config(cls, dataset: PromptDataset) -> PromptSampler:
        return cls(dataset, shuffle=dataset.config.shuffle, seed=dataset.config.seed)

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(
                len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle
            )
        return self._order

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next ``n`` prompts; an epoch boundary inside the batch starts the next epoch."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        batch: list[PromptItem] = []
        while len(batch) < n:
            order = self._current_order()
            take = order[self.position : self.position + n - len(batch)]
            batch.extend(self.dataset[i] for i in take)
            self.position += len(take)
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
                self._order = None
        return batch

    def state_dict(self) -> dict[str, int]:
        # num_items guards against resuming on a different dataset (other files,
        # another max_prompt_length), which would silently change every order.
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"data sampler state was saved with seed {state['seed']}, "
                f"but this run uses seed {self.seed}"
            )
        num_items = state.get("num_items", len(self.dataset))
        if num_items != len(self.dataset):
            raise ValueError(
                f"data sampler state was saved for {num_items} prompts, "
                f"but the dataset now has {len(self.dataset)}"
            )
        if state["epoch"] < 0 or not 0 <= state["position"] < len(self.dataset):
            raise ValueError(f"invalid data sampler state {dict(state)}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
