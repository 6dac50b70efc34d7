"""The embedded server as a process of its own, put to sleep and woken as a colocated run
does: its resident set drops by its weights' bytes on release and comes back on resume;
pushed weights then give the same greedy tokens as before; asleep, it refuses a push and a
generation by name.

The model (about 80 MB in fp32) is saved in bf16, as checkpoints usually are: the server
upcasts it into memory of its own. The process runs without MALLOC_ENV: the release itself
returns the memory to the system.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_grpo.embedded.weights import hf_weights, load_hf_model, tensor_update
from megatron_grpo.launch import free_port
from megatron_grpo.rollout.client_config import ClientConfig
from megatron_grpo.rollout.engine_calls import EngineCalls
from megatron_grpo.rollout.servers import http_ok
from megatron_grpo.sglang_api.errors import RolloutHTTPError
from megatron_grpo.sglang_api.memory import CUDA_GRAPH, KV_CACHE, WEIGHTS
from megatron_grpo.testing.memory import rss

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
MB = 1e6


def save_model(directory) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked logits: no near-ties in greedy decoding
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def generate(url: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(GREEDY).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def server(tmp_path):
    save_model(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_grpo.embedded", "--model-path", str(tmp_path)]
        + ["--port", str(port)],
        env=os.environ.copy(),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not http_ok(f"{url}/health", timeout_s=1.0):
        assert proc.poll() is None, "the embedded server exited"
        assert time.monotonic() < deadline, "the embedded server did not start"
        time.sleep(0.2)
    yield proc, url, tmp_path
    proc.terminate()
    proc.wait(timeout=30)


def test_asleep_the_resident_set_drops_by_the_weights_and_comes_back(server):
    proc, url, model_dir = server
    weights = {k: v.detach() for k, v in hf_weights(load_hf_model(str(model_dir))).items()}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())  # fp32
    status, before = generate(url)
    assert status == 200

    async def scenario() -> dict[str, int]:
        async with EngineCalls(ClientConfig(urls=(url,))) as calls:
            figures = {"awake": rss(proc.pid)}
            await calls.release_memory_occupation([WEIGHTS, KV_CACHE, CUDA_GRAPH])
            figures["asleep"] = rss(proc.pid)

            status, refused = generate(url)
            assert status == 400
            assert (
                "/generate refused: the engine's kv_cache and weights and cuda_graph memory"
                in (refused["error"]["message"])
            )
            update = tensor_update(weights, weight_version="pushed")
            await calls.begin_weight_update()
            with pytest.raises(RolloutHTTPError, match="weights memory is released"):
                await calls.update_weights_from_tensor(update, url=url)

            await calls.resume_memory_occupation([WEIGHTS])
            figures["weights_resumed"] = rss(proc.pid)
            await calls.update_weights_from_tensor(update, url=url)
            await calls.end_weight_update()
            await calls.resume_memory_occupation([KV_CACHE, CUDA_GRAPH])
            figures["pushed"] = rss(proc.pid)
            return figures

    figures = asyncio.run(scenario())
    print(
        f"weights {weight_bytes / MB:.1f} MB; resident set: "
        + ", ".join(f"{k} {v / MB:.1f} MB" for k, v in figures.items())
    )
    assert figures["awake"] - figures["asleep"] >= 0.8 * weight_bytes
    assert figures["weights_resumed"] - figures["asleep"] >= 0.8 * weight_bytes
    status, after = generate(url)
    assert status == 200
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == "pushed"
