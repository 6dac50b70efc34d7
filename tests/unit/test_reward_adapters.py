"""TRL-style and verl-style reward functions scored unchanged (``reward.custom_style``), and
function objects handed over by name, pickled or held in this process.

The reward functions below are written as those libraries' docs write them: TRL's
``reward_len`` (quick start), its format and reference examples ("Using a custom reward
function", standard format) and its async one; verl's custom ``compute_score(data_source,
solution_str, ground_truth, extra_info=None)`` and its GSM8K scorer's shape."""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
import time

import pytest

from megatron_grpo.config import RewardConfig, from_dict
from megatron_grpo.rewards import RewardError, RewardScorer, TrlReward, VerlReward, detect_style
from megatron_grpo.rewards.custom import held, importable_spec, load_function, pickled

MODULE = r'''
import asyncio
import re
import time

calls = []


# --- TRL: GRPOTrainer(reward_funcs=...), standard (string) format -------------------------

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    matches = [re.match(pattern, content) for content in completions]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def ids_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def math_reward_func(prompts, completions, task, **kwargs):
    calls.append({"prompts": prompts, "completions": completions, "task": task, **kwargs})
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if completion.strip() == prompt.split("=")[-1] else -1.0)
        else:
            rewards.append(None)  # not this function's task
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    calls.append(len(completions))
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


def counted_len(completions, **kwargs):
    calls.append(list(completions))
    return [float(len(c)) for c in completions]


counted_len.deterministic = True


def too_few(completions, **kwargs):
    return [1.0]


def slow_len(completions, **kwargs):
    if "hang" in completions:
        time.sleep(600)
    return [float(len(c)) for c in completions]


# --- verl: custom_reward_function.path / .name ------------------------------------------

def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100


def extract_solution(solution_str):
    found = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    return None if found is None else found.group(1).replace(",", "").replace("$", "")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K-style: 1 for the right number after ####, 0.1 for the format, else 0."""
    calls.append((data_source, ground_truth, extra_info))
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth else 0.1


def gsm8k_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def dict_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = extract_solution(solution_str) == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def no_score_key(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0.2)
    return 1.0 if extract_solution(solution_str) == ground_truth else 0.0


# --- neither ---------------------------------------------------------------------------

def native(response, label, metadata):
    return float(response == label)


def both(completions, solution_str, **kwargs):
    return []


def one_argument(text):
    return 0.0
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = "grpo_test_adapted_rewards"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get sys.path too
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def scorer(module, function: str, **kwargs) -> RewardScorer:
    spec = f"{module.__name__}:{function}"
    return RewardScorer(RewardConfig(type="custom", custom_function=spec, **kwargs))


# ---------------------------------------------------------------------------- style


def test_auto_style_follows_the_parameter_names(module):
    assert detect_style(module.reward_len) == "trl"
    assert detect_style(module.async_reward_func) == "trl"
    assert detect_style(module.compute_score) == "verl"
    assert detect_style(module.gsm8k_compute_score) == "verl"
    assert detect_style(module.native) == "native"
    assert detect_style(lambda *args, **kwargs: 0.0) == "native"  # as before: any callable
    for ambiguous in (module.both, module.one_argument):
        with pytest.raises(ValueError, match="set reward.custom_style to native, trl or verl"):
            detect_style(ambiguous)
    with pytest.raises(ValueError, match="reward.custom_style"):
        scorer(module, "both")
    assert isinstance(scorer(module, "reward_len").reward_fn, TrlReward)
    assert isinstance(scorer(module, "compute_score").reward_fn, VerlReward)
    assert scorer(module, "reward_len", custom_style="native").reward_fn is module.reward_len


def test_config_checks_the_new_options():
    with pytest.raises(ValueError, match="reward.custom_style='openai' is not one of"):
        from_dict(RewardConfig, {"custom_style": "openai"}, prefix="reward.")
    with pytest.raises(ValueError, match="not both"):
        RewardConfig(type="custom", custom_function="m:f", custom_pickle="f.pkl")
    with pytest.raises(ValueError, match="label_name"):
        RewardConfig(label_name="")
    RewardConfig(type="custom", custom_pickle="f.pkl")


# ---------------------------------------------------------------------------- TRL


def test_trl_quick_start_and_format_examples(module):
    completions = ["x" * 20, "short", "<think>a</think><answer>b</answer>"]
    result = scorer(module, "reward_len").score(completions, [None] * 3, [{}] * 3)
    assert result.rewards == [0.0, -15.0, -14.0]
    result = scorer(module, "format_reward_func").score(completions, [None] * 3, [{}] * 3)
    assert result.rewards == [0.0, 0.0, 1.0]


def test_trl_gets_the_label_under_its_column_name(module):
    completions = [r"The solution is \boxed{2}.", r"The solution is \boxed{6}."]
    s = scorer(module, "reward_func", label_name="ground_truth")
    assert s.score(completions, ["2", "5"], [{}, {}]).rewards == [1.0, 0.0]
    spec = f"{module.__name__}:reward_func"
    s = RewardScorer(RewardConfig(type="custom", custom_function=spec), label_key="ground_truth")
    assert s.score(completions, ["2", "5"], [{}, {}]).rewards == [1.0, 0.0]  # data.label_key
    # under the default name the function misses its column, and the error says where it is
    with pytest.raises(RewardError, match="needs 'ground_truth'.*reward.label_name='label'"):
        scorer(module, "reward_func").score(completions, ["2", "5"], [{}, {}])


def test_trl_is_called_once_per_batch_with_every_column(module):
    s = scorer(module, "math_reward_func", on_error="zero")
    metas = [{"task": "math", "source": "a"}, {"task": "math"}, {"task": "code", "source": "c"}]
    result = s.score(
        ["3", "5", "def f(): pass"],
        ["x", "y", "z"],
        metas,
        prompts=["1+2=3", "2+2=4", "write f"],
        completion_ids=[[7], [8], [9, 10]],
    )
    # None (not this function's task) is an error of its sample: 0 with on_error=zero
    assert result.rewards == [1.0, -1.0, 0.0]
    assert result.num_errors == 1 and "NoneType" in result.errors[0]
    [call] = module.calls
    assert call["prompts"] == ["1+2=3", "2+2=4", "write f"]
    assert call["completion_ids"] == [[7], [8], [9, 10]]
    assert call["label"] == ["x", "y", "z"]
    assert call["source"] == ["a", None, "c"]  # a column some rows lack is None there
    assert call["trainer_state"] is None
    assert "__prompt__" not in call and "__completion_ids__" not in call


def test_trl_prompts_and_ids_are_none_when_not_given(module):
    scorer(module, "math_reward_func", on_error="zero").score(["3"], ["x"], [{"task": "code"}])
    assert module.calls[0]["prompts"] == [None] and module.calls[0]["completion_ids"] == [None]
    result = scorer(module, "ids_reward").score(["ab"], [None], [{}], completion_ids=[[1, 2]])
    assert result.rewards == [2.0]


def test_trl_wrong_number_of_rewards_fails_every_sample(module):
    s = scorer(module, "too_few", on_error="zero")
    result = s.score(["a", "b"], [None] * 2, [{}] * 2)
    assert result.rewards == [0.0, 0.0] and result.num_errors == 2
    assert "returned 1 rewards for 2 completions" in result.errors[0]
    with pytest.raises(RewardError, match=r"reward custom .*too_few \(trl-style\) failed"):
        scorer(module, "too_few").score(["a", "b"], [None] * 2, [{}] * 2)


def test_trl_async_function_is_awaited_once_per_batch(module):
    s = scorer(module, "async_reward_func")
    assert s.runs_elsewhere  # scored group by group while generation goes on
    assert s.score(["a", "", "b"], [None] * 3, [{}] * 3).rewards == [1.0, 0.0, 1.0]
    assert module.calls == [3]


def test_trl_deterministic_function_is_memoized(module):
    s = scorer(module, "counted_len")
    assert s.memo is not None
    assert s.score(["ab", "ab", "c"], [1, 1, 1], [{}] * 3).rewards == [2.0, 2.0, 1.0]
    assert s.score(["ab", "xyz"], [1, 1], [{}] * 2).rewards == [2.0, 3.0]
    assert module.calls == [["ab", "c"], ["xyz"]]  # one call per batch, distinct ones only


@pytest.mark.timeout(120)
def test_trl_in_a_worker_process_runs_under_the_time_limit(module):
    s = scorer(module, "slow_len", num_workers=2, timeout_s=2.0, on_error="zero")
    try:
        assert s.score(["ab", "abc"], [None] * 2, [{}] * 2).rewards == [2.0, 3.0]
        start = time.monotonic()
        result = s.score(["ab", "hang"], [None] * 2, [{}] * 2)
        assert time.monotonic() - start < 30
        assert result.rewards == [0.0, 0.0]  # the one call held both samples
        assert all("RewardTimeout" in e for e in result.errors)
        assert s.score(["abcd"], [None], [{}]).rewards == [4.0]  # a new worker took over
    finally:
        s.close()


# ---------------------------------------------------------------------------- verl


def test_verl_docs_function_and_gsm8k_style_scores(module):
    assert scorer(module, "my_reward_fn").score(["x" * 50], ["1"], [{}]).rewards == [0.5]
    responses = ["so 3 + 4 = #### 7", "#### 8", "seven"]
    # verl's GSM8K scorer takes neither data_source nor extra_info: they are left out
    expected = {"compute_score": 0.1, "gsm8k_compute_score": 0.0, "dict_score": 0.0}
    for name, wrong_number in expected.items():
        rewards = scorer(module, name).score(responses, ["7"] * 3, [{}] * 3).rewards
        assert rewards == pytest.approx([1.0, wrong_number, 0.0]), name


def test_verl_arguments_come_from_label_and_metadata(module):
    s = scorer(module, "compute_score")
    rows = [
        # a verl-made parquet: label_key=reward_model, with data_source and extra_info columns
        ({"style": "rule", "ground_truth": "7"}, {"data_source": "gsm8k", "extra_info": {"i": 0}}),
        # a plain row: the label is the ground truth, the other columns are extra_info
        ("7", {"level": 2}),
    ]
    result = s.score(["#### 7", "#### 7"], [r[0] for r in rows], [r[1] for r in rows])
    assert result.rewards == [1.0, 1.0]
    assert module.calls == [("gsm8k", "7", {"i": 0}), (None, "7", {"level": 2})]


def test_verl_dict_without_score_is_an_error(module):
    with pytest.raises(RewardError, match="returned a dict without 'score' \\(keys: acc\\)"):
        scorer(module, "no_score_key").score(["#### 7"], ["7"], [{}])


def test_verl_async_function_scores_samples_at_once(module):
    start = time.monotonic()
    s = scorer(module, "async_compute_score")
    assert s.score(["#### 7"] * 10, ["7"] * 10, [{}] * 10).rewards == [1.0] * 10
    assert time.monotonic() - start < 1.5


@pytest.mark.timeout(120)
def test_verl_in_worker_processes(module):
    s = scorer(module, "compute_score", num_workers=2)
    try:
        assert s.score(["#### 7", "#### 1"], ["7", "7"], [{}, {}]).rewards == [1.0, 0.1]
    finally:
        s.close()


# ---------------------------------------------------------------------------- objects


def test_a_module_function_is_named_a_lambda_is_not(module):
    assert importable_spec(module.reward_len) == f"{module.__name__}:reward_len"
    assert importable_spec(lambda completions, **kw: []) is None
    assert importable_spec(functools.partial(module.reward_len)) is None


def test_what_pickles_by_value(module):
    partial = functools.partial(module.gsm8k_compute_score, format_score=0.5)
    assert pickle.loads(pickled(partial))("#### 1", "2") == 0.5
    with pytest.raises(ValueError, match="lambda or a nested function"):
        pickled(lambda completions, **kw: [])

    def grpo_test_main_reward(completions, **kwargs):  # as a notebook cell defines one
        return []

    grpo_test_main_reward.__module__ = "__main__"
    grpo_test_main_reward.__qualname__ = "grpo_test_main_reward"
    main = sys.modules["__main__"]
    main.grpo_test_main_reward = grpo_test_main_reward  # pickle names it there
    try:
        assert importable_spec(grpo_test_main_reward) is None
        with pytest.raises(ValueError, match="defined in __main__"):
            pickled(grpo_test_main_reward)
    finally:
        del main.grpo_test_main_reward


def test_a_pickled_function_is_scored_in_its_style(module, tmp_path):
    path = tmp_path / "reward_fn.pkl"
    path.write_bytes(pickled(functools.partial(module.compute_score)))
    s = RewardScorer(RewardConfig(type="custom", custom_pickle=str(path)))
    assert isinstance(s.reward_fn, VerlReward)
    assert s.score(["#### 7"], ["7"], [{}]).rewards == [1.0]
    assert "pickled in" in s.name
    with pytest.raises(ValueError, match="cannot be read"):
        RewardScorer(RewardConfig(type="custom", custom_pickle=str(tmp_path / "missing.pkl")))


def test_a_held_function_is_found_in_this_process_only():
    def closure_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    with held(closure_reward) as spec:
        s = RewardScorer(RewardConfig(type="custom", custom_function=spec, on_error="zero"))
        assert s.name == "custom function object closure_reward (trl-style)"
        assert s.score(["abc"], [None], [{}]).rewards == [3.0]
        with held(lambda completions, **kw: []) as other, held(closure_reward) as again:
            assert other.endswith(".lambda") and again.endswith(".closure_reward_2")
    with pytest.raises(ValueError, match="held in the process that called it"):
        load_function(spec)
    with held(closure_reward) as again:  # the same name in the next run: its resume matches
        assert again == spec
