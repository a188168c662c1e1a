"""Every kind of test body people write, in every world: processes are the oracle.

Each kind runs once in ``local_world`` (a process per rank), once in ``threaded_world`` (a
thread per rank), which must give every rank what its process gets, and once in
``simulated_world`` (every rank in one program; stage by stage for pipelines), which must
give the same or refuse with a ``SimulationError`` naming the call, never a foreign
exception and never a different value. The bodies are in world_bodies.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from meshstate import SimulationError
from meshstate.megatron import install, uninstall
from meshstate.testing import local_world, simulated_world, threaded_world
from meshstate.testing.launch import LocalWorld
from meshstate.tools.bench.simulated import pipeline_step

import world_bodies as bodies


def each_ranks_lines(simulated: list[Any], processes: list[Any]) -> None:
    """Logging in one program: a line per group of ranks with one text, naming them."""
    for rank, (got, want) in enumerate(zip(simulated, processes, strict=True)):
        for line in want:
            named = [re.fullmatch(r"\[simulated ranks? ([\d, ]+)\] (.*)", text) for text in got]
            assert line in got or any(
                match and match[2] == line and rank in map(int, match[1].split(", ")) for match in named
            ), f"rank {rank}: {line!r} not among {got}"


@dataclass(frozen=True)
class Kind:
    """A kind of body: its function, arguments and world size, and what a simulated world
    does with it: ``None`` gives what processes give, a text is the start of the
    ``SimulationError`` it raises, a function checks its results against the processes'."""

    body: Callable[..., Any]
    args: tuple[Any, ...] = ()
    simulated: str | Callable[[list[Any], list[Any]], None] | None = None
    world_size: int = 4
    stages: int = 1
    in_a_folder: bool = False
    installs_megatron: bool = False


BRANCH = "a Python branch on a value that differs between the simulated ranks"
FORMAT = "a format (an f-string) of a value that differs between the simulated ranks"
COMPILE_OVER_SLICES = "torch.compile cannot trace this with every rank's values in one process"
KINDS = {
    "a slice at the rank": Kind(bodies.slices_at_a_rank),
    "narrow at the rank": Kind(bodies.narrow_at_a_rank),
    "chunk, split, tensor_split and unbind at the rank": Kind(bodies.parts_at_a_rank),
    "index_select at the rank": Kind(bodies.index_select_at_a_rank),
    "torch.tensor of ranks": Kind(bodies.tensors_made_of_ranks),
    "a seeded torch.Generator": Kind(bodies.seeded_generators),
    "torch.manual_seed": Kind(bodies.manual_seeds),
    "group membership queries": Kind(bodies.group_queries),
    "ProcessGroup.rank()": Kind(bodies.process_group_rank),
    "an f-string of a rank": Kind(bodies.f_string_of_a_rank, simulated=FORMAT),
    "logging a rank": Kind(bodies.logs_each_rank, simulated=each_ranks_lines),
    "fully_shard (FSDP2)": Kind(bodies.fsdp_step),
    "DistributedDataParallel": Kind(
        bodies.ddp_step, simulated="DistributedDataParallel in a simulated world: its C++ reducer"),
    "assert_close and allclose": Kind(bodies.comparisons),
    "all_gather_object and broadcast_object_list": Kind(bodies.object_collectives),
    "loss.item()": Kind(bodies.loss_items),
    "a TP step": Kind(bodies.tp_step),
    "a TP step compiled by dynamo": Kind(bodies.tp_step, ("eager",)),
    "a JAX-style TP step compiled, seeded in the body": Kind(
        bodies.jax_style_tp_step_compiled, simulated=COMPILE_OVER_SLICES),
    "a 1F1B pipeline schedule": Kind(pipeline_step, (2, 2), world_size=8, stages=2),
    "send and recv between stages": Kind(bodies.point_to_point, world_size=8, stages=2),
    "a ring of send and recv": Kind(bodies.send_receive_and_ring, simulated=BRANCH),
    "torch.distributed.checkpoint": Kind(bodies.dcp_save_and_load, simulated=BRANCH, in_a_folder=True),
    "megatron-core's layers": Kind(bodies.megatron_core_layers, simulated=BRANCH, installs_megatron=True),
    "ring attention with an if on the block index": Kind(bodies.ring_attention, simulated=BRANCH),
    "printing a rank and a loss": Kind(bodies.prints, simulated=FORMAT),
    "torch's and meshstate's collectives": Kind(bodies.collectives_on_a_tp_mesh),
    "the Megatron getters": Kind(bodies.megatron_getters_per_rank, simulated=BRANCH),
}


def run_in(world: str, kind: Kind, folder: Path) -> list[Any]:
    args = (folder / world,) if kind.in_a_folder else kind.args
    if world == "processes":
        if kind.installs_megatron:  # its workers install, so they are not the pooled ones
            with LocalWorld(kind.world_size) as fresh:
                return fresh.run(kind.body, *args)
        return local_world(kind.world_size).run(kind.body, *args)
    one_process = (threaded_world(kind.world_size) if world == "threads"
                   else simulated_world(kind.world_size, stages=kind.stages))
    if not kind.installs_megatron:
        return one_process.run(kind.body, *args)
    install()  # the body installs in this process too: uninstalled here, whatever it raised
    try:
        return one_process.run(kind.body, *args)
    finally:
        uninstall()


@pytest.fixture
def processes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The kind's results in processes, once for both one-process worlds."""
    name = request.node.callspec.params["name"]
    if name not in _IN_PROCESSES:
        _IN_PROCESSES[name] = run_in("processes", KINDS[name], tmp_path_factory.mktemp("processes"))
    return _IN_PROCESSES[name]


_IN_PROCESSES: dict[str, list[Any]] = {}


@pytest.fixture(autouse=True)
def _megatron_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core's CUDA tuning hint


def assert_same(got: Any, want: Any, path: str) -> None:
    """The same types and values; tensors and floats within float tolerance (the worlds may
    reduce in different orders)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__}, processes {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, msg=lambda message: f"{path}: {message}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for index, (one, other) in enumerate(zip(got, want)):
            assert_same(one, other, f"{path}[{index}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-12), f"{path}: {got}, processes {want}"
    else:
        assert got == want, f"{path}: {got!r}, processes {want!r}"


@pytest.mark.parametrize("name", list(KINDS))
def test_threads_give_every_rank_what_its_process_gets(name: str, processes: list[Any], tmp_path: Path) -> None:
    threads = run_in("threads", KINDS[name], tmp_path)
    for rank, (got, want) in enumerate(zip(threads, processes, strict=True)):
        assert_same(got, want, f"rank {rank}")


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
@pytest.mark.parametrize("name", list(KINDS))
def test_one_program_gives_what_processes_give_or_refuses_by_name(
    name: str, processes: list[Any], tmp_path: Path
) -> None:
    kind = KINDS[name]
    if isinstance(kind.simulated, str):
        with pytest.raises(SimulationError) as refused:
            run_in("simulated", kind, tmp_path)
        assert str(refused.value).startswith(kind.simulated), str(refused.value)
        return
    simulated = run_in("simulated", kind, tmp_path)
    if kind.simulated is None:
        for rank, (got, want) in enumerate(zip(simulated, processes, strict=True)):
            assert_same(got, want, f"rank {rank}")
    else:
        kind.simulated(simulated, processes)
