"""The tool-call format: a call parsed out of a model turn, a result rendered for the model.

A call is ``call_start <body> call_end`` (rollout.tools). Its body is, with
``call_format: json``, ``{"name": "calculator", "arguments": {"expression": "2+3"}}``
(the Hermes format Qwen's chat template uses), or, with ``call_format: text``,
``calculator 2+3``: the tool's name, a space, and its one argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class CallFormatError(ValueError):
    """A turn that ended a call whose body does not parse."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] | str
    """Keyword arguments (json), or the one positional argument (text)."""


def call_body(text: str, start: str, end: str) -> str:
    """The body of the last call in a turn's text, which ends with ``end``."""
    stop = text.rfind(end)
    begin = text.rfind(start, 0, max(stop, 0))
    if stop < 0 or begin < 0:
        raise CallFormatError(f"a tool call must be written {start}...{end}")
    return text[begin + len(start) : stop].strip()


def parse_call(body: str, call_format: str) -> ToolCall:
    """The call a body spells, in ``call_format`` (json or text)."""
    if call_format == "text":
        name, _, argument = body.partition(" ")
        if not name:
            raise CallFormatError("the tool call names no tool")
        return ToolCall(name, argument.strip())
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise CallFormatError(f"the tool call is not JSON: {e}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise CallFormatError('the tool call must be {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        raise CallFormatError("the tool call's arguments must be an object")
    return ToolCall(call["name"], arguments)


def render_result(template: str, result: str, max_chars: int) -> str:
    """The text that goes back to the model: ``result`` cut to ``max_chars``, in ``template``."""
    if len(result) > max_chars:
        result = result[:max_chars] + "...[cut]"
    return template.replace("{result}", result)
