"""init_mesh(dp_replicate=R): torchtitan's HSDP axes; init_mesh(ranks=[...]): listed sub-grids.

Layouts on torch's fake backend, against torch.arange grids and torchtitan 0.3's ParallelDims.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import AxisError, ConfigError, MeshConfig, ParallelLayout
from meshstate.layout.layout import HSDP_KINDS, ListedGrid
from meshstate.core.arguments import check_ranks
from meshstate.testing import fake_world

# (world, dp_replicate, cp, tp, pp), ranks checked
HSDP = [
    ((8, 2, 1, 2, 1), (0, 5)),
    ((16, 2, 2, 2, 1), (11,)),
    ((32, 2, 2, 2, 2), (30,)),
    ((64, 4, 1, 2, 4), (37,)),
    ((512, 4, 2, 8, 4), (0, 301)),
]


def _grid(mesh: object) -> tuple[object, list[int]]:
    return mesh.mesh_dim_names, mesh.mesh.tolist()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("config", "ranks"), HSDP, ids=[str(c[0]) for c in HSDP])
def test_hsdp_axes_are_torchtitans_world_mesh(config: tuple[int, ...], ranks: tuple[int, ...]) -> None:
    world, dpr, cp, tp, pp = config
    dps = world // (dpr * cp * tp * pp)
    # torchtitan's world mesh [pp, dp_replicate, dp_shard, cp, tp], outer to inner
    expected = torch.arange(world).view(pp, dpr, dps, cp, tp)
    for rank in ranks:
        with fake_world(rank, world):
            mesh = meshstate.init_mesh(tp=tp, cp=cp, pp=pp, dp_replicate=dpr)
            assert mesh.hsdp.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
            assert mesh.hsdp.mesh.tolist() == expected.tolist()
            p, r, s, c, t = (int(i) for i in (expected == rank).nonzero()[0])
            assert mesh.ranks("dp_replicate") == tuple(expected[p, :, s, c, t].tolist())
            assert mesh.ranks("dp_shard") == tuple(expected[p, r, :, c, t].tolist())
            assert mesh.ranks("cp-dp_shard") == tuple(expected[p, r, :, :, t].flatten().tolist())
            assert (mesh.rank("dp_replicate"), mesh.rank("dp_shard"), mesh.size("dp_shard-cp")) == (r, s, dps * cp)
            assert mesh["dp_replicate", "dp_shard"].mesh.tolist() == expected[p, :, :, c, t].tolist()
            assert mesh["dp_replicate", "dp_shard-cp", "tp"].mesh.tolist() == (
                expected[p].reshape(dpr, dps * cp, tp).tolist())
            # dp is dp_replicate x dp_shard, in every spelling; one communicator per rank set
            for spelling in ("dp_replicate-dp_shard", "dp_shard-dp_replicate"):
                assert mesh.ranks(spelling) == mesh.ranks("dp") and mesh.group(spelling) is mesh.group("dp")
            assert mesh.group("cp-dp_shard-dp_replicate") is mesh.group("dp-cp")
            assert mesh["dp_shard-dp_replicate"] is mesh["dp"]
            assert mesh.coordinate["dp_replicate"] == r and mesh.coordinate["dp_shard"] == s
            distinct = {frozenset(mesh.ranks(key)) for key in mesh.keys()} - {frozenset(range(world))}
            assert mesh.process_groups.creation_calls == len(distinct)  # the world is the default group
            assert mesh.keys()[-len(HSDP_KINDS):] == HSDP_KINDS
            mesh.destroy()


@pytest.mark.parametrize(("config", "ranks"), HSDP, ids=[str(c[0]) for c in HSDP])
def test_hsdp_meshes_equal_torchtitans(config: tuple[int, ...], ranks: tuple[int, ...]) -> None:
    titan_parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
    world, dpr, cp, tp, pp = config
    for rank in ranks:
        with fake_world(rank, world):
            theirs = titan_parallel_dims.ParallelDims(
                dp_replicate=dpr, dp_shard=-1, cp=cp, tp=tp, pp=pp, ep=1, world_size=world,
                spmd_backend="full_dtensor")
            theirs.build_mesh()
            partial = titan_parallel_dims.ParallelDims(
                dp_replicate=dpr, dp_shard=-1, cp=cp, tp=tp, pp=pp, ep=1, world_size=world,
                spmd_backend="partial_dtensor")
            partial.build_mesh()
            mesh = meshstate.init_mesh(tp=tp, cp=cp, pp=pp, dp_replicate=dpr)
            dense = theirs._global_meshes["dense"]
            assert _grid(mesh.hsdp) == _grid(dense)
            for axes in (("dp_replicate", "dp_shard"), ("dp_replicate",), ("dp_shard", "cp"), ("pp", "dp_shard", "tp")):
                assert _grid(mesh[axes]) == _grid(dense[axes]), axes
            fsdp = partial._global_meshes["dense"]
            assert mesh["dp_replicate", "dp_shard-cp", "tp"].mesh.tolist() == fsdp["dp_replicate", "fsdp", "tp"].mesh.tolist()
            assert mesh["dp_shard-cp"].mesh.tolist() == fsdp["fsdp"].mesh.tolist()
            assert mesh["dp_replicate-dp_shard"].mesh.tolist() == theirs.get_mesh("batch").mesh.tolist()
            assert mesh["dp_replicate-dp_shard-cp"].mesh.tolist() == theirs.get_mesh("loss").mesh.tolist()
            mesh.destroy()


def test_dp_replicate_one_keeps_megatrons_keys_and_declares_hsdp_keys_on_request() -> None:
    with fake_world(3, 8):
        plain = meshstate.init_mesh(tp=2)
        assert "dp_shard" not in plain and "dp_replicate-dp_shard" not in plain
        assert plain.config == MeshConfig(8, tp=2) and repr(plain).endswith("dp=4 edp=4)")
        # undeclared HSDP axes still make DeviceMeshes (groups of the same ranks reused)
        assert plain["dp_replicate", "dp_shard"].mesh.tolist() == [[1, 3, 5, 7]]
        plain.destroy()
        declared = meshstate.init_mesh(tp=2, joint_groups=HSDP_KINDS)
        assert declared.group("dp_shard") is declared.group("dp") and declared.size("dp_replicate") == 1
        assert declared.ranks("dp_replicate-dp_shard") == (1, 3, 5, 7)
        declared.destroy()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=2, dp_replicate=3), r"dp = 4 \(world size 8 / tp\*cp\*pp = 2\) is not divisible by dp_replicate = 3"),
        (dict(dp_replicate=0), "dp_replicate must be a positive integer, got 0"),
        (dict(dp_replicate=True), "dp_replicate must be a positive integer, got True"),
        (dict(dp_replicate="2"), "dp_replicate must be a positive integer, got '2'"),
        (dict(tp=8, dp_replicate=2), r"dp = 1 \(world size 8 / tp\*cp\*pp = 8\) is not divisible by dp_replicate = 2"),
    ],
)
def test_bad_dp_replicate_is_one_config_error(kwargs: dict[str, object], message: str) -> None:
    with fake_world(0, 8):
        with pytest.raises(ConfigError, match=message) as error:
            meshstate.init_mesh(**kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(error.value)


def test_hsdp_key_errors() -> None:
    layout = ParallelLayout(MeshConfig(8, tp=2, dp_replicate=2))
    with pytest.raises(AxisError, match=r"key 'dp-dp_shard' names dp and a part of it"):
        layout.resolve("dp-dp_shard")
    with pytest.raises(AxisError, match="mixes dense and expert axes; a joint group uses the dense axes .*, the HSDP axes .* or the expert"):
        layout.resolve("dp_shard-ep")
    with fake_world(0, 8):
        mesh = meshstate.init_mesh(tp=2, dp_replicate=2)
        with pytest.raises(AxisError, match=r"run against mesh order"):
            mesh["dp_shard", "dp_replicate"]
        mesh.destroy()


def test_listed_grid_maps_each_local_rank() -> None:
    grid = ListedGrid(("tp", "dp"), (2, 2), ranks=(1, 3, 5, 7))
    assert grid.rank_grid().tolist() == [[1, 3], [5, 7]]
    assert grid.group_ranks(5, ["dp"]) == (1, 5) and grid.coordinate(7) == {"tp": 1, "dp": 1}
    assert grid.members_at(7, ["dp", "tp"], range(1, 3)) == (3, 5)
    with pytest.raises(ConfigError, match=r"rank 2 is not one of the grid's ranks \[1, 3, 5, 7\]"):
        grid.group_ranks(2, ["tp"])
    with pytest.raises(ConfigError, match=r"a grid over listed ranks has no strides; ask group_ranks\(5, \['dp'\]\)"):
        grid.lattice_of(5, ["dp"])
    with pytest.raises(ConfigError, match=r"listed ranks must increase from >= 0, got \[3, 1, 5, 7\]"):
        ListedGrid(("tp", "dp"), (2, 2), ranks=(3, 1, 5, 7))
    with pytest.raises(ConfigError, match="listed ranks take no rank_offset, got 4"):
        ParallelLayout(MeshConfig(4, tp=2), rank_offset=4, ranks=(0, 2, 4, 6))
    layout = ParallelLayout(MeshConfig(4, tp=2), ranks=(0, 2, 4, 6))
    assert layout.groups("dp").tolist() == [[0, 4], [2, 6]] and layout.group_ranks(6, "tp") == (4, 6)


def test_listed_ranks_build_a_mesh_on_those_ranks_only() -> None:
    for rank in range(8):
        with fake_world(rank, 8):
            mesh = meshstate.init_mesh(tp=2, dp_replicate=2, ranks=[1, 3, 5, 7])
            if rank % 2 == 0:
                assert mesh is None
                continue
            assert mesh is not None
            assert mesh.ranks("tp") == ((1, 3) if rank < 4 else (5, 7))
            assert mesh.ranks("dp") == ((1, 5) if rank in (1, 5) else (3, 7))
            assert mesh.ranks("dp_replicate") == mesh.ranks("dp") and mesh.ranks("dp_shard") == (rank,)
            assert mesh["dp_replicate", "dp_shard", "tp"].mesh.tolist() == [[[1, 3]], [[5, 7]]]
            mesh.destroy()


def test_sub_world_keeps_a_range_and_refuses_what_is_not_increasing_ranks() -> None:
    half = range(1 << 21, 1 << 22)
    assert check_ranks(half, 1 << 22) is half
    assert check_ranks([4, 5, 6], 8) == range(4, 7) and check_ranks(range(0, 8, 2), 8) == (0, 2, 4, 6)
    with fake_world(0, 8):
        wrong = r"ranks must be increasing ranks of the world 0..7 \(local rank i of the mesh is ranks\[i\]\), got "
        for ranks, shown in (([2, 0], r"\[2, 0\]"), ([0, 0], r"\[0, 0\]"), ([6, 8], r"\[6, 8\]"),
                             (range(4, 12), r"range\(4, 12\)"), (range(6, 2, -2), r"range\(6, 2, -2\)")):
            with pytest.raises(ConfigError, match=wrong + shown):
                meshstate.init_mesh(ranks=ranks)
        with pytest.raises(ConfigError, match=r"ranks must be a non-empty range or list of ranks, got \[\]"):
            meshstate.init_mesh(ranks=[])
        with pytest.raises(ConfigError, match="world size 3 is not divisible by tp"):
            meshstate.init_mesh(tp=2, ranks=[0, 2, 4])
    assert dist.is_initialized() is False
