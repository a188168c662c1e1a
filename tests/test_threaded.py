"""threaded_world: every rank a thread of this process, with real values.

The oracle is the same body on real processes (``local_world``), compared rank
by rank; the bodies are in threaded_bodies.py so the workers can import them.
"""

import os
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate.errors import MeshStateError
from meshstate.megatron import install, uninstall
from meshstate.megatron import parallel_state as mpu
from meshstate.testing import distributed, fake_world, local_world, threaded_world
from meshstate.testing.launch import LocalWorld
from meshstate.testing.report import RankFailure, RankTimeout

import threaded_bodies as bodies

REPOSITORY = Path(__file__).resolve().parents[1]


def assert_same(threads, processes, path="result"):
    """Equal results, tensors within float tolerance (the two worlds reduce in different orders)."""
    if isinstance(processes, dict):
        assert threads.keys() == processes.keys(), path
        for key in processes:
            assert_same(threads[key], processes[key], f"{path}[{key!r}]")
    elif isinstance(processes, torch.Tensor):
        torch.testing.assert_close(threads, processes, msg=lambda message: f"{path}: {message}")
    else:
        assert threads == processes, path


def in_both_worlds(body, *args):
    """``body`` on 4 threads and on 4 processes: the results, which must agree rank by rank."""
    threads = threaded_world(4).run(body, *args)
    processes = local_world(4).run(body, *args)
    for rank, (by_thread, by_process) in enumerate(zip(threads, processes, strict=True)):
        assert_same(by_thread, by_process, f"rank {rank}")
    return threads


def test_collectives_and_meshstates_answer_as_on_processes():
    results = in_both_worlds(bodies.collectives_on_a_tp_mesh)
    assert results[2]["psum"].tolist() == [50.0, 52.0, 54.0, 56.0]   # ranks 2 and 3: tp group
    assert results[3]["ppermute"].tolist() == [20.0, 21.0, 22.0, 23.0]


