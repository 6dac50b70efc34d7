"""The ``python`` tool: a model's code run in a Python process of its own, under limits.

The process is a fresh interpreter (``-I -S``: no site packages, no environment, no
current directory on the path) in an empty temporary directory, and before the code
runs it:
- limits its own CPU time (``RLIMIT_CPU``) and address space (``RLIMIT_AS``) with the
  ``resource`` module; the parent also kills it past the wall-clock limit;
- imports a fixed set of standard modules (math, itertools, ...) and then installs an
  audit hook (PEP 578) that refuses opening files, sockets, new processes, ``os`` file
  operations, and importing anything else.
What the code prints (and the value of a last bare expression) is the result; an
exception, a limit or a refusal is an error whose message goes back to the model as the
tool's output. These are limits against a model's mistakes and accidents (a runaway
loop, a stray write), not a container against a determined attacker.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

from megatron_grpo.rollout.tools.calculator import format_number

ALLOWED_MODULES = (
    "math",
    "cmath",
    "fractions",
    "decimal",
    "statistics",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "random",
    "re",
    "string",
    "json",
)
"""Modules the code may import (imported before the audit hook goes in)."""

REFUSED_EVENTS = (
    "open",
    "os.",
    "socket.",
    "subprocess.",
    "shutil.",
    "ctypes.",
    "import",
    "urllib.",
    "pty.",
    "mmap.",
    "sys.addaudithook",
)
"""Audit events (prefixes) that stop the code with a PermissionError."""

MAX_OUTPUT_CHARS = 10_000
"""The child keeps at most this much of what the code prints."""

_RUNNER = r"""
import ast, io, resource, sys
cpu_s, memory, keep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
for name in sys.argv[4].split(","):
    __import__(name)
refused = tuple(sys.argv[5].split(","))
code = sys.stdin.read()
out, real_out = io.StringIO(), sys.stdout

def audit(event, args):
    if event.startswith(refused):
        what = f"{event} {args[0]!r}" if args and isinstance(args[0], (str, bytes)) else event
        raise PermissionError(f"not allowed in the sandbox: {what}")

def run():
    tree = ast.parse(code, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__"}
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))

sys.addaudithook(audit)
sys.stdout = out
ok = True
try:
    run()
except BaseException as e:
    ok = False
    error = type(e).__name__ + (f": {e}" if str(e) else "")
sys.stdout = real_out
real_out.write(out.getvalue()[:keep])
if not ok:
    real_out.write(("\n" if out.getvalue() else "") + error)
real_out.flush()
sys.exit(0 if ok else 1)
"""


class SandboxError(RuntimeError):
    """The code failed: an exception, a refusal, or a limit."""


class PythonSandbox:
    """``await sandbox(code)``: what the code printed, or a SandboxError with its message."""

    def __init__(self, *, timeout_s: float, memory_mb: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_mb << 20

    async def __call__(self, code: str) -> str:
        with tempfile.TemporaryDirectory(prefix="mgrpo_sandbox_") as cwd:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", _RUNNER,
                str(max(1, round(self.timeout_s + 0.5))), str(self.memory_bytes),
                str(MAX_OUTPUT_CHARS), ",".join(ALLOWED_MODULES), ",".join(REFUSED_EVENTS),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=cwd, env={},
            )  # fmt: skip
            try:
                out, err = await asyncio.wait_for(
                    process.communicate(code.encode()), self.timeout_s
                )
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
                raise SandboxError(
                    f"timed out after {format_number(self.timeout_s)} s (the time limit)"
                ) from None
        text = out.decode(errors="replace")
        status = process.returncode
        assert status is not None  # communicate() waited for it
        if status == 0:
            return text
        if status < 0:  # killed by a signal: SIGXCPU at the CPU limit
            raise SandboxError(f"stopped by the time or memory limit (signal {-status})")
        if not text.strip():  # the runner itself failed (e.g. out of memory at start)
            lines = err.decode(errors="replace").strip().splitlines()
            text = lines[-1] if lines else f"exit code {status}"
        raise SandboxError(text.strip())
