"""Export a megatron-core distributed checkpoint (any TP/PP layout) as a Hugging Face model.

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/qwen3 --out qwen3-hf

Reads ``model.yaml`` and ``hf/`` (config template, tokenizer) from the
checkpoint directory when present, as written by convert_hf_to_megatron.py.
Writes ``config.json``, ``model.safetensors`` (or shards and an index), and
copies the generation config and tokenizer files. See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-dir", required=True, help="distributed checkpoint directory")
    parser.add_argument("--out", required=True, help="HF model directory to write")
    parser.add_argument(
        "--family",
        default="auto",
        choices=["auto", "llama", "qwen2", "qwen3"],
        help="HF family to write; auto: from the model config's QKV bias / q-k norm",
    )
    parser.add_argument(
        "--model-config", help="YAML model config (default: <megatron-dir>/model.yaml)"
    )
    parser.add_argument(
        "--hf-config-dir",
        help="directory whose config.json (and generation_config.json) is written back, "
        "after checking it matches (default: <megatron-dir>/hf when present)",
    )
    parser.add_argument(
        "--tokenizer-dir", help="copy tokenizer files from here (default: <megatron-dir>/hf)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the written weights (default: the model config's params_dtype)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file")
    parser.add_argument("--num-procs", type=int, default=2, help="reader processes (at least 2)")
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_grpo.commands.convert.tool import run_conversion

    def convert() -> str:
        from megatron_grpo.commands.convert.megatron_to_hf import convert_megatron_to_hf

        out = convert_megatron_to_hf(
            args.megatron_dir,
            args.out,
            family=args.family,
            model_config=args.model_config,
            hf_config_dir=args.hf_config_dir,
            tokenizer_dir=args.tokenizer_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            num_procs=args.num_procs,
            timeout=args.timeout,
        )
        return f"wrote {out}"

    return run_conversion("convert_megatron_to_hf", convert, worker="reader")


if __name__ == "__main__":  # the guard dist_checkpointing's spawned helpers need
    sys.exit(main())
