"""Every rank in one process: each rank-dependent answer of a simulated world (torch's
LocalTensorMode) equals the one that rank gets in a world of processes."""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import meshstate
from meshstate.errors import SimulationError
from meshstate.core.groups import create_group_family
from meshstate.core.one_rank import index_when_run
from meshstate.megatron import parallel_state as mpu
from meshstate.testing import distributed, local_world, simulated_world

LAYOUTS = {
    "dense": dict(tp=2, cp=2),
    "expert": dict(tp=2, pp=2, ep=2, etp=1),
    "hsdp": dict(tp=2, dp_replicate=2),
}
ORDERED = [("cp", "dp"), ("pp", "tp"), "tp", ("dp", "tp")]


def _by_key(mesh: meshstate.ParallelMesh, ask: Any) -> dict[str, Any]:
    return {key: ask(key) for key in mesh.kinds}


CORE_VALUES = {
    "global_rank": lambda mesh: mesh.global_rank,
    "rank": lambda mesh: _by_key(mesh, mesh.rank),
    "rank_in": lambda mesh: _by_key(mesh, mesh.rank),
    "ranks": lambda mesh: _by_key(mesh, mesh.ranks),
    "coordinate": lambda mesh: mesh.coordinate,
    "next_rank": lambda mesh: _by_key(mesh, mesh.next_rank),
    "prev_rank": lambda mesh: _by_key(mesh, mesh.prev_rank),
    "first_rank": lambda mesh: _by_key(mesh, mesh.first_rank),
    "last_rank": lambda mesh: _by_key(mesh, mesh.last_rank),
    "is_first": lambda mesh: _by_key(mesh, mesh.is_first),
    "is_last": lambda mesh: _by_key(mesh, mesh.is_last),
    "ordered index": lambda mesh: {axes: mesh.ordered(axes).index for axes in ORDERED},
    "ordered ranks": lambda mesh: {axes: mesh.ordered(axes).ranks for axes in ORDERED},
    "tables": lambda mesh: _by_key(mesh, lambda key: mesh.tables.rank[key]),
    "get_rank(group)": lambda mesh: _by_key(mesh, lambda key: dist.get_rank(mesh.group(key))),
    "DeviceMesh local rank": lambda mesh: {
        key: mesh[key].get_local_rank() for key in ("tp", "dp", "dp-cp", "tp-dp", "pp")
    },
    "DeviceMesh coordinate": lambda mesh: tuple(mesh.dense.get_coordinate()),  # torch simulates a list
    "torch.distributed.get_rank()": lambda mesh: dist.get_rank(),
}


