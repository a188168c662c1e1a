"""What only the simulated world does with real test bodies: its refusals by name, a
failed ``assert_close`` naming the simulated ranks, torch's own log formatting.

Every kind of body compared rank by rank with processes (shards, generators, groups,
objects, comparisons, logging, a compiled TP step...) is test_every_world.py's.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import SimulationError
from meshstate.simulation.per_rank import per_rank_value
from meshstate.testing import simulated_world

import world_bodies as bodies
from world_bodies import W


def assert_close_on_tp_rank_0() -> None:
    t = meshstate.init_mesh(tp=2).rank("tp")
    torch.testing.assert_close(torch.full((2,), t) * 0.5, torch.zeros(2))


def test_a_failed_assert_close_names_the_simulated_ranks_it_failed_on() -> None:
    with pytest.raises(AssertionError) as raised:
        simulated_world(4).run(assert_close_on_tp_rank_0)
    assert str(raised.value).startswith("On simulated ranks [1, 3]: Tensor-likes are not close!")


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


def test_what_torch_compile_cannot_trace_is_refused_naming_torchs_reason() -> None:
    """Torch's reason is the first line of the exception its failure was raised for; which
    one depends on what dynamo already compiled in this process (alone: "Unexpected fake
    buffer"; after other tests' compiles, dynamo may first break the graph and fail later)."""
    with pytest.raises(SimulationError) as raised:
        simulated_world(4).run(bodies.tp_step, "aot_eager")
    reason = raised.value.__cause__
    while (inner := reason.__cause__ or reason.__context__) is not None:
        reason = inner
    torchs_reason = str(reason).strip().splitlines()[0]
    assert "torch.compile cannot trace this with every rank's values in one process " \
           f"(BackendCompilerFailed: {type(reason).__name__}: {torchs_reason}): dynamo traced " \
           "one graph for every rank, which its backend could not compile" in str(raised.value)
    assert type(raised.value.__cause__).__name__ == "BackendCompilerFailed"


def copies_a_dtensors_spec() -> bool:
    """What dynamo's guard on a DTensor does: ``copy.deepcopy`` of its spec, mesh tensor and all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = distribute_tensor(torch.ones(4, 4), meshstate.init_mesh(tp=2)["tp"], [Shard(0)])
    return copy.deepcopy(weight._spec) == weight._spec


def test_a_deep_copy_of_what_every_rank_shares_is_no_write_into_it() -> None:
    assert simulated_world(4).run(copies_a_dtensors_spec) == [True] * 4
