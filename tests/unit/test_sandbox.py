"""The ``python`` tool's box, attacked: every test runs an escape for real and checks
what the host sees (files, processes, connections, the trainer's memory), not a
message."""

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megatron_grpo.config import ToolsConfig
from megatron_grpo.rollout.tools import isolation
from megatron_grpo.rollout.tools.registry import build_tools, run_call
from megatron_grpo.rollout.tools.sandbox import MAX_PIPE_BYTES, MAX_PROCESSES, PythonSandbox

pytestmark = pytest.mark.timeout(60)


ESCAPE = "import sys; sys.modules['__main__'].refused = ('x',)\n"
"""What switched off the audit hook of the Python-level sandbox this box replaced."""


def python(code, *, timeout_s=2.0, memory_mb=256, isolation="bwrap"):
    """``(output, failed, seconds)`` of one call of the tool, as the tool loop makes it."""
    cfg = ToolsConfig(
        names=["python"], python_timeout_s=timeout_s, python_memory_mb=memory_mb,
        python_isolation=isolation,
    )  # fmt: skip
    tools = build_tools(cfg)
    start = time.monotonic()
    output, failed = asyncio.run(run_call(tools, _call(code)))
    return output, failed, time.monotonic() - start


def _call(code):
    from megatron_grpo.rollout.tools.calls import ToolCall

    return ToolCall("python", {"code": code})


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("the trainer's secret")
    return path


def test_the_code_gets_what_it_prints_and_its_last_value():
    assert python("print(6*7)")[:2] == ("42\n", False)
    assert python("import math\nmath.factorial(5)")[:2] == ("120\n", False)
    output, failed, _ = python("print('y' * 20000)")
    assert not failed and output.startswith("y" * 10_000)
    assert output.endswith("\n...[10001 more characters cut]")


def test_an_error_in_the_code_is_what_the_model_reads():
    output, failed, _ = python("1/0")
    assert failed and output == "error: ZeroDivisionError: division by zero"


def test_the_audit_hook_escape_reads_nothing_of_the_host(secret):
    # the escape that opened the Python-hook sandbox: switch the hook off through sys
    code = (
        f"import sys; sys.modules['__main__'].refused = ('x',)\nprint(open({str(secret)!r}).read())"
    )
    output, failed, _ = python(code)
    assert failed and "FileNotFoundError" in output
    assert "secret" not in output.replace(str(secret), "")
    output, failed, _ = python("print(open('/etc/passwd').read())")
    assert failed and "FileNotFoundError" in output and "root:" not in output


def test_the_subclasses_escape_runs_a_shell_that_cannot_touch_the_host(tmp_path, secret):
    owned = tmp_path / "owned"
    code = textwrap.dedent(f"""
        g = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close']
        os = g[0].__init__.__globals__
        os['sys'].modules['__main__'].refused = ('x',)  # no import: the hook's off
        print(os['system']('id > {owned}; cat {secret} > /tmp/copy'), os['system']('cat /tmp/copy'))
    """)
    output, failed, _ = python(code)
    assert not owned.exists()
    assert "the trainer's secret" not in output


def test_the_code_writes_only_inside_its_own_temporary_directory(tmp_path):
    outside = tmp_path / "new.txt"
    output, failed, _ = python(f"open({str(outside)!r}, 'w').write('x')")
    assert failed and not outside.exists()
    for path in ("/usr/owned", "/usr/lib/owned", sys.base_prefix + "/owned"):
        output, failed, _ = python(f"open({path!r}, 'w').write('x')")
        assert failed and ("Read-only file system" in output or "Permission denied" in output)
        assert not Path(path).exists()
    code = "open('scratch.txt', 'w').write('kept'); print(open('scratch.txt').read())"
    assert python(code)[:2] == ("kept\n", False)
    output, failed, _ = python("open('big', 'wb').write(bytes(20 << 20))")
    assert failed and "File too large" in output


def test_the_code_sees_no_process_of_the_host():
    parent = os.getpid()
    code = f"import os\nprint(open('/proc/{parent}/environ').read())"
    output, failed, _ = python(code)
    assert failed and "FileNotFoundError" in output
    output, failed, _ = python(f"import os\nos.kill({parent}, 15)")
    assert failed and "ProcessLookupError" in output
    output, failed, _ = python(
        "import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())"
    )
    assert not failed and max(eval(output)) < 10  # only the box's own few processes
    output, failed, _ = python("import os\nos.getuid()")
    assert not failed and (os.geteuid() != 0 or int(output) == isolation.NOBODY)


