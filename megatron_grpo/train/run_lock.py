"""One run per output directory: a lock file naming its holder.

``<output_dir>/run.lock`` holds the host, pid and start time of the process that owns
the directory: ``megatron-grpo train --nproc`` takes it before it starts torchrun (its
workers then know it is held for them, through ``HELD_ENV``), a run started by torchrun
directly takes it on global rank 0. A second launch into a locked directory is refused,
naming the holder. A lock left by a process that is gone (kill -9) on this host is taken
over with a warning; a holder on another host cannot be checked from here, so that lock
is left for the user to remove.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HELD_ENV = "MEGATRON_GRPO_RUN_LOCK_HELD"
"""Set to the lock's path in the environment of workers whose launcher holds the lock."""


class RunLockedError(ValueError):
    """The output directory belongs to another run."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """The lock of ``output_dir`` while this process holds it."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        mine = {"host": host, "pid": os.getpid(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_holder(host)
                continue  # the stale lock was removed: try again
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.held = True
            return self
        raise RunLockedError(f"{self.path}: another launch took the lock at the same time")

    def _check_holder(self, host: str) -> None:
        try:
            holder = json.loads(self.path.read_text())
            who = f"pid {holder['pid']} on {holder['host']}, started {_when(holder['started'])}"
        except (OSError, ValueError, KeyError, TypeError):
            holder, who = None, "a process that left no readable record"
        if holder is not None and holder["host"] == host and not _alive(int(holder["pid"])):
            logger.warning("%s: taking over the lock of %s, which is gone", self.path, who)
            self.path.unlink(missing_ok=True)
            return
        raise RunLockedError(
            f"output_dir {self.path.parent} is in use by {who} ({self.path}); use another "
            f"output_dir, or delete {self.path} if that run is over"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
