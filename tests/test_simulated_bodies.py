"""Real test bodies in one process: each simulated rank gets what its own process gets, or a
SimulationError that names the call.

Each body below runs once in ``simulated_world(4)`` and once in ``local_world(4)``
(``init_mesh(tp=2)``: t = ``mesh.rank("tp")`` is 0 on ranks 0 and 2, 1 on ranks 1 and 3),
and every rank's answers are compared: shards taken with a per-rank index (slices, ``W[t]``,
``narrow``, the parts of ``chunk``, ``split``, ``tensor_split`` and ``unbind``), tensors
made of per-rank integers, explicit generators, a group's members and rank, the object
collectives, ``allclose``, ``assert_close``, ``.item()``, logging and a TP step compiled
by dynamo. What one process cannot hold (a write into a tensor every rank shares, ``str()``
of a per-rank value, a float ``.item()`` that differs, DDP, FSDP, AOTAutograd's compile)
is refused by name.
"""

from __future__ import annotations

import logging
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshstate
from meshstate import SimulationError
from meshstate.simulation.per_rank import per_rank_value
from meshstate.testing import local_world, simulated_world

W = torch.arange(24, dtype=torch.float64).reshape(4, 6)
"""Made outside the bodies, as a test's module-level weights are: every rank holds it."""
MADE_OUTSIDE = torch.Generator()

SHARDS = {
    "W[:, t*3:(t+1)*3]": lambda t: W[:, t * 3:(t + 1) * 3],
    "W[t]": lambda t: W[t],
    "W[..., t]": lambda t: W[..., t],
    "W[None, t, 1:]": lambda t: W[None, t, 1:],
    "W.narrow(1, t*3, 3)": lambda t: W.narrow(1, t * 3, 3),
    "W.chunk(2, 1)[t]": lambda t: W.chunk(2, 1)[t],
    "torch.split(W, 3, dim=1)[t]": lambda t: torch.split(W, 3, dim=1)[t],
    "W.tensor_split(2, 1)[t]": lambda t: W.tensor_split(2, 1)[t],
    "W.unbind(0)[t]": lambda t: W.unbind(0)[t],
    "torch.chunk(W, 2, -1)[-1 - t]": lambda t: torch.chunk(W, 2, -1)[-1 - t],
    "W.tensor_split(4, 1)[t + 1] (parts of 2, 2, 1, 1)": lambda t: W.tensor_split(4, 1)[t + 1],
}
Pair = namedtuple("Pair", "rank tp")


def shards() -> dict[str, Any]:
    t = meshstate.init_mesh(tp=2).rank("tp")
    taken = {name: take(t).clone() for name, take in SHARDS.items()}
    mine = W + torch.zeros(1)  # made in the body: each rank's own
    mine[:, t * 3:(t + 1) * 3] *= -1
    mine[t] = 100.0
    mine[t + 2] = torch.full((6,), -5.0, dtype=torch.float64)
    taken["writes through per-rank views of a tensor the body made"] = mine
    weight = torch.nn.Parameter(W.clone())
    (weight[:, t * 3:(t + 1) * 3] * (torch.full((), dist.get_rank()) + 1.0)).sum().backward()
    taken["gradient through a per-rank slice"] = weight.grad
    taken["vmap of chunk"] = torch.func.vmap(lambda row: row.chunk(2))(W)
    taken["tree_map over chunk"] = torch.utils._pytree.tree_map(lambda part: part * 2, W.chunk(2, 1))
    return taken


def made_tensors() -> dict[str, Any]:
    rank, t = dist.get_rank(), meshstate.init_mesh(tp=2).rank("tp")
    return {"torch.tensor(rank)": torch.tensor(rank), "torch.tensor([rank, 1])": torch.tensor([rank, 1]),
            "torch.as_tensor([[t], [rank]])": torch.as_tensor([[t], [rank]]),
            "torch.tensor([t], dtype=float)": torch.tensor([t], dtype=torch.float64),
            "torch.full((2,), rank)": torch.full((2,), rank)}


