"""A rollout hook for the end-to-end tests (loaded by dotted path in the trainer's
processes): every episode is two model turns with three tokens of "tool output" between
them, so that every sample has masked tokens inside its response."""

from megatron_grpo.rollout.hook import Trajectory

TOOL_TEXT = "+1="
FIRST_TURN_TOKENS = 2


async def two_turns(episode, engine):
    trajectory = Trajectory(episode.prompt_ids)
    first = await engine.generate(trajectory.context, max_new_tokens=FIRST_TURN_TOKENS)
    trajectory.add_model_turn(first)
    trajectory.add_tokens(engine.tokenizer.encode(TOOL_TEXT, add_special_tokens=False))
    room = engine.max_new_tokens - len(trajectory.response_ids)
    second = await engine.generate(trajectory.context, max_new_tokens=room)
    trajectory.add_model_turn(second)
    return trajectory.episode(second.finish_reason, metrics={"turns": 2})
