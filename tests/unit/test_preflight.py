"""Bad values that ``megatron-grpo train`` refuses before any process starts: exit 2, one
line naming the config key."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_grpo import cli

MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.vocab_size=32",
    "data.apply_chat_template=false",
]


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """``megatron-grpo train --nproc 2`` on a tokenizer and a data file made here; the exit
    code and stderr. Starting torchrun fails the test: refusals come before it."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "what is one plus two".split()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(
        tmp_path / "tok"
    )
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "what is one plus two", "label": "3"}) + "\n")

    def launched(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(cli, "_relaunch_under_torchrun", launched)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def train(*overrides: str, nproc: int = 2) -> tuple[int, str]:
        base = [f"tokenizer={tmp_path / 'tok'}", f"data.path={data}", *MODEL]
        sets = [f"--set={o}" for o in [*base, f"output_dir={tmp_path / 'out'}", *overrides]]
        code = cli.main(["train", *sets, "--nproc", str(nproc)])
        return code, capsys.readouterr().err

    return train


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (
            ["rollout.sampling.temperature=-1"],
            2,
            "rollout.sampling.temperature must be >= 0, got -1.0",
        ),
        (["optim.lr=nan"], 2, "optim.lr must be a finite number, got 'nan'"),
        (["parallel.tp=2"], 3, "world size 3 is not divisible by TP(2) x PP(1) x CP(1)"),
        (["parallel.tp=8"], 8, "model.num_attention_heads=4 is not divisible by TP=8"),
        (["model.ffn_hidden_size=100", "parallel.tp=8"], 8, "not divisible by TP=8"),
        (
            ["rollout.samples_per_prompt=1", "rollout.prompts_per_step=1"],
            2,
            "train.global_batch_size=1 is below DP=2",
        ),
        (["data.path=/nowhere/train.jsonl"], 2, "data.path '/nowhere/train.jsonl' does not"),
        (["reward.type=custom", "reward.custom_function=no_such_module:score"], 2, None),
        (
            ["eval.datasets=[{name: held, path: /nowhere/held.jsonl}]"],
            2,
            "eval.datasets[held]: data.path '/nowhere/held.jsonl' does not exist",
        ),
        (["eval.k=[8]"], 2, "eval.k must list values in [1, eval.samples_per_prompt=4]"),
        # no GPU here: context parallelism needs Transformer Engine's attention, in 16-bit
        (
            ["parallel.cp=2", "model.params_dtype=bfloat16"],
            2,
            "parallel.cp=2 needs Transformer Engine's attention",
        ),
        (["parallel.cp=2"], 2, "parallel.cp=2 needs model.params_dtype=bfloat16"),
    ],
)
def test_refused_before_launch(run, overrides, nproc, message):
    code, err = run(*overrides, nproc=nproc)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("megatron-grpo: error: "), err
    if message is not None:
        assert message in lines[-1], err
    if overrides[0].startswith("reward"):
        assert "reward.custom: " in lines[-1] and "cannot import 'no_such_module'" in lines[-1]


def test_a_dataset_without_a_usable_row_is_refused(run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"label": "3"}\nnot json\n')
    code, err = run(f"data.path={bad}")
    assert code == 2
    assert f"data: every row of {bad} is bad (2 rows); first: {bad}:1:" in err


def test_a_good_config_reaches_the_launch(run):
    with pytest.raises(AssertionError, match="torchrun was started"):
        run()


@pytest.mark.parametrize(
    "path, looked_for",
    [
        ("runs/demo/assets/model", "runs/demo/assets/model"),  # the demo's, from elsewhere
        ("./tok", "tok"),
        ("demo/model", "demo/model"),  # the hub's form, but not in its cache
    ],
)
def test_a_missing_tokenizer_is_refused_here_not_sent_to_the_hub(
    run, tmp_path, monkeypatch, path, looked_for
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path / "tok")  # the tokenizer directory exists, just not from here
    code, err = run(f"tokenizer={path}")
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"megatron-grpo: error: tokenizer={path!r} (looked for {tmp_path}/tok/{looked_for}, "
        "from the current directory) does not exist"
    ), line
    assert "a Hugging Face tokenizer directory (with tokenizer.json" in line
    assert "Repo id" not in line


def test_a_hub_id_in_the_cache_is_left_to_transformers(run, tmp_path, monkeypatch):
    from megatron_grpo.train.preflight import check_tokenizer

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--org--tok").mkdir(parents=True)
    check_tokenizer("org/tok")
    check_tokenizer("gpt2")  # no separator: the hub's to resolve
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"file' is a file: give a Hugging Face tokenizer"):
        check_tokenizer(str(tmp_path / "file"))


def test_a_tokenizer_is_needed_when_train_init_is_not_a_hf_directory(run, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")
    code, err = run("tokenizer=null", f"train.init={tmp_path / 'ckpt'}")
    assert code == 2
    assert err.strip() == (
        "megatron-grpo: error: tokenizer is not set and train.init is a megatron checkpoint: "
        "give a Hugging Face tokenizer directory (with tokenizer.json or tokenizer_config.json)"
    )


def test_an_overlong_prompt_anywhere_refuses_the_run_when_asked(run, tmp_path):
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": "what is one", "label": "1"}, {"prompt": "one " * 40, "label": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    context = "model.max_position_embeddings=100"  # less rollout.max_new_tokens=64: 36 tokens
    code, err = run(f"data.path={data}", "data.overlong_prompts=error", context)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"megatron-grpo: error: data: {data}:2: the prompt has 40 tokens, more than "
        "data.max_prompt_length=36 (data.overlong_prompts=error; 'filter' drops such prompts)"
    )