def draws() -> dict[str, Any]:
    rank = dist.get_rank()
    seeded = torch.Generator().manual_seed(0)
    per_rank = torch.Generator().manual_seed(rank)
    answers = {"a seeded generator": torch.randn(3, generator=seeded),
               "its next draw": torch.randint(10, (4,), generator=seeded),
               "its initial seed": seeded.initial_seed(),
               "a generator seeded with the rank": torch.randn(3, generator=per_rank),
               "its next draw, in place": torch.zeros(2).normal_(generator=per_rank),
               "isinstance(a generator made outside, torch.Generator)": isinstance(MADE_OUTSIDE, torch.Generator)}
    torch.manual_seed(7)
    answers["torch.manual_seed(7)"] = torch.randn(2)
    torch.manual_seed(rank)
    answers["torch.manual_seed(rank)"] = torch.randn(2)
    return answers


def group_queries() -> dict[str, Any]:
    mesh = meshstate.init_mesh(tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    rank = dist.get_rank()
    return {"get_process_group_ranks(tp)": dist.get_process_group_ranks(tp),
            "get_process_group_ranks(dp)": dist.get_process_group_ranks(dp),
            "get_process_group_ranks(None)": dist.get_process_group_ranks(None),
            "torch.tensor(get_process_group_ranks(tp))": torch.tensor(dist.get_process_group_ranks(tp)),
            "get_global_rank(tp, 1)": dist.get_global_rank(tp, 1),
            "get_global_rank(dp, tp rank)": dist.get_global_rank(dp, mesh.rank("tp")),
            "get_group_rank(tp, rank)": dist.get_group_rank(tp, rank),
            "tp.rank()": tp.rank(), "tp.size()": tp.size(), "dp.rank()": dp.rank(),
            'mesh["tp"].mesh': mesh["tp"].mesh, 'mesh["dp"].mesh': mesh["dp"].mesh}


def object_collectives() -> dict[str, Any]:
    mesh = meshstate.init_mesh(tp=2)
    rank, tp = dist.get_rank(), mesh.group("tp")
    everyone: list[Any] = [None] * 4
    dist.all_gather_object(everyone, {"rank": rank, "row": W[rank], "pair": Pair(rank, mesh.rank("tp"))})
    partners: list[Any] = [None] * 2
    dist.all_gather_object(partners, (rank, "same text"), group=tp)
    from_one: list[Any] = [rank, "x"]
    dist.broadcast_object_list(from_one, src=1)
    from_first: list[Any] = [rank * 10, mesh.ranks("tp"), rank % 3 == 0]
    dist.broadcast_object_list(from_first, src=mesh.first_rank("tp"), group=tp)
    from_second: list[Any] = [{"rank": rank}]
    dist.broadcast_object_list(from_second, group=tp, group_src=1)
    return {"all_gather_object": everyone, "all_gather_object over tp": partners,
            "broadcast_object_list(src=1)": from_one,
            "broadcast_object_list(src=first of tp, group=tp)": from_first,
            "broadcast_object_list(group=tp, group_src=1)": from_second}


def comparisons() -> dict[str, Any]:
    t = meshstate.init_mesh(tp=2).rank("tp")
    mine = torch.full((2,), t) * 0.5
    answers: dict[str, Any] = {
        "allclose(mine, 0)": torch.allclose(mine, torch.zeros(2)),
        "mine.allclose(mine + 1e-9)": mine.allclose(mine + 1e-9),
        "equal(mine, 0)": torch.equal(mine, torch.zeros(2)),
        "item() of an int": torch.full((1,), dist.get_rank()).item(),
        "item() of a bool": (torch.full((1,), t) > 0).item(),
        "item() of a float every rank shares": (torch.ones(1) * 0.25).item(),
    }
    torch.testing.assert_close(mine * 2, torch.full((2,), t) * 1.0)
    return answers


BODIES = {"shards": shards, "made tensors": made_tensors, "draws": draws,
          "group queries": group_queries, "object collectives": object_collectives,
          "comparisons": comparisons}


@pytest.fixture(scope="module", params=list(BODIES))
def both_worlds(request: pytest.FixtureRequest) -> tuple[list[Any], list[Any]]:
    body = BODIES[request.param]
    return simulated_world(4).run(body), local_world(4).run(body)


def test_every_rank_gets_what_its_process_gets(both_worlds: tuple[list[Any], list[Any]]) -> None:
    simulated, processes = both_worlds
    for rank, (got, want) in enumerate(zip(simulated, processes)):
        assert got.keys() == want.keys()
        for name in want:
            assert same(got[name], want[name]), f"{name} on rank {rank}: {got[name]!r}, processes {want[name]!r}"


def same(got: Any, want: Any) -> bool:
    """Whether ``got`` is ``want``: the same types, tensors of one dtype and equal values."""
    if type(got) is not type(want):
        return False
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and bool(torch.equal(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[key], want[key]) for key in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    return bool(got == want)


def assert_close_on_tp_rank_0() -> None:
    t = meshstate.init_mesh(tp=2).rank("tp")
    torch.testing.assert_close(torch.full((2,), t) * 0.5, torch.zeros(2))


def test_a_failed_assert_close_names_the_simulated_ranks_it_failed_on() -> None:
    with pytest.raises(AssertionError) as raised:
        simulated_world(4).run(assert_close_on_tp_rank_0)
    assert str(raised.value).startswith("On simulated ranks [1, 3]: Tensor-likes are not close!")


def logs_each_rank() -> list[str]:
    logger = logging.getLogger("simulated body")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning("tp rank %s of %d", meshstate.init_mesh(tp=2).rank("tp"), 2)
        logger.warning("every rank: %s", 2)
    finally:
        logger.removeHandler(handler)
    return lines


def test_logging_a_per_rank_value_logs_each_ranks_line() -> None:
    assert local_world(4).run(logs_each_rank)[1] == ["tp rank 1 of 2", "every rank: 2"]
    assert simulated_world(4).run(logs_each_rank)[1] == [
        "[simulated ranks 0, 2] tp rank 0 of 2", "[simulated ranks 1, 3] tp rank 1 of 2",
        "every rank: 2",
    ]


def torch_log_line() -> str:
    """A warning as torch's own formatter writes it: ``[rank{get_rank()}]:`` first."""
    record = logging.LogRecord("torch.x", logging.WARNING, __file__, 1, "a warning", (), None)
    return torch._logging._internal.TorchLogsFormatter().format(record)


def test_torchs_own_formatting_of_a_per_rank_value_describes_it() -> None:
    line = simulated_world(4).run(torch_log_line)[0]
    assert line.startswith("[rankper rank (0 on rank 0; 1 on rank 1; 2 on rank 2; 3 on rank 3)]:")


def write_into_shared() -> None:
    t = meshstate.init_mesh(tp=2).rank("tp")
    W.clone()[:, t * 3:(t + 1) * 3].mul_(-1)


def add_into_shared() -> None:
    W.clone().add_(torch.full((6,), dist.get_rank()))


def out_into_shared() -> None:
    torch.add(torch.full((6,), dist.get_rank()), 1, out=W.clone())


def index_beside_a_tensor() -> None:
    W[meshstate.init_mesh(tp=2).rank("tp"), torch.tensor([0, 1])]


def part_out_of_range() -> None:
    W.chunk(2)[dist.get_rank()]


def group_rank_of_a_stranger() -> None:
    dist.get_group_rank(meshstate.init_mesh(tp=2).group("tp"), 1)


def branch_on_a_per_rank_size() -> None:
    part = W.tensor_split(4, 1)[meshstate.init_mesh(tp=2).rank("tp") + 1]
    if part.shape[1] == 2:
        pass


def float_item() -> None:
    (torch.full((1,), dist.get_rank()) * 0.5).item()


def str_of_rank() -> None:
    str(dist.get_rank())


def f_string_of_tp_rank() -> None:
    f"tp{meshstate.init_mesh(tp=2).rank('tp')}.ckpt"


def ddp() -> None:
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))


