"""The built-in multi-turn tool loop, a rollout hook (``rollout.hook: tools``).

Each turn the model generates until its end of sequence or until it closes a tool call
(``rollout.tools.call_end``, a stop token). A call is parsed, run, and its result,
rendered with ``result_template`` and tokenized on its own, is appended to the context
with loss mask 0; the model's tokens keep the ids and log-probs the engine gave them.
The episode ends at the end of sequence, at the token budget (``rollout.max_new_tokens``
over model and tool tokens) or at the turn limit (``rollout.tools.max_turns``); the
last two count as cut (finish type ``length``). The reward reads the model's last turn.
Each episode reports ``turns``, ``tool_calls`` and ``tool_errors``
(``rollout/<name>_mean``).
"""

from __future__ import annotations

from typing import Any

from megatron_grpo.config import ToolsConfig
from megatron_grpo.rollout.episode import EngineSession, Episode, EpisodeInput, Trajectory
from megatron_grpo.rollout.tools.calls import (
    CallFormatError,
    call_body,
    parse_call,
    render_result,
)
from megatron_grpo.rollout.tools.registry import build_tools, run_call
from megatron_grpo.sglang_api.types import FinishReason, Generation


def single_token_id(tokenizer: Any, text: str, key: str) -> int:
    """The id of ``text`` when the tokenizer spells it as one token; else a ValueError."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{key}={text!r} must be a single token of the tokenizer (generation stops on "
            f"it), got {len(ids)} tokens {ids}; add it to the tokenizer"
        )
    return ids[0]


class ToolLoop:
    """``await loop(episode, engine)``: one multi-turn episode."""

    def __init__(self, cfg: ToolsConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools = build_tools(cfg)
        self.call_end_id = single_token_id(tokenizer, cfg.call_end, "rollout.tools.call_end")

    def _calls_tool(self, turn: Generation) -> bool:
        return turn.finish_reason.type == "stop" and turn.output_ids[-1:] == (self.call_end_id,)

    async def _tool_output(self, turn: Generation) -> tuple[list[int], bool]:
        """The token ids of the result of the call that ends ``turn``, and whether it failed."""
        text = self.tokenizer.decode(list(turn.output_ids), skip_special_tokens=False)
        try:
            call = parse_call(call_body(text, self.cfg.call_start, self.cfg.call_end),
                              self.cfg.call_format)  # fmt: skip
            result, failed = await run_call(self.tools, call)
        except CallFormatError as e:
            result, failed = f"error: {e}", True
        shown = render_result(self.cfg.result_template, result, self.cfg.max_result_chars)
        return self.tokenizer.encode(shown, add_special_tokens=False), failed

    async def __call__(self, episode: EpisodeInput, engine: EngineSession) -> Episode:
        trajectory = Trajectory(episode.prompt_ids)
        calls = errors = 0
        finish = FinishReason(type="length", detail="max_turns")
        for turn_index in range(self.cfg.max_turns):
            room = engine.max_new_tokens - len(trajectory.response_ids)
            turn = await engine.generate(
                trajectory.context, max_new_tokens=room, stop_token_ids=[self.call_end_id]
            )
            trajectory.add_model_turn(turn)
            last_turn = turn
            if not self._calls_tool(turn):
                finish = turn.finish_reason
                break
            calls += 1
            ids, failed = await self._tool_output(turn)
            errors += failed
            if turn_index + 1 == self.cfg.max_turns:
                break  # no turn left to read the result
            if len(ids) >= room - len(turn.output_ids):  # no room for it and one more token
                finish = FinishReason(type="length", detail="token budget")
                break
            trajectory.add_tokens(ids)
        answer = self.tokenizer.decode(list(last_turn.output_ids), skip_special_tokens=True)
        return trajectory.episode(
            finish,
            response_text=answer,
            metrics={"turns": turn_index + 1, "tool_calls": calls, "tool_errors": errors},
        )
