"""Make everything the CPU demo needs, locally: data, a tokenizer, a tiny warmed-up model.

The task is verifiable addition: the prompt is ``a+b=``, the reward is 1 when
the completion's number equals a + b. A tokenizer is trained on the task's
text, a tiny Qwen2-style model is made with transformers and given a short
supervised warm-up (it learns the format and some sums), and everything is
saved as a Hugging Face directory that the trainer starts from.

    python examples/cpu_demo/prepare.py --out runs/cpu_demo/assets
    python examples/cpu_demo/prepare.py --out runs/cpu_demo/assets --moe   # adds moe_model/

With ``--moe`` a tiny Qwen3-MoE (4 experts, top-2) gets the same warm-up and is saved
beside the dense model as ``moe_model``: the demo trains it with
``--set train.init=runs/cpu_demo/assets/moe_model``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_grpo.testing import char_tokenizer, tiny_qwen2_for

MAX_OPERAND = 9


def problems(seed: int, n: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def warm_up(model, tokenizer, data: list[tuple[str, str]], steps: int, seed: int) -> None:
    """Next-token cross-entropy on the answers only, a few hundred small steps."""
    torch.manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data, 64)
        rows, masks = [], []
        for prompt, answer in batch:
            p = tokenizer(prompt)["input_ids"]
            a = tokenizer(answer)["input_ids"] + [eos]
            rows.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, data: list[tuple[str, str]]) -> float:
    correct = 0
    for prompt, answer in data:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        correct += text.strip() == answer
    return correct / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="also warm up a tiny Qwen3-MoE")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_rows = problems(args.seed, 4000)
    with (out / "train.jsonl").open("w") as f:
        for prompt, label in train_rows:
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    held_out = problems(args.seed + 1, 200)
    with (out / "eval.jsonl").open("w") as f:  # for eval.datasets
        for prompt, label in held_out[:64]:
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    tokenizer = char_tokenizer([p + a for p, a in train_rows])

    for family, name in [("qwen2", "model")] + ([("qwen3_moe", "moe_model")] if args.moe else []):
        model = tiny_qwen2_for(tokenizer, args.seed, family)
        warm_up(model, tokenizer, train_rows, args.warmup_steps, args.seed)
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        # Measured on the saved model and tokenizer: what the trainer will start from.
        saved = AutoModelForCausalLM.from_pretrained(out / name).float().eval()
        acc = greedy_accuracy(saved, AutoTokenizer.from_pretrained(out / name), held_out)
        (out / name / "warmup.json").write_text(
            json.dumps({"greedy_accuracy": acc, "steps": args.warmup_steps})
        )
        print(f"{name}: {args.warmup_steps} warm-up steps, held-out greedy accuracy {acc:.2f}")
    print(f"vocab_size {len(tokenizer)}; assets in {out}")


if __name__ == "__main__":
    main()
