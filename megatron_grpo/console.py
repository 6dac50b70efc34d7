"""What reaches the console from third-party code.

megatron-core warns at import, once per module and process, that Transformer Engine and
Apex are absent and it falls back to torch: on a CPU machine (where neither exists) that
is a dozen lines a run that ask nothing of the user. Loading a distributed checkpoint,
megatron-core calls torch APIs that torch has deprecated (``load_state_dict``,
``ShardedTensor``): a FutureWarning per rank on every resume, about code the user does not
own. Both are dropped; every other warning is shown as Python shows it.
"""

from __future__ import annotations

import warnings

ABSENT_BACKENDS = r".*(Transformer Engine and Apex are|Apex is) not installed"
"""megatron-core's fallback warnings (``UserWarning`` at import)."""


TORCH_DEPRECATIONS_IN_MCORE = r".*(`load_state_dict` is deprecated|deprecating ShardedTensor)"
"""What torch says of the APIs megatron-core's checkpoint loading calls."""


def quiet_third_party_warnings() -> None:
    """Drop the warnings above in this process (each entry point calls it)."""
    warnings.filterwarnings("ignore", message=ABSENT_BACKENDS, category=UserWarning)
    warnings.filterwarnings("ignore", message=TORCH_DEPRECATIONS_IN_MCORE, category=FutureWarning)
