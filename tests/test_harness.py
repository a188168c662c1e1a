"""The harness explains failures and leaves no process behind.

One 4-rank world serves the first tests; the hang comes last because it ends that world.
The signal tests run pytest in a subprocess on a generated test file and signal it mid-test.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import heed_ctrl_c

from meshstate.errors import MeshStateError
from meshstate.testing import fork_server
from meshstate.testing.report import RankFailure, RankTimeout
from meshstate.testing import local_world
from harness_bodies import (
    all_ranks_assert,
    log_and_warn,
    low_and_high_ranks_disagree,
    say_hello,
    takes_anything,
    send_uncaught_exception_hook,
    wait_forever_on_rank_two,
)


def test_one_failure_on_every_rank_is_reported_once():
    with pytest.raises(RankFailure) as failed:
        local_world(4).run(all_ranks_assert)
    message = str(failed.value)
    assert message.startswith("all_ranks_assert: ranks 0-3 raised\n"
                              "--- ranks 0-3: AssertionError: no rank is negative ---\n")
    assert message.count("Traceback (most recent call last)") == 1


def test_distinct_failures_are_reported_once_each():
    with pytest.raises(RankFailure) as failed:
        local_world(4).run(low_and_high_ranks_disagree)
    message = str(failed.value)
    assert "--- ranks 0-1: ValueError: low ---" in message
    assert "--- ranks 2-3: ValueError: high ---" in message
    assert message.count("Traceback (most recent call last)") == 2


def test_worker_output_carries_its_rank_and_workers_have_their_own_group(capfd):
    groups = local_world(4).run(say_hello)
    out, err = capfd.readouterr()
    for rank in range(4):
        assert f"[rank {rank}] hello from {rank}\n" in out
        assert f"[rank {rank}] fd 2 of {rank}\n" in err
    assert os.getpgrp() not in groups


def test_worker_logging_and_warnings_reach_its_stderr(capfd):
    """Workers may fork from pytest itself; its capture of logs and warnings is not theirs."""
    local_world(4).run(log_and_warn)
    err = capfd.readouterr().err
    for rank in range(4):
        assert f"[rank {rank}] logged on {rank}\n" in err
        assert f"UserWarning: warned on {rank}\n" in err


def test_a_fork_server_forked_from_the_caller_drops_its_handlers_and_captured_streams():
    """A caller's SIGTERM handler (meshstate check's) must not run in the server."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
            fork_server._forget_caller_state()
            status = int(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                         or sys.stdout is not sys.__stdout__)
        finally:
            os._exit(status)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_an_argument_that_cannot_reach_the_workers_fails_at_once():
    world = local_world(4)
    with pytest.raises(MeshStateError, match=r"takes_anything: argument 'value' \(a _thread.lock\) "
                                             r"cannot be sent to the worker processes"):
        world.run(takes_anything, value=threading.Lock())
    with pytest.raises(MeshStateError, match=r"positional argument 0 \(a builtins.function\)"):
        world.run(takes_anything, lambda: None)
    assert world.run(takes_anything, value=Path("/tmp")) == [True] * 4


def test_a_hung_rank_is_reported_with_its_stack():
    with pytest.raises(RankTimeout) as hung:
        local_world(4).run(wait_forever_on_rank_two, timeout=timedelta(seconds=3))
    message = str(hung.value)
    assert message.startswith("wait_forever_on_rank_two: rank 2 of 4 did not finish within 3 s\n"
                              "--- rank 2 stack (most recent call first) ---\n")
    assert "harness_bodies.py" in message and " in wait_forever_on_rank_two" in message


SLEEPING_TEST = """
from meshstate.testing import distributed
from harness_bodies import record_pid_then_sleep

@distributed(world_size=2)
def test_sleeps():
    record_pid_then_sleep()
"""


