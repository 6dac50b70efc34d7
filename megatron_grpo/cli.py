"""The ``megatron-grpo`` command line."""

from __future__ import annotations

import argparse
import sys

from megatron_grpo.config import dump_config, load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=1e-6 (repeatable)",
    )


def cmd_config(args: argparse.Namespace) -> int:
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config and print it resolved")
    add_config_args(p)
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"megatron-grpo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
