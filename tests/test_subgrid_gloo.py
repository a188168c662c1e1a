"""Sub-grids: meshes over disjoint halves of 8 gloo ranks, side by side; HSDP keys by collectives."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import meshstate
from meshstate.layout.config import MeshConfig
from meshstate.layout.layout import ParallelLayout
from meshstate.testing import distributed
from meshstate.tools.verify import verify_mesh


@distributed(world_size=8)
def test_two_meshes_over_disjoint_halves_run_collectives_at_once():
    rank = dist.get_rank()
    low = meshstate.init_mesh(tp=2, ranks=range(0, 4))
    high = meshstate.init_mesh(tp=2, pp=2, ranks=[4, 5, 6, 7])
    mesh = low if rank < 4 else high
    assert (low is None) == (rank >= 4) and (high is None) == (rank < 4)
    assert mesh is not None
    if rank < 4:
        assert mesh.ranks("tp") == (rank // 2 * 2, rank // 2 * 2 + 1) and mesh.ranks("dp") == (rank % 2, rank % 2 + 2)
        assert mesh["dp", "tp"].mesh.tolist() == [[0, 1], [2, 3]]
    else:
        pipeline = (rank - 2, rank) if rank >= 6 else (rank, rank + 2)
        assert mesh.ranks("pp") == pipeline and mesh.ranks("tp-pp") == (4, 5, 6, 7)
    # both halves all-reduce over their own tp-dp-cp group at the same time
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mesh.group("tp-dp-cp") if rank < 4 else mesh.group("tp-pp"))
    assert total.item() == (0 + 1 + 2 + 3 if rank < 4 else 4 + 5 + 6 + 7)
    collection = meshstate.ProcessGroupCollection.from_mesh(mesh)
    assert dist.get_process_group_ranks(collection.tp) == list(mesh.ranks("tp"))
    mesh.destroy()


@distributed(world_size=8)
def test_two_meshes_over_interleaved_halves_run_collectives_at_once():
    rank = dist.get_rank()
    evens = meshstate.init_mesh(tp=2, ranks=[0, 2, 4, 6])
    odds = meshstate.init_mesh(tp=2, ranks=range(1, 8, 2))
    assert (evens is None) == (rank % 2 == 1) and (odds is None) == (rank % 2 == 0)
    mesh = evens or odds
    assert mesh is not None
    low = rank % 2  # local rank i of a half is global rank 2*i + low
    assert mesh.ranks("tp") == ((low, low + 2) if rank < 4 else (low + 4, low + 6))
    assert mesh.ranks("dp") == ((rank % 4, rank % 4 + 4))
    assert mesh["dp", "tp"].mesh.tolist() == [[low, low + 2], [low + 4, low + 6]]
    # both halves all-reduce over their own groups at the same time
    for key, members in (("tp", mesh.ranks("tp")), ("dp", mesh.ranks("dp")), ("tp-dp", range(low, 8, 2))):
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=mesh.group(key))
        assert total.item() == sum(members), key
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=mesh["dp", "tp"].get_group("tp"))
    assert [t.item() for t in gathered] == [float(r) for r in mesh.ranks("tp")]
    collection = meshstate.ProcessGroupCollection.from_mesh(mesh)
    assert dist.get_process_group_ranks(collection.dp) == list(mesh.ranks("dp"))
    assert [check.problems for check in verify_mesh(mesh)] == [()] * len(mesh.kinds)
    mesh.destroy()


@distributed(world_size=8)
def test_hsdp_keys_groups_by_collectives():
    rank = dist.get_rank()
    mesh = meshstate.init_mesh(cp=2, dp_replicate=2)  # dp=4: dp_replicate=2 x dp_shard=2
    # torchtitan's [dp_replicate, dp_shard, cp]: rank = 4*replicate + 2*shard + cp
    replicate, shard, cp = rank // 4, rank // 2 % 2, rank % 2
    expected = {
        "dp_replicate": [shard * 2 + cp, 4 + shard * 2 + cp],
        "dp_shard": [replicate * 4 + cp, replicate * 4 + 2 + cp],
        "dp_shard-cp": list(range(replicate * 4, replicate * 4 + 4)),
        "dp_replicate-dp_shard": list(range(cp, 8, 2)),
    }
    for key, members in expected.items():
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=mesh.group(key))
        assert total.item() == sum(members) and list(mesh.ranks(key)) == members, key
    checks = verify_mesh(mesh)  # every kind, HSDP ones too: all_reduce, all_gather, DeviceMesh
    assert [check.key for check in checks][-3:] == ["dp_replicate", "dp_shard", "dp_shard-cp"]
    assert [check.problems for check in checks] == [()] * len(checks)
    hsdp = mesh["dp_replicate", "dp_shard"]
    assert hsdp.mesh.tolist() == [[cp, 2 + cp], [4 + cp, 6 + cp]]
    for dim, members in enumerate((expected["dp_replicate"], expected["dp_shard"])):
        gathered = [torch.zeros(1) for _ in members]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=hsdp.get_group(dim))
        assert [t.item() for t in gathered] == [float(r) for r in members]
    # FSDP2's HSDP on it: gradients average over the 4 ranks of this rank's hsdp mesh
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    fully_shard(model, mesh=hsdp)
    model(torch.full((1, 4), float(rank))).sum().backward()
    assert model.weight.grad.full_tensor().tolist() == [[float(sum(hsdp.mesh.flatten()) / 4)] * 4]
    mesh.destroy()


def test_layout_with_offset_gives_groups_of_those_ranks():
    layout = ParallelLayout(MeshConfig(4, tp=2), rank_offset=4)
    assert layout.groups("dp").tolist() == [[4, 6], [5, 7]]
    assert layout.group_ranks(7, "tp") == (6, 7)
