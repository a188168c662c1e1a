"""The pure layout against megatron-core's RankGenerator, and its own invariants."""

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshstate import AxisError, ConfigError, Grid, MeshConfig, ParallelLayout
from meshstate.layout.layout import (
    GROUP_KINDS,
    Chunks,
    DerivedGroup,
    Instances,
    Level,
    Pick,
    spellings,
)

from conftest import megatron_groups

ORDERS = [
    "tp-cp-ep-dp-pp",
    "tp-dp-pp",
    "tp-pp-dp",
    "pp-tp-dp",
    "dp-tp-cp-pp-ep",
    "ep-dp-cp-tp-pp",
    "tp-ep-cp-dp-pp",
    "cp-tp-ep-pp-dp",
]


def _valid_configs():
    for order, world_size, tp, cp, ep, etp, pp in itertools.product(
        ORDERS, [8, 16, 48], [1, 2], [1, 2], [1, 2, 4], [None, 1, 2], [1, 2, 3]
    ):
        try:
            yield MeshConfig(world_size, order=order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp)
        except ConfigError:
            continue


TABLE = list(_valid_configs())


def assert_layout_matches_megatron(config, sample_ranks=None):
    layout = ParallelLayout(config)
    expected = megatron_groups(config)
    ranks = range(config.world_size) if sample_ranks is None else sample_ranks
    for kind in GROUP_KINDS:
        groups = layout.groups(kind).tolist()
        assert groups == expected[kind], (config, kind)
        group_by_rank = {rank: group for group in groups for rank in group}
        for rank in ranks:
            assert list(layout.group_ranks(rank, kind)) == group_by_rank[rank], (config, kind, rank)


def test_table_has_many_configs():
    assert len(TABLE) > 300


@pytest.mark.parametrize("config", TABLE, ids=str)
def test_every_group_equals_megatron_for_every_rank(config):
    assert_layout_matches_megatron(config)


@pytest.mark.parametrize(
    "config",
    [
        MeshConfig(131072, tp=8, cp=2, pp=8, ep=8, etp=1),
        MeshConfig(98304, order="tp-cp-ep-pp-dp", tp=4, cp=2, pp=4, ep=8, etp=1),
    ],
    ids=str,
)
def test_large_worlds_equal_megatron(config):
    assert_layout_matches_megatron(config, sample_ranks=[0, 1, 4097, config.world_size - 1])


