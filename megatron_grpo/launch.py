"""Run a function on N local processes, as torchrun would, with a hard timeout.

Used by the test suite and by ``check-invariance``: each rank runs
``target(**kwargs)`` with torchrun's environment set (RANK, WORLD_SIZE,
MASTER_ADDR, ...); what it returns is saved with ``torch.save`` and handed back
as a list indexed by rank. A rank that fails or a run that exceeds its timeout
kills every rank and raises ``WorkerError`` with the tail of each failing
rank's output, so a hang never blocks the caller.

``target`` is ``"package.module:function"`` or ``"path/to/file.py:function"``.

Also what ``megatron-grpo train`` runs its processes with: torchrun on one node with its
store on loopback (``python -m megatron_grpo.launch torchrun ...``), a process that dies
with its parent, and temporary files that go with the process that made them.
"""

from __future__ import annotations

import ctypes
import getpass
import importlib
import importlib.util
import logging
import os
import pickle
import pkgutil
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """A rank failed or the run timed out."""


PR_SET_PDEATHSIG = 1

# Looked up once, here: between fork and exec (``preexec_fn``) a child of a process with
# threads must not import or dlopen, only call.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux).

    torchrun puts each worker in a session of its own, so killing the launcher's process
    group, even with SIGKILL, leaves the workers running; with this, a worker whose torchrun
    is gone, a torchrun whose ``megatron-grpo train --nproc`` is gone, and a rollout server
    whose trainer is gone get ``sig`` (torchrun stops its workers on SIGTERM). Gets ``sig``
    at once if the parent is already gone. Safe between fork and exec (``preexec_fn``);
    does nothing off Linux.
    """
    if _prctl is None:
        return
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # orphaned before the call took effect
        os.kill(os.getpid(), sig)


_REMOVE_AT_EOF = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], True)"


def use_private_tempdir(prefix: str = "megatron_grpo_") -> str:
    """Make a directory of this process's own the default of ``tempfile`` (``mkdtemp``,
    ``TemporaryDirectory``) and have it removed when this process ends, however it ends
    (SIGKILL included); its path.

    A watcher, in a session of its own, reads a pipe whose writing end only this process
    holds; when that closes, at any exit, it removes the directory. So an embedded server's
    model directory or a weight push's files are never left in /tmp by a killed run.
    Subprocesses keep the system's temporary directory (SGLang's socket paths stay short).
    """
    # torch.compile's cache is meant to outlive the process: it stays where it was.
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    default_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_")
    read_end, write_end = os.pipe()  # not inherited by subprocesses (PEP 446)
    subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REMOVE_AT_EOF, path],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not stopped with this process's group
    )
    os.close(read_end)
    # write_end stays open, unused, until the process ends: the kernel closes it then.
    tempfile.tempdir = path
    return path


LOOPBACK = "127.0.0.1"


def loopback_torchrun(argv: list[str]) -> None:
    """torchrun's ``main(argv)`` on this node alone, its store listening on 127.0.0.1 only.

    torchrun's own rendezvous (``--standalone``) starts two TCP stores, and a TCP store
    server listens on every interface whatever host it is given: anyone who reaches the
    port can read and write the run's keys. Here the store is started first on a socket
    bound to loopback; torchrun's static rendezvous, given that address and port, shares it
    (``multi_tenant``), and the workers connect to it as clients. ``argv`` must not name a
    rendezvous, nodes or a master address. torchrun's log directory (its workers' error
    files) is this process's private tempdir.
    """
    import torch.distributed as dist
    from torch.distributed import run

    use_private_tempdir()
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen()
    port = sock.getsockname()[1]
    store = dist.TCPStore(  # noqa: F841  (held for the run: torchrun's store shares it)
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The launcher prints the first worker error, once: not torchrun's report of it (its
    # modules' loggers carry levels of their own, set at import).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run.main(
            [
                "--nnodes=1",
                "--rdzv-backend=static",
                f"--master-addr={LOOPBACK}",
                f"--master-port={port}",
                *argv,
            ]
        )
    except ChildFailedError:
        sys.exit(1)
    except (KeyboardInterrupt, SignalException):  # the workers are stopped by now
        sys.exit(130)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(
    target: str,
    nprocs: int,
    *,
    timeout: float = 300.0,
    kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target(**kwargs)`` on ``nprocs`` ranks; return each rank's result."""
    with tempfile.TemporaryDirectory(prefix="mgrpo_launch_") as tmp:
        work = Path(tmp)
        (work / "kwargs.pkl").write_bytes(pickle.dumps(kwargs or {}))
        base_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            **(env or {}),
        }
        procs = []
        for rank in range(nprocs):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            log = open(work / f"rank{rank}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "megatron_grpo.launch", target, str(work)],
                    env=rank_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        _wait_all(procs, timeout, work, target)
        return [_load_result(work / f"rank{r}.result") for r in range(nprocs)]


def _wait_all(procs: list[subprocess.Popen], timeout: float, work: Path, target: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            _kill(procs)
            what = f"rank(s) {failed} failed" if failed else f"timed out after {timeout:.0f}s"
            ranks = failed or list(range(len(procs)))
            tails = "\n".join(
                f"--- rank {r} (last lines) ---\n{_tail(work / f'rank{r}.log')}" for r in ranks
            )
            raise WorkerError(f"{target} on {len(procs)} processes: {what}\n{tails}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _load_result(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)


def resolve(target: str):
    """The function named by ``module:function`` (``pkgutil.resolve_name``) or
    ``file.py:function`` (a test's workers, loaded by path)."""
    where, _, name = target.rpartition(":")
    if not where.endswith(".py"):
        return pkgutil.resolve_name(target)
    spec = importlib.util.spec_from_file_location(Path(where).stem, where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _worker_main(target: str, work: str) -> None:
    import torch

    fn = resolve(target)
    kwargs = pickle.loads((Path(work) / "kwargs.pkl").read_bytes())
    result = fn(**kwargs)
    rank = os.environ["RANK"]
    torch.save(result, Path(work) / f"rank{rank}.result")
    # Skip interpreter teardown: gloo's threads, torn down while peers are already gone, abort
    # now and then ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "torchrun":
        loopback_torchrun(sys.argv[2:])
    else:
        _worker_main(sys.argv[1], sys.argv[2])
