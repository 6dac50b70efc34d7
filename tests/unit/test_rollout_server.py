"""The embedded server with a tiny random Qwen2: real generation, SGLang's contract, control.

The reference is always a plain transformers forward pass of the same
weights in fp32: greedy tokens are its argmax, and each returned logprob is
its log_softmax at that token.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_grpo.embedded.server import start_embedded_server
from megatron_grpo.embedded.weights import shared_bucket, tensor_update
from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.sglang_api.errors import RolloutBatchError, RolloutHTTPError
from megatron_grpo.sglang_api.types import FinishReason, RolloutRequest, SamplingParams
from megatron_grpo.testing import sglang_contract as contract

pytestmark = pytest.mark.timeout(120)

PROMPTS = ((5, 6, 7, 8, 9, 10, 11), (20, 21, 22), (30, 31, 32, 33, 34))
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def tiny_qwen2(seed: int, eos_token_id: int | None = None) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # Larger than the usual 0.02 so that logits are peaked: no near-ties
        # for float rounding to flip between the server and the reference.
        initializer_range=0.2,
        eos_token_id=eos_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


def reference(model, prompt, output):
    """(argmax token at each output position, logprob of each output token), by one forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(output)])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(output, dtype=torch.long)[:, None])[:, 0]
    return logprobs.argmax(dim=-1).tolist(), chosen


