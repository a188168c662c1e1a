"""The local-world harness: failures with tracebacks, timeouts naming ranks, crashed workers."""

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshstate.testing.launch import LocalWorld
from meshstate.testing.report import RankFailure, RankTimeout
from meshstate.testing import local_world


def rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 disagrees")
    return dist.get_rank()


def rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


def rank_one_exits():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(1)
    return dist.get_rank()


def world_size_and_rank():
    return dist.get_world_size(), dist.get_rank()


def test_results_failures_and_timeouts():
    with LocalWorld(2, timeout=timedelta(seconds=30)) as world:
        assert world.run(world_size_and_rank) == [(2, 0), (2, 1)]
        with pytest.raises(RankFailure) as failed:
            world.run(rank_one_raises)
        message = str(failed.value)
        assert message.startswith("rank_one_raises: rank 1 raised\n"
                                  "--- rank 1: ValueError: rank 1 disagrees ---\nTraceback")
        assert world.run(world_size_and_rank) == [(2, 0), (2, 1)]   # still usable
        with pytest.raises(RankTimeout, match="rank_one_hangs: rank 1 of 2 did not finish within 2 s"):
            world.run(rank_one_hangs, timeout=timedelta(seconds=2))
        assert not world.alive   # a timed-out world is torn down


def test_a_crashed_worker_is_reported_and_the_pool_replaced():
    world = local_world(2)
    with pytest.raises(RankFailure, match=r"worker process of rank 1 exited \(exit code 3\)"):
        world.run(rank_one_exits)
    assert local_world(2) is not world
    assert local_world(2).run(world_size_and_rank) == [(2, 0), (2, 1)]


def environment_variable(name):
    return os.environ.get(name)


def test_workers_see_the_callers_environment_of_now(monkeypatch):
    """Workers fork from a server started earlier; the environment still is the caller's."""
    local_world(2)   # the fork server is running
    monkeypatch.setenv("MESHSTATE_TEST_SETTING", "set after the server started")
    with LocalWorld(2, timeout=timedelta(seconds=30)) as world:
        assert world.run(environment_variable, "MESHSTATE_TEST_SETTING") == [
            "set after the server started"] * 2


WORLD_SCRIPT = """
import sys
import time

import torch.distributed as dist

from meshstate.testing import local_world


def rank():
    return dist.get_rank()


if __name__ == "__main__":
    print(local_world(4).run(rank), flush=True)
    if sys.argv[1] != "exit":
        time.sleep(120)  # until signalled
"""


@pytest.mark.parametrize("how", ["exit", "SIGTERM", "SIGINT", "SIGKILL"])
def test_a_script_with_a_local_world_leaks_no_semaphore(tmp_path, how):
    """The workers' tasks and results go through pipes: nothing for Python's resource tracker
    to find left behind, however the script ends (it warned of 27 semaphores after a SIGTERM)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "script.py").write_text(WORLD_SCRIPT)
    script = subprocess.Popen(
        [sys.executable, "script.py", how], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job ignores it
    )
    try:
        assert script.stdout is not None
        first = script.stdout.readline()
        assert first == "[0, 1, 2, 3]\n", first + script.communicate(timeout=60)[0]
        if how != "exit":
            script.send_signal(getattr(signal, how))
        output = first + script.communicate(timeout=120)[0]  # the tracker's warning comes after
    finally:
        script.kill()
    assert "leaked" not in output, output
