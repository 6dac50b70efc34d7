"""Make everything the CPU tool-use demo needs, locally: data, a tokenizer, a tiny model.

The task is two-step arithmetic, ``a*b+c=``, rewarded when the final answer is the
value. The model may call a calculator: ``<call>calculator 7*8+5</call>``, to which the
tool loop answers ``<r>61</r>`` (tokens the model does not train on), and the model then
writes its answer. The tokenizer is one token per character, plus one token for each
tag and for the tool's name. The tiny Qwen2-style model gets a short supervised
warm-up on a mix of traces: a few call the calculator and copy its result, the others
answer directly (a tiny model rarely gets those right). GRPO then has something to
find: calling the tool pays.

Calling pays only if the model can copy the tool's result, and a tiny model learns that
copy abruptly, somewhere between 100 and 450 warm-up steps, where exactly depending on
the seed and on the rounding of the machine's float kernels: at seed 0, 200 steps left a
model that copied 45% of held-out results with AVX2 kernels and 22% with AVX-512 ones,
on which GRPO learned to avoid the tool. So the warm-up runs until the model copies the
result in ``--copy-target`` of held-out calls (checked every 50 steps; much longer, and
it learns to answer without the tool too), and refuses to write assets that fall short.

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


CHECK_EVERY = 50
"""Warm-up steps between two checks of the copy."""


def encode_trace(tokenizer, prompt: str, expression: str, answer: str, use_tool: bool):
    """A demonstration's token ids and loss mask (1 on the pieces trained on), with the end
    of sequence."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    mask = [0] * len(ids)
    for text, trained in trace(expression, answer, use_tool):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [int(trained)] * len(piece)
    return ids + [tokenizer.eos_token_id], mask + [1]


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


@torch.no_grad()
def copy_rate(model, tokenizer, rows) -> float:
    """The share of ``rows`` whose answer the model writes greedily after a right call and
    the calculator's result: the answer's tokens and the end of sequence, each the argmax."""
    traces = [encode_trace(tokenizer, p, e, a, use_tool=True)[0] for p, e, a in rows]
    was_training = model.training
    predicted = model.eval()(input_ids=padded(traces)).logits.argmax(-1)
    model.train(was_training)
    copied = 0
    for i, (ids, (_, _, answer)) in enumerate(zip(traces, rows)):
        n, end = len(tokenizer.encode(answer, add_special_tokens=False)) + 1, len(ids)
        copied += predicted[i, end - n - 1 : end - 1].tolist() == ids[end - n :]
    return copied / len(rows)


def warm_up(model, tokenizer, rows, checks, *, max_steps: int, copy_target: float,
            tool_fraction: float, seed: int) -> tuple[int, float]:  # fmt: skip
    """Next-token cross-entropy on the model's own pieces of the traces, until the model
    copies the calculator's result in ``copy_target`` of the ``checks`` (0: no check) or
    for ``max_steps``. Returns the steps taken and the copy rate at the end."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(1, max_steps + 1):
        ids, masks = [], []
        for prompt, expression, answer in rng.sample(rows, 64):
            row, mask = encode_trace(tokenizer, prompt, expression, answer,
                                     use_tool=rng.random() < tool_fraction)  # fmt: skip
            ids.append(row)
            masks.append(mask)
        batch = padded(ids)
        weight = padded(masks).float()
        logits = model(input_ids=batch).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * weight[:, 1:].reshape(-1)).sum() / weight[:, 1:].sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if copy_target and step % CHECK_EVERY == 0:
            if copy_rate(model, tokenizer, checks) >= copy_target:
                break
    model.eval()
    return step, copy_rate(model, tokenizer, checks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=800,
        help="the most warm-up steps (fewer once the copy target is met)",
    )
    parser.add_argument("--copy-target", type=float, default=0.8,
                        help="share of held-out calls whose result the model must copy "
                             "(0: exactly --warmup-steps steps, no check)")  # fmt: skip
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
    checks = problems(args.seed + 2, 64)  # neither trained on nor evaluated
    steps, copied = warm_up(model, tokenizer, rows, checks, max_steps=args.warmup_steps,
                            copy_target=args.copy_target, tool_fraction=args.tool_fraction,
                            seed=args.seed)  # fmt: skip
    if copied < args.copy_target:
        raise SystemExit(
            f"prepare.py: after {steps} warm-up steps the model copies the calculator's result "
            f"in {copied:.0%} of held-out calls, under --copy-target {args.copy_target:.0%}: "
            "calling the tool would not pay, and GRPO would learn to avoid it; raise "
            "--warmup-steps"
        )
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"{steps} warm-up steps, {args.tool_fraction:.0%} of the traces with the calculator, "
          f"its result copied in {copied:.0%} of held-out calls; vocab_size {len(tokenizer)}; "
          f"assets in {out}")  # fmt: skip


if __name__ == "__main__":
    main()
