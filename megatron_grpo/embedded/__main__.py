"""The embedded server in a process of its own, started as SGLang's is:

    python -m megatron_grpo.embedded --model-path DIR --port 30000

It serves until SIGTERM or Ctrl-C; ``/health`` answers once the model is loaded. With
``--load-format dummy`` (SGLang's name) only DIR's config.json is read and the weights are
random, for a trainer that pushes its own before the first rollout.

``--api-key KEY`` (SGLang's flag) makes every endpoint but ``/health`` and
``/health_generate`` want ``Authorization: Bearer KEY``; ``--api-key-env NAME`` reads the
key from the environment variable NAME instead, keeping it off the command line (which
other users of the machine can read). A ``--host`` beyond loopback needs one of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from megatron_grpo.embedded.auth import check_api_key
from megatron_grpo.embedded.server import start_embedded_server
from megatron_grpo.heap import freeze_startup_objects


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.embedded")
    parser.add_argument("--model-path", required=True, help="a Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--weight-version", default="default")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="the key requests must carry (Authorization: Bearer)")
    key.add_argument("--api-key-env", help="environment variable that holds the API key")
    args = parser.parse_args(argv)
    api_key = args.api_key
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            parser.error(f"--api-key-env: environment variable {args.api_key_env} is not set")
    try:
        check_api_key(api_key, args.host)
    except ValueError as err:
        parser.error(str(err))
    model = args.model_path
    if args.load_format == "dummy":
        import transformers

        config = transformers.AutoConfig.from_pretrained(args.model_path)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    handle = start_embedded_server(
        model,
        args.host,
        args.port,
        seed=args.seed,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
        api_key=api_key,
    )
    freeze_startup_objects()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"embedded server ready at {handle.url}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    handle.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
