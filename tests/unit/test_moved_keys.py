"""Keys that moved (``config.loader.MOVED_KEYS``): a config that names them the old way
still loads, to the same Config, with one warning per key naming its new name."""

import re
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_grpo import cli
from megatron_grpo.api import build_config
from megatron_grpo.config import MOVED_KEYS, Config, MovedKeyWarning, from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests" / "fixtures" / "old_configs"
EXAMPLES = ROOT / "examples"
TODAY = {
    "grpo_math.yaml": EXAMPLES / "grpo_math.yaml",
    "cpu_demo.yaml": EXAMPLES / "cpu_demo" / "grpo.yaml",
    "tool_demo.yaml": EXAMPLES / "tool_demo" / "grpo.yaml",
}


def moved_warnings(load):
    """What ``load()`` returns, and the old keys it warned about, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load()
    said = [str(w.message) for w in caught if issubclass(w.category, MovedKeyWarning)]
    keys = [re.fullmatch(r"config key '(.+)' is now '(.+)'", s) for s in said]
    assert all(keys), said
    assert all(MOVED_KEYS[m.group(1)] == m.group(2) for m in keys)
    return result, [m.group(1) for m in keys]


def dotted(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


URLS = ["rollout.engines.urls=[http://10.0.0.2:30000]"]
"""What the GPU recipes add to grpo_math.yaml for it to load (examples/common.sh)."""


@pytest.mark.parametrize("name", sorted(TODAY))
def test_an_example_as_it_was_loads_to_the_example_as_it_is(name):
    old, overrides = OLD / name, URLS if name == "grpo_math.yaml" else []
    cfg, warned = moved_warnings(lambda: load_config(old, overrides))
    assert cfg == load_config(TODAY[name], overrides)
    named = [k for k in dotted(yaml.safe_load(old.read_text())) if k in MOVED_KEYS]
    assert named and sorted(warned) == sorted(named)  # each once


def test_the_old_grpo_math_names_three_moved_keys():
    _, warned = moved_warnings(lambda: load_config(OLD / "grpo_math.yaml", URLS))
    assert sorted(warned) == ["rollout.engine", "rollout.sync_method", "rollout.temperature"]


def test_a_recipe_as_it_was_gives_the_recipe_as_it_is():
    """examples/common.sh passed the engines' URLs and the master address by --set."""
    old = ["rollout.urls=[http://10.0.0.2:30000]", "rollout.sync_master_address=10.0.0.1"]
    new = ["rollout.engines.urls=[http://10.0.0.2:30000]", "rollout.sync.master_address=10.0.0.1"]
    cfg, warned = moved_warnings(lambda: load_config(OLD / "grpo_math.yaml", old))
    assert cfg == load_config(EXAMPLES / "grpo_math.yaml", new)
    assert cfg.rollout.engines.urls == ["http://10.0.0.2:30000"]
    assert {"rollout.urls", "rollout.sync_master_address"} <= set(warned)


EVERY_OLD_KEY = """
train: {hf_family: llama}
optim: {distributed_optimizer: true}
rollout:
  temperature: 0.7
  top_p: 0.9
  top_k: 20
  stop_token_ids: [5]
  engine: sglang
  embedded_server: auto
  urls: [http://10.0.0.2:30000]
  launch_command: null
  num_servers: 3
  server_host: 10.0.0.1
  server_startup_timeout_s: 120
  server_log_dir: /tmp/logs
  router_url: http://10.0.0.3:30000
  api_key_env: MY_KEY
  max_concurrency: 128
  request_timeout_s: 300
  connect_timeout_s: 5
  control_timeout_s: 30
  weight_update_timeout_s: 900
  sync_method: distributed
  sync_master_address: 10.0.0.1
  sync_bucket_mb: 256
  sync_disk_dir: /tmp/sync
  check_weight_sync: true
reward:
  type: remote
  format_pattern: ".*answer.*"
  format_mode: search
  format_match_score: 2.0
  format_miss_score: -1.0
  format_weight: 0.5
  remote_url: http://10.0.0.4/score
  remote_field: score
  remote_timeout: 10
  remote_retries: 4
  remote_retry_backoff: 0.25
  remote_batch_size: 16
"""

