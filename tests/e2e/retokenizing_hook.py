"""A rollout hook (loaded by dotted path in the trainer's processes) that breaks token in,
token out: it keeps each completion as text and encodes it again with a vocabulary that
is not the model's, one whose end-of-sequence and padding ids are swapped (as a base
model's tokenizer and its chat model's can differ in their special tokens). The learner
then scores tokens the engine did not sample, beside the engine's log-probs of those it
did."""

from megatron_grpo.rollout.hook import Episode


def other_vocabulary(model_tokenizer) -> dict[str, int]:
    """The model's vocabulary with ``<eos>`` and ``<pad>`` swapped."""
    vocab = dict(model_tokenizer.get_vocab())
    vocab["<eos>"], vocab["<pad>"] = vocab["<pad>"], vocab["<eos>"]
    return vocab


async def retokenized(episode, engine):
    turn = await engine.generate(episode.prompt_ids)
    text = engine.tokenizer.convert_ids_to_tokens(list(turn.output_ids))  # one per character
    vocab = other_vocabulary(engine.tokenizer)
    return Episode(
        response_ids=[vocab[token] for token in text],
        loss_mask=[1.0] * len(text),
        rollout_logprobs=turn.rollout_logprobs,
        finish_reason=turn.finish_reason,
    )