def fsdp2() -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(torch.nn.Linear(2, 2), mesh=meshstate.init_mesh(tp=1)["dp"])


def fsdp1() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    FullyShardedDataParallel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("body", "says"), [
    (write_into_shared, "mul_() writes per rank into a tensor of shape (4, 3) that every simulated rank shares"),
    (add_into_shared, "add_() writes per rank into a tensor of shape (4, 6) that every simulated rank shares"),
    (out_into_shared, "add() writes per rank into a tensor of shape (4, 6) that every simulated rank shares"),
    (index_beside_a_tensor, "tensor[...] with an integer that differs between the simulated ranks beside a tensor index"),
    (part_out_of_range, "a part index (0 on rank 0; 1 on rank 1; 2 on rank 2; 3 on rank 3) out of range for 2 parts"),
    (group_rank_of_a_stranger, "rank 1 is in the group of some simulated ranks only (not of ranks [2, 3])"),
    (branch_on_a_per_rank_size, "a Python branch on a value that differs between the simulated ranks (True on ranks 0, 2; False on ranks 1, 3)"),
    (float_item, "Tensor.item() (or float()) of a torch.float32 tensor whose value differs between the simulated ranks (0.0 on rank 0; 0.5 on rank 1"),
    (str_of_rank, "str() of a value that differs between the simulated ranks (per rank (0 on rank 0; 1 on rank 1"),
    (f_string_of_tp_rank, "a format (an f-string) of a value that differs between the simulated ranks (per rank (0 on ranks 0, 2; 1 on ranks 1, 3))"),
    (ddp, "DistributedDataParallel in a simulated world: its C++ reducer"),
    (fsdp2, "fully_shard (FSDP2) in a simulated world"),
    (fsdp1, "FullyShardedDataParallel in a simulated world"),
])
def test_what_one_process_cannot_hold_is_refused_by_name(body: Any, says: str) -> None:
    with pytest.raises(SimulationError) as raised:
        simulated_world(4).run(body)
    assert says in str(raised.value)
    assert not dist.is_initialized()