@st.composite
def configs(draw):
    """Random sizes and orders; axes of size 1 may be left out of the order."""
    sizes = {axis: draw(st.sampled_from([1, 1, 2, 3, 4])) for axis in ("tp", "cp", "ep", "pp")}
    etp = draw(st.sampled_from([None, 1, 2]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    world_size = sizes["tp"] * sizes["cp"] * sizes["pp"] * dp
    order = draw(st.permutations(["tp", "cp", "ep", "dp", "pp"]))
    droppable = [a for a in order if a in ("cp", "ep") and sizes[a] == 1]
    dropped = draw(st.sets(st.sampled_from(droppable))) if droppable else set()
    order_text = "-".join(a for a in order if a not in dropped)
    try:
        return MeshConfig(world_size, order=order_text, etp=etp, **sizes)
    except ConfigError:
        assume(False)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(configs())
def test_hypothesis_configs_equal_megatron(config):
    assert_layout_matches_megatron(config)


def test_joint_key_is_a_set():
    layout = ParallelLayout(MeshConfig(16, tp=2, cp=2, pp=2))
    assert layout.canonical("cp-dp") == "dp-cp"
    assert layout.canonical("pp-ep-etp") == "etp-ep-pp"
    assert layout.groups("cp-dp").tolist() == layout.groups("dp-cp").tolist()
    assert layout.group_ranks(5, "cp-tp-dp") == layout.group_ranks(5, "tp-dp-cp")


def test_rank_order_inside_joint_group_is_mesh_order():
    # tp=2 cp=2 dp=2: in a dp-cp group cp (first in the order) varies fastest.
    layout = ParallelLayout(MeshConfig(8, tp=2, cp=2))
    assert layout.groups("dp-cp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.dense.axes_mesh_order == ("pp", "dp", "cp", "tp")
    assert layout.expert.axes_mesh_order == ("pp", "edp", "ep", "etp")


def test_coordinate_round_trips():
    layout = ParallelLayout(MeshConfig(48, tp=2, cp=2, pp=3, ep=2, etp=1))
    for rank in range(48):
        coordinate = layout.coordinate(rank)
        dense = layout.dense
        assert sum(coordinate[a] * dense.stride(a) for a in dense.axes_fastest_first) == rank
        expert = layout.expert
        assert sum(coordinate[a] * expert.stride(a) for a in expert.axes_fastest_first) == rank


def test_grid_ordered_groups_follow_the_callers_axis_order():
    grid = Grid(("tp", "dp"), (2, 3))
    assert grid.groups(["dp", "tp"]).tolist() == [[0, 1, 2, 3, 4, 5]]
    assert grid.groups(["tp", "dp"]).tolist() == [[0, 2, 4, 1, 3, 5]]
    assert grid.group_ranks(3, ["tp", "dp"]) == (0, 2, 4, 1, 3, 5)
    assert grid.index_in_group(3, ["tp", "dp"]) == 4
    assert grid.index_in_group(3, ["dp", "tp"]) == 3


def test_grid_with_offset():
    grid = Grid(("a", "b"), (2, 2), rank_offset=8)
    assert grid.groups(["b"]).tolist() == [[8, 10], [9, 11]]
    assert grid.coordinate(11) == {"a": 1, "b": 1}


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda l: l.groups("xp"), AxisError,
         "unknown axis 'xp' in key 'xp'; valid axes are tp, cp, dp, pp, etp, ep, edp"),
        (lambda l: l.groups("tp-ep"), AxisError,
         "key 'tp-ep' mixes dense and expert axes; a joint group uses the dense axes "
         "tp, cp, dp, pp or the expert axes etp, ep, edp, pp"),
        (lambda l: l.groups("tp-tp"), AxisError, "key 'tp-tp' names an axis twice"),
        (lambda l: l.group_ranks(8, "tp"), ConfigError, "rank 8 is outside the grid's ranks 0..7"),
        (lambda l: l.group_ranks(-1, "tp"), ConfigError, "rank -1 is outside the grid's ranks 0..7"),
        (lambda l: l.dense.groups(["tp", "ep"]), AxisError,
         "unknown axis 'ep'; valid axes are tp, cp, dp, pp"),
    ],
)
def test_layout_errors_name_the_valid_set(call, error, message):
    layout = ParallelLayout(MeshConfig(8, tp=2))
    with pytest.raises(error) as raised:
        call(layout)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "axes, sizes, message",
    [
        (("a", "b"), (2,), "grid has 2 axis names ('a', 'b') but 1 sizes (2,)"),
        (("a", "a"), (2, 2), "grid axis names ('a', 'a') repeat a name"),
        (("a",), (0,), "size of axis 'a' must be a positive integer, got 0"),
    ],
)
def test_grid_errors(axes, sizes, message):
    with pytest.raises(ConfigError) as raised:
        Grid(axes, sizes)
    assert str(raised.value) == message


# 16 ranks, tp=2 cp=2, so dp=4: rank 0's data+context group is 0, 2, 4, ..., 14 (cp fastest).
DERIVED = [
    (DerivedGroup("dp-cp", Chunks(2)), [[0, 2], [4, 6], [8, 10], [12, 14]]),
    (DerivedGroup("dp-cp", Instances(2)), [[0, 2, 4, 6], [8, 10, 12, 14]]),
    (DerivedGroup("dp-cp", Instances(2, inter=True)), [[0, 8], [2, 10], [4, 12], [6, 14]]),
    (DerivedGroup("dp-cp", Level(0, (2, 4))), [[0, 2], [4, 6], [8, 10], [12, 14]]),
    (DerivedGroup("dp-cp", Level(1, (2, 4))), [[0, 4, 8, 12], [2, 6, 10, 14]]),
    (DerivedGroup("dp-cp", backend="gloo"), [[0, 2, 4, 6, 8, 10, 12, 14]]),
]


@pytest.mark.parametrize("spec, rank0_groups", DERIVED, ids=[str(spec) for spec, _ in DERIVED])
def test_derived_groups_carve_the_base_group(spec, rank0_groups):
    layout = ParallelLayout(MeshConfig(16, tp=2, cp=2))
    every = layout.every_group(spec)
    assert every[: len(rank0_groups)] == rank0_groups
    assert sorted(rank for group in every for rank in group) == list(range(16))
    for group in rank0_groups:
        assert all(layout.members(rank, spec) == tuple(group) for rank in group)


