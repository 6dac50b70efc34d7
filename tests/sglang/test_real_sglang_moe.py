"""Routed experts (R3) from a real SGLang 0.5.23 server on CPU, replayed by the learner.

Needs ``.venv-sglang`` as ``test_real_sglang.py`` does. The model is a random tiny
Qwen3-MoE (2 layers, 8 experts, top-2, float32) with that module's tokenizer; the server is
launched the same way, with ``--enable-return-routed-experts``.

Stock SGLang 0.5.23 cannot start with that flag on a CPU-only machine: its scheduler
allocates the host buffer of routes (``RoutedExpertsCapturer``) pinned, and its table of
allocators has no CPU entry, so the buffer is registered with ``cudaHostRegister``
(``alloc_with_host_register``) and the scheduler exits with ``RuntimeError: Found no
NVIDIA driver on your system`` before the server is up
(``test_stock_sglang_cannot_keep_routes_on_cpu`` asserts it). The other tests serve the
model with that one allocation changed (``tests/sglang_cpu_routes/sitecustomize.py``:
plain host memory); the routing, its capture and the answer are SGLang's own.

Checked: a request for routes follows SGLang's contract and the routes of its answer
(prompt tokens from the prefix cache included) and of a group of sampled completions,
``[prompt + output - 1, layers, top-k]``, are the top-k of the same HF model's routers in one
plain transformers forward; a single-process megatron learner loaded from the same
checkpoint, replaying them (``train.routing_replay=r3``), computes the server's
log-probs, and replaying them one position late does not.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from test_real_sglang import (
    LAUNCH,
    SERVER_ENV,
    STUB,
    VOCAB,
    save_tokenizer,
    sglang_python,  # noqa: F401  (a fixture)
)

from megatron_grpo.launch import run_workers
from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.rollout.servers import LaunchConfig, ServerStartError, launch_servers
from megatron_grpo.sglang_api.protocol import build_generate_payload, parse_generate_response
from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams
from megatron_grpo.testing import random_hf_model, tiny_hf_config
from megatron_grpo.testing import sglang_contract as contract

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CPU_ROUTES = ROOT / "tests" / "sglang_cpu_routes"
WORKERS = str(Path(__file__).with_name("workers_sglang_moe.py"))
LAUNCH_R3 = LAUNCH + " --enable-return-routed-experts"
NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2
PROMPTS = [(5, 6, 7, 8, 9, 10, 11), (20, 21, 22), (30, 31, 32, 33, 34)]
MAX_NEW_TOKENS = 12
LOGPROB_ATOL = 1e-5
NEAR_TIE = 1e-4
"""Router logit gap under which the server and transformers may pick different experts."""


# --------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The HF directory the server loads, and the same model in transformers."""
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    eos = save_tokenizer(path)
    config = tiny_hf_config(
        "qwen3_moe",
        vocab_size=VOCAB,
        num_hidden_layers=NUM_LAYERS,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        eos_token_id=eos,
    )
    model = random_hf_model(config, seed=3)
    model.save_pretrained(path)
    return path, model