def greedy_reference(model, prompt, num_tokens):
    tokens = []
    for _ in range(num_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(prompt) + tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens


def assert_policy_logprobs(model, sample):
    argmax, expected = reference(model, sample.prompt_ids, sample.output_ids)
    got = torch.tensor(sample.rollout_logprobs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    return argmax


def http(url, body=None, *, method="POST", timeout=30.0):
    """(status, decoded JSON or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def rollout(url, request, **config):
    async def run():
        async with SGLangClient(ClientConfig(urls=(url,), **config)) as client:
            return await client.generate(request)

    return asyncio.run(run())


async def wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="module")
def server(model):
    handle = start_embedded_server(model, seed=0)
    yield handle
    handle.stop()


@pytest.fixture
def own_server(model):
    """A server for tests that change weights or stop it."""
    handle = start_embedded_server(model, seed=0)
    yield handle
    handle.stop()


# ---- generation ----


def test_greedy_tokens_and_logprobs_equal_a_transformers_forward(server, model):
    samples = rollout(server.url, RolloutRequest(prompts=PROMPTS, sampling=GREEDY))
    assert [s.prompt_index for s in samples] == [0, 1, 2]
    for sample in samples:
        argmax = assert_policy_logprobs(model, sample)
        assert list(sample.output_ids) == argmax
        assert sample.finish_reason == FinishReason(type="length", detail=12)
        assert sample.weight_version == "default"
    # the three prompts of different lengths were decoded as one padded batch
    assert server.engine.stats.max_round_size >= 3


def test_top_k_1_and_tiny_top_p_equal_greedy(server):
    greedy = rollout(server.url, RolloutRequest(prompts=PROMPTS[:2], sampling=GREEDY))
    for kwargs in ({"top_k": 1}, {"top_p": 1e-9}):
        sampling = SamplingParams(max_new_tokens=12, temperature=1.0, **kwargs)
        samples = rollout(server.url, RolloutRequest(prompts=PROMPTS[:2], sampling=sampling))
        assert [s.output_ids for s in samples] == [g.output_ids for g in greedy]


def test_sampling_is_seeded_and_logprobs_are_the_raw_policy(server, model):
    sampling = SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.95, seed=11)
    request = RolloutRequest(prompts=PROMPTS[:1], num_samples=4, sampling=sampling)
    first = rollout(server.url, request)
    again = rollout(server.url, request)
    assert [s.output_ids for s in first] == [s.output_ids for s in again]
    assert len({s.output_ids for s in first}) > 1  # each sample has its own seed
    for sample in first:
        # temperature and top_p shape the draw, not the reported logprob
        assert_policy_logprobs(model, sample)


def test_top_k_limits_the_draw(server, model):
    sampling = SamplingParams(max_new_tokens=10, temperature=5.0, top_k=2, seed=3)
    samples = rollout(server.url, RolloutRequest(prompts=PROMPTS, num_samples=2, sampling=sampling))
    for sample in samples:
        with torch.no_grad():
            ids = torch.tensor([list(sample.prompt_ids) + list(sample.output_ids)])
            logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1]
        top2 = logits.topk(2, dim=-1).indices
        assert all(t in top2[i].tolist() for i, t in enumerate(sample.output_ids))


def test_stop_token_ends_the_sample_and_stays_in_it(server, model):
    prompt = PROMPTS[0]
    ref = greedy_reference(model, prompt, 12)
    cut = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(ref[cut],))
    [sample] = rollout(server.url, RolloutRequest(prompts=(prompt,), sampling=sampling))
    assert list(sample.output_ids) == ref[: cut + 1]
    assert sample.finish_reason == FinishReason(type="stop", detail=ref[cut])
    assert len(sample.rollout_logprobs) == cut + 1


def test_answers_satisfy_sglang_contract(server):
    single = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "one"}
    batch = {
        "input_ids": [[1, 2], [3, 4, 5]],
        "sampling_params": {"max_new_tokens": 3, "n": 2},
        "return_logprob": True,
    }
    status, answer = http(server.url + "/generate", dict(single, return_logprob=True))
    assert status == 200 and isinstance(answer, dict)
    [decoded] = contract.validate_response(answer)
    assert decoded.meta_info.id == "one" and len(decoded.output_ids) == 4
    assert decoded.meta_info.weight_version == "default"
    status, answers = http(server.url + "/generate", batch)
    assert status == 200 and len(answers) == 4
    decoded = contract.validate_response(answers)
    assert [d.meta_info.prompt_tokens for d in decoded] == [2, 2, 3, 3]
    assert all(len(d.meta_info.output_token_logprobs) == 3 for d in decoded)
    status, info = http(server.url + "/model_info", method="GET")
    assert contract.validate("GetModelInfoResponse", info).weight_version == "default"
    status, info = http(server.url + "/server_info", method="GET")
    assert contract.validate("GetServerInfoResponse", info).max_context_length == 4096


def test_n_samples_come_back_as_a_list(server):
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 6, "n": 3, "sampling_seed": 4},
        "return_logprob": True,
    }
    status, answers = http(server.url + "/generate", body)
    assert status == 200 and len(answers) == 3
    contract.validate_response(answers)
    # one seed for all three: identical draws, as SGLang gives
    assert len({tuple(a["output_ids"]) for a in answers}) == 1
    del body["sampling_params"]["sampling_seed"]
    status, answers = http(server.url + "/generate", body)
    assert len({tuple(a["output_ids"]) for a in answers}) > 1


def test_unknown_sampling_field_is_400_and_unknown_top_level_key_is_ignored(server):
    status, answer = http(server.url + "/generate", {"input_ids": [1], "sampling_params": {"x": 1}})
    assert status == 400 and answer["error"].startswith("unknown field `x`")
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "router_hint": 3}
    assert http(server.url + "/generate", body)[0] == 200


def test_too_long_a_request_is_400(server):
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}
    status, answer = http(server.url + "/generate", body)
    assert status == 400 and "context of 4096" in answer["error"]


def test_eos_from_a_model_directory_ends_generation(tmp_path):
    probe = tiny_qwen2(seed=0)
    ref = greedy_reference(probe, PROMPTS[0], 8)
    eos = next(ref[i] for i in range(2, 8) if ref[i] not in ref[:i])
    tiny_qwen2(seed=0, eos_token_id=eos).save_pretrained(tmp_path)
    handle = start_embedded_server(tmp_path)
    try:
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
        [sample] = rollout(handle.url, RolloutRequest(prompts=PROMPTS[:1], sampling=sampling))
        assert sample.finish_reason == FinishReason(type="stop", detail=eos)
        assert list(sample.output_ids) == ref[: ref.index(eos) + 1]
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        [sample] = rollout(handle.url, RolloutRequest(prompts=PROMPTS[:1], sampling=sampling))
        assert list(sample.output_ids) == ref
    finally:
        handle.stop()


# ---- control ----


LONG = SamplingParams(max_new_tokens=3000, temperature=1.0, ignore_eos=True, seed=1)


def in_engine(server):
    return server.engine.num_running + server.engine.num_queued


async def wait_for_steps(server, count):
    target = server.engine.stats.steps + count
    await wait_until(lambda: server.engine.stats.steps >= target)


def test_abort_all_ends_running_samples_with_type_abort(server, model):
    async def scenario():
        async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
            task = asyncio.create_task(
                client.generate(RolloutRequest(prompts=PROMPTS[:2], sampling=LONG))
            )
            await wait_until(lambda: in_engine(server) == 2)
            await wait_for_steps(server, 5)  # some tokens are out
            await client.abort_all()
            return await asyncio.wait_for(task, 20)

    samples = asyncio.run(scenario())
    assert any(len(s.output_ids) > 0 for s in samples)
    for sample in samples:
        assert sample.finish_reason == FinishReason(type="abort", detail="Aborted")
        assert len(sample.output_ids) < LONG.max_new_tokens
        assert_policy_logprobs(model, sample)


def test_abort_by_rid_ends_only_that_sample(server):
    async def scenario():
        async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
            task = asyncio.create_task(
                client.generate(RolloutRequest(prompts=PROMPTS[:2], sampling=LONG))
            )
            await wait_until(lambda: in_engine(server) == 2 and len(list(client._in_flight)) == 2)
            finished = server.engine.stats.finished
            await client.abort_request(min(list(client._in_flight)))  # prompt 0's rid
            await wait_until(lambda: server.engine.stats.finished == finished + 1)
            await wait_for_steps(server, 3)
            survivors = in_engine(server)
            await client.abort_all()
            return survivors, await asyncio.wait_for(task, 20)

    survivors, samples = asyncio.run(scenario())
    assert survivors == 1
    assert [s.finish_reason.type for s in samples] == ["abort", "abort"]


def test_pause_in_place_holds_requests_until_continue(server):
    async def scenario():
        async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
            await client.pause_generation(mode="in_place")
            request = RolloutRequest(prompts=PROMPTS[:1], sampling=GREEDY)
            task = asyncio.create_task(client.generate(request))
            await asyncio.sleep(0.3)
            held = not task.done()
            await client.continue_generation()
            return held, await asyncio.wait_for(task, 20)

    held, [sample] = asyncio.run(scenario())
    assert held and sample.finish_reason.type == "length"


def test_pause_abort_mode_aborts_running_samples(server):
    async def scenario():
        async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
            task = asyncio.create_task(
                client.generate(RolloutRequest(prompts=PROMPTS[:1], sampling=LONG))
            )
            await wait_until(lambda: server.engine.num_running == 1)
            await wait_for_steps(server, 2)
            await client.pause_generation()
            samples = await asyncio.wait_for(task, 20)
            await client.continue_generation()
            return samples

    [sample] = asyncio.run(scenario())
    assert sample.finish_reason.type == "abort"


def test_health_flush_and_weight_calls_refused_by_name(server):
    async def scenario():
        async with SGLangClient(ClientConfig(urls=(server.url,))) as client:
            health = await client.health_generate()
            await client.flush_cache()
            with pytest.raises(RolloutHTTPError, match="no weight update group 'g' is open"):
                await client.update_weights_from_distributed(
                    names=["w"],
                    dtypes=["float32"],
                    shapes=[[1]],
                    group_name="g",
                    weight_version="1",
                )
            with pytest.raises(RolloutHTTPError, match="joins gloo groups only, not 'nccl'"):
                await client.init_weights_update_group(
                    url=server.url,
                    master_address="127.0.0.1",
                    master_port=1,
                    rank_offset=1,
                    world_size=2,
                    group_name="g",
                    backend="nccl",
                )
            with pytest.raises(RolloutHTTPError, match="no weight named 'nope'"):
                await client.get_weights_by_name("nope", truncate_size=2, url=server.url)
            norm = await client.get_weights_by_name(
                "model.norm.weight", truncate_size=3, url=server.url
            )
            assert len(norm) == 3 and all(isinstance(v, float) for v in norm)
            return health

    assert asyncio.run(scenario()) == {server.url: True}


def test_server_stopped_mid_batch_fails_the_rest_and_keeps_the_finished(own_server):
    # long enough that the sample in flight cannot finish while the server stops
    sampling = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    request = RolloutRequest(prompts=PROMPTS, sampling=sampling)
    config = ClientConfig(
        urls=(own_server.url,), max_concurrency=1, max_retries=2, backoff_initial_s=0.05
    )

    async def scenario():
        async with SGLangClient(config) as client:
            task = asyncio.create_task(client.generate(request))
            await wait_until(lambda: own_server.engine.stats.finished >= 1)
            await asyncio.to_thread(own_server.stop)
            with pytest.raises(RolloutBatchError) as caught:
                await asyncio.wait_for(task, 30)
            return caught.value

    error = asyncio.run(scenario())
    assert [s.prompt_index for s in error.completed] == [0]
    assert error.completed[0].finish_reason.type == "length"
    assert [f.prompt_index for f in error.failures] == [1, 2]
    assert all("gave up after 3 attempts" in str(f.error) for f in error.failures)


# ---- weights ----


def test_update_weights_from_disk_changes_outputs_and_version(own_server, tmp_path):
    new_model = tiny_qwen2(seed=1)
    new_model.save_pretrained(tmp_path)

    async def scenario():
        async with SGLangClient(ClientConfig(urls=(own_server.url,))) as client:
            await client.update_weights_from_disk(str(tmp_path), weight_version="2")
            info = await client.model_info()
            samples = await client.generate(RolloutRequest(prompts=PROMPTS, sampling=GREEDY))
            return info, samples

    info, samples = asyncio.run(scenario())
    assert info["weight_version"] == "2" and info["model_path"] == str(tmp_path)
    for sample in samples:
        assert list(sample.output_ids) == assert_policy_logprobs(new_model, sample)
        assert sample.weight_version == "2"


@pytest.mark.parametrize("way", ["body", "shared_memory"])
def test_update_weights_from_tensor_inside_a_session(own_server, model, way):
    new_model = tiny_qwen2(seed=2)
    shared = shared_bucket(new_model.state_dict())
    payload: object = tensor_update(new_model.state_dict(), weight_version="3")
    if way == "shared_memory":
        payload = shared.request(weight_version="3")

    async def scenario():
        async with SGLangClient(ClientConfig(urls=(own_server.url,))) as client:
            with pytest.raises(RolloutHTTPError, match="between begin_weight_update"):
                await client.update_weights_from_tensor(payload, url=own_server.url)
            await client.begin_weight_update()
            bad = tensor_update({"no.such.weight": torch.zeros(1)}, weight_version="x")
            with pytest.raises(RolloutHTTPError, match="no such weights"):
                await client.update_weights_from_tensor(bad, url=own_server.url)
            with pytest.raises(RolloutHTTPError, match="takes the tensors in shared memory"):
                await client.update_weights_from_tensor({"weight_version": "x"}, url=own_server.url)
            elsewhere = {"shared_memory": {"path": "/etc/passwd", "tensors": []}}
            with pytest.raises(RolloutHTTPError, match="must be a /dev/shm/mgrpo_weights_"):
                await client.update_weights_from_tensor(elsewhere, url=own_server.url)
            await client.update_weights_from_tensor(payload, url=own_server.url)
            await client.end_weight_update()
            return await client.generate(RolloutRequest(prompts=PROMPTS, sampling=GREEDY))

    try:
        samples = asyncio.run(scenario())
    finally:
        shared.close()
    assert not shared.path.exists()
    for sample in samples:
        assert list(sample.output_ids) == assert_policy_logprobs(new_model, sample)
        assert sample.weight_version == "3"


def test_a_groups_samples_share_one_prefill_and_keep_their_own_draws(model):
    """Rows with one prompt run through the prefill once; each row's tokens still depend
    only on its seed, and its log-probs are the policy's."""
    from megatron_grpo.embedded.decode import SequenceSpec, generate_batch

    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    specs = [
        SequenceSpec(prompt_ids=p, sampling=sampling, seed=10 * i + j)
        for i, p in enumerate(PROMPTS)
        for j in range(3)
    ]
    rows_seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        together = generate_batch(model, specs, eos_token_ids=frozenset())
    finally:
        hook.remove()
    assert rows_seen == [3] + [9] * 5  # the prefill of 3 distinct prompts, then 9 rows
    for spec, done in zip(specs, together, strict=True):
        alone = generate_batch(model, [spec], eos_token_ids=frozenset())[0]
        assert done.output_ids == alone.output_ids
        _, expected = reference(model, spec.prompt_ids, done.output_ids)
        torch.testing.assert_close(torch.tensor(done.logprobs), expected, atol=1e-5, rtol=0)


def test_rows_that_stop_early_end_as_they_would_alone(model):
    """Stopped rows ride along in the batch for a while; what each row returns is what it
    returns generated alone."""
    from megatron_grpo.embedded.decode import SequenceSpec, generate_batch

    sampling = SamplingParams(
        max_new_tokens=8, temperature=1.0, stop_token_ids=tuple(range(0, 300, 6))
    )
    specs = [
        SequenceSpec(prompt_ids=p, sampling=sampling, seed=100 + 10 * i + j)
        for i, p in enumerate(PROMPTS)
        for j in range(4)
    ]
    together = generate_batch(model, specs, eos_token_ids=frozenset())
    lengths = [len(done.output_ids) for done in together]
    assert min(lengths) < 8 and max(lengths) == 8, lengths  # rows ended at different steps
    for spec, done in zip(specs, together, strict=True):
        alone = generate_batch(model, [spec], eos_token_ids=frozenset())[0]
        assert (done.output_ids, done.finish_reason) == (alone.output_ids, alone.finish_reason)
        _, expected = reference(model, spec.prompt_ids, done.output_ids)
        torch.testing.assert_close(torch.tensor(done.logprobs), expected, atol=1e-5, rtol=0)
