"""``megatron-grpo convert hf-to-megatron`` as a script of its own (same options and help).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-0.6B --out ckpt/qwen3 --tp 2 --pp 2

See docs/conversion.md.
"""

import sys

from megatron_grpo.commands.convert.cli import tool_main

if __name__ == "__main__":  # the guard dist_checkpointing's spawned helpers need
    sys.exit(tool_main("hf-to-megatron"))
