"""Generation tokens/s: the embedded server through the HTTP client vs transformers ``generate``.

    python bench/rollout.py                 # 8 prompts x 8 samples x 64 new tokens, Qwen3-shaped
    python bench/rollout.py --prompts 16 --samples 4 --new-tokens 128
    python bench/rollout.py --quick

Both sides run the same random fp32 model (no end-of-sequence token, so every
completion is exactly ``--new-tokens`` long) on the same prompts with the same
sampling (temperature 1, top-p 1, no top-k), ``n`` samples per prompt, in this
one process. The server side is what the trainer does: ``SGLangClient.generate``
sends one ``/generate`` request per prompt, carrying its ``n`` samples, to
``start_embedded_server``, which batches everything queued into one decoding round
(the samples of a prompt sharing one prefill) and returns each token's log-prob. The
baseline is one ``model.generate`` call over the left-padded prompts with
``num_return_sequences=n`` (no log-probs). A third side splits the
server's time: ``decode.generate_batch``, the server's decoding loop, called
directly on the same requests (no HTTP, no queue). A fourth sends the same samples to
the server as one batched ``/generate`` request (what a client that batched a whole
rollout would send). All alternate within each repeat, in rotating order. Reported:
server tokens/s / generate tokens/s, and the same for the direct decoding loop and the
one batched request.
"""

from __future__ import annotations

from _common import Ratio, interleaved, parser, ratios, seconds, summary, write_result


def make_model(quick: bool, path: str | None = None):
    import torch

    if path is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path).float().eval()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    size = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=500)
        if quick
        else dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=16000)
    )
    config = Qwen3Config(
        **size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=size["hidden_size"] // 4,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).float().eval()


def parse_args():
    p = parser(__doc__)
    p.add_argument("--prompts", type=int)
    p.add_argument("--samples", type=int, help="samples per prompt (n)")
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument(
        "--model-path",
        help="a Hugging Face model directory instead of the random Qwen3-shaped model "
        "(e.g. the CPU demo's, runs/cpu_demo/assets/model)",
    )
    return p.parse_args()


def random_prompts(vocab: int, num_prompts: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(
            1, vocab, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(num_prompts)
    ]


class Sides:
    """The three ways of generating the same completions; each records the tokens it made.

    They share one seed sequence, so every call samples with a fresh seed.
    """

    def __init__(self, model, prompts: list[list[int]], n: int, new_tokens: int) -> None:
        import asyncio

        import torch
        from transformers import GenerationConfig

        from megatron_grpo.embedded.server import start_embedded_server
        from megatron_grpo.rollout.client import ClientConfig, SGLangClient

        self.model, self.prompts, self.n, self.new_tokens = model, prompts, n, new_tokens
        self.server = start_embedded_server(model, max_batch_size=len(prompts) * n, seed=0)
        self.loop = asyncio.new_event_loop()
        self.client = SGLangClient(
            ClientConfig(urls=(self.server.url,), max_concurrency=len(prompts) * n)
        )
        self.loop.run_until_complete(self.client.__aenter__())
        self.tokens: dict[str, list[int]] = {
            "server": [],
            "generate": [],
            "decode_direct": [],
            "server_one_request": [],
        }
        self.seed = iter(range(1, 1 << 30))
        self.width = max(len(x) for x in prompts)
        self.input_ids = torch.tensor([[0] * (self.width - len(x)) + x for x in prompts])
        self.attention_mask = torch.tensor(
            [[0] * (self.width - len(x)) + [1] * len(x) for x in prompts]
        )
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=n,
            pad_token_id=0,
            eos_token_id=None,
        )

    def request(self):
        from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

        return RolloutRequest(
            prompts=tuple(tuple(x) for x in self.prompts),
            num_samples=self.n,
            sampling=SamplingParams(
                max_new_tokens=self.new_tokens,
                temperature=1.0,
                ignore_eos=True,
                seed=next(self.seed),
            ),
        )

    def via_server(self) -> None:
        samples = self.loop.run_until_complete(self.client.generate(self.request()))
        self.tokens["server"].append(sum(len(s.output_ids) for s in samples))

    def via_one_request(self) -> None:
        """The same samples as one batched ``/generate`` request (a list of input_ids, one
        entry per sample with its own seed), as a client that batched would send them."""
        import aiohttp

        from megatron_grpo.sglang_api.protocol import sampling_params_to_json

        r = self.request()
        body = {
            "input_ids": [list(p) for p in r.prompts for _ in range(self.n)],
            "sampling_params": [
                sampling_params_to_json(r.sampling, seed=r.sample_seed(i, j))
                for i in range(len(r.prompts))
                for j in range(self.n)
            ],
            "return_logprob": True,
        }

        async def post() -> list:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{self.server.url}/generate", json=body) as answer:
                    answer.raise_for_status()
                    return await answer.json()

        answers = self.loop.run_until_complete(post())
        self.tokens["server_one_request"].append(sum(len(a["output_ids"]) for a in answers))

    def via_decode_loop(self) -> None:
        from megatron_grpo.embedded.decode import SequenceSpec, generate_batch

        r = self.request()
        specs = [
            SequenceSpec(prompt_ids=p, sampling=r.sampling, seed=r.sample_seed(i, j) or 0)
            for i, p in enumerate(r.prompts)
            for j in range(self.n)
        ]
        done = generate_batch(self.model, specs, eos_token_ids=frozenset())
        self.tokens["decode_direct"].append(sum(len(c.output_ids) for c in done))

    def via_generate(self) -> None:
        import torch

        torch.manual_seed(next(self.seed))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.input_ids,
                attention_mask=self.attention_mask,
                generation_config=self.generation_config,
            )
        self.tokens["generate"].append(int(out[:, self.width :].numel()))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        self.server.stop()


