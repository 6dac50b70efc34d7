"""Rollout hooks and the tool loop with a scripted engine: masks, log-probs, the loss weights."""

import asyncio
from dataclasses import dataclass

import pytest
import torch

from megatron_grpo.algo.batch import collate
from megatron_grpo.algo.normalization import GlobalCounts, local_counts, sequence_weights
from megatron_grpo.config import AdvantageConfig, RolloutConfig, ToolsConfig
from megatron_grpo.rollout.hook import Episode, HookRunner, RolloutHookError, load_hook
from megatron_grpo.rollout.parts import RolloutSettings
from megatron_grpo.rollout.stage import collect
from megatron_grpo.rollout.tools.loop import ToolLoop
from megatron_grpo.sglang_api.types import FinishReason, Generation
from megatron_grpo.testing import tool_tokenizer

pytestmark = pytest.mark.timeout(60)

TOOLS = ToolsConfig(
    names=["calculator"], call_start="<call>", call_end="</call>", call_format="text",
    result_template="<r>{result}</r>",
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    words = ["<call>", "</call>", "<r>", "</r>", "calculator"]
    return tool_tokenizer(["0123456789+-*= abcdefghijklmnopqrstuvwxyz'():,"], words)


class ScriptedClient:
    """The model: with a tool result in context it answers 5; else, on an even seed, it
    calls the calculator on 2+3, on an odd one it answers 4. Token i of a turn has
    log-prob -0.1 (i + 1). Honours max_new_tokens and stop tokens as an engine does."""

    def __init__(self, tokenizer, call="calculator 2+3"):
        self.tokenizer, self.call = tokenizer, call
        self.contexts = []

    async def generate(self, request):
        (context,) = request.prompts
        self.contexts.append(context)
        text = self.tokenizer.decode(list(context))
        if text.endswith("</r>"):
            reply = "5"
        elif request.sampling.seed % 2 == 0:
            reply = f"<call>{self.call}</call>"
        else:
            reply = "4"
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = FinishReason(type="length")
        for i, t in enumerate(ids):
            if t in request.sampling.stop_token_ids:
                ids, finish = ids[: i + 1], FinishReason(type="stop", detail=t)
                break
        if len(ids) > request.sampling.max_new_tokens:
            ids, finish = ids[: request.sampling.max_new_tokens], FinishReason(type="length")
        return [
            Generation(
                prompt_index=0,
                sample_index=0,
                prompt_ids=context,
                output_ids=tuple(ids),
                rollout_logprobs=tuple(-0.1 * (i + 1) for i in range(len(ids))),
                finish_reason=finish,
                weight_version="0",
            )  # fmt: skip
        ]


class Runtime:
    def __init__(self, client):
        self.client = client

    def run_on_engines(self, work):
        return asyncio.run(work(self.client))


@dataclass
class Item:
    prompt_ids: list
    label: str
    metadata: dict
    prompt_text: str = ""


def episodes(tokenizer, *, tools=TOOLS, max_new_tokens=32, seed=0, n=2, call="calculator 2+3"):
    cfg = RolloutConfig(prompts_per_step=1, samples_per_prompt=n, max_new_tokens=max_new_tokens)
    runner = HookRunner(ToolLoop(tools, tokenizer), "tools", tokenizer)
    item = Item(tokenizer.encode("2+3=", add_special_tokens=False), "5", {})
    client = ScriptedClient(tokenizer, call)
    groups = runner.generate_groups(
        [item], Runtime(client), cfg, seed=seed, stop_token_ids=[tokenizer.eos_token_id]
    )
    return groups[0], client


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_two_turn_episode_masks_the_tool_output_and_keeps_the_engine_tokens(tokenizer):
    (called, direct), client = episodes(tokenizer)
    eos = tokenizer.eos_token_id
    turn1, result, turn2 = (
        ids(tokenizer, "<call>calculator 2+3</call>"),
        ids(tokenizer, "<r>5</r>"),
        ids(tokenizer, "5") + [eos],
    )
    assert list(called.response_ids) == turn1 + result + turn2
    assert list(called.loss_mask) == [1.0] * 7 + [0.0] * 3 + [1.0] * 2
    lp1 = [-0.1 * (i + 1) for i in range(7)]
    assert list(called.rollout_logprobs) == pytest.approx(lp1 + [0.0] * 3 + [-0.1, -0.2])
    assert called.finish_reason == FinishReason(type="stop", detail=eos)
    assert called.response_text == "5"
    assert called.metrics == {"turns": 2, "tool_calls": 1, "tool_errors": 0}
    # token in, token out: the second turn's input is the prompt and the first turn's
    # ids exactly as generated, then the tool output
    (second,) = [c for c in client.contexts if len(c) > 4]
    assert list(second) == ids(tokenizer, "2+3=") + turn1 + result
    assert direct.metrics == {"turns": 1, "tool_calls": 0, "tool_errors": 0}
    assert list(direct.loss_mask) == [1.0, 1.0] and direct.response_text == "4"


def test_turn_limit_and_token_budget_end_the_episode_as_cut(tokenizer):
    one_turn = ToolsConfig(**{**TOOLS.__dict__, "max_turns": 1})
    (called, _), _ = episodes(tokenizer, tools=one_turn)
    assert called.finish_reason == FinishReason(type="length", detail="max_turns")
    assert called.metrics == {"turns": 1, "tool_calls": 1, "tool_errors": 0}
    assert list(called.loss_mask) == [1.0] * 7  # the result nobody reads is not appended
    # 7 call tokens + 3 result tokens leave no room for an answer in 10
    (called, _), _ = episodes(tokenizer, max_new_tokens=10)
    assert called.finish_reason == FinishReason(type="length", detail="token budget")
    assert len(called.response_ids) <= 10


def test_a_failing_tool_call_is_answered_with_its_error(tokenizer):
    wrong = ToolsConfig(**{**TOOLS.__dict__, "names": ["test_rollout_hook:broken"]})
    (called, _), client = episodes(tokenizer, tools=wrong, max_new_tokens=128)
    assert called.metrics == {"turns": 2, "tool_calls": 1, "tool_errors": 1}
    (second,) = [c for c in client.contexts if len(c) > 4]
    shown = tokenizer.decode(list(second))
    assert shown.endswith("<r>error: unknown tool 'calculator' (tools: broken)</r>")


@pytest.mark.parametrize(
    "code, error",
    [
        ("while True: pass", "timed out after 1 s (the time limit)"),
        ("open('/etc/hostname').read()",
         "FileNotFoundError: [Errno 2] No such file or directory: '/etc/hostname'"),
    ],
)  # fmt: skip
def test_the_sandbox_refusing_code_is_the_tool_output_the_model_reads(code, error):
    import string

    words = ["<call>", "</call>", "<r>", "</r>", "python"]
    tokenizer = tool_tokenizer([string.printable], words)
    tools = ToolsConfig(**{**TOOLS.__dict__, "names": ["python"], "python_timeout_s": 1.0})
    (called, _), client = episodes(
        tokenizer, tools=tools, max_new_tokens=256, call=f"python {code}"
    )
    assert called.metrics == {"turns": 2, "tool_calls": 1, "tool_errors": 1}
    (second,) = [c for c in client.contexts if len(c) > 4]
    assert tokenizer.decode(list(second)).endswith(f"</call><r>error: {error}</r>")


def broken(text):
    raise RuntimeError("unused")


def test_stage_trains_on_model_tokens_only_and_counts_them_by_hand(tokenizer):
    """Two prompts x two samples: per group one two-turn episode (7 + 2 model tokens, 3
    tool tokens) and one direct answer (2 tokens). Tool tokens count in no denominator:
    T = 22 (not 28), N = 4, T_g = 11, G_g = 2, P = 2."""

    class Sampler:
        def next_batch(self, n):
            return [Item(ids(tokenizer, "2+3="), "5", {}) for _ in range(n)]

    class Scorer:
        def score(self, texts, labels, metas, **kwargs):
            return type("S", (), {"rewards": [float(t == lb) for t, lb in zip(texts, labels)],
                                  "num_errors": 0})()  # fmt: skip

    cfg = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=32)
    batch = collect(
        1, sampler=Sampler(), runtime=Runtime(ScriptedClient(tokenizer)), scorer=Scorer(),
        tokenizer=tokenizer, cfg=cfg, adv_cfg=AdvantageConfig(scale_by_std=False), seed=0,
        stop_token_ids=[tokenizer.eos_token_id],
        hook=HookRunner(ToolLoop(TOOLS, tokenizer), "tools", tokenizer),
    )  # fmt: skip
    samples = batch.samples
    assert [s.num_loss_tokens for s in samples] == [2, 9, 2, 9]
    assert [s.advantage for s in samples] == [-0.5, 0.5, -0.5, 0.5]
    called = samples[1]
    assert called.loss_mask.tolist() == [0.0] * 4 + [1.0] * 7 + [0.0] * 3 + [1.0] * 2
    assert called.rollout_logprobs[11:].tolist() == pytest.approx([0.0] * 3 + [-0.1, -0.2])
    assert batch.stats["turns_mean"] == 1.5 and batch.stats["tool_calls_mean"] == 0.5
    assert batch.stats["tool_errors_mean"] == 0.0 and batch.stats["reward_mean"] == 0.5
    assert batch.stats["response_length_mean"] == (2 + 12) / 2  # tool tokens are response

    mb = collate([[s] for s in samples], num_groups=2)
    counts = GlobalCounts.from_vector(local_counts(mb.seq_tokens, mb.group_ids, 2))
    assert (counts.num_tokens, counts.num_seqs, counts.num_groups) == (22.0, 4.0, 2.0)
    assert counts.group_tokens.tolist() == [11.0, 11.0]
    assert counts.group_seqs.tolist() == [2.0, 2.0]
    weights = {
        mode: sequence_weights(mode, counts, mb.seq_tokens, mb.group_ids).tolist()
        for mode in ("token-mean", "seq-mean-token-mean", "group-token-mean")
    }
    assert weights["token-mean"] == pytest.approx([1 / 22] * 4)
    assert weights["seq-mean-token-mean"] == pytest.approx([1 / 8, 1 / 36, 1 / 8, 1 / 36])
    assert weights["group-token-mean"] == pytest.approx([1 / 22] * 4)
    # the targets of the tool tokens (shifted by one) are no loss positions
    assert mb.loss_mask[1, 10:14].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert torch.equal(mb.loss_mask.sum(dim=1), torch.tensor([2.0, 9.0, 2.0, 9.0]))


