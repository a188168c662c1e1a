"""The mesh in fake worlds of up to 16,384 ranks (torch's fake backend, one process)."""

from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import meshstate
from meshstate import AxisError, ConfigError, MeshConfig, MeshStateError
from meshstate.layout.layout import GROUP_KINDS, Chunks, DerivedGroup, Level, Pick
from meshstate.testing import fake_world

from conftest import megatron_groups

BIG = dict(tp=4, cp=2, pp=4, ep=8, etp=1)
BIG_WORLD = 16384
BIG_CONFIG = MeshConfig(BIG_WORLD, **BIG)


@pytest.fixture(scope="module")
def big_groups():
    groups = megatron_groups(BIG_CONFIG)
    return {kind: {rank: group for group in groups[kind] for rank in group} for kind in groups}


def live_group_count():
    return len(c10d._world.pg_map)


@pytest.mark.parametrize("rank", [0, 1, 2049, 8191, 16383])
def test_big_world_groups_equal_megatron(rank, big_groups):
    with fake_world(rank, BIG_WORLD):
        mesh = meshstate.init_mesh(**BIG)
        for kind in GROUP_KINDS:
            expected = big_groups[kind][rank]
            assert list(mesh.ranks(kind)) == expected, kind
            assert mesh.rank(kind) == expected.index(rank)
            assert mesh.size(kind) == len(expected)
            assert dist.get_process_group_ranks(mesh.group(kind)) == expected
            assert dist.get_rank(mesh.group(kind)) == expected.index(rank)
        mesh.destroy()


@pytest.mark.parametrize("rank", [0, 2049, 16383])
def test_big_world_creates_one_group_per_distinct_rank_set(rank):
    with fake_world(rank, BIG_WORLD):
        before = live_group_count()
        mesh = meshstate.init_mesh(**BIG)
        distinct = {mesh.ranks(kind) for kind in GROUP_KINDS}
        assert mesh.process_groups.creation_calls == len(distinct)
        assert live_group_count() - before == len(distinct)
        # etp=1: the expert tensor+expert group is the expert group itself.
        assert mesh.group("etp-ep") is mesh.group("ep")
        mesh.destroy()
        assert live_group_count() == before


@pytest.mark.parametrize("rank", [0, 2049, 16383])
def test_big_world_device_mesh_slices(rank, big_groups):
    with fake_world(rank, BIG_WORLD):
        mesh = meshstate.init_mesh(**BIG)
        assert mesh.dense.mesh_dim_names == ("pp", "dp", "cp", "tp")
        assert mesh.dense.shape == (4, 512, 2, 4)
        assert mesh.expert.mesh_dim_names == ("pp", "edp", "ep", "etp")
        assert mesh.expert.shape == (4, 512, 8, 1)
        for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            sliced = mesh[axis]
            assert sliced.mesh_dim_names == (axis,)
            assert sliced.mesh.tolist() == big_groups[axis][rank]
            assert sliced.get_local_rank() == mesh.rank(axis)
            assert sliced.get_group() is mesh.group(axis)
            assert mesh[axis] is sliced
        for joint in ("tp-cp", "dp-cp", "tp-dp", "tp-dp-cp", "tp-pp", "etp-ep", "etp-ep-pp"):
            flat = mesh[joint]
            assert flat.ndim == 1 and flat.mesh_dim_names == (joint,)
            assert flat.mesh.tolist() == big_groups[joint][rank]
            assert flat.get_local_rank() == mesh.rank(joint)
            assert flat.get_group() is mesh.group(joint)
        assert mesh["cp-dp"] is mesh["dp-cp"]
        hsdp = mesh["dp", "cp"]
        assert hsdp.mesh_dim_names == ("dp", "cp") and hsdp.shape == (512, 2)
        assert hsdp.mesh.flatten().tolist() == big_groups["dp-cp"][rank]
        assert hsdp.get_coordinate() == (mesh.coordinate["dp"], mesh.coordinate["cp"])
        assert mesh["dp", "cp"] is hsdp
        # Slices share the root, so torch can combine them (FSDP2 + TP does).
        assert hsdp._get_root_mesh() is mesh.dense
        assert mesh["dp-cp"]._get_root_mesh() is mesh.dense
        assert mesh["tp"]._get_root_mesh() is mesh.dense
        mesh.destroy()


