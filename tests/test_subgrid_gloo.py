"""Sub-grids: meshes over disjoint halves of 8 gloo ranks, side by side."""

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate.core.config import MeshConfig
from meshstate.core.layout import ParallelLayout
from meshstate.testing import distributed, fake_world


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


def test_ranks_must_be_consecutive_ranks_of_the_world():
    with fake_world(0, 8):
        with pytest.raises(meshstate.ConfigError, match=r"ranks must be consecutive ranks of the world 0..7 in order, got \[0, 2\]"):
            meshstate.init_mesh(ranks=[0, 2])
        with pytest.raises(meshstate.ConfigError, match="world size 3 is not divisible by tp"):
            meshstate.init_mesh(tp=2, ranks=range(0, 3))


def test_layout_with_offset_gives_groups_of_those_ranks():
    layout = ParallelLayout(MeshConfig(4, tp=2), rank_offset=4)
    assert layout.groups("dp").tolist() == [[4, 6], [5, 7]]
    assert layout.group_of(7, "tp") == (6, 7)