def test_a_pick_leaves_the_other_ranks_without_a_group():
    layout = ParallelLayout(MeshConfig(8, pp=4))
    ends = DerivedGroup("pp", Pick("ends", lambda stages: [stages[-1], stages[0]]))
    assert layout.every_group(ends) == [[0, 6], [1, 7]]
    assert (layout.members(6, ends), layout.members(2, ends)) == ((0, 6), None)


def test_derived_groups_that_carve_different_groups_are_different_values():
    # Each pair splits the same base differently; one cache slot must not serve both.
    pairs = [
        (DerivedGroup("edp", Instances(2)), DerivedGroup("edp", Instances(4))),
        (DerivedGroup("cp", Level(0, (2, 4))), DerivedGroup("cp", Level(0, (4, 2)))),
        (DerivedGroup("pp", Pick("end", lambda stages: stages[:1])),
         DerivedGroup("pp", Pick("end", lambda stages: stages[-1:]))),
    ]
    layout = ParallelLayout(MeshConfig(16, cp=8, pp=2))
    for first, second in pairs:
        assert first != second and len({first, second}) == 2, (first, second)
        cache = {first: layout.every_group(first)}
        assert second not in cache

    @dataclass  # a callable without a hash: a pick compares its function by identity
    class FirstOf:
        count: int

        def __call__(self, ranks: list[int]) -> list[int]:
            return ranks[: self.count]

    first = FirstOf(1)
    assert Pick("p", first) == Pick("p", first) != Pick("p", FirstOf(1))
    assert len({Pick("p", first), Pick("p", first), Pick("p", FirstOf(1))}) == 2


def test_a_derived_groups_lookup_form_leaves_out_what_the_mesh_supplies():
    assert DerivedGroup("cp", Level(1, (2, 2))).lookup == DerivedGroup("cp", Level(1))
    assert DerivedGroup("edp", Instances(4, inter=True)).lookup == DerivedGroup("edp", Instances(inter=True))
    assert DerivedGroup("pp", Pick("first", min)).lookup == DerivedGroup("pp", Pick("first"))
    assert DerivedGroup("dp-cp", Chunks(2)).lookup == DerivedGroup("dp-cp", Chunks(2))
    assert spellings(DerivedGroup("cp", Level(1, (2, 2)))) == [
        DerivedGroup("cp", Level(1, (2, 2))), DerivedGroup("cp", Level(1))]


def test_derived_groups_compare_by_what_tells_them_apart_in_one_mesh():
    assert len({
        DerivedGroup("cp", Level(0)), DerivedGroup("cp", Level(1)), DerivedGroup("dp-cp", Chunks(2)),
        DerivedGroup("dp-cp", Chunks(4)), DerivedGroup("edp", Instances(inter=True)),
        DerivedGroup("dp", backend="gloo"), DerivedGroup("dp", separate=True),
    }) == 7
    assert [str(spec) for spec, _ in DERIVED] == [
        "dp-cp/chunks of 2", "dp-cp/intra-instance of 2", "dp-cp/inter-instance of 2",
        "dp-cp/level 0 of 2x4", "dp-cp/level 1 of 2x4", "dp-cp[gloo]",
    ]
    assert str(DerivedGroup(("edp", "pp"), Instances(2), backend="gloo")) == (
        "(edp, pp)/intra-instance of 2[gloo]")
    assert spellings(DerivedGroup("cp-dp", Chunks(2))) == [
        DerivedGroup("cp-dp", Chunks(2)), DerivedGroup("dp-cp", Chunks(2))]


@pytest.mark.parametrize(
    "spec, message",
    [
        (DerivedGroup("dp-cp", Chunks(3)), "8 ranks do not split into chunks of 3"),
        (DerivedGroup("dp-cp", Instances(3)), "8 ranks do not split into intra-instance of 3"),
        (DerivedGroup("dp-cp", Level(0, (2, 2))),
         "hierarchical sizes [2, 2] multiply to 4, not to the 8 ranks they split"),
        (DerivedGroup("dp", Pick("none", lambda ranks: [])),
         "pick 'none' chose [] from [0, 4, 8, 12]; it must choose distinct ranks of that group, "
         "at least one"),
        (DerivedGroup("dp", Pick("lookup only")), "pick 'lookup only' has no ranks_of function"),
    ],
)
def test_derived_group_errors_name_the_numbers(spec, message):
    with pytest.raises(ConfigError) as raised:
        ParallelLayout(MeshConfig(16, tp=2, cp=2)).members(0, spec)
    assert str(raised.value) == message


def test_a_derived_group_must_derive_something():
    with pytest.raises(ConfigError, match="derives nothing from its base"):
        DerivedGroup("dp")
