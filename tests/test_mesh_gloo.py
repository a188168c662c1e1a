"""8 real gloo ranks build the mesh and verify every group with collectives."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate.layout.layout import GROUP_KINDS
from meshstate.testing import distributed
from meshstate.tools.verify import verify_mesh

CONFIGS = [
    dict(order="tp-cp-ep-dp-pp", tp=2, cp=2, pp=2, ep=2, etp=1),  # expert, etp=1
    dict(order="tp-pp-dp", tp=2, pp=2),
    dict(order="tp-cp-ep-dp-pp", tp=4, cp=2, ep=4, etp=2),
    dict(order="pp-dp-tp", tp=2, pp=4, ep=1),
    dict(order="dp-tp-cp-ep-pp", tp=2, ep=4, etp=1, pp=1),
]


@pytest.mark.parametrize("sizes", CONFIGS, ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
@distributed(world_size=8)
def test_every_group_verified_by_collectives(sizes):
    mesh = meshstate.init_mesh(**sizes)
    checks = verify_mesh(mesh)
    assert [check.key for check in checks] == list(GROUP_KINDS)
    failed = [(check.key, check.problems) for check in checks if not check.ok]
    assert not failed, failed
    mesh.destroy()


@distributed(world_size=8)
def test_size_one_groups_behave_as_real_single_rank_groups():
    mesh = meshstate.init_mesh(tp=2, cp=1, pp=2, ep=2, etp=1)
    rank = dist.get_rank()
    for key in ("cp", "etp"):
        group = mesh.group(key)
        assert dist.get_rank(group) == 0 and dist.get_world_size(group) == 1
        value = torch.tensor([rank + 0.5])
        dist.all_reduce(value, group=group)
        assert value.item() == rank + 0.5
        out = [torch.full((2,), -1.0)]
        dist.all_gather(out, torch.tensor([rank, 7.0]), group=group)
        assert out[0].tolist() == [rank, 7.0]
    mesh.destroy()


@distributed(world_size=8)
def test_backend_and_timeout_reach_every_group():
    mesh = meshstate.init_mesh(tp=2, cp=2, pp=2, backend="gloo", timeout=timedelta(seconds=45))
    for key in GROUP_KINDS:
        group = mesh.group(key)
        assert group is not dist.group.WORLD
        assert dist.get_backend(group) == "gloo"
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=45)
    mesh.destroy()


@distributed(world_size=8)
def test_device_mesh_slices_on_rank_5():
    # order tp-cp-ep-dp-pp, tp=2 cp=2 pp=2 -> dp=1; rank 5 = tp 1, cp 0, pp 1.
    mesh = meshstate.init_mesh(tp=2, cp=2, pp=2)
    rank = dist.get_rank()
    if rank == 5:
        assert mesh["tp"].mesh.tolist() == [4, 5]
        assert mesh["cp"].mesh.tolist() == [5, 7]
        assert mesh["pp"].mesh.tolist() == [1, 5]
        assert mesh["dp", "cp"].mesh.tolist() == [[5, 7]]
        assert mesh["tp-cp"].mesh.tolist() == [4, 5, 6, 7]
        assert mesh["tp-pp"].mesh.tolist() == [0, 1, 4, 5]
    # The flattened tp-cp mesh reduces over its own group.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=mesh["tp-cp"].get_group())
    assert value.item() == sum(mesh.ranks("tp-cp"))
    mesh.destroy()


@distributed(world_size=8)
def test_init_destroy_cycles_leave_no_groups_behind():
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    for sizes in [dict(tp=2), dict(tp=2, pp=2, cp=2), dict(ep=4, etp=1, pp=2), dict(tp=8)]:
        mesh = meshstate.init_mesh(**sizes)
        assert all(check.ok for check in verify_mesh(mesh))
        mesh.destroy()
        assert len(c10d._world.pg_map) == before


@distributed(world_size=4)
def test_verify_reports_a_group_that_does_not_match_the_layout():
    mesh = meshstate.init_mesh(tp=2)
    # Pretend the layout put the ranks of each tp group the other way round.
    mesh._ranks_of["tp"], mesh._rank_in["tp"] = mesh._ranks_of["tp"][::-1], 1 - mesh._rank_in["tp"]
    checks = {check.key: check for check in verify_mesh(mesh)}
    assert not checks["tp"].ok
    assert any("all_gather of ranks gave" in p for p in checks["tp"].problems)
    assert all(check.ok for key, check in checks.items() if key != "tp")
    mesh.destroy()


def dtensor_matmul_on_a_fresh_mesh():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = meshstate.init_mesh(tp=2)
    tp = mesh["tp"]
    weight = DTensor.from_local(torch.ones(2, 3), tp, [Shard(0)], run_check=False)
    inputs = DTensor.from_local(torch.ones(4, 2), tp, [Shard(1)], run_check=False)
    result = torch.mm(inputs, weight).redistribute(tp, [Replicate()]).to_local()
    mesh.destroy()
    return result.sum().item()


@distributed(world_size=8)
def test_dtensors_on_a_rebuilt_mesh_do_not_reach_the_destroyed_groups():
    # DTensor caches sharding decisions by mesh layout; destroy() must forget them.
    assert dtensor_matmul_on_a_fresh_mesh() == dtensor_matmul_on_a_fresh_mesh() == 48.0


@distributed(world_size=4)
def test_no_rank_returns_with_a_group_before_every_member_has_it():
    # gloo's constructor can return on one member while another is still connecting; a
    # member that then destroyed the group would cut that connection. Rank 1's constructor
    # is slow here: its tp partner, rank 0, must not return before it has the group.
    import time

    from meshstate.core import compat

    create = compat.new_member_group

    def slow_on_rank_1(*args, **kwargs):
        group = create(*args, **kwargs)
        if dist.get_rank() == 1:
            time.sleep(0.5)
        return group

    compat.new_member_group = slow_on_rank_1
    try:
        started = time.monotonic()
        mesh = meshstate.init_mesh(tp=2, pp=2)
        waited = time.monotonic() - started
    finally:
        compat.new_member_group = create
    if dist.get_rank() in (0, 1):
        assert waited >= 0.5
    mesh.destroy()
