"""meshstate.titan.ParallelDims against torchtitan 0.3's, rank by rank on the fake backend."""

from __future__ import annotations

import itertools

import pytest

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


# Degrees torchtitan refuses with an AssertionError: (dp_replicate, dp_shard, cp, tp, pp, ep, world).
BAD_DEGREES = [
    ((2, 2, 1, 3, 1, 1, 8), r"dp_replicate\*dp_shard\*cp\*tp\*pp = 2\*2\*1\*3\*1 = 12 is not the world size 8"),
    ((0, 1, 1, 1, 1, 1, 1), "dp_replicate must be a positive integer, got 0"),
    ((1, 0, 1, 1, 1, 1, 1), r"dp_shard \(or -1\) must be a positive integer, got 0"),
    ((1, -1, 1, 4, 1, 1, 2), "dp_shard=-1 leaves no rank: world size 2 < dp_replicate\\*cp\\*tp\\*pp = 4"),
]


@pytest.mark.parametrize(("degrees", "message"), BAD_DEGREES)
def test_bad_degrees_are_assertion_and_config_errors_as_in_torchtitan(degrees, message) -> None:  # type: ignore[no-untyped-def]
    args = dict(zip(("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size"), degrees))
    with pytest.raises(AssertionError):
        titan.ParallelDims(**args)
    with pytest.raises(ConfigError, match=f"^{message}$") as raised:
        ParallelDims(**args)
    assert isinstance(raised.value, AssertionError)


def test_ep_that_does_not_divide_is_refused_when_built_as_in_torchtitan() -> None:
    args = dict(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=3, world_size=4)
    assert titan.ParallelDims(**args).ep_enabled  # torchtitan accepts it until it builds
    dims = ParallelDims(**args)
    with fake_world(0, 4), pytest.raises(ConfigError, match=r"^ep=3 does not divide dp_shard\*cp\*tp = 2\*1\*1 = 2$"):
        dims.build_mesh()


def test_from_config_reads_torchtitans_parallelism_config() -> None:
    from torchtitan.config.configs import ParallelismConfig

    config = ParallelismConfig(data_parallel_replicate_degree=2, tensor_parallel_degree=2,
                               expert_parallel_degree=2, spmd_backend="full_dtensor")
    theirs, ours = (cls.from_config(config, world_size=16) for cls in (titan.ParallelDims, ParallelDims))
    fields = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size", "spmd_backend")
    assert [getattr(ours, name) for name in fields] == [getattr(theirs, name) for name in fields]
    assert ours.dp_shard == 4


def _answer(call):  # type: ignore[no-untyped-def]
    """What a call gives: the mesh described, ``None``, or the builtin kinds of the error it raised."""
    try:
        return _describe(call())
    except (KeyError, ValueError, AssertionError) as error:
        return {kind.__name__ for kind in (KeyError, ValueError, AssertionError) if isinstance(error, kind)}


def _same(mine: object, theirs: object) -> bool:
    """The same mesh or ``None``, or an error catchable as torchtitan's."""
    if isinstance(mine, set) and isinstance(theirs, set):
        return theirs <= mine
    return mine == theirs


@pytest.mark.parametrize(("config", "ranks"), CONFIGS, ids=[str(c[0]) for c in CONFIGS])
def test_spmd_mesh_questions_match_torchtitan(config: tuple, ranks: tuple[int, ...]) -> None:  # type: ignore[type-arg]
    """spmd_meshes, spmd_dense/sparse_mesh, get_dense_tp_mesh, get_activated_mesh,
    resolve_mesh and resolve_shared_mesh give torchtitan's meshes and Nones."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout

    world, dpr, dps, cp, tp, pp, ep, backend = config
    args = dict(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, world_size=world, spmd_backend=backend)
    axis_lists = [list(c) for size in (1, 2, 3, 4) for c in itertools.combinations(
        (MeshAxisName.DP, MeshAxisName.DP_REPLICATE, MeshAxisName.EFSDP, MeshAxisName.CP,
         MeshAxisName.TP, MeshAxisName.EP), size)]
    layouts = [[SpmdLayout({MeshAxisName.TP: spmd.V, MeshAxisName.DP: spmd.V}), None,
                SpmdLayout({MeshAxisName.TP: spmd.R, MeshAxisName.DP: spmd.V})],
               [None], [SpmdLayout({MeshAxisName.EP: spmd.V}), SpmdLayout({MeshAxisName.TP: spmd.V})]]
    for rank in ranks:
        with fake_world(rank, world):
            theirs = titan.ParallelDims(**args)
            theirs.build_mesh()
            ours = ParallelDims(**args)
            for dims in (theirs, ours):
                meshes = dims.spmd_meshes()
                assert dims.spmd_meshes() is meshes or dims.spmd_meshes() == meshes
            assert [_describe(m) for m in ours.spmd_meshes()] == [_describe(m) for m in theirs.spmd_meshes()]
            for question in ("spmd_dense_mesh", "spmd_sparse_mesh", "get_dense_tp_mesh"):
                assert _same(_answer(getattr(ours, question)), _answer(getattr(theirs, question))), question
            for axes in axis_lists:
                names = [axis.value for axis in axes]
                assert _same(_answer(lambda: ours.get_activated_mesh(names)),
                             _answer(lambda: theirs.get_activated_mesh(names))), names
                expected = _answer(lambda: theirs.resolve_mesh(axes))
                assert _same(_answer(lambda: ours.resolve_mesh(axes)), expected), names
                if expected is not None and not isinstance(expected, set):  # one of the SPMD meshes?
                    assert any(ours.resolve_mesh(axes) is mesh for mesh in ours.spmd_meshes()) == any(
                        theirs.resolve_mesh(axes) is mesh for mesh in theirs.spmd_meshes()), names
            for boundary in layouts:
                assert _same(_answer(lambda: ours.resolve_shared_mesh(boundary)),
                             _answer(lambda: theirs.resolve_shared_mesh(boundary)))
            ours.mesh.destroy()


def test_unknown_axis_is_a_value_error() -> None:
    with fake_world(0, 8):
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
        with pytest.raises(ValueError, match="Invalid mesh dim: 'fsdp'"):
            dims.get_mesh("fsdp")
        with pytest.raises(ValueError, match="not available"):
            dims.get_mesh("cp")
        assert dims.get_mesh("tp") is dims.get_mesh("tp")
        dims.mesh.destroy()