def test_size_one_axes_share_one_single_rank_group():
    with fake_world(3, 8):
        before = live_group_count()
        mesh = meshstate.init_mesh(tp=2, ep=2, etp=1)
        single = mesh.group("cp")
        assert mesh.group("etp") is single and mesh.group("pp") is single
        assert dist.get_process_group_ranks(single) == [3]
        assert dist.get_rank(single) == 0 and dist.get_world_size(single) == 1
        distinct = {mesh.ranks(kind) for kind in GROUP_KINDS} - {tuple(range(8))}
        assert live_group_count() - before == len(distinct)
        mesh.destroy()


def test_pipeline_and_ring_neighbours():
    # 16 ranks, tp=2 pp=4, dp=2: rank 5's pipeline is (1, 5, 9, 13).
    with fake_world(5, 16):
        mesh = meshstate.init_mesh(tp=2, pp=4)
        assert mesh.ranks("pp") == (1, 5, 9, 13)
        assert (mesh.prev_rank("pp"), mesh.next_rank("pp")) == (1, 9)
        assert (mesh.first_rank("pp"), mesh.last_rank("pp")) == (1, 13)
        assert not mesh.is_first("pp") and not mesh.is_last("pp")
        mesh.destroy()
    with fake_world(13, 16):
        mesh = meshstate.init_mesh(tp=2, pp=4)
        assert mesh.is_last("pp") and mesh.next_rank("pp") == 1
        mesh.destroy()
    # Context-parallel ring: tp=2 cp=4 -> rank 3's cp group is (1, 3, 5, 7).
    with fake_world(3, 8):
        mesh = meshstate.init_mesh(tp=2, cp=4)
        assert (mesh.next_rank("cp"), mesh.prev_rank("cp")) == (5, 1)
        mesh.destroy()


def test_whole_world_group_is_the_default_group_unless_options_are_given():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2)
        assert mesh.group("tp-dp") is dist.group.WORLD
        mesh.destroy()
        mesh = meshstate.init_mesh(tp=2, timeout=timedelta(seconds=30))
        assert mesh.group("tp-dp") is not dist.group.WORLD
        assert dist.get_process_group_ranks(mesh.group("tp-dp")) == list(range(8))
        mesh.destroy()


def test_init_and_destroy_repeat_with_different_configs():
    with fake_world(6, 16):
        before = live_group_count()
        for sizes in [dict(tp=2), dict(tp=4, pp=2), dict(cp=2, ep=4, etp=1), dict(tp=2)]:
            mesh = meshstate.init_mesh(**sizes)
            assert mesh.config == MeshConfig(16, **sizes)
            mesh.destroy()
            mesh.destroy()
            assert live_group_count() == before


