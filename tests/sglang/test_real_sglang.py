"""A real SGLang 0.5.23 server on CPU, driven the way the trainer drives it.

Needs ``.venv-sglang`` (``bash scripts/setup_sglang_venv.sh``). One server
for the module, started through ``rollout.servers`` and registered with a
real sglang-router, serving a random tiny Qwen2 (hidden 64, 2 layers) with a
locally made tokenizer; nothing is downloaded. The learner is a TP2 x PP2 megatron
model on 4 gloo processes that loads the same HF weights
(``workers_sglang.learner_scenario``).

Checked: SGLang's own contract accepts our requests and its answers parse;
greedy tokens and per-token log-probs of the server equal the learner's
forward pass; abort mid-generation; generation through the router; and the
disk, tensor and distributed weight updates from both pipeline stages of the learner
(after each, the server's greedy samples equal the new weights' argmax and their
log-probs the new weights' log-probs, with weight_version = step). Last,
once that server is stopped, the trainer itself (``megatron-grpo train``,
2 processes) launches its own server from ``rollout.engines.launch_command``,
trains 2 steps with distributed weight sync, and stops it.

Without ``.venv-sglang`` these tests are skipped, unless the ``sglang``
marker was asked for (``pytest -m sglang``): then they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_grpo.launch import free_port, run_workers
from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.rollout.servers import (
    LaunchConfig,
    launch_servers,
    router_workers,
    stop_process_group,
)
from megatron_grpo.sglang_api.protocol import build_generate_payload, parse_generate_response
from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams
from megatron_grpo.testing import sglang_contract as contract

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = ROOT / ".venv-sglang"
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
STUB = ROOT / "tests" / "sglang_stub"
WORKERS = str(Path(__file__).with_name("workers_sglang.py"))
LAUNCH = (
    f"{SGLANG_PYTHON} -m sglang.launch_server --model-path {{model}} --device cpu "
    "--attention-backend torch_native --disable-overlap-schedule --dtype float32 "
    "--max-total-tokens 4096 --host {host} --port {port}"
)
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(STUB)}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
MAX_NEW_TOKENS = 12
LOGPROB_ATOL = 1e-5
VOCAB = 300


# --------------------------------------------------------------------------- model


def save_tokenizer(path: Path) -> int:
    """A byte-level BPE of VOCAB tokens with a chat template; returns the eos id."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog", "one two three four five six"]
    tok.train_from_iterator(text * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)
    assert len(fast) == VOCAB, len(fast)
    return fast.eos_token_id


def save_tiny_qwen2(path: Path) -> None:
    import transformers

    eos = save_tokenizer(path)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # Larger than the usual 0.02: peaked logits, no near-ties for rounding to flip.
        initializer_range=0.2,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).float().save_pretrained(path)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sglang_python(request) -> Path:
    if not SGLANG_PYTHON.exists():
        message = f"{SGLANG_VENV} is missing: run `bash scripts/setup_sglang_venv.sh`"
        if "sglang" in (request.config.option.markexpr or ""):
            pytest.fail(message)
        pytest.skip(message)
    return SGLANG_PYTHON


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_qwen2(path)
    return path


@pytest.fixture(scope="module")
def router(sglang_python, tmp_path_factory):
    """A real sglang-router with no workers yet (it starts while the server loads)."""
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                str(sglang_python.parent / "sglang-router"),
                "launch",
                "--host=127.0.0.1",
                f"--port={port}",
                "--policy=round_robin",
                "--log-level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield {"url": f"http://127.0.0.1:{port}", "process": process, "log": log}
    stop_process_group(process, grace_s=20)


@pytest.fixture(scope="module")
def server(sglang_python, hf_dir, router, tmp_path_factory):
    """One real SGLang server, launched and registered with the router by rollout.servers."""
    start = time.perf_counter()
    group = launch_servers(
        LaunchConfig(
            command=LAUNCH,
            model=str(hf_dir),
            log_dir=str(tmp_path_factory.mktemp("sglang_logs")),
            env=SERVER_ENV,
            startup_timeout_s=420,
            stop_grace_s=30,
            router_url=router["url"],
        )
    )
    print(f"SGLANG-TIER: server ready and registered in {time.perf_counter() - start:.1f} s")
    yield group
    group.stop()  # stopped already by the last test, unless it failed or was deselected


