"""A world simulated stage by stage: each pipeline stage's ranks simulated in a process of its
own, point-to-point between stages real. (A 1F1B step and every way of sending between
stages, equal to processes rank by rank, are in test_every_world.py.)

``simulated_world(8, stages=2)`` runs ranks 0-3 and ranks 4-7 as two programs; with
``init_mesh(tp=2, pp=2)`` (pp outermost, Megatron's default order) each is a pipeline
stage. Every rank's answers are compared with what its own process gets
(``local_world(8)``) or with one process's computation of the whole model.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import SimulationError
from meshstate.errors import MeshStateError
from meshstate.simulation import local_compat
from meshstate.testing import distributed, fake_world, local_world, simulated_world
from meshstate.tools.bench.simulated import (
    SimulatedCheckRow,
    format_simulated_checks,
    pipeline_expected,
    pipeline_step,
)
from meshstate.tools.cli import main
from meshstate.tools.verify import PIPELINE_SENDS, KindSummary, verify_every_rank


MADE_OUTSIDE = torch.tensor([7, 8, 9])
"""Made outside the bodies: every rank holds the same."""


def test_a_1f1b_step_of_64_ranks_in_four_stages_equals_one_process() -> None:
    # pp=4 tp=2 dp=8: the meshstate bench times the same step at 1,024 ranks (pp=4 tp=8 dp=32).
    got = simulated_world(64, stages=4).run(pipeline_step, 2, 4)
    torch.testing.assert_close(got, pipeline_expected(64, 2, 4))


def _a_dtensor_backward() -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = meshstate.init_mesh(tp=2)
    weight = distribute_tensor(torch.ones(2, 2), mesh["tp"], [Replicate()]).requires_grad_()
    (weight * 2).to_local().sum().backward()


def test_stages_run_autograd_after_a_dtensor_backward_in_the_caller() -> None:
    # torch 2.14: a process forked after a DTensor backward cannot run autograd ("Unable to
    # handle autograd's threading in combination with fork-based multiprocessing")
    simulated_world(2).run(_a_dtensor_backward)
    got = simulated_world(16, stages=2).run(pipeline_step, 2, 2)
    torch.testing.assert_close(got, pipeline_expected(16, 2, 2))


@distributed(world_size=4, simulate=True, stages=2)
def test_a_decorated_test_runs_stage_by_stage() -> None:
    mesh = meshstate.init_mesh(pp=2)
    mine = torch.full((1,), dist.get_rank())
    if mesh.is_first("pp"):
        dist.send(mine, dst=mesh.next_rank("pp"))
    else:
        dist.recv(mine, src=mesh.prev_rank("pp"))
    assert torch.equal(mine, torch.full((1,), dist.get_rank() % 2))


def test_a_decorated_staged_test_runs_after_a_dtensor_backward_in_its_process() -> None:
    simulated_world(2).run(_a_dtensor_backward)
    test_a_decorated_test_runs_stage_by_stage()  # its body, imported by name in the stages


def test_stages_without_simulate_are_refused_in_one_line() -> None:
    with pytest.raises(MeshStateError, match=r"^stages=2 splits a simulated world; add simulate=True$"):
        distributed(4, stages=2)


def _listed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: value.tolist() if isinstance(value, torch.Tensor) else value
             for name, value in result.items()} for result in results]


def average_over_pp() -> torch.Tensor:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    mine = torch.tensor([dist.get_rank()], dtype=torch.float)
    dist.all_reduce(mine, op=dist.ReduceOp.AVG, group=mesh.group("pp"))  # gloo has no AVG
    return mine


def test_an_average_over_pp_divides_by_the_group_size() -> None:
    assert [value.item() for value in simulated_world(8, stages=2).run(average_over_pp)] == [
        2.0, 3.0, 4.0, 5.0, 2.0, 3.0, 4.0, 5.0]


def mesh_answers() -> dict[str, Any]:
    """What each rank's own process answers, and what a body asks per rank in its stage."""
    mesh = meshstate.init_mesh(tp=2, pp=2, ep=2, etp=1)
    rank, tp = dist.get_rank(), mesh.group("tp")
    partners: list[Any] = [None, None]
    dist.all_gather_object(partners, {"rank": rank}, group=tp)
    first: list[Any] = [rank]
    dist.broadcast_object_list(first, group=tp, group_src=0)
    mine = torch.tensor([rank])
    torch.testing.assert_close(mine, torch.tensor([rank]))
    logging.getLogger(__name__).warning("rank %s of stage %s", rank, mesh.rank("pp"))
    return {"all_gather_object over tp": partners, "broadcast_object_list over tp": first,
            "equal": torch.equal(mine, torch.tensor([rank])), "allclose": mine.allclose(mine),
            "rank": {key: mesh.rank(key) for key in mesh.kinds},
            "ranks": {key: mesh.ranks(key) for key in mesh.kinds},
            "coordinate": mesh.coordinate, "get_rank()": dist.get_rank(),
            "get_rank(pp)": dist.get_rank(mesh.group("pp")),
            "pp group": dist.get_process_group_ranks(mesh.group("pp")),
            "DeviceMesh local rank": {key: mesh[key].get_local_rank() for key in ("tp", "dp", "pp")}}


