"""Prompt datasets: loading, templating, bad rows, length filter, seeded epochs, resume."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_grpo.data import (
    DataConfig,
    PromptDataset,
    PromptSampler,
    epoch_order,
)

SPECIAL = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "what is one plus two three four five hello world be brief long".split()


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    hf.chat_template = TEMPLATE
    return hf


def ids(tokenizer, text):
    return tokenizer.convert_tokens_to_ids(text.split())


def write_jsonl(path, rows):
    path.write_bytes(
        b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows)
    )
    return str(path)


def test_jsonl_with_chat_template(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "what is one plus two", "label": "3", "source": "gsm"},
            {"prompt": [{"role": "user", "content": "hello world"}], "label": 7},
        ],
    )
    ds = PromptDataset(DataConfig(path=path, shuffle=False), tokenizer)
    assert len(ds) == 2 and ds.problems == [] and ds.num_too_long == 0
    first, second = ds[0], ds[1]
    assert first.prompt_text == "<|user|> what is one plus two <|end|> <|assistant|>"
    assert first.prompt_ids == ids(tokenizer, first.prompt_text)
    assert (first.index, first.label, first.metadata) == (0, "3", {"source": "gsm"})
    assert second.prompt_text == "<|user|> hello world <|end|> <|assistant|>"
    assert (second.index, second.label, second.metadata) == (1, 7, {})


def test_system_prompt_and_custom_keys(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "hello", "a": "world"}])
    config = DataConfig(path=path, prompt_key="q", label_key="a", system_prompt="be brief")
    (item,) = PromptDataset(config, tokenizer).items
    assert item.prompt_text == "<|system|> be brief <|end|> <|user|> hello <|end|> <|assistant|>"
    assert item.label == "world"


def test_without_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world", "label": "x"}])
    (item,) = PromptDataset(DataConfig(path=path, apply_chat_template=False), tokenizer).items
    assert item.prompt_text == "hello world"
    assert item.prompt_ids == ids(tokenizer, "hello world")


def test_parquet_and_several_files(tmp_path, tokenizer):
    table = pa.table(
        {
            "prompt": ["one two", "three four"],
            "label": ["a", None],
            "level": [1, 2],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    jsonl = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "five", "label": "b"}])
    config = DataConfig(path=[str(tmp_path / "p.parquet"), jsonl], shuffle=False)
    ds = PromptDataset(config, tokenizer)
    # The parquet row without a label is reported by its row number.
    assert ds.problems == [(str(tmp_path / "p.parquet"), 2, "missing label key 'label'")]
    assert [(i.index, i.label, i.metadata) for i in ds.items] == [
        (0, "a", {"level": 1}),
        (1, "b", {}),
    ]
    assert ds[1].prompt_text == "<|user|> five <|end|> <|assistant|>"


def test_parquet_message_lists(tmp_path, tokenizer):
    messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]]
    pq.write_table(pa.table({"prompt": messages, "label": ["x"]}), tmp_path / "m.parquet")
    config = DataConfig(path=str(tmp_path / "m.parquet"), system_prompt="ignored here")
    (item,) = PromptDataset(config, tokenizer).items
    assert item.prompt_text == "<|system|> be brief <|end|> <|user|> hello <|end|> <|assistant|>"


def test_bad_rows_are_reported_and_skipped(tmp_path, tokenizer, caplog):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "hello", "label": "1"},  # 1 good
            {"question": "hello", "label": "1"},  # 2 no prompt key
            {"prompt": "   ", "label": "1"},  # 3 empty prompt
            b'{"prompt": "caf\xff", "label": "1"}\n',  # 4 invalid UTF-8
            b'{"prompt": "hello", \n',  # 5 invalid JSON
            {"prompt": "hello"},  # 6 no label
            b"\n",  # 7 blank: not a row
            {"prompt": "world", "label": "2"},  # 8 good
            [1, 2],  # 9 not an object
            {"prompt": [], "label": "1"},  # 10 no messages
            {"prompt": [{"role": "user"}], "label": "1"},  # 11 malformed message
            {"prompt": [{"role": "tool", "content": "x"}], "label": "1"},  # 12 template rejects
        ],
    )
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.data"):
        ds = PromptDataset(DataConfig(path=path), tokenizer)
    assert [i.label for i in ds.items] == ["1", "2"]
    assert [p.line for p in ds.problems] == [2, 3, 4, 5, 6, 9, 10, 11, 12]
    assert all(p.file == path for p in ds.problems)
    reasons = [p.reason for p in ds.problems]
    assert "missing prompt key" in reasons[0] and "empty prompt" in reasons[1]
    assert "invalid UTF-8" in reasons[2] and "invalid JSON" in reasons[3]
    assert "missing label" in reasons[4] and "JSON object" in reasons[5]
    assert reasons[8] == "chat template failed: tool messages are not supported"
    assert f"{path}:4: skipping row: invalid UTF-8" in caplog.text


def test_label_optional(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    (item,) = PromptDataset(DataConfig(path=path, require_label=False), tokenizer).items
    assert item.label is None


def test_every_row_bad_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"x": 1}, b"not json\n"])
    with pytest.raises(ValueError, match="every row .* is bad .*:1: missing prompt key"):
        PromptDataset(DataConfig(path=path), tokenizer)


def test_long_prompts_are_filtered_and_counted(tmp_path, tokenizer):
    # Templated lengths: "hello" -> 4 tokens, "one two three four five" -> 8.
    rows = [{"prompt": "hello", "label": "a"}, {"prompt": "one two three four five", "label": "b"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows * 2)
    ds = PromptDataset(DataConfig(path=path, max_prompt_length=4), tokenizer)
    assert ds.num_too_long == 2 and ds.problems == []
    assert [(i.index, i.label, len(i.prompt_ids)) for i in ds.items] == [(0, "a", 4), (1, "a", 4)]
    with pytest.raises(ValueError, match="0 bad rows, 4 longer than data.max_prompt_length=3"):
        PromptDataset(DataConfig(path=path, max_prompt_length=3), tokenizer)


def test_an_overlong_prompt_is_simply_not_in_the_dataset(tmp_path, tokenizer, caplog):
    """The default (filter): the dataset, and so every sampler's batches, are those of the
    file without the long prompt; one line gives the count."""
    short = [{"prompt": w, "label": str(i)} for i, w in enumerate("one two three four".split())]
    long = {"prompt": "one two three four five", "label": "long"}  # 8 tokens templated
    with_long = write_jsonl(tmp_path / "with.jsonl", [*short[:2], long, *short[2:]])
    without = write_jsonl(tmp_path / "without.jsonl", short)
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.data"):
        ds = PromptDataset(DataConfig(path=with_long, max_prompt_length=4, seed=3), tokenizer)
    expected = PromptDataset(DataConfig(path=without, max_prompt_length=4, seed=3), tokenizer)
    assert ds.items == expected.items and ds.num_too_long == 1
    batches = [PromptSampler.from_config(d).next_batch(7) for d in (ds, expected)]
    assert batches[0] == batches[1]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "dropped 1 of 5 prompts longer than data.max_prompt_length=4 tokens "
        "(data.overlong_prompts=filter)"
    )


def test_an_overlong_prompt_refuses_the_run_when_asked(tmp_path, tokenizer):
    rows = [{"prompt": "hello", "label": "a"}, {"prompt": "one two three four five", "label": "b"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    config = DataConfig(path=path, max_prompt_length=4, overlong_prompts="error")
    with pytest.raises(ValueError) as err:
        PromptDataset(config, tokenizer)
    assert str(err.value) == (
        f"{path}:2: the prompt has 8 tokens, more than data.max_prompt_length=4 "
        "(data.overlong_prompts=error; 'filter' drops such prompts)"
    )


def test_an_empty_file_among_several_is_named_once(tmp_path, tokenizer, caplog):
    first = write_jsonl(tmp_path / "first.jsonl", [{"prompt": "hello", "label": "a"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.data"):
        ds = PromptDataset(DataConfig(path=[first, str(empty)]), tokenizer)
    assert len(ds) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"data.path {empty} has no rows; the other files are read"
    ]


def test_config_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="must end in .jsonl, .parquet or .arrow, or be a saved"):
        DataConfig(path="prompts.csv")
    with pytest.raises(ValueError, match="system_prompt needs data.apply_chat_template"):
        DataConfig(path="p.jsonl", system_prompt="hi", apply_chat_template=False)
    with pytest.raises(ValueError, match="data.seed"):
        DataConfig(path="p.jsonl", seed=-1)
    with pytest.raises(ValueError, match="max_prompt_length"):
        DataConfig(path="p.jsonl", max_prompt_length=0)
    with pytest.raises(ValueError, match="does not exist"):
        PromptDataset(DataConfig(path=str(tmp_path / "missing.jsonl")), tokenizer)
    with pytest.raises(ValueError, match="data.path is empty"):
        PromptDataset(DataConfig(), tokenizer)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello", "label": "x"}])
    no_template = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="tokenizer has no chat_template"):
        PromptDataset(DataConfig(path=path), no_template)


# --------------------------------------------------------------------------- HF datasets

BRIEF = "<|system|> be brief <|end|> "


def hf_rows():
    return [
        {"prompt": "what is one plus two", "label": "3", "level": 1},
        {"prompt": "hello world", "label": "7", "level": 2},
    ]


def test_saved_dataset_folder_with_system_prompt(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(hf_rows()).save_to_disk(str(tmp_path / "saved"))
    config = DataConfig(path=str(tmp_path / "saved"), system_prompt="be brief", shuffle=False)
    ds = PromptDataset(config, tokenizer)
    assert [(i.label, i.metadata) for i in ds.items] == [("3", {"level": 1}), ("7", {"level": 2})]
    assert ds[0].prompt_text == BRIEF + "<|user|> what is one plus two <|end|> <|assistant|>"
    assert ds[0].prompt_ids == ids(tokenizer, ds[0].prompt_text)


def test_dataset_dict_folder_reads_its_split(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    train, test = datasets.Dataset.from_list(hf_rows()), datasets.Dataset.from_list(hf_rows()[1:])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    assert len(PromptDataset(DataConfig(path=str(tmp_path / "dd")), tokenizer)) == 2
    (item,) = PromptDataset(DataConfig(path=str(tmp_path / "dd"), split="test"), tokenizer).items
    assert item.label == "7"
    with pytest.raises(ValueError, match="without the split 'dev' .*splits are train, test"):
        PromptDataset(DataConfig(path=str(tmp_path / "dd"), split="dev"), tokenizer)


def test_arrow_files(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(hf_rows()).save_to_disk(str(tmp_path / "saved"))
    (stream,) = (tmp_path / "saved").glob("*.arrow")  # what datasets writes: an Arrow stream
    table = pa.table({"prompt": ["five"], "label": ["b"]})
    with pa.ipc.new_file(str(tmp_path / "plain.arrow"), table.schema) as writer:
        writer.write_table(table)  # an Arrow IPC file
    config = DataConfig(path=[str(stream), str(tmp_path / "plain.arrow")], shuffle=False)
    assert [i.label for i in PromptDataset(config, tokenizer).items] == ["3", "7", "b"]


def test_missing_columns_are_named(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "hello", "answer": "x"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.table({"prompt": ["hello"], "answer": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="no prompt column 'prompt': its columns are question, "):
        PromptDataset(DataConfig(path=str(tmp_path / "saved")), tokenizer)
    with pytest.raises(ValueError, match="no label column 'label'.*data.require_label=false"):
        PromptDataset(DataConfig(path=str(tmp_path / "p.parquet")), tokenizer)
    config = DataConfig(path=str(tmp_path / "saved"), prompt_key="question", label_key="answer")
    assert PromptDataset(config, tokenizer)[0].label == "x"


def test_empty_or_unreadable_folders(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": [], "label": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no rows in .*empty"):
        PromptDataset(DataConfig(path=str(tmp_path / "empty")), tokenizer)
    (tmp_path / "not_saved").mkdir()
    with pytest.raises(ValueError, match="not_saved'.*neither a `Dataset`"):
        PromptDataset(DataConfig(path=str(tmp_path / "not_saved")), tokenizer)
    (tmp_path / "broken.arrow").write_bytes(b"not arrow")
    with pytest.raises(ValueError, match="is not an Arrow stream or file"):
        PromptDataset(DataConfig(path=str(tmp_path / "broken.arrow")), tokenizer)


def test_epoch_order_seeded_and_per_epoch():
    a = epoch_order(20, seed=3, epoch=0, shuffle=True)
    assert a == epoch_order(20, seed=3, epoch=0, shuffle=True)
    assert sorted(a) == list(range(20))
    assert a != epoch_order(20, seed=3, epoch=1, shuffle=True)
    assert a != epoch_order(20, seed=4, epoch=0, shuffle=True)
    assert epoch_order(5, seed=3, epoch=7, shuffle=False) == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def ten_prompts(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("data") / "p.jsonl"
    write_jsonl(path, [{"prompt": w, "label": str(i)} for i, w in enumerate(WORDS[:10])])
    return PromptDataset(DataConfig(path=str(path), seed=5), tokenizer)


def test_sampler_crosses_epochs(ten_prompts):
    sampler = PromptSampler.from_config(ten_prompts)
    drawn = [item.index for _ in range(7) for item in sampler.next_batch(3)]  # 2.1 epochs
    assert sorted(drawn[:10]) == sorted(drawn[10:20]) == list(range(10))
    assert drawn[:10] == epoch_order(10, seed=5, epoch=0, shuffle=True)
    assert drawn[10:20] == epoch_order(10, seed=5, epoch=1, shuffle=True)
    assert sampler.state_dict() == {"epoch": 2, "position": 1, "seed": 5, "num_items": 10}
    big = sampler.next_batch(25)  # a batch larger than the dataset spans epochs too
    assert len(big) == 25 and sampler.state_dict()["epoch"] == 4


def test_resume_gives_the_same_batches(ten_prompts):
    uninterrupted = PromptSampler.from_config(ten_prompts)
    expected = [[i.index for i in uninterrupted.next_batch(4)] for _ in range(8)]

    first = PromptSampler.from_config(ten_prompts)
    got = [[i.index for i in first.next_batch(4)] for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON survives a checkpoint
    resumed = PromptSampler.from_config(ten_prompts)
    resumed.load_state_dict(state)
    got += [[i.index for i in resumed.next_batch(4)] for _ in range(5)]
    assert got == expected


def test_resume_rejects_another_seed_or_dataset(ten_prompts):
    sampler = PromptSampler(ten_prompts, shuffle=True, seed=6)
    with pytest.raises(ValueError, match="seed 5"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "seed": 5})
    with pytest.raises(ValueError, match="saved for 11 prompts"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "seed": 6, "num_items": 11})