def test_the_code_reaches_no_server_of_the_host():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    seen = []
    threading.Thread(target=lambda: seen.append(_accept(server)), daemon=True).start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
    output, failed, _ = python(code)
    assert failed and "ConnectionRefusedError" in output
    output, failed, _ = python("import socket\nsocket.getaddrinfo('pypi.org', 443)")
    assert failed and "gaierror" in output
    time.sleep(0.2)
    server.close()
    assert seen in ([], [None])


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_forking_past_the_process_limit_is_refused():
    code = textwrap.dedent("""
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                children += 1
        except OSError as e:
            print(children, e.errno)
    """)
    output, failed, _ = python(code, timeout_s=5)
    children, errno = map(int, output.split())
    assert not failed and children < MAX_PROCESSES and errno == 11  # EAGAIN


def _marked_processes(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(pid)
    return found


@pytest.mark.parametrize("main_waits", [True, False])
def test_a_detached_grandchild_does_not_outlive_the_call(main_waits):
    marker = f"31.{os.getpid()}{int(main_waits)}"
    code = textwrap.dedent(f"""
        import os, subprocess
        subprocess.Popen(['sleep', '{marker}'], start_new_session=True, close_fds=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        if os.fork() == 0:  # and a double-forked one that closes its descriptors
            os.setsid()
            os.closerange(0, 64)
            os.execv('/bin/sleep', ['sleep', '{marker}'])
        while {main_waits}:
            pass
    """)
    output, failed, seconds = python(ESCAPE + code, timeout_s=1.0)
    assert seconds < 2.0  # the deadline held within a second
    assert failed == main_waits
    time.sleep(0.5)
    assert _marked_processes(marker) == []


def test_the_deadline_holds_within_a_second():
    output, failed, seconds = python("while True:\n    pass", timeout_s=1.5)
    assert failed and output == "error: timed out after 1.5 s (the time limit)"
    assert 1.5 <= seconds < 2.5


def test_a_10_gb_allocation_is_refused():
    output, failed, _ = python("x = bytearray(10 << 30)", memory_mb=256)
    assert failed and output == "error: MemoryError"


_MEASURE = """
import asyncio, resource, sys, time
from megatron_grpo.rollout.tools.sandbox import PythonSandbox, SandboxError
sandbox = PythonSandbox(timeout_s=10, memory_mb=1024, isolation=sys.argv[2])
start = time.monotonic()
try:
    asyncio.run(sandbox(sys.argv[1]))
    result = "ok"
except SandboxError as e:
    result = str(e)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, time.monotonic() - start, result)
"""


def _trainer_side(code, isolation="bwrap"):
    """The peak resident set (MB) of a fresh process that runs one call, its seconds, and
    the call's result."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, code, isolation], capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    peak_mb, seconds, result = done.stdout.split(maxsplit=2)
    return int(peak_mb), float(seconds), result.strip()


@pytest.mark.parametrize("channel", ["sys.__stderr__", "sys.__stdout__", "os.fdopen(1, 'w')"])
def test_300_mb_of_output_leaves_the_trainer_memory_flat(channel):
    baseline_mb, _, result = _trainer_side("print(1)")
    assert result == "ok"
    flood = f"import os, sys\nout = {channel}\nfor _ in range(300):\n    out.write('x' * (1 << 20))"
    peak_mb, seconds, result = _trainer_side(flood)
    assert result == f"stopped: wrote more than {MAX_PIPE_BYTES} bytes (the output limit)"
    assert peak_mb - baseline_mb < 16, (baseline_mb, peak_mb)
    assert seconds < 5


def test_without_isolation_the_limits_still_hold_and_the_run_is_warned(secret, caplog):
    output, failed, _ = python(f"print(open({str(secret)!r}).read())", isolation="none")
    assert (output, failed) == ("the trainer's secret\n", False)  # what "unsafe" means
    assert "python_isolation=none" in caplog.text and "unsafe" in caplog.text
    output, failed, seconds = python("while True:\n    pass", timeout_s=1.0, isolation="none")
    assert failed and seconds < 2.0
    peak_mb, _, result = _trainer_side(
        "import sys\nsys.__stdout__.write('x' * (300 << 20))", "none"
    )
    assert "output limit" in result


def test_a_machine_without_bubblewrap_refuses_the_run_at_start_by_name(tmp_path, monkeypatch):
    from megatron_grpo.config import Config, RolloutConfig
    from megatron_grpo.train.preflight import check_tools

    cfg = Config(rollout=RolloutConfig(hook="tools", tools=ToolsConfig(names=["python"])))
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    isolation.box_prefix.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"needs bubblewrap \('bwrap', not on PATH\)") as e:
            PythonSandbox(timeout_s=1, memory_mb=64)
        assert "rollout.tools.python_isolation=none" in str(e.value)
        with pytest.raises(ValueError, match=r"^rollout.tools: the python tool runs model-written"):
            check_tools(cfg)  # what preflight runs before any worker starts
        unsafe = ToolsConfig(names=["python"], python_isolation="none")
        check_tools(Config(rollout=RolloutConfig(hook="tools", tools=unsafe)))
    finally:
        isolation.box_prefix.cache_clear()