@pytest.mark.parametrize(
    "request_key, error, message",
    [
        ("xp", AxisError,
         "mesh has no axis 'xp'; valid are dense axes ('tp', 'cp', 'dp', 'pp'), "
         "expert axes ('etp', 'ep', 'edp', 'pp')"),
        (("cp", "dp"), AxisError,
         "axes ('cp', 'dp') run against mesh order (outer to inner) ('pp', 'dp', 'cp', 'tp'), "
         "and a torch DeviceMesh keeps its dims in mesh order; slice mesh['dp', 'cp'] and give "
         "the order in the spec instead: P(('cp', 'dp')) lays a dim out major to minor"),
        (("tp", "ep"), AxisError,
         "axes ('tp', 'ep') mix dense and expert axes; valid are dense axes "
         "('tp', 'cp', 'dp', 'pp'), expert axes ('etp', 'ep', 'edp', 'pp')"),
        (("tp", "tp-cp"), AxisError, "axes ('tp', 'tp-cp') name an axis twice"),
    ],
)
def test_slicing_errors_list_the_valid_names(request_key, error, message):
    with fake_world(0, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with pytest.raises(error) as raised:
            mesh[request_key]
        assert str(raised.value) == message
        mesh.destroy()


def test_group_query_errors_list_the_valid_keys():
    with fake_world(0, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with pytest.raises(AxisError) as raised:
            mesh.group("cp-pp")
        assert str(raised.value) == (
            "mesh has no group 'cp-pp'; valid keys are tp, cp, dp, pp, tp-cp, dp-cp, tp-dp, "
            "tp-dp-cp, tp-pp, ep, etp, etp-ep, etp-ep-pp, edp"
        )
        assert mesh.group("cp-tp") is mesh.group("tp-cp")
        mesh.destroy()


def test_bad_config_fails_before_any_group_exists():
    with fake_world(0, 12):
        before = live_group_count()
        with pytest.raises(ConfigError, match="world size 12 is not divisible by tp\\*cp\\*pp"):
            meshstate.init_mesh(tp=2, pp=8)
        assert live_group_count() == before


def test_init_mesh_without_a_world_or_torchrun_says_what_to_do(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MeshStateError, match="torch.distributed is not initialized"):
        meshstate.init_mesh(tp=2)


# 16 ranks, tp=2 cp=4, so dp=2. Rank 5: cp group 1, 3, 5, 7; data+context group 1, 3, ..., 15.
INNER, OUTER = DerivedGroup("cp", Level(0, (2, 2))), DerivedGroup("cp", Level(1, (2, 2)))
QUARTERS = DerivedGroup("cp-dp", Chunks(4))
FIRST = DerivedGroup("dp", Pick("first", lambda ranks: ranks[:1]))


def test_derived_groups_are_asked_for_by_value():
    with fake_world(5, 16):
        mesh = meshstate.init_mesh(tp=2, cp=4, derived=[INNER, OUTER, QUARTERS, FIRST])
        assert mesh.keys()[len(GROUP_KINDS):] == (INNER, OUTER, DerivedGroup("dp-cp", Chunks(4)), FIRST)
        for spec, ranks in [(INNER, [5, 7]), (OUTER, [1, 5]), (QUARTERS, [1, 3, 5, 7]), (FIRST, [5])]:
            assert list(mesh.ranks(spec)) == ranks, spec
            assert mesh.rank(spec) == ranks.index(5) and mesh.size(spec) == len(ranks)
            assert dist.get_process_group_ranks(mesh.group(spec)) == ranks
        # A lookup value needs only what tells the groups apart; any spelling of its base works.
        assert mesh.group(DerivedGroup("cp", Level(1))) is mesh.group(OUTER)
        assert mesh.group(DerivedGroup("dp-cp", Chunks(4))) is mesh.group(QUARTERS)
        # The same ranks are the same process group: a quarter of dp-cp is rank 5's cp group.
        assert mesh.group(QUARTERS) is mesh.group("cp")
        assert mesh.rank(INNER) == 0 and mesh.size("cp-tp") == mesh.size("tp-cp") == 8
        with pytest.raises(AxisError) as raised:
            mesh.group(DerivedGroup("cp", Level(2)))
        assert str(raised.value).startswith("mesh has no group 'cp/level 2'; valid keys are tp, cp")
        mesh.destroy()
    with fake_world(13, 16):
        mesh = meshstate.init_mesh(tp=2, cp=4, derived=[FIRST])
        assert FIRST in mesh and not mesh.has_group(FIRST)
        with pytest.raises(MeshStateError, match="rank 13 is in no 'dp/first' group"):
            mesh.ranks(FIRST)
        mesh.destroy()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(derived=[INNER, DerivedGroup("cp", Level(0, (4, 1)))]),
         "derived group 'cp/level 0 of 4x1' is declared twice"),
        (dict(derived=["cp"]), "derived takes DerivedGroup values, got 'cp'"),
        (dict(group_options={OUTER: meshstate.GroupOptions(backend="gloo")}),
         "group_options names ['cp/level 1 of 2x2'], which are not keys of the mesh: tp, cp, dp, "
         "pp, tp-cp, dp-cp, tp-dp, tp-dp-cp, tp-pp, ep, etp, etp-ep, etp-ep-pp, edp"),
    ],
)
def test_bad_derived_declarations_fail_before_any_group_exists(kwargs, message):
    with fake_world(0, 16):
        before = live_group_count()
        with pytest.raises(ConfigError) as raised:
            meshstate.init_mesh(tp=2, cp=4, **kwargs)
        assert str(raised.value) == message
        assert live_group_count() == before


