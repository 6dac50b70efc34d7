"""Make everything the CPU tool-use demo needs, locally: data, a tokenizer, a tiny model.

The task is two-step arithmetic, ``a*b+c=``, rewarded when the final answer is the
value. The model may call a calculator: ``<call>calculator 7*8+5</call>``, to which the
tool loop answers ``<r>61</r>`` (tokens the model does not train on), and the model then
writes its answer. The tokenizer is one token per character, plus one token for each
tag and for the tool's name. The tiny Qwen2-style model gets a short supervised
warm-up on a mix of traces: a few call the calculator and copy its result, the others
answer directly (a tiny model rarely gets those right). GRPO then has something to
find: calling the tool pays.

    python examples/tool_demo/prepare.py --out runs/tool_demo/assets
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from megatron_grpo.testing import tiny_qwen2_for, tool_tokenizer

TAGS = ["<call>", "</call>", "<r>", "</r>", "calculator"]
CORPUS = ["0123456789+*= "]


def problems(seed: int, n: int) -> list[tuple[str, str, str]]:
    """``(prompt, expression, answer)`` rows of ``a*b+c`` with one-digit operands."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(0, 9)
        out.append((f"{a}*{b}+{c}=", f"{a}*{b}+{c}", str(a * b + c)))
    return out


def trace(expression: str, answer: str, use_tool: bool) -> list[tuple[str, bool]]:
    """A demonstration as ``(text, trained on)`` pieces: the tool's result is not."""
    if not use_tool:
        return [(answer, True)]
    return [(f"<call>calculator {expression}</call>", True), (f"<r>{answer}</r>", False),
            (answer, True)]  # fmt: skip


def warm_up(model, tokenizer, rows, *, steps: int, tool_fraction: float, seed: int) -> None:
    """Next-token cross-entropy on the model's own pieces of the traces."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, masks = [], []
        for prompt, expression, answer in rng.sample(rows, 64):
            row, mask = tokenizer.encode(prompt, add_special_tokens=False), []
            mask = [0] * len(row)
            for text, trained in trace(expression, answer, rng.random() < tool_fraction):
                piece = tokenizer.encode(text, add_special_tokens=False)
                row, mask = row + piece, mask + [int(trained)] * len(piece)
            ids.append(row + [tokenizer.eos_token_id])
            masks.append(mask + [1])
        width = max(map(len, ids))
        batch = torch.tensor([r + [0] * (width - len(r)) for r in ids])
        weight = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float)
        logits = model(input_ids=batch).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * weight[:, 1:].reshape(-1)).sum() / weight[:, 1:].sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--tool-fraction", type=float, default=0.2,
                        help="share of warm-up traces that call the calculator")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = problems(args.seed, 4000)
    with (out / "train.jsonl").open("w") as f:
        for prompt, _, answer in rows:
            f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
    with (out / "eval.jsonl").open("w") as f:  # held out, for eval.datasets
        for prompt, _, answer in problems(args.seed + 1, 64):
            f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
    tokenizer = tool_tokenizer(CORPUS, TAGS)
    model = tiny_qwen2_for(tokenizer, args.seed)
    warm_up(model, tokenizer, rows, steps=args.warmup_steps, tool_fraction=args.tool_fraction,
            seed=args.seed)  # fmt: skip
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"{args.warmup_steps} warm-up steps, {args.tool_fraction:.0%} of the traces with "
          f"the calculator; vocab_size {len(tokenizer)}; assets in {out}")  # fmt: skip


if __name__ == "__main__":
    main()
