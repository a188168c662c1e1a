"""threaded_world: every rank a thread of this process, with real values.

Every kind of body compared rank by rank with processes is test_every_world.py's;
here is what only threads do: failures, hangs, state per rank and what they leave.
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
from meshstate.megatron import parallel_state as mpu
from meshstate.testing import distributed, fake_world, threaded_world
from meshstate.testing.report import RankFailure, RankTimeout

import world_bodies as bodies

REPOSITORY = Path(__file__).resolve().parents[1]


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
    assert "world_bodies.py" in message and " in receive_forever_on_rank_two" in message
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


def test_groups_named_by_a_count_of_builds_agree_between_threads():
    """The count is per rank (per default group): one per process would give each thread
    the next number, and the threads would wait for each other under different names."""
    results = threaded_world(4).run(bodies.groups_made_without_an_agreed_name,
                                    timeout=timedelta(seconds=20))
    assert [t.item() for t in results] == [6.0] * 4


PROGRAM = textwrap.dedent("""
    import torch.distributed as dist
    import world_bodies as bodies
    from meshstate.errors import MeshStateError
    from meshstate.testing import local_world, simulated_world, threaded_world

    def rank_of():
        return dist.get_rank()

    threaded_world(4).run(bodies.megatron_getters_per_rank)  # it made gloo groups, garbage now
    print(len(local_world(4).run(bodies.megatron_getters_per_rank)))
    print(simulated_world(4, stages=2).run(rank_of))
    print("threads:", threaded_world(2).run(rank_of))
    try:
        local_world(2).run(rank_of)
    except MeshStateError as error:
        print("processes:", error)
