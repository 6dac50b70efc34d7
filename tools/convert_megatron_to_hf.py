"""``megatron-grpo convert megatron-to-hf`` as a script of its own (same options and help).

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/qwen3 --out qwen3-hf

See docs/conversion.md.
"""

import sys

from megatron_grpo.commands.convert.cli import tool_main

if __name__ == "__main__":  # the guard dist_checkpointing's spawned helpers need
    sys.exit(tool_main("megatron-to-hf"))