def test_each_stage_answers_for_its_own_ranks_as_their_processes_do() -> None:
    assert simulated_world(8, stages=2).run(mesh_answers) == local_world(8).run(mesh_answers)


def reduce_scatter_over_pp() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(2), group=mesh.group("pp"))


def gather_over_pp() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1), group=mesh.group("pp"))


def send_inside_a_stage() -> None:
    meshstate.init_mesh(tp=2, pp=2)
    dist.send(torch.ones(1), dst=dist.get_rank() + 1)


def send_to_one_rank() -> None:
    meshstate.init_mesh(tp=2, pp=2)
    if dist.get_rank() < 4:
        dist.send(torch.ones(1), dst=4)


def pp_not_outermost() -> None:
    meshstate.init_mesh("tp-cp-ep-pp-dp", tp=2, pp=2)


def no_pipeline() -> None:
    meshstate.init_mesh(tp=2)


def mesh_of_named_axes() -> None:
    meshstate.make_mesh((2, 4), ("stage", "rest"))


def objects_over_pp() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.all_gather_object([None, None], dist.get_rank(), group=mesh.group("pp"))


def broadcast_objects_over_pp() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.broadcast_object_list([dist.get_rank()], group=mesh.group("pp"), group_src=0)


def and_over_pp() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.all_reduce(torch.tensor([dist.get_rank()]), op=dist.ReduceOp.BAND, group=mesh.group("pp"))


def recv_into_a_tensor_made_outside() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.recv(MADE_OUTSIDE, group=mesh.group("pp"), group_src=1 - mesh.rank("pp"))


def send_shapes_that_differ() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    dist.send(torch.zeros(mesh.rank("tp") + 1), group=mesh.group("pp"), group_dst=1 - mesh.rank("pp"))


def recv_from_any_source() -> None:
    meshstate.init_mesh(tp=2, pp=2)
    dist.recv(torch.zeros(1))


@pytest.mark.parametrize(("body", "says"), [
    (reduce_scatter_over_pp, r"reduce_scatter_base over the 'pp' group \(a group such as \[0, 4\]\) in stage [01] "
                        r"\(ranks [04]-[37]\) of a world simulated in stages"),
    (gather_over_pp, r"allgather_base over the 'pp' group"),
    (send_inside_a_stage, r"send in stage [01] \(ranks [04]-[37]\) to ranks \+1 away: a world "
                          r"simulated in stages sends only between stages"),
    (send_to_one_rank, r"send in stage 0 \(ranks 0-3\) of a world simulated in stages: the ranks' "
                       r"peers \(0 -> 4, 1 -> 4, 2 -> 4, 3 -> 4, …\) are not each rank's own"),
    (pp_not_outermost, r"a world simulated in 2 stages of 4 ranks needs pp=2 as the mesh's outermost "
                       r"axis, so that a pp group holds one rank of each stage \(0, 4\), as "
                       r"Megatron's default order tp-cp-ep-dp-pp has it; this mesh has pp groups "
                       r"like \[0, 2\]"),
    (no_pipeline, r"a world simulated in 2 stages .* this mesh has pp groups like \[0\]\n"),
    (mesh_of_named_axes, r"a world simulated in 2 stages .* this mesh has no 'pp' axis\n"),
    (objects_over_pp, r"all_gather_object over the group of ranks \[[04], [48]\]: ranks \[[04], "),
    (broadcast_objects_over_pp, r"broadcast_object_list over the group of ranks \[[04], [48]\]"),
    (and_over_pp, r"all_reduce with .*BAND.* over the 'pp' group across stages"),
    (recv_into_a_tensor_made_outside, r"recv into a tensor of shape \(3,\) that the simulated "
                                      r"ranks share"),
    (send_shapes_that_differ, r"send of a tensor whose shape differs between the simulated ranks "
                              r"\(\(1,\), \(2,\)\)"),
    (recv_from_any_source, r"recv without a peer \(from any source\)"),
])
def test_what_crosses_stages_otherwise_is_refused_by_name(body: Any, says: str) -> None:
    with pytest.raises(SimulationError, match="^" + says):
        simulated_world(8, stages=2).run(body)


