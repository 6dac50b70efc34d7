"""The ``python`` tool: a model's code run in a box of the operating system's, under limits.

The code is treated as hostile. It runs in a fresh interpreter (``-I -S``) inside the
box of ``isolation.py`` (its own mount, network, PID and IPC namespaces, an
unprivileged user, a private ``/tmp`` as its working directory), and before it runs the
interpreter sets its own limits with ``resource``: CPU time, address space, processes,
file size and open files. The trainer's side holds the rest:
- the deadline: at ``timeout_s`` the whole process group is killed, and with it (the
  PID namespace) every process the code started, however it detached;
- the output: at most ``MAX_OUTPUT_CHARS`` of what the code prints comes back; what it
  writes past that on any channel (``sys.__stdout__``, file descriptors 1 and 2) is read
  up to a fixed cap and then the code is stopped, so the trainer's memory stays flat.
With ``isolation="none"`` (``rollout.tools.python_isolation: none``) the code runs with
the same limits but without the box: as the trainer's user, with its files and network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Literal

from megatron_grpo.rollout.tools.calculator import format_number
from megatron_grpo.rollout.tools.isolation import box_prefix

logger = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 10_000
"""What the code prints (and its last value) is cut to this many characters."""

MAX_PIPE_BYTES = 1 << 20
"""Bytes read from each of the code's output pipes before it is stopped."""

MAX_PROCESSES = 32
"""Processes (and threads) the code may have at once (``RLIMIT_NPROC``; in the box)."""

MAX_FILE_BYTES = 16 << 20
"""Largest file the code may write (``RLIMIT_FSIZE``)."""

MAX_OPEN_FILES = 64
"""Most file descriptors the code may hold (``RLIMIT_NOFILE``)."""

_RUNNER = r"""
import ast, os, resource, sys
cpu_s, memory, keep, nproc, fsize, nofile = map(int, sys.argv[1:7])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
code = sys.stdin.read()
sys.stdin.close()
real_out = sys.stdout

class Capped:
    def __init__(self):
        self.parts, self.n = [], 0
    def write(self, s):
        if self.n < keep:
            self.parts.append(str(s)[: keep - self.n])
        self.n += len(s)
        return len(s)
    def flush(self):
        pass
    def text(self):
        cut = self.n - keep
        return "".join(self.parts) + (f"\n...[{cut} more characters cut]" if cut > 0 else "")

def run():
    tree = ast.parse(code, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__"}
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))

out = Capped()
sys.stdout = out
ok = True
try:
    run()
except BaseException as e:
    ok = False
    error = type(e).__name__ + (f": {e}" if str(e) else "")
sys.stdout = real_out
text = out.text()
real_out.write(text)
if not ok:
    real_out.write(("\n" if text else "") + error)
real_out.flush()
os._exit(0 if ok else 1)
"""


class SandboxError(RuntimeError):
    """The code failed: an exception, a limit, or the box."""


class PythonSandbox:
    """``await sandbox(code)``: what the code printed, or a SandboxError with its message.

    ``isolation="bwrap"`` (the default) checks at construction that the box can be made
    on this machine and raises ``isolation.IsolationUnavailable`` naming what is missing."""

    def __init__(
        self, *, timeout_s: float, memory_mb: int, isolation: Literal["bwrap", "none"] = "bwrap"
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_mb << 20
        self.prefix = box_prefix() if isolation == "bwrap" else (sys.executable,)
        if isolation == "none":
            logger.warning(
                "rollout.tools.python_isolation=none: the python tool runs model-written "
                "code as this user, with its files, network and processes (unsafe)"
            )

    def _argv(self) -> list[str]:
        boxed = self.prefix[0] != sys.executable
        limits = (
            max(1, round(self.timeout_s + 0.5)),
            self.memory_bytes,
            MAX_OUTPUT_CHARS,
            MAX_PROCESSES if boxed else 0,  # outside a box it would count the user's all
            MAX_FILE_BYTES,
            MAX_OPEN_FILES,
        )
        return [*self.prefix, "-I", "-S", "-c", _RUNNER, *map(str, limits)]

    async def __call__(self, code: str) -> str:
        return await asyncio.to_thread(self.run, code)

    def run(self, code: str) -> str:
        """The call, blocking: what the code printed, or a SandboxError."""
        boxed = self.prefix[0] != sys.executable  # the box has a /tmp of its own
        workdir = (
            contextlib.nullcontext(None)
            if boxed
            else tempfile.TemporaryDirectory(prefix="mgrpo_sandbox_")
        )
        with workdir as cwd:
            process = subprocess.Popen(
                self._argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=cwd, env={}, start_new_session=True,
            )  # fmt: skip
            try:
                out, err, why = _supervise(process, code.encode(), self.timeout_s)
            finally:
                _kill_group(process)
                process.wait()
                for pipe in (process.stdin, process.stdout, process.stderr):
                    assert pipe is not None
                    pipe.close()
        if why == "timeout":
            limit = format_number(self.timeout_s)
            raise SandboxError(f"timed out after {limit} s (the time limit)")
        if why == "output":
            raise SandboxError(
                f"stopped: wrote more than {MAX_PIPE_BYTES} bytes (the output limit)"
            )
        text = out.decode(errors="replace")
        status = process.returncode
        assert status is not None  # _supervise waited for it
        if status == 0:
            return text
        if status < 0:  # killed by a signal: SIGXCPU at the CPU limit, SIGKILL
            raise SandboxError(f"stopped by the time or memory limit (signal {-status})")
        if not text.strip():  # the runner itself failed (e.g. out of memory at start)
            lines = err.decode(errors="replace").strip().splitlines()
            text = lines[-1] if lines else f"exit code {status}"
        raise SandboxError(text.strip())


def _supervise(
    process: subprocess.Popen[bytes], code: bytes, timeout_s: float
) -> tuple[bytes, bytes, str]:
    """``(stdout, stderr, why)``: ``why`` is ``""`` when the process ended on its own,
    ``"timeout"`` at the deadline, ``"output"`` when a pipe passed ``MAX_PIPE_BYTES``.

    Ends with the process: once it has exited, pipes still held open (outside the box, by
    a child it left behind) are read for a moment more, not waited for."""
    assert process.stdin and process.stdout and process.stderr
    deadline = time.monotonic() + timeout_s
    received: dict[int, bytearray] = {process.stdout.fileno(): bytearray()}
    received[process.stderr.fileno()] = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdin, selectors.EVENT_WRITE)
        for fd in received:
            selector.register(fd, selectors.EVENT_READ)
        exited_at = None
        while len(selector.get_map()) > 0:
            now = time.monotonic()
            if now >= deadline:
                return bytes(received[process.stdout.fileno()]), b"", "timeout"
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in selector.select(min(0.05, deadline - now)):
                if key.fileobj is process.stdin:
                    code = _write_some(process.stdin, code, selector)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                elif len(received[key.fd]) + len(chunk) > MAX_PIPE_BYTES:
                    return b"", b"", "output"
                else:
                    received[key.fd] += chunk
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(received[process.stdout.fileno()]), b"", "timeout"
    return bytes(received[process.stdout.fileno()]), bytes(received[process.stderr.fileno()]), ""


def _write_some(stdin: IO[bytes], code: bytes, selector: selectors.BaseSelector) -> bytes:
    """Writes what the pipe takes now; the rest of ``code`` (the pipe closed when done)."""
    try:
        code = code[os.write(stdin.fileno(), code[: 1 << 16]) :]
    except (BrokenPipeError, ConnectionResetError):
        code = b""
    if not code:
        selector.unregister(stdin)
        stdin.close()
    return code


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
