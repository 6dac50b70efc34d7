import pytest

from megatron_grpo.config import Config, ParallelDims, dump_config, load_config


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_dotted_overrides(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 4\noptim:\n  lr: 1e-5\nparallel:\n  tp: 2\n")
    cfg = load_config(path, ["optim.lr=3e-6", "model.qk_layernorm=true", "seed=7"])
    assert isinstance(cfg, Config)
    assert cfg.model.num_layers == 4
    assert cfg.optim.lr == pytest.approx(3e-6)
    assert cfg.model.qk_layernorm is True
    assert cfg.seed == 7
    assert cfg.parallel == ParallelDims(tp=2)
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads


def test_unknown_key_is_named(tmp_path):
    path = write(tmp_path, "optim:\n  lrr: 1e-5\n")
    with pytest.raises(ValueError, match=r"unknown config key 'optim\.lrr'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"unknown config key 'bogus'"):
        load_config(None, ["bogus=1"])


def test_wrong_type_and_bad_value_are_named():
    with pytest.raises(ValueError, match=r"model\.num_layers must be int, got 'four'"):
        load_config(None, ["model.num_layers=four"])
    with pytest.raises(ValueError, match=r"optim\.optimizer='adamw' is not one of 'adam', 'sgd'"):
        load_config(None, ["optim.optimizer=adamw"])
    with pytest.raises(ValueError, match=r"optim\.min_lr=0\.1 is above optim\.lr"):
        load_config(None, ["optim.lr=0.01", "optim.min_lr=0.1"])
    with pytest.raises(ValueError, match="not of the form key=value"):
        load_config(None, ["optim.lr"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.hidden_size=128", "parallel.pp=2"])
    path = write(tmp_path, dump_config(cfg))
    assert load_config(path) == cfg


def test_layout_validation_names_the_cause():
    dims = ParallelDims(tp=2, pp=2)
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by TP\(2\) x PP\(2\) x CP\(1\) = 4"
    ):
        dims.data_parallel_size(6)
    assert dims.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"model\.num_layers=3 is not divisible"):
        dims.validate_model(num_layers=3, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match=r"model\.num_attention_heads=6 is not divisible by TP=4"):
        ParallelDims(tp=4).validate_model(num_layers=2, num_attention_heads=6, num_query_groups=6)
    with pytest.raises(ValueError, match=r"model\.num_query_groups=2 is not divisible by TP=4"):
        ParallelDims(tp=4).validate_model(num_layers=2, num_attention_heads=8, num_query_groups=2)
    with pytest.raises(ValueError, match=r"parallel\.tp must be >= 1"):
        ParallelDims(tp=0)
