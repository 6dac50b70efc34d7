"""TRL-style and verl-style reward functions, called unchanged (``reward.custom_style``).

- native: ``fn(response, label, metadata) -> float``, per sample (the project's own).
- trl: TRL's ``fn(prompts, completions, **kwargs) -> list[float]``, once per batch, with
  keyword arguments only: ``prompts``, ``completions`` (strings: TRL's standard format;
  the conversational one, lists of messages, is not made), ``completion_ids``,
  ``trainer_state`` (None), the item's label under ``reward.label_name`` and each of its
  metadata entries (the row's other columns) under its own name; one list entry per sample.
  ``prompts`` and ``completion_ids`` are each sample's when the caller hands them to
  ``RewardScorer.score``, else None.
- verl: verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)
  -> float | dict``, per sample, by keyword: ``data_source`` from the metadata entry of that
  name, ``ground_truth`` the label (or its ``ground_truth`` entry when the label is a mapping,
  as verl's ``reward_model`` column is), ``extra_info`` the metadata's ``extra_info`` entry
  when it has one, else the whole metadata. A dict's ``score`` is the reward; its other
  entries are not kept.

A keyword argument the function does not take (no parameter of that name, no
``**kwargs``) is left out, so verl's own ``gsm8k.compute_score(solution_str, ground_truth)``
works too; one it requires and is not given is an error that lists what there is.
``auto`` picks the style from the names of the function's parameters (adapt).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from megatron_grpo.rewards.runner import is_async

Style = Literal["auto", "native", "trl", "verl"]

TRL_NAMES = frozenset({"prompts", "completions", "completion_ids"})
"""Parameter names that only a TRL-style function has."""
VERL_NAMES = frozenset({"data_source", "solution_str", "extra_info"})
"""Parameter names that only a verl-style function has (``ground_truth`` is common to both)."""

PROMPT_KEY = "__prompt__"
COMPLETION_IDS_KEY = "__completion_ids__"
"""Metadata entries that carry a sample's prompt and completion token ids to a TRL-style
function (``RewardScorer.score(prompts=, completion_ids=)``); never passed as columns."""

SIGNATURES = {
    "native": "fn(response, label, metadata) -> float",
    "trl": "fn(prompts, completions, **kwargs) -> list[float]",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None)",
}


def function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def detect_style(fn: Callable[..., Any]) -> Literal["native", "trl", "verl"]:
    """The style of ``fn`` by the names of its parameters: trl or verl when it has names of
    exactly one of them, native when it has neither and takes three positional arguments;
    anything else is a ValueError that names the choices."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some C callables): as before
        return "native"
    names = set(signature.parameters)
    styles = [s for s, own in (("trl", TRL_NAMES), ("verl", VERL_NAMES)) if names & own]
    if len(styles) == 1:
        return styles[0]  # type: ignore[return-value]
    if not styles:
        try:
            signature.bind("response", "label", {})
            return "native"
        except TypeError:
            pass
    choices = "; ".join(f"{s}: {sig}" for s, sig in SIGNATURES.items())
    raise ValueError(
        f"cannot tell the style of reward function {function_name(fn)}{signature} from its "
        f"parameters: set reward.custom_style to native, trl or verl ({choices})"
    )


def adapt(fn: Callable[..., Any], style: Style, *, label_name: str) -> Callable[..., Any]:
    """``fn`` as the scorer calls a reward function: itself (native), or wrapped."""
    if style == "auto":
        style = detect_style(fn)
    if style == "native":
        return fn
    if style == "trl":
        return AsyncTrlReward(fn, label_name) if is_async(fn) else TrlReward(fn, label_name)
    return AsyncVerlReward(fn) if is_async(fn) else VerlReward(fn)


class _Keywords:
    """Calls a function with the keyword arguments it takes, naming one it lacks."""

    style: str

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.deterministic = getattr(fn, "deterministic", False) is True
        """The memo keeps the values of a function that says it is deterministic."""
        self.accepts: frozenset[str] | None = None
        """The keyword arguments it takes; None: any (it has ``**kwargs``)."""
        self.requires: tuple[str, ...] = ()
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self.accepts = frozenset(p.name for p in params if p.kind in named)
        self.requires = tuple(p.name for p in params if p.kind in named and p.default is p.empty)

    def keywords(self, given: dict[str, Any]) -> dict[str, Any]:
        missing = [name for name in self.requires if name not in given]
        if missing:
            raise TypeError(
                f"{self.style}-style reward function {function_name(self.fn)} needs "
                f"{missing[0]!r}, which it is not given; it gets {', '.join(given)}" + self.hint()
            )
        if self.accepts is None:
            return given
        return {k: v for k, v in given.items() if k in self.accepts}

    def hint(self) -> str:
        return ""


