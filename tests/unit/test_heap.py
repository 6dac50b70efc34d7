"""Start-up objects frozen out of the garbage collector's passes."""

import gc
import weakref

from megatron_grpo.heap import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_startup_garbage_is_collected_and_the_rest_frozen():
    garbage, kept = _Node(), _Node()
    gone = weakref.ref(garbage)
    del garbage
    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gone() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > before
        assert all(o is not kept for o in gc.get_objects())  # out of the passes
    finally:
        gc.unfreeze()
