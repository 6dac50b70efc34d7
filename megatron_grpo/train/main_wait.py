"""Work done by the main rank alone (a rollout, an evaluation), waited for outside collectives.

A rollout has no useful upper bound (long reasoning, dynamic sampling rounds), while every
collective has a timeout (``train.collective_timeout_s``). So the other ranks do not wait
for the main rank inside a collective: ``MainRankWork.run`` runs the work on the main rank
while a thread there beats a counter in torch.distributed's store every ``beat_s``
seconds; the other ranks poll the store for the work's end, watching the beat. Once the
work is done, the result's broadcast finds every rank there at once.

A main rank that stops (a frozen process, a stuck C call holding the interpreter) stops
beating: after ``stall_s`` without a beat the waiting ranks raise an error that says so. A
main rank that dies takes the store with it: the waiting ranks' next store call fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_grpo.mcore.device import default_store

T = TypeVar("T")


def poll_pause(waited_s: float) -> float:
    """The pause before the next look at the store: a tenth of the time waited so far, from
    2 ms up to half a second. The end of the work is seen at most about 10% late (a demo's
    0.2 s rollout is not stretched by a fixed poll interval), and a long wait asks the store
    twice a second, whatever the number of ranks waiting."""
    return min(max(waited_s / 10, 0.002), 0.5)


class MainRankWork:
    """Every rank calls ``run`` at the same points, in the same order."""

    def __init__(self, *, is_main: bool, world_size: int, stall_s: float, beat_s: float = 5.0):
        self.is_main = is_main
        self.stall_s = stall_s
        self.beat_s = min(beat_s, stall_s / 4)
        self._count = 0
        # torch.distributed's own store (TCPStore on the main rank under torchrun).
        self.store: Any = default_store() if world_size > 1 else None

    def run(self, what: str, work: Callable[[], T]) -> T | None:
        """``work()`` on the main rank (its result; None elsewhere, once it is done)."""
        self._count += 1
        key = f"mgrpo/main_work/{self._count}"
        if self.store is None:
            return work()
        if self.is_main:
            return self._produce(key, work)
        self._wait(key, what)
        return None

    def _produce(self, key: str, work: Callable[[], T]) -> T:
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.beat_s):
                self.store.add(f"{key}/beat", 1)

        beating = threading.Thread(target=beat, name="main-work-beat", daemon=True)
        beating.start()
        try:
            return work()
        finally:
            done.set()
            beating.join()
            self.store.set(f"{key}/done", "1")  # also after an error: the others go on to see it

    def _wait(self, key: str, what: str) -> None:
        # Polled (a store wait that times out logs a warning each time; see poll_pause).
        # The beat, which moves every beat_s, is read at most once a second.
        start = time.monotonic()
        last_beat, since, read = -1, start, start - 1.0
        while not self.store.check([f"{key}/done"]):
            now = time.monotonic()
            time.sleep(poll_pause(now - start))
            if now - read < 1.0:
                continue
            read = now
            beat = self.store.add(f"{key}/beat", 0)
            if beat != last_beat:
                last_beat, since = beat, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                raise RuntimeError(
                    f"the main rank has shown no sign of life for {self.stall_s:.0f} s "
                    f"during its {what} (train.collective_timeout_s): it is frozen or hung"
                )