@pytest.mark.parametrize("stages", [3, 0, True, 2.0])
def test_stages_that_do_not_split_the_world_are_refused_in_one_line(stages: Any) -> None:
    with pytest.raises(SimulationError) as refused:
        simulated_world(8, stages=stages)
    assert str(refused.value) == (
        f"stages={stages!r} does not split a world of 8 ranks into blocks of equal size: give a "
        "positive integer that divides the world size")


def test_a_simulation_of_ranks_that_are_no_stage_is_refused() -> None:
    with fake_world(0, 4), local_compat.local_tensor_mode(frozenset({0, 2})):
        with pytest.raises(SimulationError, match="^torch's LocalTensorMode simulates 2 of the "
                           "world's 4 ranks; init_mesh simulates the whole world, or one stage of it"):
            meshstate.init_mesh()


def fails_in_stage_one() -> None:
    if dist.get_rank() >= 4:  # every rank of stage 1 (one program), none of stage 0
        raise ValueError("stage one's own error")
    torch.zeros(1)


def dies_in_stage_one() -> None:
    if dist.get_rank() >= 4:
        os._exit(3)


def fails_before_it_sends() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    if mesh.rank("pp") == 1:
        raise ValueError("stage one never sends")
    dist.recv(torch.zeros(1), group=mesh.group("pp"), group_src=1)  # waits for stage 1


def test_a_stages_error_is_raised_not_the_error_of_a_stage_waiting_for_it() -> None:
    for _ in range(3):
        with pytest.raises(ValueError, match="stage one never sends"):
            simulated_world(8, stages=2).run(fails_before_it_sends)


def fails_unpicklably() -> None:
    raise RuntimeError(lambda: "a lambda does not pickle")


def test_a_stages_error_is_raised_here_naming_the_stage() -> None:
    with pytest.raises(ValueError, match="stage one's own error") as raised:
        simulated_world(8, stages=2).run(fails_in_stage_one)
    assert raised.value.__notes__[0].startswith("raised in the process of stage 1 (ranks 4-7):\n")
    with pytest.raises(SimulationError, match=r"the process of stage 1 \(ranks 4-7\) ended without "
                                              r"a result \(exit code 3\)"):
        simulated_world(8, stages=2).run(dies_in_stage_one)
    with pytest.raises(SimulationError, match="^RuntimeError: <function fails_unpicklably"):
        simulated_world(8, stages=2).run(fails_unpicklably)


def test_check_simulates_stages_and_checks_the_pp_send_and_recv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--simulate", "--stages", "2", "--world-size", "16", "--tp", "2",
                 "--pp", "2", "--ep", "2", "--etp", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == ("meshstate check: 16 ranks (simulated in 2 stages), order tp-cp-ep-dp-pp, "
                        "tp=2 cp=1 ep=2 etp=1 pp=2 dp=4 edp=4")
    assert "tp-pp           4       4  ok" in table  # an all_reduce and all_gather across stages
    assert "pp p2p          2       8  ok" in table
    assert table[-1] == "all 14 group kinds and the pp send/recv verified on 16 ranks"