EVERY_NEW_KEY = """
model: {hf_family: llama}
optim: {use_distributed_optimizer: true}
rollout:
  sampling: {temperature: 0.7, top_p: 0.9, top_k: 20, stop_token_ids: [5]}
  engines:
    type: sglang
    embedded_server: auto
    urls: [http://10.0.0.2:30000]
    launch_command: null
    num_servers: 3
    host: 10.0.0.1
    startup_timeout_s: 120
    log_dir: /tmp/logs
    router_url: http://10.0.0.3:30000
    api_key_env: MY_KEY
  client:
    max_concurrency: 128
    request_timeout_s: 300
    connect_timeout_s: 5
    control_timeout_s: 30
    weight_update_timeout_s: 900
  sync:
    method: distributed
    master_address: 10.0.0.1
    bucket_mb: 256
    disk_dir: /tmp/sync
    check: true
reward:
  type: remote
  format: {pattern: ".*answer.*", mode: search, match_score: 2.0, miss_score: -1.0, weight: 0.5}
  remote:
    url: http://10.0.0.4/score
    field: score
    timeout_s: 10
    retries: 4
    retry_backoff_s: 0.25
    batch_size: 16
"""


def test_every_moved_key_loads_into_its_new_place(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(EVERY_OLD_KEY)
    new.write_text(EVERY_NEW_KEY)
    cfg, warned = moved_warnings(lambda: load_config(old))
    assert sorted(warned) == sorted(MOVED_KEYS)  # every key, each once
    assert cfg == load_config(new) != load_config(None)
    assert cfg.rollout.sampling.temperature == 0.7 and cfg.reward.remote.retry_backoff_s == 0.25


def test_a_run_saved_with_the_old_keys_loads_as_saved():
    cfg, warned = moved_warnings(lambda: load_config(OLD / "saved_run.yaml"))
    assert len(warned) == len(set(warned)) == 35  # every moved rollout and reward key
    assert cfg.rollout.sampling.temperature == 0.7 and cfg.rollout.sync.bucket_mb == 256
    assert cfg.reward.format.weight == 0.1 and cfg.reward.remote.timeout_s == 10
    assert cfg.optim.use_distributed_optimizer


def test_a_config_that_gives_both_names_is_refused_naming_both(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("rollout:\n  temperature: 0.5\n  sampling: {temperature: 0.7}\n")
    both = "config gives both 'rollout.temperature' and 'rollout.sampling.temperature'"
    with pytest.raises(ValueError, match=re.escape(both)):
        load_config(path)
    with pytest.raises(ValueError, match=re.escape(both)):  # within one --set as well
        load_config(None, ["rollout={temperature: 0.5, sampling: {temperature: 0.7}}"])


def test_an_override_by_the_old_name_sets_the_new_key(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text("rollout:\n  sampling: {temperature: 0.7}\n")
    cfg, warned = moved_warnings(lambda: load_config(path, ["rollout.temperature=0.5"]))
    assert cfg.rollout.sampling.temperature == 0.5 and warned == ["rollout.temperature"]
    cfg, warned = moved_warnings(
        lambda: load_config(None, ["rollout={engine: sglang, urls: [http://a:1]}"])
    )
    assert (cfg.rollout.engines.type, cfg.rollout.engines.urls) == ("sglang", ["http://a:1"])
    assert sorted(warned) == ["rollout.engine", "rollout.urls"]


def test_the_python_api_takes_the_old_names_too():
    cfg, warned = moved_warnings(
        lambda: build_config({"reward": {"format_weight": 0.5}}, {"reward.format_pattern": "x"})
    )
    assert (cfg.reward.format.weight, cfg.reward.format.pattern) == (0.5, "x")
    assert sorted(warned) == ["reward.format_pattern", "reward.format_weight"]


def test_an_invalid_value_is_named_by_its_new_key():
    with pytest.raises(ValueError, match=r"rollout\.sampling\.temperature must be >= 0"):
        moved_warnings(lambda: load_config(None, ["rollout.temperature=-1"]))
    with pytest.raises(ValueError, match=r"reward\.remote\.timeout_s must be > 0"):
        moved_warnings(lambda: load_config(None, ["reward.remote_timeout=0"]))


def test_a_dict_built_without_moving_its_keys_names_the_new_one():
    with pytest.raises(ValueError, match=r"'rollout\.temperature' is now 'rollout\.sampling"):
        from_dict(Config, {"rollout": {"temperature": 1.0}})


def test_the_workers_of_a_launch_do_not_say_it_again(monkeypatch, capsys):
    """The launcher loaded the same config and warned; its workers (and every rank but 0 of
    a torchrun started by hand) load it quietly."""
    argv = ["train", "--dry-run", "--world-size", "1", "--config", str(OLD / "grpo_math.yaml")]
    argv += ["--set", "rollout.engines.urls=[http://a:1]"]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(cli.ERROR_DIR_ENV, raising=False)
    _, warned = moved_warnings(lambda: cli.main(argv))
    assert len(warned) == 3
    monkeypatch.setenv("RANK", "1")
    assert moved_warnings(lambda: cli.main(argv)) == (0, [])


def test_options_md_lists_every_moved_key():
    text = (ROOT / "docs" / "options.md").read_text()
    listed = dict(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", text, flags=re.M))
    assert listed == MOVED_KEYS