async def bad_hook(episode, engine):
    return Episode(response_ids=(1, 2), loss_mask=(1.0,), rollout_logprobs=(0.0, 0.0),
                   finish_reason=FinishReason(type="stop"))  # fmt: skip


def test_bad_hooks_are_named(tokenizer):
    cfg = RolloutConfig(prompts_per_step=1, samples_per_prompt=1, hook="test_rollout_hook:broken")
    with pytest.raises(ValueError, match="'test_rollout_hook:broken' must be an async"):
        load_hook(cfg, tokenizer)
    with pytest.raises(ValueError, match="rollout.hook must be 'tools' or"):
        RolloutConfig(hook="my_hook")
    runner = load_hook(RolloutConfig(prompts_per_step=1, samples_per_prompt=1,
                                     hook="test_rollout_hook:bad_hook"), tokenizer)  # fmt: skip
    item = Item([3, 4], "5", {})
    with pytest.raises(RolloutHookError, match="failed on prompt 0 sample 0: ValueError: "
                       "response_ids, loss_mask and rollout_logprobs differ"):  # fmt: skip
        runner.generate_groups([item], Runtime(ScriptedClient(tokenizer)),
                               RolloutConfig(prompts_per_step=1, samples_per_prompt=1),
                               seed=0, stop_token_ids=[])  # fmt: skip
    two_tokens = ToolsConfig(call_end="</tool_call>")
    with pytest.raises(ValueError, match="rollout.tools.call_end='</tool_call>' must be a single"):
        ToolLoop(two_tokens, tokenizer)


