"""The conversion command lines: ``megatron-grpo convert hf-to-megatron | megatron-to-hf``.

Each direction's arguments are declared once, here. ``add_parser`` puts both
under ``megatron-grpo convert``; ``tool_main`` runs one of them as a command
of its own (the scripts in ``tools/``). Either way a run exits 0 when done,
2 for bad input (named in one line, before any process starts) and 1 when a
worker process failed. Under torchrun with the world size the conversion
needs, each rank runs the command and converts as one of the processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_grpo.console import quiet_third_party_warnings

HF_TO_MEGATRON = """\
Convert a Hugging Face Llama / Qwen2 / Qwen3 checkpoint to a megatron-core one.

Starts the TP x PP processes itself (or runs as one of them under torchrun
with WORLD_SIZE = TP x PP). Writes a distributed checkpoint, model.yaml (the
model config for training and for the way back) and hf/ (the source's config
and tokenizer files). See docs/conversion.md."""

MEGATRON_TO_HF = """\
Export a megatron-core checkpoint (any TP/PP layout) as a Hugging Face model.

--megatron-dir is a training run (its latest checkpoint), one of its
checkpoints (<run>/checkpoints/step_N), or a checkpoint made by hf-to-megatron.
A run's saved config gives the model, its train.init the config template and
its tokenizer the tokenizer; a converted checkpoint's model.yaml and hf/ give
them. The run state saved beside the model (optimizer, RNG, step) is not read.
Writes config.json, generation_config.json, model.safetensors (or shards and
an index) and the tokenizer files. Starts the --num-procs reader processes
itself (or runs as one of them under torchrun with WORLD_SIZE = --num-procs).
See docs/conversion.md."""

FAMILIES = ["auto", "llama", "qwen2", "qwen3", "qwen3_moe"]
DTYPE_NAMES = ["float32", "bfloat16", "float16"]
DEFAULT_TIMEOUT_S = 6 * 3600.0


def existing_dir(value: str) -> str:
    """An argparse ``type``: the path, if it is a directory."""
    if not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {value}")
    return value


def add_hf_to_megatron_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf-dir", required=True, type=existing_dir, help="HF model directory (safetensors)"
    )
    parser.add_argument("--out", required=True, help="distributed checkpoint directory to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at")
    parser.add_argument(
        "--family",
        default="auto",
        choices=FAMILIES,
        help="expected model family; auto takes it from config.json",
    )
    parser.add_argument(
        "--model-config",
        help="YAML model config (or run config with a model: section) the HF config must match",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="parameter dtype (default: the model config's, else the HF config's)",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.set_defaults(func=hf_to_megatron, prog=parser.prog)


def add_megatron_to_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--megatron-dir",
        required=True,
        type=existing_dir,
        help="a training run, one of its checkpoints, or a converted checkpoint",
    )
    parser.add_argument("--out", required=True, help="HF model directory to write")
    parser.add_argument(
        "--family",
        default="auto",
        choices=FAMILIES,
        help="HF family to write; auto: from the model config's QKV bias / q-k norm / experts",
    )
    parser.add_argument(
        "--model-config",
        help="YAML model config, or a run config with a model: section "
        "(default: the run's config.yaml, else <megatron-dir>/model.yaml)",
    )
    parser.add_argument(
        "--hf-config-dir",
        help="directory whose config.json (and generation_config.json) is written back, "
        "after checking it matches (default: the run's train.init, else <megatron-dir>/hf)",
    )
    parser.add_argument(
        "--tokenizer-dir",
        help="copy tokenizer files from here "
        "(default: the run's tokenizer, else <megatron-dir>/hf)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="dtype of the written weights (default: the model config's params_dtype)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file")
    parser.add_argument("--num-procs", type=int, default=2, help="reader processes (at least 2)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.set_defaults(func=megatron_to_hf, prog=parser.prog)


# name -> (help in the list of subcommands, description, arguments)
DIRECTIONS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "hf-to-megatron": (
        "Hugging Face checkpoint -> megatron-core distributed checkpoint",
        HF_TO_MEGATRON,
        add_hf_to_megatron_args,
    ),
    "megatron-to-hf": (
        "megatron-core distributed checkpoint -> Hugging Face model",
        MEGATRON_TO_HF,
        add_megatron_to_hf_args,
    ),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``convert`` and its two directions as a subcommand of ``megatron-grpo``."""
    parser = subparsers.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face and megatron-core",
        description="Convert checkpoints between Hugging Face and megatron-core "
        "(see docs/conversion.md).",
    )
    directions = parser.add_subparsers(dest="direction", required=True)
    for name, (summary, description, add_arguments) in DIRECTIONS.items():
        add_arguments(
            directions.add_parser(
                name,
                help=summary,
                description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )


def tool_main(direction: str, argv: list[str] | None = None) -> int:
    """Run one direction as a command of its own, with the arguments and help of the subcommand."""
    _, description, add_arguments = DIRECTIONS[direction]
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


def hf_to_megatron(args: argparse.Namespace) -> int:
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

    return run_conversion(args.prog, convert, worker="conversion")


def megatron_to_hf(args: argparse.Namespace) -> int:
    def convert() -> str:
        from megatron_grpo.commands.convert.megatron_to_hf import convert_megatron_to_hf

        checkpoint = convert_megatron_to_hf(
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
        return f"wrote {args.out} from {checkpoint}"

    return run_conversion(args.prog, convert, worker="reader")


def run_conversion(name: str, convert: Callable[[], str], *, worker: str) -> int:
    """Run ``convert`` (it returns what to print when done) and map failures to exit codes:
    2 for bad input (named in the message), 1 when one of the ``worker`` processes failed."""
    quiet_third_party_warnings()
    from megatron_grpo.launch import WorkerError

    try:
        done = convert()
    except (ValueError, FileNotFoundError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        print(f"{name}: a {worker} process failed: {err}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(done)
    return 0
