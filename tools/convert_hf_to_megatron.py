"""Convert a Hugging Face Llama / Qwen2 / Qwen3 checkpoint into a megatron-core checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-0.6B --out ckpt/qwen3 --tp 2 --pp 2

Starts the TP x PP processes itself (or runs as one of them under torchrun
with WORLD_SIZE = TP x PP). Writes a distributed checkpoint, ``model.yaml``
(the model config for training and for the way back) and ``hf/`` (the
source's config and tokenizer files). See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF model directory (safetensors)")
    parser.add_argument("--out", required=True, help="distributed checkpoint directory to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at")
    parser.add_argument(
        "--family",
        default="auto",
        choices=["auto", "llama", "qwen2", "qwen3"],
        help="expected model family; auto takes it from config.json",
    )
    parser.add_argument(
        "--model-config",
        help="YAML model config (or run config with a model: section) the HF config must match",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: the model config's, else the HF config's)",
    )
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_grpo.commands.convert.tool import run_conversion

    def convert() -> str:
        from megatron_grpo.commands.convert.hf_to_megatron import convert_hf_to_megatron

        cfg = convert_hf_to_megatron(
            args.hf_dir,
            args.out,
            tp=args.tp,
            pp=args.pp,
            family=args.family,
            model_config=args.model_config,
            dtype=args.dtype,
            timeout=args.timeout,
        )
        return (
            f"wrote {args.out} (TP{args.tp} x PP{args.pp}, {cfg.num_layers} layers, "
            f"{cfg.params_dtype}) with model.yaml"
        )

    return run_conversion("convert_hf_to_megatron", convert, worker="conversion")


if __name__ == "__main__":  # the guard dist_checkpointing's spawned helpers need
    sys.exit(main())