class TrlReward(_Keywords):
    """A TRL-style function, called once per batch: ``(responses, labels, metadatas) ->``
    one value per sample."""

    style = "trl"
    batched = True
    """RewardRunner calls it with the whole batch, not sample by sample."""

    def __init__(self, fn: Callable[..., Any], label_name: str) -> None:
        super().__init__(fn)
        self.label_name = label_name

    def hint(self) -> str:
        return (
            f" (a dataset column arrives under its own name, the label under "
            f"reward.label_name={self.label_name!r})"
        )

    def arguments(
        self, responses: Sequence[str], labels: Sequence[Any], metadatas: Sequence[dict]
    ) -> dict[str, Any]:
        """TRL's keyword arguments for a batch: a list per name, one entry per sample."""
        columns = dict.fromkeys(
            k for m in metadatas for k in m if k not in (PROMPT_KEY, COMPLETION_IDS_KEY)
        )
        given: dict[str, Any] = {k: [m.get(k) for m in metadatas] for k in columns}
        given[self.label_name] = list(labels)
        given.update(
            prompts=[m.get(PROMPT_KEY) for m in metadatas],
            completions=list(responses),
            completion_ids=[m.get(COMPLETION_IDS_KEY) for m in metadatas],
            trainer_state=None,
        )
        return self.keywords(given)

    def values(self, returned: Any, num_samples: int) -> list[Any]:
        """The function's rewards, one per sample (each checked by the scorer)."""
        if isinstance(returned, str | bytes | Mapping) or not hasattr(returned, "__len__"):
            raise TypeError(
                f"trl-style reward function {function_name(self.fn)} returned "
                f"{type(returned).__name__}, not a list of rewards"
            )
        values = list(returned)
        if len(values) != num_samples:
            raise ValueError(
                f"trl-style reward function {function_name(self.fn)} returned {len(values)} "
                f"rewards for {num_samples} completions"
            )
        return values

    def __call__(
        self, responses: Sequence[str], labels: Sequence[Any], metadatas: Sequence[dict]
    ) -> list[Any]:
        returned = self.fn(**self.arguments(responses, labels, metadatas))
        return self.values(returned, len(responses))


class AsyncTrlReward(TrlReward):
    """An ``async def`` TRL-style function: awaited once per batch."""

    async def __call__(  # type: ignore[override]
        self, responses: Sequence[str], labels: Sequence[Any], metadatas: Sequence[dict]
    ) -> list[Any]:
        returned = await self.fn(**self.arguments(responses, labels, metadatas))
        return self.values(returned, len(responses))


class VerlReward(_Keywords):
    """A verl-style ``compute_score``, called per sample as a native function is."""

    style = "verl"

    def arguments(self, response: str, label: Any, metadata: dict[str, Any]) -> dict[str, Any]:
        reference = label
        if isinstance(label, Mapping) and "ground_truth" in label:
            reference = label["ground_truth"]  # verl's reward_model column as the label
        return self.keywords(
            {
                "data_source": metadata.get("data_source"),
                "solution_str": response,
                "ground_truth": reference,
                "extra_info": metadata.get("extra_info", metadata),
            }
        )

    def value(self, returned: Any) -> Any:
        if isinstance(returned, Mapping):
            if "score" not in returned:
                raise KeyError(
                    f"verl-style reward function {function_name(self.fn)} returned a dict "
                    f"without 'score' (keys: {', '.join(map(str, returned))})"
                )
            return returned["score"]
        return returned

    def __call__(self, response: str, label: Any, metadata: dict[str, Any]) -> Any:
        return self.value(self.fn(**self.arguments(response, label, metadata)))


class AsyncVerlReward(VerlReward):
    """An ``async def`` verl-style function: awaited for many samples at once."""

    async def __call__(  # type: ignore[override]
        self, response: str, label: Any, metadata: dict[str, Any]
    ) -> Any:
        return self.value(await self.fn(**self.arguments(response, label, metadata)))
