"""What the main rank tells every stage's sender about a push, and what each sender answers.

The main rank makes a ``SyncPlan`` when it opens a push on the engines
(``weight_sync.engines.begin_push``) and hands it to every stage's sender; each sender
answers with a ``StageReport``, from which the main rank closes the push
(``weight_sync.engines.finish_push``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SyncMethod = Literal["tensor", "disk", "distributed"]
CheckMode = Literal["rows", "checksum"]


@dataclass(frozen=True)
class SyncPlan:
    """What every stage's sender needs for one push; made by the main rank."""

    urls: tuple[str, ...]
    method: SyncMethod
    weight_version: str
    bucket_bytes: int
    disk_dir: str | None = None
    main_host: str = ""
    """The main rank's host name."""
    master_address: str = "127.0.0.1"
    """``distributed``: the address engines reach senders on the main rank's host at."""
    check: CheckMode | None = None
    """``rollout.sync.check``: what each sender compares after the push (None: nothing)."""
    delta: bool = False
    """``rollout.sync.delta``: send engines that hold the sender's last push a delta."""


@dataclass
class StageReport:
    """What a stage's sender did, for the main rank."""

    stage: int
    error: str | None = None
    rollout_error: bool = False
    """The error came from an engine (it may have died), not from the learner."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """``disk``: file name -> the weights it holds."""
    nbytes: int = 0
    sent_bytes: int = 0
    """``rollout.sync.delta``: bytes of tensor data sent to one engine (full or delta)."""