def reference_routes(model, tokens: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """Each router's top-k over ``tokens`` in one plain forward (no cache, no padding): the
    ids ``[len(tokens), layers, topk]`` and the router logits that chose them."""
    logits = torch.zeros(len(tokens), NUM_LAYERS, NUM_EXPERTS)

    def keep(layer, module, args, _output):
        logits[:, layer] = torch.nn.functional.linear(
            args[0].reshape(len(tokens), -1), module.weight
        )

    hooks = [
        block.mlp.gate.register_forward_hook(functools.partial(keep, layer))
        for layer, block in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    ids = torch.topk(logits, TOP_K, dim=-1).indices.to(torch.int32)
    return ids.numpy(), logits


def assert_routes_match(model, prompt, output, routes: np.ndarray) -> int:
    """Routes cover prompt + output[:-1] and pick, at every position and layer, the experts
    of the plain forward (as sets; a differing pick only on a float near-tie). Returns the
    number of (position, layer) whose sets are equal."""
    tokens = list(prompt) + list(output)[:-1]
    assert routes.dtype == np.int32 and routes.shape == (len(tokens), NUM_LAYERS, TOP_K)
    assert ((routes >= 0) & (routes < NUM_EXPERTS)).all()
    assert (np.sort(routes, axis=-1)[..., 1:] != np.sort(routes, axis=-1)[..., :-1]).all()
    expected, logits = reference_routes(model, tokens)
    same = (np.sort(routes, axis=-1) == np.sort(expected, axis=-1)).all(axis=-1)
    for position, layer in zip(*np.nonzero(~same)):
        top = torch.sort(logits[position, layer], descending=True).values
        gap = float(top[TOP_K - 1] - top[TOP_K])
        assert gap < NEAR_TIE, (position, layer, routes[position, layer], expected[position, layer])
    return int(same.sum())


# --------------------------------------------------------------------------- server


def launch(model_dir: Path, log_dir: Path, env: dict[str, str]):
    return launch_servers(
        LaunchConfig(
            command=LAUNCH_R3,
            model=str(model_dir),
            log_dir=str(log_dir),
            env=env,
            startup_timeout_s=420,
            stop_grace_s=30,
        )
    )


@pytest.fixture(scope="module")
def server(sglang_python, hf_model, tmp_path_factory):  # noqa: F811  (the imported fixture)
    """One server with the CPU allocation of routes (``tests/sglang_cpu_routes``)."""
    start = time.perf_counter()
    env = SERVER_ENV | {"PYTHONPATH": f"{STUB}:{CPU_ROUTES}"}
    group = launch(hf_model[0], tmp_path_factory.mktemp("sglang_logs"), env)
    print(f"SGLANG-MOE: server ready in {time.perf_counter() - start:.1f} s")
    yield group
    group.stop()


@pytest.fixture(scope="module")
def generations(server):
    """Two sampled completions of each prompt, with their routes, as the trainer asks."""
    request = RolloutRequest(
        prompts=tuple(PROMPTS),
        num_samples=2,
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=11),
    )
    config = ClientConfig(urls=server.urls, return_routed_experts=True, num_layers=NUM_LAYERS)

    async def run():
        async with SGLangClient(config) as client:
            return await client.generate(request)

    return asyncio.run(run())


def post(url: str, body: dict) -> object:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
def test_stock_sglang_cannot_keep_routes_on_cpu(sglang_python, hf_model, tmp_path):  # noqa: F811
    """First in the module, before the shared server: one server at a time."""
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("an NVIDIA driver is loaded: the failure asserted is a CPU-only machine's")
    start = time.perf_counter()
    with pytest.raises(ServerStartError) as failed:
        launch(hf_model[0], tmp_path, SERVER_ENV)
    message = str(failed.value)
    assert "exited with code" in message
    assert "in init_routed_experts_capturer" in message
    assert "in alloc_with_host_register" in message and "in _cuda_host_register" in message
    assert "RuntimeError: Found no NVIDIA driver on your system" in message
    print(f"SGLANG-MOE: stock server exited in {time.perf_counter() - start:.1f} s")


@pytest.mark.timeout(540)  # includes starting the server: ~30 s on an idle 2-core machine
def test_routes_of_a_group_are_the_routers_top_k_in_transformers(generations, hf_model):
    assert len(generations) == 2 * len(PROMPTS)
    agree, total = 0, 0
    for g in generations:
        assert g.routed_experts is not None and len(g.output_ids) == MAX_NEW_TOKENS
        agree += assert_routes_match(hf_model[1], g.prompt_ids, g.output_ids, g.routed_experts)
        total += g.routed_experts.shape[0] * NUM_LAYERS
    print(f"SGLANG-MOE: {agree}/{total} token-layer top-{TOP_K} sets equal transformers'")


@pytest.mark.timeout(120)
def test_a_request_for_routes_follows_sglang_contract(server, generations, hf_model):
    """After ``generations``: the prompt's routes come from SGLang's prefix cache."""
    prompt = PROMPTS[0]
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    payload = build_generate_payload(
        prompt, sampling, rid="routes", seed=3, return_routed_experts=True
    )
    contract.validate_request(payload)
    answer = post(server.urls[0] + "/generate", payload)
    contract.validate_response(answer)
    assert isinstance(answer, dict) and answer["meta_info"]["cached_tokens"] > 0
    result = parse_generate_response(answer, num_layers=NUM_LAYERS, num_input_tokens=len(prompt))
    assert result.routed_experts is not None
    assert result.routed_experts.shape == (len(prompt) + 6 - 1, NUM_LAYERS, TOP_K)
    assert_routes_match(hf_model[1], prompt, result.output_ids, result.routed_experts)


@pytest.mark.timeout(300)
def test_the_learner_replaying_the_routes_computes_the_servers_logprobs(generations, hf_model):
    start = time.perf_counter()
    [steps] = run_workers(
        f"{WORKERS}:replay_steps",
        1,
        timeout=240,
        kwargs={"hf_dir": str(hf_model[0]), "generations": generations},
    )
    replayed, shifted = steps["replayed"], steps["shifted"]
    assert replayed["logprob_mismatch_max"] < LOGPROB_ATOL, replayed
    assert replayed["router_agreement"] == 1.0  # the forward used the server's routes
    # In float32 the learner's own routers choose as the server's did, near-ties aside.
    assert replayed["router_agreement_own"] > 0.99, replayed
    # The replay is what the forward routed by: one position late, log-probs move.
    assert shifted["router_agreement"] == 1.0 and shifted["router_agreement_own"] < 0.6
    assert shifted["logprob_mismatch"] > 1e-2, shifted
    print(
        f"SGLANG-MOE: learner step with R3 in {time.perf_counter() - start:.1f} s: "
        f"|logp_learner - logp_sglang| mean {replayed['logprob_mismatch']:.1e} "
        f"max {replayed['logprob_mismatch_max']:.1e}, own router agreement "
        f"{replayed['router_agreement_own']:.3f}; routes one position late: mismatch mean "
        f"{shifted['logprob_mismatch']:.2f}, own agreement {shifted['router_agreement_own']:.3f}"
    )
