"""The embedded server in a process of its own, started as SGLang's is:

    python -m megatron_grpo.rollout.embedded --model-path DIR --port 30000

It serves until SIGTERM or Ctrl-C; ``/health`` answers once the model is loaded. With
``--load-format dummy`` (SGLang's name) only DIR's config.json is read and the weights are
random, for a trainer that pushes its own before the first rollout.
"""

from __future__ import annotations

import argparse
import signal
import threading

from megatron_grpo.heap import freeze_startup_objects
from megatron_grpo.rollout.embedded.server import start_embedded_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.rollout.embedded")
    parser.add_argument("--model-path", required=True, help="a Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args(argv)
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
