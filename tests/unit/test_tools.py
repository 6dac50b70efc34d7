"""Tools of the multi-turn loop: the calculator, calls and their errors (the Python
sandbox: test_sandbox.py)."""

import asyncio

import pytest

from megatron_grpo.config import ToolsConfig
from megatron_grpo.rollout.tools.calculator import CalculatorError, calculator
from megatron_grpo.rollout.tools.calls import (
    CallFormatError,
    ToolCall,
    call_body,
    parse_call,
    render_result,
)
from megatron_grpo.rollout.tools.registry import build_tools, run_call

pytestmark = pytest.mark.timeout(60)


def test_calculator_evaluates_arithmetic_exactly():
    assert calculator("3*4+5") == "17"
    assert calculator(" (2+3)**2 - 7//2 ") == "22"
    assert calculator("7/2") == "3.5"
    assert calculator("-2**3 % 5") == "2"
    assert calculator("2**40") == "1099511627776"


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os')", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("9**9**9", "exponent"),
        ("1/0", "division by zero"),
        ("2+", "cannot parse"),
        ("'a'*3", "not arithmetic"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calculator(expression)


def run(coro):
    return asyncio.run(coro)


def test_tool_errors_come_back_as_text():
    tools = build_tools(ToolsConfig(names=["calculator"]))
    assert run(run_call(tools, ToolCall("calculator", "2+2"))) == ("4", False)
    assert run(run_call(tools, ToolCall("calculator", {"expression": "1/0"}))) == (
        "error: division by zero",
        True,
    )
    output, failed = run(run_call(tools, ToolCall("search", "x")))
    assert failed and output == "error: unknown tool 'search' (tools: calculator)"
    output, failed = run(run_call(tools, ToolCall("calculator", {"expr": "1"})))
    assert failed and output.startswith("error: TypeError: calculator() got an unexpected")


def test_user_tools_by_dotted_path_sync_and_async():
    tools = build_tools(ToolsConfig(names=["calculator", "test_tools:shout", "test_tools:later"]))
    assert sorted(tools) == ["calculator", "later", "shout"]
    assert run(run_call(tools, ToolCall("shout", {"text": "hi"}))) == ("HI", False)
    assert run(run_call(tools, ToolCall("later", "x"))) == ("x!", False)
    with pytest.raises(ValueError, match="rollout.tools.names: 'search' is neither"):
        build_tools(ToolsConfig(names=["search"]))
    with pytest.raises(ValueError, match="rollout.tools.names entry 'no_such_module:f'"):
        build_tools(ToolsConfig(names=["no_such_module:f"]))


def shout(text):
    return text.upper()


async def later(text):
    await asyncio.sleep(0)
    return text + "!"


def test_calls_parse_in_both_formats_and_malformed_ones_are_named():
    call = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
    text = f"I will call <tool_call>{call}</tool_call>"
    body = call_body(text, "<tool_call>", "</tool_call>")
    assert parse_call(body, "json") == ToolCall("calculator", {"expression": "2+3"})
    args_as_string = '{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'
    assert parse_call(args_as_string, "json") == ToolCall("calculator", {"expression": "1"})
    assert parse_call("calculator 7*8+5", "text") == ToolCall("calculator", "7*8+5")
    with pytest.raises(CallFormatError, match="not JSON"):
        parse_call("calculator 1", "json")
    with pytest.raises(CallFormatError, match="must be written <c>...</c>"):
        call_body("no opening</c>", "<c>", "</c>")
    assert render_result("<r>{result}</r>", "x" * 12, 10) == "<r>" + "x" * 10 + "...[cut]</r>"


def test_tools_config_refusals_are_named():
    with pytest.raises(ValueError, match="rollout.tools.names is empty"):
        ToolsConfig(names=[])
    with pytest.raises(ValueError, match="rollout.tools.result_template must hold"):
        ToolsConfig(result_template="<r></r>")
    with pytest.raises(ValueError, match="rollout.tools.python_timeout_s"):
        ToolsConfig(python_timeout_s=0)
