"""The operating-system box around the ``python`` tool: bubblewrap's command line.

Threat model: the code is hostile (a policy optimized against a reward finds any path
the box leaves open). The box is made by the kernel, not by Python, so nothing the code
can reach inside its interpreter can open it:
- mount namespace: a read-only view of the interpreter and the system libraries, an
  empty ``/dev`` and ``/proc`` of its own, and a size-capped tmpfs at ``/tmp`` (its
  working directory, and the only place it can write); no ``/etc``, ``/home``, ``/root``
  (beyond the interpreter's own files), host ``/tmp``, ``/dev/shm`` or site-packages;
- network namespace: no interface but a loopback of its own, so nothing on the host,
  the rollout servers included, can be reached;
- PID and IPC namespaces: no view of, or signals to, any process outside; when the
  code's main process ends or is killed, every process it started dies with it;
- an unprivileged user: started as root, the box drops to ``nobody`` (uid 65534) with
  no capabilities before the interpreter starts (setpriv); started as another user, a
  user namespace of its own; ``no_new_privs`` either way;
- resource limits set in the child before any code runs (sandbox.py): CPU time, address
  space, processes, file size, open files.
bubblewrap is what Flatpak runs its applications in; it comes with every common
distribution (``apt install bubblewrap``, ``dnf install bubblewrap``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NOBODY = 65534
"""The user (and group) the code runs as when the trainer runs as root."""

TMPFS_BYTES = 64 << 20
"""Size of the code's own ``/tmp`` (its working directory, its only writable place)."""

UNSAFE_HINT = (
    "set rollout.tools.python_isolation=none to run it without isolation (unsafe: the "
    "code runs with this user's rights, files, network and processes)"
)


class IsolationUnavailable(ValueError):
    """This machine cannot put the code in a box (a config the machine cannot run)."""


def _interpreter() -> tuple[str, list[str]]:
    """The real interpreter binary and the folders the box must show read-only."""
    executable = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), os.path.dirname(executable)}
    return executable, sorted(r for r in roots if not r.startswith("/usr/") and r != "/usr")


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parents
    return [str(p) for p in reversed(parts) if str(p) != "/"]


def bwrap_argv(bwrap: str, *, as_root: bool) -> list[str]:
    """bubblewrap's arguments up to (and including) the interpreter to run in the box."""
    executable, roots = _interpreter()
    argv = [bwrap, "--die-with-parent", "--new-session", "--clearenv"]
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    argv += ["--unshare-cgroup-try"]
    if as_root:  # no user namespace: setpriv below changes the real user
        argv += ["--cap-drop", "ALL"]
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--perms", "0755", "--dir", "/etc"]
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made: set[str] = set()
    for root in roots:
        for parent in _ancestors(root):
            if parent not in made and not parent.startswith("/usr"):
                argv += ["--perms", "0755", "--dir", parent]  # not the source's 0700
                made.add(parent)
        argv += ["--ro-bind", root, root]
    site = os.path.realpath(sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"])
    if any(site.startswith(root + "/") for root in roots) and os.path.isdir(site):
        argv += ["--tmpfs", site]  # the interpreter's installed packages stay out of view
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    if as_root:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        argv += [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv + [executable]


@functools.cache
def box_prefix() -> tuple[str, ...]:
    """The command that runs the interpreter in the box, checked once per process.

    Raises IsolationUnavailable with what is missing and what to do."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable(
            "the python tool runs model-written code and needs bubblewrap ('bwrap', not "
            "on PATH) to isolate it: install it (apt install bubblewrap, dnf install "
            f"bubblewrap), or {UNSAFE_HINT}"
        )
    as_root = os.geteuid() == 0
    if as_root and not (shutil.which("setpriv") or os.path.exists("/usr/bin/setpriv")):
        raise IsolationUnavailable(
            "the python tool, started as root, drops to user nobody with setpriv "
            f"(util-linux), which is not installed: install it, or {UNSAFE_HINT}"
        )
    argv = bwrap_argv(bwrap, as_root=as_root)
    probe = "import os; print(os.getuid())"
    try:
        done = subprocess.run(
            [*argv, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30, env={}
        )
    except subprocess.TimeoutExpired:
        raise IsolationUnavailable(f"bubblewrap did not start in 30 s; {UNSAFE_HINT}") from None
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise IsolationUnavailable(
            f"bubblewrap cannot make the python tool's box on this machine ({why}); user "
            f"namespaces may be disabled (sysctl kernel.unprivileged_userns_clone, "
            f"user.max_user_namespaces) or the trainer lacks the rights; {UNSAFE_HINT}"
        )
    if as_root and int(done.stdout) != NOBODY:
        raise IsolationUnavailable(
            f"the python tool's box runs as uid {done.stdout.strip()}, not nobody; {UNSAFE_HINT}"
        )
    return tuple(argv)