def test_each_rank_has_its_own_megatron_state():
    results = in_both_worlds(bodies.megatron_getters_per_rank)
    assert [r["tp size override before init"] for r in results] == [1, 2, 3, 4]
    assert [r["vpp size"] for r in results] == [5, 6, 7, 8]
    assert [r["dp group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["initialized after rank 0 destroyed"] for r in results] == [False, True, True, True]
    assert not any(r["initialized after destroy"] for r in results)


def test_the_process_megatron_state_and_getter_come_back_after_a_threaded_world():
    with fake_world(5, 8):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        served_facts = mpu.getters._facts
        try:
            threaded_world(4).run(bodies.megatron_getters_per_rank)
            assert mpu.getters._facts is served_facts
            assert mpu.get_tensor_model_parallel_rank() == 1
            assert mpu.get_data_parallel_world_size() == 4
            assert dist.get_world_size() == 8 and dist.get_backend() == "fake"
        finally:
            mpu.destroy_model_parallel()


def test_ddp_step_as_on_processes():
    results = in_both_worlds(bodies.ddp_step)
    assert all(torch.equal(r["weight.grad"], results[0]["weight.grad"]) for r in results)


def test_fsdp2_step_as_on_processes():
    in_both_worlds(bodies.fsdp_step)


def test_send_receive_and_a_ring_that_receives_first():
    results = in_both_worlds(bodies.send_receive_and_ring)
    assert results[1]["pair"].tolist() == [1.0, 2.0, 3.0]
    assert [r["ring"][0].item() for r in results] == [3.0, 0.0, 1.0, 2.0]


def test_a_1f1b_pipeline_over_pp_matches_one_process():
    for result in in_both_worlds(bodies.pipeline_1f1b):
        assert_same(result["pipelined"], result["one process"])


def test_dcp_saves_and_loads(tmp_path):
    threads = threaded_world(4).run(bodies.dcp_save_and_load, tmp_path / "threads")
    processes = local_world(4).run(bodies.dcp_save_and_load, tmp_path / "processes")
    for by_thread, by_process in zip(threads, processes, strict=True):
        assert_same(by_thread, by_process)
        assert torch.equal(by_thread["whole"], torch.arange(32.0).reshape(8, 4))
    assert by_thread["step"].item() == 7


def test_megatron_core_layers_under_install(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core's CUDA tuning hint
    install()
    try:
        threads = threaded_world(4).run(bodies.megatron_core_layers)
    finally:
        uninstall()
    with LocalWorld(4) as world:  # its workers install, so they are not the pooled ones
        processes = world.run(bodies.megatron_core_layers)
    for by_thread, by_process in zip(threads, processes, strict=True):
        assert_same(by_thread, by_process)


def test_each_rank_prints_its_lines(capfd):
    threaded_world(4).run(bodies.say_hello)
    out = capfd.readouterr().out
    assert sorted(out.splitlines()) == [f"[rank {rank}] hello from {rank}" for rank in range(4)]


def test_a_failing_rank_is_reported_and_the_others_released():
    with pytest.raises(RankFailure) as failed:
        threaded_world(4).run(bodies.raise_on_rank_one_while_others_wait,
                              timeout=timedelta(seconds=60))
    message = str(failed.value)
    assert message.startswith("raise_on_rank_one_while_others_wait: rank 1 raised; "
                              "ranks 0, 2-3 of 4 did not finish\n"
                              "--- rank 1: ValueError: rank 1 fails ---\n")
    assert message.count("Traceback (most recent call last)") == 1
    waiting_in = dict(section.split(" stack (most recent call first) ---\n")
                      for section in message.split("\n--- ")[1:] if " stack " in section)
    assert " in recv\n" in waiting_in["rank 0"]
    assert " in all_reduce\n" in waiting_in["ranks 2-3"]
    assert not [t for t in threading.enumerate() if t.name.startswith("meshstate-rank")]


def test_a_hung_rank_times_out_with_its_stack_and_is_woken(capfd):
    with pytest.raises(RankTimeout) as hung:
        threaded_world(4).run(bodies.receive_forever_on_rank_two, timeout=timedelta(seconds=1))
    message = str(hung.value)
    assert message.startswith("receive_forever_on_rank_two: rank 2 of 4 did not finish within 1 s\n"
                              "--- rank 2 stack (most recent call first) ---\n")
    assert "threaded_bodies.py" in message and " in receive_forever_on_rank_two" in message
    assert "could not be woken" not in message
    assert not [t for t in threading.enumerate() if t.name.startswith("meshstate-rank")]
    err = capfd.readouterr().err
    assert "receive_forever_on_rank_two has run half its 1 s timeout; rank 2 not finished" in err


def test_a_thread_that_cannot_be_woken_is_named():
    with pytest.raises(RankTimeout) as hung:
        threaded_world(4).run(bodies.receive_on_two_and_sleep_on_three,
                              timeout=timedelta(seconds=0.5))
    assert str(hung.value).splitlines()[0] == (
        "receive_on_two_and_sleep_on_three: ranks 2-3 of 4 did not finish within 0.5 s; the "
        "threads of rank 3 could not be woken and still run (daemon threads: a thread cannot "
        "be killed)")
    assert threaded_world(2).run(dist.get_rank) == [0, 1]  # the next world runs meanwhile


def test_a_threaded_world_takes_arguments_and_closes_as_a_local_world_does():
    with threaded_world(2) as world:
        assert world.run(lambda factor, offset: dist.get_rank() * factor + offset, 3, offset=1) == [1, 4]
    with pytest.raises(MeshStateError, match="^this ThreadedWorld is closed; start a new one$"):
        world.run(dist.get_rank)


def test_one_threaded_world_at_a_time():
    def start_another():
        threaded_world(2).run(dist.get_rank)

    with pytest.raises(RankFailure, match="a threaded world of 4 ranks is running in this process; "
                                          "a second .2 ranks. must wait"):
        threaded_world(4).run(start_another)


def test_a_threaded_world_leaves_the_process_group_and_its_hooks_as_they_were():
    with fake_world(0, 8):
        default_group, excepthook = dist.group.WORLD, sys.excepthook
        assert threaded_world(4).run(dist.get_world_size) == [4] * 4
        assert dist.group.WORLD is default_group and dist.get_world_size() == 8
        assert sys.excepthook is excepthook  # each rank's init wrapped it in a "[rankN]: " one
        assert torch.autograd.is_multithreading_enabled()
        assert meshstate.init_mesh(tp=2).size("tp") == 2


@distributed(world_size=4, threads=True)
def test_distributed_runs_a_test_on_threads(tmp_path):
    assert dist.get_backend() == "meshstate_threads"
    assert tmp_path.exists()


def test_distributed_refuses_threads_with_simulate_or_a_backend():
    with pytest.raises(MeshStateError, match="simulated or threaded, not both"):
        distributed(4, simulate=True, threads=True)
    with pytest.raises(MeshStateError, match="a threaded world has no backend; got backend='gloo'"):
        distributed(4, threads=True, backend="gloo")


STDIN_PROGRAM = textwrap.dedent("""
    import torch.distributed as dist
    from meshstate.errors import MeshStateError
    from meshstate.testing import local_world, threaded_world

    def rank_of():
        return dist.get_rank()

    print("threads:", threaded_world(2).run(rank_of))
    try:
        local_world(2).run(rank_of)
    except MeshStateError as error:
        print("processes:", error)
""")


def test_a_function_from_stdin_runs_on_threads_and_processes_say_why_not(tmp_path):
    done = subprocess.run([sys.executable, "-"], input=STDIN_PROGRAM, capture_output=True,
                          text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "threads: [0, 1]",
        "processes: rank_of is defined in __main__, which has no file the worker processes can "
        "import (a notebook, python -, python -c); threaded_world or simulated_world run every "
        "rank in this process",
    ]
    assert "Traceback" not in done.stderr


def test_groups_named_by_a_count_of_builds_agree_between_threads():
    """The count is per rank (per default group): one per process would give each thread
    the next number, and the threads would wait for each other under different names."""
    results = threaded_world(4).run(bodies.groups_made_without_an_agreed_name,
                                    timeout=timedelta(seconds=20))
    assert [t.item() for t in results] == [6.0] * 4


AFTER_GLOO_GROUPS_PROGRAM = textwrap.dedent("""
    import threaded_bodies as bodies
    import torch.distributed as dist
    from meshstate.testing import local_world, simulated_world, threaded_world

    def rank_of():
        return dist.get_rank()

    threaded_world(4).run(bodies.megatron_getters_per_rank)  # it made gloo groups, garbage now
    print(len(local_world(4).run(bodies.megatron_getters_per_rank)))
    print(simulated_world(4, stages=2).run(rank_of))
""")


def test_forks_start_after_a_threaded_world_that_made_gloo_groups():
    """The fork server and a simulated world's stages are forks of this process: the
    threads' gloo groups, garbage by then, must not be destroyed in them (their locks
    were copied held), where they hang or abort."""
    done = subprocess.run([sys.executable, "-c", AFTER_GLOO_GROUPS_PROGRAM], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent,
                          env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert (done.returncode, done.stdout) == (0, "4\n[0, 1, 2, 3]\n"), done.stderr[-2000:]