def core_answers(sizes: dict[str, int]) -> dict[str, Any]:
    """Every rank-dependent value of the core, as the calling rank sees it."""
    mesh = meshstate.init_mesh(**sizes)
    return {name: value(mesh) for name, value in CORE_VALUES.items()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def both_worlds(request: pytest.FixtureRequest) -> tuple[list[Any], list[Any]]:
    sizes = LAYOUTS[request.param]
    return simulated_world(8).run(core_answers, sizes), local_world(8).run(core_answers, sizes)


@pytest.mark.parametrize("name", list(CORE_VALUES))
def test_core_value_per_simulated_rank(name: str, both_worlds: tuple[list[Any], list[Any]]) -> None:
    simulated, processes = both_worlds
    assert [answers[name] for answers in simulated] == [answers[name] for answers in processes]


MEGATRON_LAYOUTS = {
    "tp pp ep": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                     expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "tp cp": dict(tensor_model_parallel_size=2, context_parallel_size=2),
}
MEGATRON_VALUES = {
    name: getattr(mpu, name)
    for name in (
        "get_tensor_model_parallel_rank", "get_pipeline_model_parallel_rank",
        "get_data_parallel_rank", "get_context_parallel_rank",
        "get_tensor_and_context_parallel_rank", "get_expert_model_parallel_rank",
        "get_expert_tensor_parallel_rank", "get_expert_tensor_and_model_parallel_rank",
        "get_expert_data_parallel_rank", "is_pipeline_first_stage", "is_pipeline_last_stage",
        "get_tensor_model_parallel_src_rank", "get_model_parallel_src_rank",
        "get_data_parallel_src_rank", "get_expert_model_parallel_src_rank",
        "get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_last_rank",
        "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
        "get_context_parallel_global_ranks",
    )
}
MEGATRON_VALUES.update({
    "get_data_parallel_rank(with_context_parallel=True)":
        lambda: mpu.get_data_parallel_rank(with_context_parallel=True),
    "get_data_parallel_src_rank(with_context_parallel=True)":
        lambda: mpu.get_data_parallel_src_rank(with_context_parallel=True),
    "get_data_parallel_rank(True, partial_data_parallel=True)":
        lambda: mpu.get_data_parallel_rank(True, partial_data_parallel=True),
})


def megatron_answers(arguments: dict[str, int]) -> dict[str, Any]:
    """Every rank-dependent Megatron getter, as the calling rank sees it."""
    mpu.initialize_model_parallel(**arguments)
    return {name: getter() for name, getter in MEGATRON_VALUES.items()}


@pytest.fixture(scope="module", params=list(MEGATRON_LAYOUTS))
def megatron_worlds(request: pytest.FixtureRequest) -> tuple[list[Any], list[Any]]:
    arguments = MEGATRON_LAYOUTS[request.param]
    return (simulated_world(8).run(megatron_answers, arguments),
            local_world(8).run(megatron_answers, arguments))


@pytest.mark.parametrize("name", list(MEGATRON_VALUES))
def test_megatron_getter_per_simulated_rank(
    name: str, megatron_worlds: tuple[list[Any], list[Any]]
) -> None:
    simulated, processes = megatron_worlds
    assert [answers[name] for answers in simulated] == [answers[name] for answers in processes]


TITAN_LAYOUTS = {
    "hsdp tp": dict(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, ep=1),
    "fsdp cp tp ep": dict(dp_replicate=1, dp_shard=-1, cp=2, tp=2, pp=1, ep=2),
}


def titan_answers(sizes: dict[str, int]) -> dict[str, Any]:
    """Each torchtitan DeviceMesh's local rank and coordinate, as the calling rank sees them."""
    from meshstate.titan import ParallelDims

    dims = ParallelDims(**sizes, world_size=8)
    meshes = dims.get_all_one_dimensional_meshes()
    answers = {f"{name} local rank": mesh.get_local_rank() for name, mesh in meshes.items()}
    answers.update({f"{name} coordinate": tuple(mesh.get_coordinate()) for name, mesh in meshes.items()})
    answers["world coordinate"] = tuple(dims.world_mesh.get_coordinate())
    return answers


@pytest.mark.parametrize("layout", list(TITAN_LAYOUTS))
def test_titan_meshes_per_simulated_rank(layout: str) -> None:
    sizes = TITAN_LAYOUTS[layout]
    assert simulated_world(8).run(titan_answers, sizes) == local_world(8).run(titan_answers, sizes)


def collectives_and_getters() -> dict[str, Any]:
    """A body that runs unchanged in both worlds: Megatron's getters, mesh queries and
    collectives over an axis, a joint key and an undeclared axis tuple."""
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    mesh = mpu.get_mesh()
    rank = torch.full((1,), dist.get_rank(), dtype=torch.float)
    summed = {}
    for key in ("tp", "dp-cp"):
        value = rank.clone()
        dist.all_reduce(value, group=mesh.group(key))
        summed[key] = value
    value = rank.clone()
    dist.all_reduce(value, group=mesh.ordered(("cp", "dp")).group)
    summed["(cp, dp)"] = value
    gathered = [torch.empty(1) for _ in range(mpu.get_context_parallel_world_size())]
    dist.all_gather(gathered, rank, group=mpu.get_context_parallel_group())
    return {
        "summed": summed, "gathered": gathered, "tp": mpu.get_tensor_model_parallel_rank(),
        "dp-cp": mpu.get_data_parallel_rank(with_context_parallel=True),
        "first stage": mpu.is_pipeline_first_stage(), "dp ranks": mesh.ranks("dp"),
        "axis index": mesh.ordered(("cp", "dp")).index, "coordinate": mesh.coordinate,
    }


def test_a_body_gives_every_rank_what_processes_give() -> None:
    simulated = simulated_world(8).run(collectives_and_getters)
    processes = local_world(8).run(collectives_and_getters)
    assert [repr(answers) for answers in simulated] == [repr(answers) for answers in processes]


@distributed(world_size=8, simulate=True)
def test_simulated_decorator_gives_every_rank_its_values() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    expected_tp = torch.full((1,), dist.get_rank(), dtype=torch.long) % 2
    assert torch.equal(torch.full((1,), mesh.rank("tp"), dtype=torch.long), expected_tp)
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.group("dp"))
    assert total.item() == 2  # every rank holds 2: the answer is the same on all