def group_rank_of_no_member() -> None:
    dist.get_group_rank(meshstate.init_mesh(tp=2).group("tp"), 7)


def test_a_rank_in_no_group_is_a_value_error_as_in_a_process() -> None:
    with pytest.raises(ValueError, match="is in no group of"):
        simulated_world(4).run(group_rank_of_no_member)


def test_values_one_simulated_program_cannot_hold_are_refused() -> None:
    with pytest.raises(SimulationError, match="all_gather_object gives the simulated ranks values that differ"):
        per_rank_value({0: object(), 1: object()}, "all_gather_object")


def tp_step(backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two SGD steps of a Colwise/Rowwise pair; compiled with ``backend`` unless None."""
    torch.manual_seed(0)
    mesh = meshstate.init_mesh(tp=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    run = step if backend is None else torch.compile(step, backend=backend, dynamic=False)
    x = torch.arange(8.0).reshape(2, 4) + dist.get_rank() // 2
    for _ in range(2):
        optimizer.zero_grad()
        loss = run(x)
        optimizer.step()
    return loss.detach(), model[0].weight.to_local().detach()


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_a_tp_step_compiled_by_dynamo_gives_what_processes_give() -> None:
    want = local_world(4).run(tp_step, None)
    got = simulated_world(4).run(tp_step, "eager")
    torch.testing.assert_close(got, want)


def test_what_torch_compile_cannot_trace_is_refused_naming_torchs_reason() -> None:
    with pytest.raises(SimulationError) as raised:
        simulated_world(4).run(tp_step, "aot_eager")
    assert "torch.compile cannot trace this with every rank's values in one process " \
           "(BackendCompilerFailed: AssertionError: Unexpected fake buffer" in str(raised.value)