def test_check_refuses_stages_without_simulate_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["check", "--stages", "2"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "meshstate check: error: argument --stages: needs --simulate\n"


def verify_with_tp_given_as_pp() -> list[KindSummary]:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    mesh._group_of["pp"] = mesh._group_of["tp"]
    return verify_every_rank(mesh)


def test_a_wrong_pp_group_fails_the_pp_send_and_recv() -> None:
    for stage, rows in enumerate(simulated_world(8, stages=2).call(verify_with_tp_given_as_pp)):
        sends = {row.key: row for row in rows}[PIPELINE_SENDS]
        assert sends.failed_ranks == tuple(range(4 * stage, 4 * stage + 4))
        assert sends.first_problem.startswith(
            f"send in stage {stage} (ranks {4 * stage}-{4 * stage + 3}) of a world simulated in "
            "stages: the ranks' peers")  # tp's second member: 0 -> 1, 1 -> 1, 2 -> 3, ...


BENCH = ["bench", "--world-sizes", "16", "--tp", "2", "--cp", "1", "--pp", "2", "--ep", "2",
         "--etp", "1", "--repeat", "1", "--processes", "0", "--without-megatron",
         "--without-torchtitan", "--without-runtime", "--harness-tests", "0", "--compile-ranks", "0",
         "--checkpoint-ranks", "0", "--json"]


def test_bench_times_a_1f1b_step_simulated_in_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BENCH, "--simulated-checks", "0", "--simulated-pipeline", "32"]) == 0
    rows = json.loads(capsys.readouterr().out)["simulated_check_rows"]
    assert [(row["world_size"], row["step"], row["verified"]) for row in rows] == [
        (32, "1F1B step in 4 stages, tp=8 pp=4 dp=1", True)]
    assert rows[0]["seconds"] > 0 and rows[0]["peak_rss_mib"] > 0
    table = format_simulated_checks([SimulatedCheckRow(**row) for row in rows], dict(tp=2, cp=2, pp=2))
    assert table.splitlines()[-2:] == [
        "1F1B step in 4 stages, tp=8 pp=4 dp=1 (a process per stage, each simulating its ranks), "
        "in a fresh process; peak resident memory of a stage's process:",
        f"     32 ranks {rows[0]['seconds']:>8.2f} s  peak {rows[0]['peak_rss_mib']:>7.0f} MiB  "
        "equal to one process"]


SIGNALLED_STAGES = """
import os, sys, time
from meshstate.testing import simulated_world

def body(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(120)

simulated_world(4, stages=2).run(body, sys.argv[1])
"""


def test_a_stage_process_ends_with_its_caller(tmp_path: Any) -> None:
    """A caller killed mid-run, even by SIGKILL (no handler of its runs), leaves no stage
    process behind."""
    import signal
    import subprocess
    import sys
    import time

    pids, temporary = tmp_path / "pids", tmp_path / "tmp"  # the killed run's store folder: pytest's
    pids.mkdir()
    temporary.mkdir()
    caller = subprocess.Popen([sys.executable, "-c", SIGNALLED_STAGES, str(pids)],
                              env={**os.environ, "PYTHONPATH": os.getcwd(), "TMPDIR": str(temporary)})
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    stages = [int(name) for name in os.listdir(pids)]
    assert len(stages) == 2
    caller.send_signal(signal.SIGKILL)
    caller.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in stages):
        assert time.monotonic() < deadline, f"stage processes {stages} outlived their caller"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False



def sleeps_in_stage_one() -> int:
    if meshstate.init_mesh(tp=2, pp=2).rank("pp") == 1:
        import time

        time.sleep(120)
    return dist.get_rank()


def test_stages_that_do_not_finish_within_the_timeout_are_ended_and_named() -> None:
    from datetime import timedelta

    from meshstate.testing.report import RankTimeout

    with pytest.raises(RankTimeout, match=r"^sleeps_in_stage_one: ranks 4-7 of 8 did not finish "
                                          r"within 3 s \(simulated in the process of stage 1, now "
                                          r"ended\)$"):
        simulated_world(8, stages=2).run(sleeps_in_stage_one, timeout=timedelta(seconds=3))


def broadcasts_over_pp() -> list[torch.Tensor]:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    mine = torch.full((2,), dist.get_rank(), dtype=torch.float)
    from_last, from_four = mine.clone(), mine.clone()
    dist.broadcast(from_last, group=mesh.group("pp"), group_src=1)
    dist.broadcast(from_four, src=4, group=mesh.group("pp"))  # rank 0's group: ranks 0 and 4
    return [from_last, from_four]


def test_a_broadcast_over_pp_reaches_every_stage_as_in_processes() -> None:
    """A loss broadcast from the last stage, as a pipelined training loop does."""
    for rank, got in enumerate(simulated_world(8, stages=2).run(broadcasts_over_pp)):
        peer = torch.full((2,), rank % 4 + 4, dtype=torch.float)  # the pp group {r, r + 4}
        assert torch.equal(got[0], peer) and torch.equal(got[1], peer), f"rank {rank}: {got}"