@pytest.fixture(scope="module")
def learner(server, hf_dir, tmp_path_factory):
    """The TP2 x PP2 learner's scenario against the server (see workers_sglang)."""
    start = time.perf_counter()
    [result, *_] = run_workers(
        f"{WORKERS}:learner_scenario",
        4,
        timeout=400,
        kwargs={
            "hf_dir": str(hf_dir),
            "url": server.urls[0],
            "prompts": PROMPTS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "work_dir": str(tmp_path_factory.mktemp("pushed")),
        },
    )
    print(f"SGLANG-TIER: TP2 x PP2 learner scenario took {time.perf_counter() - start:.1f} s")
    return result


def generate(url: str, request: RolloutRequest, **config):
    async def run():
        async with SGLangClient(ClientConfig(urls=(url,), **config)) as client:
            return await client.generate(request)

    return asyncio.run(run())


def get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post(url: str, body: dict) -> object:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def assert_matches_learner(rows: list[dict], phase: str, weight_version: str | None) -> float:
    """Server greedy tokens = learner argmax; server logprobs = learner logprobs. Max |diff|."""
    from megatron_grpo.algo.policy_loss import mismatch

    worst, total, tokens = 0.0, 0.0, 0
    for row in rows:
        assert row["output"], f"{phase}: empty output"
        assert row["output"] == row["learner_argmax"], f"{phase}: greedy tokens differ"
        server = torch.tensor(row["server_logprobs"])
        learner = torch.tensor(row["learner_logprobs"])
        torch.testing.assert_close(server, learner, atol=LOGPROB_ATOL, rtol=0)
        per_token = mismatch(learner, server, torch.ones_like(server))
        worst = max(worst, float(per_token.max()))
        total, tokens = total + float(per_token.sum()), tokens + len(per_token)
        if weight_version is not None:
            assert row["weight_version"] == weight_version, phase
    print(
        f"SGLANG-TIER: {phase}: {tokens} tokens, greedy tokens equal, "
        f"mismatch |logp_learner - logp_sglang| mean {total / tokens:.2e} max {worst:.2e}"
    )
    return worst


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(540)  # includes starting the server: ~40 s on an idle 2-core machine
def test_requests_and_answers_follow_sglang_contract(server):
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    payload = build_generate_payload(PROMPTS[0], sampling, rid="contract-check", seed=3)
    contract.validate_request(payload)
    answer = post(server.urls[0] + "/generate", payload)
    contract.validate_response(answer)
    result = parse_generate_response(answer)
    assert len(result.output_ids) == len(result.logprobs) == 4
    contract.validate("GetModelInfoResponse", get(server.urls[0] + "/model_info"))


@pytest.mark.timeout(600)
def test_greedy_tokens_and_logprobs_equal_the_tp2_pp2_learner(learner):
    assert learner["world"] == 4
    assert_matches_learner(learner["phases"]["initial"], "initial HF weights", None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["disk", "tensor", "distributed"])
def test_weight_update_from_both_stages_of_the_learner(learner, method):
    step = 1 + ["disk", "tensor", "distributed"].index(method)
    rows = learner["phases"][method]
    before = learner["phases"]["initial" if step == 1 else ["disk", "tensor"][step - 2]]
    # The update changed what the server computes ...
    changed = any(
        r["output"] != b["output"]
        or (torch.tensor(r["server_logprobs"]) - torch.tensor(b["server_logprobs"])).abs().max()
        > 1e-3
        for r, b in zip(rows, before)
    )
    assert changed, f"{method}: the server's answers did not change"
    # ... into exactly the learner's new weights, tagged with the step.
    assert_matches_learner(rows, f"after {method} update", str(step))
    print(f"SGLANG-TIER: {method} push took {learner['push_s'][method]:.2f} s")
    assert learner["all_reduce"] == 4.0


@pytest.mark.timeout(120)
def test_weight_check_says_sglang_reads_no_qwen_weight_back(learner):
    error = learner["check_error"]
    assert "rollout.sync.check: after pushing weight version check" in error
    assert "model.embed_tokens.weight: the engine did not return it" in error
    assert "llama-family models only" in error


