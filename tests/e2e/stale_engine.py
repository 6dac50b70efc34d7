"""An embedded rollout server whose weight updates do not arrive: it answers every update
with success and keeps the weights it started with, as an engine whose loader skips the
pushed weights would. Started by a run's ``rollout.engines.launch_command`` (with
``rollout.engines.type: sglang``) as ``python -m megatron_grpo.embedded`` is, with the same
arguments; ``--load-format dummy`` starts it from random weights, ``auto`` from
``--model-path``'s."""

import sys

from megatron_grpo.embedded import server
from megatron_grpo.embedded.__main__ import main


def keep_own_weights(model, named_tensors, *, require_all):
    """Takes the pushed tensors and copies none of them."""


server.copy_into_model = keep_own_weights

if __name__ == "__main__":
    sys.exit(main())
