"""The tools a config names, and running one call: a result, or an error as text.

A tool is a callable taking its arguments (keywords from a JSON call, or one string
from a text call) and returning its result as text, sync or ``async def``; it raises to
report an error. ``run_call`` never raises for a tool's failure: the error is the
tool's output, ``error: ...``, which the model reads and may correct.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megatron_grpo.config import ToolsConfig
from megatron_grpo.rollout.tools.calculator import CalculatorError, calculator
from megatron_grpo.rollout.tools.calls import ToolCall
from megatron_grpo.rollout.tools.sandbox import PythonSandbox, SandboxError

BUILT_IN = ("calculator", "python")

Tool = Callable[..., Any]


def build_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """``rollout.tools.names`` as ``{name: tool}``; a ValueError names a bad entry."""
    from megatron_grpo.rewards.custom import load_function

    tools: dict[str, Tool] = {}
    for spec in cfg.names:
        if spec == "calculator":
            tools[spec] = calculator
        elif spec == "python":
            tools[spec] = PythonSandbox(
                timeout_s=cfg.python_timeout_s,
                memory_mb=cfg.python_memory_mb,
                isolation=cfg.python_isolation,
            )
        elif ":" in spec:
            fn = load_function(spec, "rollout.tools.names entry")
            tools[spec.rpartition(":")[2].rpartition(".")[2]] = fn
        else:
            raise ValueError(
                f"rollout.tools.names: {spec!r} is neither a built-in tool "
                f"({', '.join(BUILT_IN)}) nor 'package.module:function'"
            )
    return tools


async def run_call(tools: dict[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """``(output, failed)``: the tool's result, or ``error: <why>`` when it failed."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r} (tools: {', '.join(tools)})", True
    try:
        if isinstance(call.arguments, dict):
            value = tool(**call.arguments)
        else:
            value = tool(call.arguments)
        if inspect.isawaitable(value):
            value = await value
    except (CalculatorError, SandboxError) as e:  # their messages say it all
        return f"error: {e}", True
    except Exception as e:
        return f"error: {type(e).__name__}: {e}", True
    return str(value), False
