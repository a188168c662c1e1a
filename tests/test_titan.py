"""meshstate.titan.ParallelDims against torchtitan 0.3's, rank by rank on the fake backend."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from meshstate import ConfigError
from meshstate.testing import fake_world
from meshstate.titan import ParallelDims

titan = pytest.importorskip("torchtitan.distributed.parallel_dims")

# (world_size, dp_replicate, dp_shard, cp, tp, pp, ep, backend), ranks checked
CONFIGS = [
    ((8, 2, -1, 1, 2, 1, 1, "spmd_types"), (0, 5)),
    ((8, 1, -1, 1, 1, 1, 1, "spmd_types"), (3,)),
    ((16, 1, 2, 2, 2, 2, 2, "spmd_types"), (9,)),
    ((32, 2, -1, 2, 2, 2, 2, "spmd_types"), (30,)),
    ((64, 2, 2, 2, 4, 2, 8, "full_dtensor"), (37,)),
    ((64, 4, 2, 1, 2, 4, 4, "partial_dtensor"), (63,)),
    ((128, 2, -1, 4, 2, 2, 4, "spmd_types"), (77,)),
    ((512, 4, -1, 2, 8, 4, 16, "spmd_types"), (0, 301)),
    ((512, 1, -1, 1, 8, 8, 8, "spmd_types"), (200,)),
]


def _valid_lists(visible: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
    return {
        combo
        for axes in visible
        for size in range(1, len(axes) + 1)
        for combo in itertools.combinations(axes, size)
    }


def _describe(mesh: object) -> object:
    if mesh is None:
        return None
    return (mesh.mesh_dim_names, tuple(mesh.shape), mesh.mesh.tolist())  # type: ignore[attr-defined]


def _ask(dims: object, names: tuple[str, ...], singleton: bool) -> object:
    try:
        return _describe(dims.get_optional_mesh(list(names), include_singleton_axes=singleton))  # type: ignore[attr-defined]
    except (KeyError, ValueError):
        return "error"


@pytest.mark.parametrize(("config", "ranks"), CONFIGS, ids=[str(c[0]) for c in CONFIGS])
def test_every_axis_list_matches_torchtitan(config: tuple, ranks: tuple[int, ...], record_property) -> None:  # type: ignore[type-arg, no-untyped-def]
    world, dpr, dps, cp, tp, pp, ep, backend = config
    args = dict(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, world_size=world, spmd_backend=backend)
    for rank in ranks:
        with fake_world(rank, world):
            theirs = titan.ParallelDims(**args)
            theirs.build_mesh()
            ours = ParallelDims(**args)
            names = list(theirs._single_axis_meshes)
            assert list(ours._keys()) == names
            valid = _valid_lists([m.mesh_dim_names for m in theirs._global_meshes.values()])
            pairs = set(itertools.permutations(names, 2))
            for combo in sorted(valid | pairs | {(name,) for name in names}):
                for singleton in (False, True):
                    assert _ask(ours, combo, singleton) == _ask(theirs, combo, singleton), (rank, combo)
            assert {k: _describe(v) for k, v in ours.get_all_one_dimensional_meshes().items()} == {
                k: _describe(v) for k, v in theirs.get_all_one_dimensional_meshes().items()
            }
            assert ours.dp_shard == theirs.dp_shard
            for prop in ("dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "cp_enabled",
                         "dp_cp_enabled", "fsdp_enabled", "tp_enabled", "pp_enabled", "ep_enabled",
                         "non_data_parallel_size", "seq_len_divisor"):
                assert getattr(ours, prop) == getattr(theirs, prop), prop
            assert ours.world_mesh.mesh.tolist() == list(range(world))
            created = ours.mesh.process_groups.creation_calls
            record_property(f"groups_rank{rank}", created)
            print(f"world {world} rank {rank}: meshstate created {created} groups")
            ours.mesh.destroy()


def test_bad_degrees_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"dp_replicate\*dp_shard\*cp\*tp\*pp = 2\*2\*1\*3\*1 = 12 is not the world size 8"):
        ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=3, pp=1, ep=1, world_size=8)
    with pytest.raises(ConfigError, match="ep=3 does not divide"):
        ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=3, world_size=8)


def test_unknown_axis_is_a_value_error() -> None:
    with fake_world(0, 8):
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
        with pytest.raises(ValueError, match="Invalid mesh dim: 'fsdp'"):
            dims.get_mesh("fsdp")
        with pytest.raises(ValueError, match="not available"):
            dims.get_mesh("cp")
        assert dims.get_mesh("tp") is dims.get_mesh("tp")
        dims.mesh.destroy()