KEPT: list[object] = []


def left_alive() -> None:
    KEPT.append(meshstate.init_mesh(tp=2))  # alive whatever the garbage collector does
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)


def test_meshes_left_alive_are_destroyed_after_a_run() -> None:
    simulated_world(4).run(left_alive)
    KEPT.clear()
    assert not mpu.is_initialized()
    assert not dist.is_initialized()


def branch_on_rank() -> None:
    mesh = meshstate.init_mesh(tp=2)
    if mesh.is_first("tp"):
        pass


def int_of_rank() -> None:
    list(range(meshstate.init_mesh(tp=2).rank("tp")))


def send_to_next() -> None:
    dist.send(torch.ones(1), dst=1)


def group_of_some_ranks() -> None:
    dist.new_group([0, 1])


def mesh_over_some_ranks() -> None:
    meshstate.init_mesh(tp=2, ranks=range(4))


def megatron_group_of_some_ranks() -> None:
    mpu.create_group([0, 1])


def family_read_past_the_world() -> None:
    create_group_family([[0, 1, 3, 4], [2, 5, 6, 7]], description="odd")


def irregular_family() -> None:
    create_group_family([[0, 1, 3, 5], [2, 4, 6, 7]], description="odd")


def subgroups_read_otherwise() -> None:
    dist.new_subgroups_by_enumeration([[0, 1], [2, 4], [3, 5], [6, 7]])


def embedding_group_of_some_stages() -> None:
    mpu.initialize_model_parallel(pipeline_model_parallel_size=4)
    mpu.get_embedding_group()


def adopt_groups() -> None:
    meshstate.adopt({})


def float_list_of_every_rank() -> None:
    torch.full((1,), dist.get_rank(), dtype=torch.float).tolist()


def compiled_shard_map(backend: str) -> torch.Tensor:
    """A shard_map's block of a tensor and its axis index, compiled whole on ``backend``."""
    from meshstate.jax import collectives as lax

    with meshstate.init_mesh(tp=2):
        step = meshstate.shard_map(lambda x: x * 2 + lax.axis_index("tp"), in_specs=meshstate.P("tp"),
                                   out_specs=meshstate.P("tp"))
        block: torch.Tensor = torch.compile(step, fullgraph=True, backend=backend)(torch.arange(4.0)).to_local()
        return block


def compile_a_shard_map_through_aot_autograd() -> None:
    compiled_shard_map("aot_eager")


def test_a_compiled_shard_map_is_one_graph_torch_runs_for_every_rank() -> None:
    """Dynamo traces a graph that carries no rank (the block and the index are read when it
    runs), which torch's simulation runs for every rank: each rank's block, doubled, plus its
    tp index."""
    blocks = simulated_world(8).run(compiled_shard_map, "eager")
    expected = [torch.tensor([0.0, 2.0]), torch.tensor([5.0, 7.0])] * 4
    assert all(torch.equal(got, want) for got, want in zip(blocks, expected, strict=True)), blocks


def gathered_compiled_with_the_simulation_left_on() -> torch.Tensor:
    """A DTensor sharded over dp and tp gathered whole (DTensor's planner reads the rank's
    mesh coordinate), compiled while the simulation's mode stays on the dispatch stack
    (dynamo takes it off while it compiles; here it does not, as when something puts it
    back during the trace)."""
    from contextlib import nullcontext

    from torch._dynamo import convert_frame
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = meshstate.init_mesh(tp=2)
    sharded = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh["dp", "tp"], [Shard(0), Shard(1)])
    torch._dynamo.reset()
    taken_off = convert_frame._disable_current_modes
    convert_frame._disable_current_modes = nullcontext
    try:
        whole: torch.Tensor = torch.compile(lambda d: d.full_tensor() * 2, fullgraph=True, backend="eager")(sharded)
    finally:
        convert_frame._disable_current_modes = taken_off
    return whole