def _running(variable, value):
    """The processes whose environment sets ``variable`` to ``value`` and that still run
    (a zombie's environment reads as empty)."""
    marker = f"{variable}={value}\0".encode()
    running = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes():
                    running.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
    return running


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signalled_test_run_leaves_no_worker(tmp_path, how):
    """SIGTERM to pytest, Ctrl-C in its terminal (SIGINT to its process group), SIGKILL."""
    (tmp_path / "test_sleeper.py").write_text(textwrap.dedent(SLEEPING_TEST))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, MESHSTATE_PID_DIR=str(pid_dir),
               PYTHONPATH=os.pathsep.join(str(p) for p in Path(__file__).parents[:2]))
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sleeper.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=heed_ctrl_c,  # a shell's background job starts with SIGINT ignored
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.iterdir())) < 3:   # two workers and their fork server
            assert pytest_run.poll() is None, pytest_run.communicate()[0].decode()
            assert time.monotonic() < deadline, "the workers did not start within 120 s"
            time.sleep(0.2)
        if how == "SIGINT":
            os.killpg(pytest_run.pid, signal.SIGINT)
        else:
            os.kill(pytest_run.pid, getattr(signal, how))
        output = pytest_run.communicate(timeout=60)[0].decode()
        expected_status = {"SIGTERM": -signal.SIGTERM, "SIGINT": pytest.ExitCode.INTERRUPTED,
                           "SIGKILL": -signal.SIGKILL}[how]
        assert pytest_run.returncode == expected_status, output
        deadline = time.monotonic() + 10
        while _running("MESHSTATE_PID_DIR", pid_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running("MESHSTATE_PID_DIR", pid_dir)
    finally:
        if pytest_run.poll() is None:
            os.killpg(pytest_run.pid, signal.SIGKILL)
        for pid in _running("MESHSTATE_PID_DIR", pid_dir):
            os.kill(pid, signal.SIGKILL)


UNGUARDED_SCRIPT = """
import torch.distributed as dist

import meshstate.testing


def rank():
    return dist.get_rank()


print(meshstate.testing.local_world(2).run(rank))
"""


def test_a_script_without_a_main_guard_is_told_what_to_add(tmp_path):
    """Workers import the script to find its functions; unguarded, it starts a world in each."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = dict(os.environ, MESHSTATE_UNGUARDED_RUN=str(tmp_path))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"meshstate.errors.MeshStateError: meshstate.testing: the script {script} starts a "
        f'local world when imported; put the call under if __name__ == "__main__":'
    )
    assert done.stderr.count("Traceback") == 1, done.stderr  # the script's own, none from a worker
    assert "RuntimeError" not in done.stderr and done.stdout == ""
    deadline = time.monotonic() + 10
    while _running("MESHSTATE_UNGUARDED_RUN", tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running("MESHSTATE_UNGUARDED_RUN", tmp_path)


EOF_REQUEST = '''
import multiprocessing.forkserver as forkserver, os, socket, time
from meshstate.testing.fork_server import warm_up

warm_up()
server = forkserver._forkserver
with socket.socket(socket.AF_UNIX) as request:
    request.connect(server._forkserver_address)  # a caller killed before it sent its request
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pid, status = os.waitpid(server._forkserver_pid, os.WNOHANG)
    if pid:
        print("server exit", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.05)
'''


@pytest.mark.skipif(not fork_server._server_can_fork_from_here(), reason="the server is a new interpreter here")
def test_a_request_cut_off_ends_the_copied_fork_server_quietly():
    done = subprocess.run([sys.executable, "-c", EOF_REQUEST], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "server exit 0"
    assert "Traceback" not in done.stderr


def test_a_worker_cut_off_at_its_start_by_ctrl_c_prints_no_traceback(capsys):
    """A worker forked while its caller is being stopped finds its start data cut short
    (EOFError) and ends quietly; any other uncaught exception prints as Python prints it.
    Seen as ``EOFError: Ran out of input`` under ``meshstate check`` interrupted on a
    loaded machine."""
    fork_server.warm_up()
    reader, writer = fork_server._CONTEXT.Pipe(duplex=False)
    worker = fork_server._CONTEXT.Process(target=send_uncaught_exception_hook, args=(writer,))
    worker.start()
    assert reader.recv() == "quiet_when_caller_gone"
    worker.join()
    for kind in (EOFError, ConnectionResetError, ValueError):
        try:
            raise kind("Ran out of input")
        except kind as error:
            fork_server.quiet_when_caller_gone(kind, error, error.__traceback__)
    printed = capsys.readouterr().err
    assert printed.count("Traceback") == 1 and "ValueError: Ran out of input" in printed