def test_evaluation_runs_the_hook_when_the_run_has_one(tokenizer, tmp_path):
    """Held-out prompts go through the tool loop as the training samples do: of the two
    samples, the one that calls the calculator is right (pass@1 1/2, pass@2 1)."""
    from megatron_grpo.config import Config, from_dict
    from megatron_grpo.eval.runner import Evaluator

    (tmp_path / "eval.jsonl").write_text('{"prompt": "2+3=", "label": "5"}\n')
    cfg = from_dict(Config, {
        "rollout": {"max_new_tokens": 32},
        "eval": {"datasets": [{"name": "sums", "path": str(tmp_path / "eval.jsonl")}],
                 "samples_per_prompt": 2, "k": [1, 2]},
    })  # fmt: skip

    class Scorer:
        def score(self, texts, labels, metas, **kwargs):
            return type("S", (), {"rewards": [float(t == lb) for t, lb in zip(texts, labels)],
                                  "num_errors": 0})()  # fmt: skip

    evaluator = Evaluator(
        cfg.eval, RolloutSettings.of(cfg), runtime=Runtime(ScriptedClient(tokenizer)),
        scorer=Scorer(), tokenizer=tokenizer,
        stop_token_ids=[tokenizer.eos_token_id],
        hook=HookRunner(ToolLoop(TOOLS, tokenizer), "tools", tokenizer),
    )  # fmt: skip
    metrics = evaluator.run(0)
    assert metrics["sums/pass@1"] == 0.5 and metrics["sums/pass@2"] == 1.0
    assert metrics["sums/response_length_mean"] == (12 + 2) / 2