def test_a_compile_does_not_depend_on_dynamo_taking_the_simulation_off_the_stack() -> None:
    """Dynamo's fake run meets the simulation's mode only where something put the mode back
    on the stack while dynamo compiles (CI saw it after other tests, never alone): then it
    read each rank's mesh coordinate from fake tensors ("Could not guard on data-dependent
    expression Eq(u0, 0)"). Ops that meet it while a tracer is at work pass it by."""
    expected = torch.arange(16.0).reshape(4, 4) * 2
    wholes = simulated_world(4).run(gathered_compiled_with_the_simulation_left_on)
    assert all(torch.equal(whole, expected) for whole in wholes), wholes


def index_read_under_a_fake_mode() -> str:
    group = meshstate.init_mesh(tp=2).ordered("tp")
    with FakeTensorMode():
        index = index_when_run(group)
    return type(index).__name__ if isinstance(index, FakeTensor) else repr(index)


def test_a_meshstate_op_under_a_fake_mode_gives_a_fake_tensor() -> None:
    """A rank-free graph's op (the group index it reads when it runs) called where a fake
    mode is on, as in dynamo's run on fake tensors, answers with its fake kernel on every
    rank: the simulation ran its real kernel there, each rank's index, past the fake mode."""
    assert simulated_world(4).run(index_read_under_a_fake_mode) == ["FakeTensor"] * 4


@pytest.mark.parametrize(("body", "says"), [
    (branch_on_rank, "a Python branch on a value that differs between the simulated ranks (True on ranks 0, 2"),
    (int_of_rank, "int() or bool() of a value that differs between the simulated ranks (0 on ranks 0, 2"),
    (send_to_next, "torch.distributed.send in a simulated world"),
    (group_of_some_ranks, "new_group(ranks=[0, 1]) in a simulated world of 8 ranks"),
    (mesh_over_some_ranks, "init_mesh(ranks=...) over 4 of 8 ranks in a simulated world"),
    (megatron_group_of_some_ranks, "over the 'group' groups on ranks such as [2, 3], which are no"),
    (family_read_past_the_world, "over the 'odd' groups on ranks such as [6, 7, 9, 10], which"),
    (irregular_family, "collective over ranks [0, 1, 3, 5]: they are no regular grid"),
    (subgroups_read_otherwise, "over the 'subgroups' groups on ranks such as [2, 3], which are no"),
    (embedding_group_of_some_stages, "simulated ranks 2, 3, 4, 5 are in no 'pp/embedding' group"),
    (adopt_groups, "adopt() cannot run in a simulated world"),
    (float_list_of_every_rank, "cannot run this (RuntimeError: Cannot convert local tensor to list)"),
    (compile_a_shard_map_through_aot_autograd, "dynamo traced one graph for every rank, which its backend could not compile"),
])
def test_what_the_simulation_cannot_do_says_so(body: Any, says: str) -> None:
    with pytest.raises(SimulationError, match="local_world") as raised:
        simulated_world(8).run(body)
    assert says in str(raised.value)
    assert not dist.is_initialized()


@distributed(world_size=8, simulate=True)
def test_a_group_compares_with_what_each_rank_expects() -> None:
    mesh = meshstate.init_mesh(tp=2, pp=2)
    rank = dist.get_rank()
    assert mesh.ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.ranks("pp") == mesh.ordered("pp").ranks
    assert mesh.rank("tp") == rank % 2


def items_and_equality() -> dict[str, Any]:
    value = torch.full((1,), dist.get_rank())
    return {"item": value.item(), "item is 0": value.item() == 0,
            "equal to 0": torch.equal(value, torch.zeros(1, dtype=torch.long))}


def meshes_one_after_another() -> list[tuple[int, ...]]:
    """Each rank's coordinates in meshes of two shapes made in turn, each gone before the
    next is made: the next often takes the dead one's address."""
    coordinates = []
    for turn in range(60):
        shape = (4,) if turn % 2 == 0 else (2, 2)
        names = ("x", "y")[: len(shape)]
        mesh = meshstate.make_mesh(shape, names)
        device_mesh = mesh[names]
        coordinates.append(tuple(device_mesh.get_local_rank(name) for name in names))
        mesh.destroy()
        del mesh, device_mesh
        gc.collect()
    return coordinates