""")


@pytest.fixture(scope="module")
def program_from_stdin():
    """``PROGRAM`` run as ``python -`` (its functions in a ``__main__`` without a file), in
    a process of its own (the forks it starts are its first): one run for the two tests
    below, which read their own lines of its output."""
    done = subprocess.run([sys.executable, "-"], input=PROGRAM, capture_output=True, text=True,
                          cwd=Path(__file__).parent, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    return done.returncode, done.stdout.splitlines(), done.stderr


def test_forks_start_after_a_threaded_world_that_made_gloo_groups(program_from_stdin):
    """The fork server and a simulated world's stages are forks of this process: the
    threads' gloo groups, garbage by then, must not be destroyed in them (their locks
    were copied held), where they hang or abort."""
    returncode, lines, stderr = program_from_stdin
    assert (returncode, lines[:2]) == (0, ["4", "[0, 1, 2, 3]"]), stderr[-2000:]


def test_a_function_from_stdin_runs_on_threads_and_processes_say_why_not(program_from_stdin):
    returncode, lines, stderr = program_from_stdin
    assert returncode == 0, stderr
    assert lines[2:] == [
        "threads: [0, 1]",
        "processes: rank_of is defined in __main__, which has no file the worker processes can "
        "import (a notebook, python -, python -c); threaded_world or simulated_world run every "
        "rank in this process",
    ]
    assert "Traceback" not in stderr


def test_each_rank_draws_from_a_default_generator_of_its_own():
    state = torch.get_rng_state()
    results = threaded_world(4).run(bodies.seeded_then_drawn_between_barriers)
    expected = torch.Generator().manual_seed(0)
    first, second = torch.randn(2, generator=expected), torch.randn(2, generator=expected)
    for result in results:
        assert torch.equal(result["first"], first) and torch.equal(result["second"], second)
        assert result["initial seed"] == 0
    assert torch.equal(torch.get_rng_state(), state)  # the caller's, untouched


def test_a_rank_draws_its_own_numbers_while_another_rank_compiles():
    # torch holds one process-wide "compiling" flag for a whole compile: rank 0 stops
    # inside its backend until rank 1 has drawn, and rank 1 must still draw its own.
    compiling, drawn = threading.Event(), threading.Event()

    def waiting_backend(graph_module, example_inputs):
        compiling.set()
        assert drawn.wait(30)
        return graph_module.forward

    def body():
        torch.manual_seed(7)
        if dist.get_rank() == 0:
            torch.compile(lambda x: x.sin() * 2, backend=waiting_backend, fullgraph=True)(torch.ones(2))
            return torch.randn(3)
        assert compiling.wait(30)
        try:
            return torch.randn(3)
        finally:
            drawn.set()

    expected = torch.randn(3, generator=torch.Generator().manual_seed(7))
    for rank, drew in enumerate(threaded_world(2).run(body)):
        assert torch.equal(drew, expected), f"rank {rank} drew {drew}, a process seeded with 7 draws {expected}"


def test_a_skip_in_a_body_skips_the_test_as_in_processes():
    def body():
        if dist.get_rank() == 1:
            pytest.skip("rank 1 has no GPU")
        dist.barrier()  # the other ranks wait for rank 1, and are released

    with pytest.raises(pytest.skip.Exception, match="rank 1 has no GPU"):
        threaded_world(4).run(body)


PYTEST_MODULE_FAILING_IN_GROUP_CREATION = textwrap.dedent('''
    import threading
    from datetime import timedelta

    import pytest
    import torch.distributed as dist

    import meshstate
    from meshstate.testing import threaded_world
    from meshstate.testing.report import RankFailure


    def fail_on_one_while_others_build_a_mesh():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails")
        meshstate.init_mesh(tp=2)  # the others wait for rank 1 in the mesh build's agreement


    def fail_on_one_while_others_form_a_group():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails")
        dist.new_group([0, 1, 2, 3])  # the others wait for rank 1 in the group's creation


    @pytest.mark.parametrize("body", [fail_on_one_while_others_build_a_mesh,
                                      fail_on_one_while_others_form_a_group])
    def test_the_waiting_ranks_are_woken(body):
        with pytest.raises(RankFailure) as failed:
            threaded_world(4).run(body, timeout=timedelta(seconds=60))
        assert str(failed.value).splitlines()[0] == (
            f"{body.__name__}: rank 1 raised; ranks 0, 2-3 of 4 did not finish")
        assert not [t for t in threading.enumerate() if t.name.startswith("meshstate-rank")]
''')


def test_a_failure_during_group_creation_leaves_no_thread_and_the_process_exits_0(tmp_path):
    (tmp_path / "test_creation.py").write_text(PYTEST_MODULE_FAILING_IN_GROUP_CREATION)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_creation.py"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


def every_rank_fails_after_a_collective():
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == 0


def test_a_failure_every_rank_raises_is_every_rank_s_as_in_processes():
    # A rank that had passed the collective when the first failure released the run goes
    # on to raise its own (it was reported as "did not finish", its stack in the collective).
    for _ in range(5):  # the ranks race to their assertion: several runs, each the same
        with pytest.raises(RankFailure) as failed:
            threaded_world(8).run(every_rank_fails_after_a_collective)
        assert str(failed.value).splitlines()[:2] == [
            "every_rank_fails_after_a_collective: ranks 0-7 raised",
            "--- ranks 0-7: AssertionError ---"]


def test_a_local_world_inside_a_threaded_rank_is_refused_by_meshstate():
    from meshstate.testing.launch import LocalWorld

    refusal = ("--- ranks 0-1: MeshStateError: a local world cannot start or run inside a "
               "threaded world's rank: c10d's world is one per thread there, and its workers "
               "would fork from a rank; start it before or after the threaded world ---")
    with pytest.raises(RankFailure) as nested:
        threaded_world(2).run(lambda: LocalWorld(2))
    assert str(nested.value).splitlines()[1] == refusal
    with LocalWorld(2) as started_before:
        with pytest.raises(RankFailure) as nested:
            threaded_world(2).run(started_before.run, dist.get_rank)
        assert str(nested.value).splitlines()[1] == refusal
        assert started_before.run(dist.get_rank) == [0, 1]
