"""One run per output directory: the lock file, its holder, stale locks."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from megatron_grpo.train.run_lock import LOCK_FILE, RunLock, RunLockedError


def test_a_second_lock_on_the_directory_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path) as first:
        holder = json.loads(first.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunLockedError) as e:
            RunLock(tmp_path).acquire()
        msg = str(e.value)
        assert f"output_dir {tmp_path} is in use by pid {os.getpid()}" in msg
        assert socket.gethostname() in msg and "delete" in msg
    assert not (tmp_path / LOCK_FILE).exists()  # released on exit
    RunLock(tmp_path).acquire().release()


def test_the_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "started": 0.0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert f"taking over the lock of pid {dead.pid}" in caplog.text


def test_a_lock_held_on_another_host_is_left_alone(tmp_path):
    record = {"host": "another-node", "pid": os.getpid(), "started": 0.0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(RunLockedError, match="in use by pid .* on another-node"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == record


def test_a_lock_without_a_readable_record_is_refused(tmp_path):
    (tmp_path / LOCK_FILE).write_text("{not json")
    with pytest.raises(RunLockedError, match="a process that left no readable record"):
        RunLock(tmp_path).acquire()