def test_a_mesh_made_where_a_dead_one_was_gets_its_own_coordinates() -> None:
    """torch 2.13 keeps a simulated mesh's coordinates under the mesh's ``id``: a later mesh at
    that address was given them (a 2-D mesh a 1-D one's: an IndexError; a 1-D mesh a 2-D
    one's: ranks 0 and 1 both at 0, so a shard or a collective went to the wrong rank)."""
    assert simulated_world(4).run(meshes_one_after_another) == local_world(4).run(meshes_one_after_another)


def test_values_torch_makes_from_ops_answer_per_rank() -> None:
    assert simulated_world(4).run(items_and_equality) == local_world(4).run(items_and_equality)


def test_run_keeps_one_contract_in_every_world() -> None:
    """``run``, ``close`` and the timeout as local_world's and threaded_world's: a
    ``timeout=`` is the world's, not the body's."""
    import inspect
    from datetime import timedelta

    from meshstate.errors import MeshStateError
    from meshstate.testing import SimulatedWorld, ThreadedWorld
    from meshstate.testing.launch import LocalWorld

    for name in ("run", "close", "__enter__", "__exit__"):
        signatures = {tuple(inspect.signature(getattr(world, name)).parameters.values())
                      for world in (LocalWorld, ThreadedWorld, SimulatedWorld)}
        assert len(signatures) == 1, f"{name}: {signatures}"
    for world in (ThreadedWorld, SimulatedWorld):
        assert inspect.signature(world).parameters["timeout"] == (
            inspect.signature(LocalWorld).parameters["timeout"])

    def rank() -> int:
        return dist.get_rank()

    with simulated_world(4, timeout=timedelta(seconds=30)) as world:
        assert world.run(rank, timeout=timedelta(seconds=5)) == [0, 1, 2, 3]
    with pytest.raises(MeshStateError, match="^this SimulatedWorld is closed; start a new one$"):
        world.run(rank)


GATHERED_SHAPES = {  # input shape, output shape for 4 ranks: c10d fills the output's elements in rank order
    "stacked rows": ((3,), (4, 3)),
    "stacked blocks": ((2, 3), (4, 2, 3)),
    "concatenated blocks": ((2, 3), (8, 3)),
    "flat": ((2, 3), (24,)),
}


def gather_into(input_shape: tuple[int, ...], output_shape: tuple[int, ...], name: str) -> torch.Tensor:
    values = torch.arange(math.prod(input_shape), dtype=torch.float).reshape(input_shape)
    output = torch.empty(output_shape)
    getattr(dist, name)(output, values + 10 * dist.get_rank())
    return output


@pytest.mark.parametrize("name", ["all_gather_into_tensor", "all_gather_single"])
@pytest.mark.parametrize("shapes", list(GATHERED_SHAPES))
def test_every_all_gather_form_fills_the_output_in_rank_order(shapes: str, name: str) -> None:
    """As NCCL and threads do (gloo takes only the concatenated form)."""
    import warnings

    input_shape, output_shape = GATHERED_SHAPES[shapes]
    expected = torch.cat([torch.arange(math.prod(input_shape), dtype=torch.float) + 10 * rank
                          for rank in range(4)]).reshape(output_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14: all_gather_into_tensor's name
        for rank, got in enumerate(simulated_world(4).run(gather_into, input_shape, output_shape, name)):
            assert torch.equal(got, expected), f"rank {rank}: {got}"


def assert_equal_to_rank_zeros() -> None:
    x = torch.full((3,), dist.get_rank(), dtype=torch.float)
    assert torch.equal(x, torch.zeros(3))


def assert_equal_to_minus_one() -> None:
    x = torch.full((3,), dist.get_rank(), dtype=torch.float)
    assert torch.equal(x, torch.full((3,), -1.0))


def test_a_failed_assert_names_the_ranks_it_failed_on() -> None:
    with pytest.raises(AssertionError) as some:
        simulated_world(4).run(assert_equal_to_rank_zeros)
    assert str(some.value) == ("True on rank 0; False on ranks 1, 2, 3 at tests/test_simulated.py:"
                               f"{assert_equal_to_rank_zeros.__code__.co_firstlineno + 2} "
                               "(assert torch.equal(x, torch.zeros(3)))")
    assert some.value.__notes__ == ["raised on simulated ranks 1, 2, 3"]
    with pytest.raises(AssertionError) as every:
        simulated_world(4).run(assert_equal_to_minus_one)
    assert every.value.__notes__ == ["raised on every simulated rank: ranks 0-3 of 4"]
