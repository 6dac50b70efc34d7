"""Make the length-bias task, locally: data, a tokenizer, a tiny warmed-up model.

The task is addition (``a+b=``, reward 1 when the last number of the completion
is a + b, the math reward of the RL run), with completions that carry a filler:
a run of ``~`` of any length that holds no digit. ``--wrong-fraction`` of the
warm-up answers are wrong on purpose, so that wrong answers are common when RL
starts.

- ``--layout answer-first`` (the default): ``<answer><filler>``, and a wrong
  warm-up answer is a marked guess, ``?<answer><filler>``. The filler comes after
  the answer, so it never changes the reward: an unbiased policy gradient
  (token-mean, or seq-mean-token-sum-norm) has no reason to make it longer or
  shorter. The mark lets the policy know which of its answers are guesses, as a
  language model knows when it is unsure (without it the tiny model cannot tell
  its wrong answers from its right ones), and the warm-up data gives guesses a
  longer filler (``--filler-wrong`` > ``--filler-right``), as language models'
  wrong answers tend to be longer. seq-mean-token-mean spreads a sequence's
  advantage over its tokens, so a long wrong answer is penalized less per token
  than a short one: it pulls guesses longer, and keeps them alive longer.
- ``--layout filler-first``: ``<filler>=<answer>``, the filler as "reasoning"
  before the answer, which a completion cut by the token budget never reaches.
  The length is chosen before the answer, so it cannot follow correctness; only
  truncation links the two (see docs/normalization_results.md).

    python examples/length_bias/prepare.py --out runs/length_bias/assets
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_grpo.rewards import math_reward
from megatron_grpo.testing import char_tokenizer, tiny_qwen2_for

MAX_OPERAND = 9
FILLER = "~"
ANSWER_MARK = "="
GUESS_MARK = "?"


def problems(seed: int, n: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)) for _ in range(n)]
    return [(f"{a}+{b}=", a + b) for a, b in pairs]


def completion(total: int, rng: random.Random, args: argparse.Namespace) -> str:
    answer, max_filler = total, args.filler_right
    if rng.random() < args.wrong_fraction:
        answer = rng.choice([s for s in range(2 * MAX_OPERAND + 1) if s != total])
        max_filler = args.filler_wrong
    filler = FILLER * rng.randint(0, max_filler)
    if args.layout == "answer-first":
        return f"{GUESS_MARK if answer != total else ''}{answer}{filler}"
    return f"{filler}{ANSWER_MARK}{answer}"


def warm_up(model, tokenizer, rows: list[tuple[str, str]], steps: int, seed: int) -> None:
    """Next-token cross-entropy on the completions: the token mean over the answer digits
    plus the token mean over the other tokens (filler, mark, end of sequence), where the
    length is decided.

    The two means are added, not pooled: pooled, the long filler would drown the one or
    two answer digits and the model would learn the lengths long before the sums.
    """
    torch.manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        ids_rows, kind_rows = [], []
        for prompt, target in rng.sample(rows, 64):
            p = tokenizer(prompt)["input_ids"]
            ids_rows.append(p + tokenizer(target)["input_ids"] + [eos])
            # 2 on digit targets (and the end that follows a digit), 1 on the rest, 0 on the prompt
            kinds = [2 if c.isdigit() else 1 for c in target]
            kind_rows.append([0] * len(p) + kinds + kinds[-1:])
        width = max(map(len, ids_rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in ids_rows])
        kind = torch.tensor([m + [0] * (width - len(m)) for m in kind_rows])[:, 1:].reshape(-1)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = sum(nll[kind == k].mean() for k in (1, 2) if (kind == k).any())
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()


@torch.no_grad()
def sampled_stats(model, tokenizer, held_out: list[tuple[str, int]], max_new_tokens: int) -> dict:
    """What the RL run starts from: reward and lengths of completions sampled at temperature 1."""
    torch.manual_seed(0)
    ids = torch.tensor([tokenizer(prompt)["input_ids"] for prompt, _ in held_out])  # same length
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    right, wrong, truncated = [], [], 0
    eos = tokenizer.eos_token_id
    for row, (_, total) in zip(out[:, ids.shape[1] :].tolist(), held_out):
        truncated += eos not in row
        new = row[: row.index(eos) + 1] if eos in row else row
        text = tokenizer.decode(new, skip_special_tokens=True)
        (right if math_reward(text, str(total), {}) else wrong).append(len(new))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "reward": len(right) / len(held_out),
        "length_right": mean(right),
        "length_wrong": mean(wrong),
        "truncated": truncated / len(held_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--layout", choices=("answer-first", "filler-first"), default="answer-first"
    )
    parser.add_argument("--warmup-steps", type=int, default=400)
    parser.add_argument("--wrong-fraction", type=float, default=0.5)
    parser.add_argument(
        "--filler-right", type=int, default=12, help="longest filler, right answers"
    )
    parser.add_argument(
        "--filler-wrong", type=int, default=30, help="longest filler, wrong answers"
    )
    parser.add_argument("--max-new-tokens", type=int, default=40, help="for the sampled stats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_rows = problems(args.seed, 4000)
    with (out / "train.jsonl").open("w") as f:
        for prompt, total in train_rows:
            f.write(json.dumps({"prompt": prompt, "label": str(total)}) + "\n")
    rng = random.Random(args.seed)
    sft = [(p, completion(t, rng, args)) for p, t in train_rows]
    tokenizer = char_tokenizer([p + c for p, c in sft])

    model = tiny_qwen2_for(tokenizer, args.seed)
    warm_up(model, tokenizer, sft, args.warmup_steps, args.seed)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    # Measured on the saved model and tokenizer: what the trainer will start from.
    saved = AutoModelForCausalLM.from_pretrained(out / "model").float().eval()
    stats = sampled_stats(
        saved,
        AutoTokenizer.from_pretrained(out / "model"),
        problems(args.seed + 1, 200),
        args.max_new_tokens,
    )
    (out / "warmup.json").write_text(json.dumps({**stats, **vars(args)}))
    print(
        f"warm-up ({args.layout}): {args.warmup_steps} steps; sampled reward "
        f"{stats['reward']:.2f}, length right {stats['length_right']:.1f}, wrong "
        f"{stats['length_wrong']:.1f}, truncated {stats['truncated']:.2f}"
    )
    print(f"vocab_size {len(tokenizer)}; assets in {out}")


if __name__ == "__main__":
    main()
