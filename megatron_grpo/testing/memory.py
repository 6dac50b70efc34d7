"""Resident memory of a process, for the memory tests and benchmarks.

Set ``MALLOC_ENV`` in a process's environment before it starts so that glibc returns
freed memory at once; otherwise the resident set keeps what is no longer live.
"""

from __future__ import annotations

import os
import threading

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def rss(pid: int | str = "self") -> int:
    """Resident set of a process (this one by default), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ResidentPeak:
    """The largest resident set of this process, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def reset(self) -> None:
        self.start = self.peak = rss()

    def close(self) -> int:
        """Stop sampling; the peak, in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak

    def growth(self) -> int:
        """Stop sampling; how far the peak rose over the resident set at the start."""
        return self.close() - self.start