def report(times, *, model, num_prompts: int, n: int, new_tokens: int, repeats: int, args) -> None:
    """Print the ratios and tokens/s, and write the JSON result."""
    expected = num_prompts * n * new_tokens
    # tokens/s ratio = inverse time ratio: both sides generate `expected` tokens
    ratio = {
        clock: Ratio.of(
            f"embedded_server_tokens_per_s/generate_tokens_per_s [{clock}]",
            [1 / r for r in ratios(times, ["server"], "generate", clock)],
        )
        for clock in ("cpu", "wall")
    }
    for r in ratio.values():
        print(r.line())
    direct = Ratio.of(
        "decode_loop_tokens_per_s/generate_tokens_per_s [cpu]",
        [1 / r for r in ratios(times, ["decode_direct"], "generate", "cpu")],
    )
    print("  " + direct.line())
    batched = Ratio.of(
        "server_one_request_tokens_per_s/generate_tokens_per_s [cpu]",
        [1 / r for r in ratios(times, ["server_one_request"], "generate", "cpu")],
    )
    print("  " + batched.line())
    per_s = {k: [expected / t.wall for t in v] for k, v in times.items()}
    print(
        f"  {num_prompts} prompts x {n} samples x {new_tokens} tokens: server "
        f"{summary(per_s['server'])['median']:.0f} tokens/s, decoding loop alone "
        f"{summary(per_s['decode_direct'])['median']:.0f}, generate "
        f"{summary(per_s['generate'])['median']:.0f} tokens/s (wall, medians)"
    )
    write_result(
        "rollout",
        args.out,
        {
            "quick": args.quick,
            "settings": {
                "prompts": num_prompts,
                "samples_per_prompt": n,
                "new_tokens": new_tokens,
                "repeats": repeats,
                "model": {
                    k: getattr(model.config, k)
                    for k in ("hidden_size", "num_hidden_layers", "vocab_size")
                },
            },
            "server_vs_generate": ratio,
            "decode_loop_vs_generate": direct,
            "server_one_request_vs_generate": batched,
            "tokens_per_s_wall": {k: summary(v) for k, v in per_s.items()},
            "seconds": seconds(times),
        },
    )


def main() -> None:
    args = parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    num_prompts = args.prompts or (2 if args.quick else 8)
    n = args.samples or (2 if args.quick else 8)
    new_tokens = args.new_tokens or (8 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 7)
    model = make_model(args.quick, args.model_path)
    sides = Sides(model, random_prompts(model.config.vocab_size, num_prompts), n, new_tokens)
    try:
        times = interleaved(
            {
                "server": sides.via_server,
                "generate": sides.via_generate,
                "decode_direct": sides.via_decode_loop,
                "server_one_request": sides.via_one_request,
            },
            repeats=repeats,
            warmup=args.warmup if args.warmup is not None else (0 if args.quick else 1),
        )
    finally:
        sides.close()
    expected = num_prompts * n * new_tokens
    if any(set(v) != {expected} for v in sides.tokens.values()):
        raise RuntimeError(f"token counts differ from {expected}: {sides.tokens}")
    report(
        times,
        model=model,
        num_prompts=num_prompts,
        n=n,
        new_tokens=new_tokens,
        repeats=repeats,
        args=args,
    )


if __name__ == "__main__":
    main()