@pytest.mark.timeout(120)
def test_abort_mid_generation(server):
    request = RolloutRequest(
        prompts=(tuple(PROMPTS[1]),),
        sampling=SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True),
    )

    async def run():
        async with SGLangClient(ClientConfig(urls=(server.urls[0],))) as client:
            task = asyncio.create_task(client.generate(request))
            deadline = time.monotonic() + 30
            while not list(client._in_flight):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # some tokens generated
            await client.abort_all()
            return await asyncio.wait_for(task, timeout=60)

    start = time.perf_counter()
    [sample] = asyncio.run(run())
    assert sample.finish_reason.type == "abort"
    assert 0 < len(sample.output_ids) < 3000
    assert len(sample.rollout_logprobs) == len(sample.output_ids)
    print(
        f"SGLANG-TIER: aborted after {len(sample.output_ids)} tokens "
        f"({time.perf_counter() - start:.1f} s)"
    )


@pytest.mark.timeout(120)
def test_generation_through_the_router(server, router):
    workers = router_workers(router["url"])
    assert [w["url"] for w in workers] == list(server.urls)
    assert workers[0]["is_healthy"]
    request = RolloutRequest(
        prompts=tuple(tuple(p) for p in PROMPTS),
        sampling=SamplingParams(max_new_tokens=5, temperature=0.0),
    )
    via_router = generate(router["url"], request, group_requests=False)  # one rid a request
    direct = generate(server.urls[0], request)
    assert [s.output_ids for s in via_router] == [s.output_ids for s in direct]
    # Not bit-equal: the second pass reuses the first one's prefix cache.
    for a, b in zip(via_router, direct):
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.timeout(120)
def test_stop_leaves_the_router_and_ends_the_process_group(server, router):
    """Last in the module: stops the shared server."""
    processes = list(server.processes)
    start = time.perf_counter()
    server.stop()
    print(f"SGLANG-TIER: server stopped in {time.perf_counter() - start:.1f} s")
    assert router_workers(router["url"]) == []
    for p in processes:
        assert p.process.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(p.process.pid, 0)  # no process of its group is left


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_text(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.timeout(600)
def test_trainer_launches_sglang_and_syncs_by_broadcast(sglang_python, tmp_path):
    """After the shared server is gone: one server at a time on this machine."""
    assets, out, logs = tmp_path / "assets", tmp_path / "out", tmp_path / "logs"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/cpu_demo/prepare.py"), "--out", str(assets)]
        + ["--warmup-steps", "10"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    model = assets / "model"
    # The demo tokenizer cannot encode SGLang's warm-up text: skip the warm-up.
    launch = LAUNCH.replace("{model}", str(model)) + " --skip-server-warmup"
    env_prefix = " ".join(f"{k}={v}" for k, v in SERVER_ENV.items())
    overrides = {
        "output_dir": out,
        "tokenizer": model,
        "train.init": model,
        "data.path": assets / "train.jsonl",
        "train.total_steps": 2,
        "rollout.prompts_per_step": 4,
        "rollout.samples_per_prompt": 4,
        "metrics.tensorboard": "false",
        "rollout.engines.type": "sglang",
        "rollout.engines.launch_command": f"env {env_prefix} {launch}",
        "rollout.engines.log_dir": logs,
        "rollout.sync.method": "distributed",
    }
    args = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", "2"]
    args += ["--config", str(ROOT / "examples/cpu_demo/grpo.yaml")]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    server_log = (logs / "server_0.log").read_text()
    assert server_log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') >= 2
    assert '"POST /destroy_weights_update_group HTTP/1.1" 200' in server_log
    # Step 2 trained on samples generated after step 1's broadcast.
    assert all(r["train/logprob_mismatch"] < LOGPROB_ATOL for r in rows), rows
    assert processes_mentioning(str(model)) == []  # the trainer stopped its server
    mismatch = ", ".join(f"{r['train/logprob_mismatch']:.1e}" for r in rows)
    sync = ", ".join(f"{r['perf/time_sync_s']:.2f}" for r in rows)
    print(
        f"SGLANG-TIER: trainer with a launched server, 2 steps in "
        f"{time.perf_counter() - start:.0f} s; logprob_mismatch {mismatch}; sync {sync} s"
    )
