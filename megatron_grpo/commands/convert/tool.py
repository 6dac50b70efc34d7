"""What the two conversion command lines share: exit codes, messages, the rank that prints."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable


def run_conversion(name: str, convert: Callable[[], str], *, worker: str) -> int:
    """Run ``convert`` (it returns what to print when done) and map failures to exit codes:
    2 for bad input (named in the message), 1 when one of the ``worker`` processes failed."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
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