def test_the_read_only_tables_answer_every_kind_as_the_queries_do():
    with fake_world(37, 64):
        mesh = meshstate.init_mesh(tp=2, cp=2, pp=2, ep=2, etp=1, joint_groups=["cp-pp"])
        try:
            for key in mesh.kinds:
                assert mesh.tables.rank[key] == mesh.rank(key)
                assert mesh.tables.size[key] == mesh.size(key)
                assert mesh.tables.group[key] is mesh.group(key)
                assert mesh.tables.ranks[key] == mesh.ranks(key)
            assert mesh.tables.size["cp-dp"] == mesh.size("dp-cp") == 16  # dp=8 x cp=2
            with pytest.raises(TypeError):
                mesh.tables.rank["tp"] = 0  # type: ignore[index]
        finally:
            mesh.destroy()


# -- set_mesh: a setter, and a `with` block that gives back the mesh set before ----------------


def test_set_mesh_sets_at_once_and_as_a_with_block_restores_the_previous_mesh():
    with fake_world(5, 8):
        first, second = meshstate.init_mesh(tp=2), meshstate.init_mesh(tp=4)
        meshstate.set_mesh(first)
        assert meshstate.current_mesh() is first
        with meshstate.set_mesh(second) as entered:
            assert entered is second and meshstate.current_mesh() is second
            with first:  # a `with mesh:` inside still comes first
                assert meshstate.current_mesh() is first
            assert meshstate.current_mesh() is second
        assert meshstate.current_mesh() is first
        with first, meshstate.set_mesh(second):  # innermost inside an outer `with mesh:` too
            assert meshstate.current_mesh() is second
        assert meshstate.current_mesh() is first
        with meshstate.set_mesh(None):
            with pytest.raises(meshstate.NotInitializedError, match="no current mesh"):
                meshstate.current_mesh()
            assert meshstate.get_mesh() is None  # JAX's get_mesh(): an empty mesh there
            with second:
                assert meshstate.get_mesh() is second
        assert meshstate.current_mesh() is first and meshstate.get_mesh() is first
        meshstate.set_mesh(None)
        with first:  # destroyed inside its `with` block: named, never answered
            first.destroy()
            with pytest.raises(meshstate.NotInitializedError, match="destroyed"):
                meshstate.get_mesh()
        second.destroy()


# -- the layout arguments: declared once, and a keyword no one takes is Python's TypeError -----


def test_every_layout_argument_is_a_field_of_mesh_config_and_init_mesh_takes_no_other():
    from dataclasses import fields

    from meshstate.core.arguments import BuildArguments, BuildOptions
    from meshstate.layout.config import SIZE_NAMES

    assert [f.name for f in fields(MeshConfig)] == ["world_size", "order", *SIZE_NAMES]
    assert [f.name for f in fields(BuildOptions)] == list(BuildArguments.__annotations__)
    with fake_world(0, 8):
        # Python 3.13 adds a suggestion to the message
        with pytest.raises(TypeError, match="^init_mesh\\(\\) got an unexpected keyword argument "
                                            "'tq'(. Did you mean 'tp'\\?)?$"):
            meshstate.init_mesh(tq=2)
        with pytest.raises(TypeError, match="^MeshConfig.__init__\\(\\) got an unexpected keyword argument 'dp'$"):
            MeshConfig(8, dp=4)
        mesh = meshstate.init_mesh(**MeshConfig(8, order="tp-dp-pp", tp=2, pp=2).arguments())
        assert (mesh.size("tp"), mesh.size("dp"), mesh.config.order) == (2, 2, "tp-dp-pp")
        mesh.destroy()


def test_the_mesh_gains_no_attribute_after_init_and_its_roots_share_one_rank_map():
    # An attribute added after __init__ (a cached_property's answer, say) turns CPython's
    # instance layout into a plain dict and every query read 40% slower from then on.
    with fake_world(3, 16):
        mesh = meshstate.init_mesh(tp=2, cp=2, ep=2)
        attributes = set(vars(mesh))
        dense, expert, hsdp = mesh.dense, mesh.expert, mesh.hsdp
        mesh["tp"], mesh["dp-cp"], mesh.ordered(("cp", "dp"))
        assert set(vars(mesh)) == attributes
        assert mesh.root_meshes() == [dense, expert, hsdp]
        assert expert._rank_map is dense._rank_map and hsdp._rank_map is dense._rank_map
        assert mesh.dense is dense
        mesh.destroy()
        assert set(vars(mesh)) == attributes and mesh.root_meshes() == []
