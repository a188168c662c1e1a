"""meshstate's HyperCommGrid against megatron-core's: enumerations, keys, groups, errors.

The enumeration tests need no process group (``WORLD_SIZE`` gives the world
size, as in megatron-core); groups are checked on torch's fake backend in this
process and with real collectives on 8 gloo ranks.
"""

import itertools
import math
import types
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshstate import AxisError, ConfigError, MeshConfig, MeshStateError, ParallelLayout
from meshstate.megatron.hyper_comm_grid import DimError, GridSizeError, GroupKeyError, HyperCommGrid
from meshstate.layout.layout import DENSE_KINDS
from meshstate.testing import distributed, fake_world

SEED_SHAPE = [2, 3, 4, 5]
SEED_DIMS = ["tp", "cp", "pp", "dp"]  # world 120, as order="tp-cp-pp-dp" with tp=2 cp=3 pp=4


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's classes, imported here so the gloo workers never load megatron."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.hyper_comm_grid import HyperCommGrid as MegatronGrid
        from megatron.core.parallel_state import RankGenerator
    return types.SimpleNamespace(HyperCommGrid=MegatronGrid, RankGenerator=RankGenerator)


@pytest.fixture
def world_size_env(monkeypatch):
    """Set ``WORLD_SIZE`` for a grid built without a process group."""
    return lambda size: monkeypatch.setenv("WORLD_SIZE", str(size))


@pytest.fixture
def no_world_size_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def every_dim_list(names):
    """Every non-empty list of distinct dims, in every order."""
    return [
        list(order)
        for count in range(1, len(names) + 1)
        for subset in itertools.combinations(names, count)
        for order in itertools.permutations(subset)
    ]


def group_containing(rank, groups):
    return next(group for group in groups if rank in group)


# ---------------------------------------------------------------- enumerations, no process group


def order_dims(grid, dims):
    """0.16's ``grid._order_dims(dims)``, which 0.19 calls ``_order_dims_for(dim_names, dims)``."""
    if hasattr(grid, "_order_dims"):
        return grid._order_dims(dims)
    return grid._order_dims_for(grid.dim_names, dims)

GRIDS = [
    (SEED_SHAPE, SEED_DIMS, 0),
    (SEED_SHAPE, SEED_DIMS, 7),
    ([2, 2, 2], ["a", "b", "c"], 0),
    ([1, 2, 4], ["tp", "cp", "dp"], 0),
    ([4, 1, 2, 3], ["tp", "cp", "dp", "pp"], 8),
    ([3], ["dp"], 2),
]


@pytest.mark.parametrize(
    "shape, dim_names, rank_offset", GRIDS, ids=lambda v: str(v).replace(" ", "")
)
def test_enumerations_and_keys_equal_megatron(shape, dim_names, rank_offset, mcore, world_size_env):
    world_size_env(rank_offset + math.prod(shape) + 3)
    ours = HyperCommGrid(shape, dim_names, rank_offset)
    theirs = mcore.HyperCommGrid(shape, dim_names, rank_offset)
    for dims in every_dim_list(dim_names):
        assert ours._gen_rank_enum(dims) == theirs._gen_rank_enum(dims), dims
        assert order_dims(ours, dims) == order_dims(theirs, dims), dims
        assert ours.get_rank_enum(dims) == theirs.get_rank_enum(dims), dims
    for name in dim_names:
        assert order_dims(ours, name) == order_dims(theirs, name) == ([name], name)
        assert ours.get_rank_enum(name) == theirs.get_rank_enum(name)


def test_attributes_equal_megatron(mcore, world_size_env):
    world_size_env(16)
    ours = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=8, backend="gloo")
    theirs = mcore.HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=8, backend="gloo")
    for attribute in ("shape", "dim_names", "rank_offset", "size", "backend", "_pgs"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert (ours.shape, ours.dim_names, ours.size, ours._pgs) == ([2, 2], ["tp", "dp"], 4, {})


def test_documented_examples(world_size_env):
    world_size_env(120)
    abc = HyperCommGrid([2, 2, 2], ["a", "b", "c"])
    assert abc._gen_rank_enum(["a", "b"]) == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert abc._gen_rank_enum(["b", "a"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert abc._gen_rank_enum(["a"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert abc._gen_rank_enum(["c"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]

    tcd = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    assert tcd.get_rank_enum(["dp", "tp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert order_dims(tcd, ["tp", "dp"]) == (["dp", "tp"], "dp-tp")
    assert order_dims(tcd, ["dp", "cp", "tp"]) == (["dp", "cp", "tp"], "dp-cp-tp")

    assert HyperCommGrid([2, 2], ["tp", "dp"]).get_rank_enum("dp") == [[0, 2], [1, 3]]
    assert HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)._gen_rank_enum(["tp"]) == [
        [4, 5],
        [6, 7],
    ]

    seed = HyperCommGrid(SEED_SHAPE, SEED_DIMS)
    assert order_dims(seed, ["dp", "pp"]) == (["dp", "pp"], "dp-pp")
    dp_groups = seed._gen_rank_enum(["dp"])
    assert len(dp_groups) == 24 and all(len(group) == 5 for group in dp_groups)
    assert dp_groups[0] == [0, 24, 48, 72, 96]


ORDERS = [("tp-cp-pp-dp", 0), ("tp-cp-dp-pp", 0), ("pp-dp-cp-tp", 0), ("tp-cp-pp-dp", 8)]


@pytest.mark.parametrize("order, rank_offset", ORDERS)
def test_order_string_grid_equals_rank_generator_and_layout(
    order, rank_offset, mcore, world_size_env
):
    world_size_env(rank_offset + 120)
    sizes = {"tp": 2, "cp": 3, "pp": 4, "dp": 5}
    dim_names = order.split("-")
    grid = HyperCommGrid([sizes[name] for name in dim_names], dim_names, rank_offset)
    generator = mcore.RankGenerator(**sizes, ep=1, order=order, rank_offset=rank_offset)
    # etp = tp*cp keeps meshstate's expert view consistent for orders not ending in pp.
    layout = ParallelLayout(MeshConfig(120, order=order, tp=2, cp=3, pp=4, etp=6))
    for kind in DENSE_KINDS:
        expected = generator.get_ranks(kind)
        assert grid.get_rank_enum(kind.split("-")) == expected, kind
        if rank_offset == 0:
            assert layout.groups(kind).tolist() == expected, kind


# ---------------------------------------------------------------- groups on the fake backend

SEED_GROUP_DIMS = [
    ["tp"], ["cp"], ["pp"], ["dp"], ["cp", "tp"], ["dp", "cp"], ["tp", "pp"],
    ["tp", "cp", "dp"], ["tp", "cp", "pp", "dp"],
]  # fmt: skip


@pytest.mark.parametrize("rank", [0, 1, 37, 119])
def test_fake_world_groups_equal_megatron_enumeration(rank, mcore, no_world_size_env):
    with fake_world(rank, 120):
        grid = HyperCommGrid(SEED_SHAPE, SEED_DIMS)
        megatron = mcore.HyperCommGrid(SEED_SHAPE, SEED_DIMS)
        for dims in SEED_GROUP_DIMS:
            expected = group_containing(rank, megatron.get_rank_enum(dims))
            group = grid.create_pg(dims)
            assert dist.get_process_group_ranks(group) == expected, dims
            assert dist.get_rank(group) == expected.index(rank), dims
            assert grid.get_pg(dims[::-1]) is group
        assert set(grid._pgs) == {order_dims(megatron, dims)[1] for dims in SEED_GROUP_DIMS}


def test_create_pg_runs_once_per_dim_set(no_world_size_env):
    with fake_world(3, 8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
        group = grid.create_pg(["cp", "dp"])
        for spelling in (["cp", "dp"], ["dp", "cp"]):
            with pytest.raises(GroupKeyError) as raised:
                grid.create_pg(spelling, timeout=timedelta(seconds=5))
            assert isinstance(raised.value, KeyError) and isinstance(raised.value, MeshStateError)
            assert str(raised.value).startswith(
                "Process group for dims 'dp-cp' has already been created on this grid"
            )
            assert "use get_pg(['dp', 'cp']) to get it" in str(raised.value)
        assert grid.get_pg(["cp", "dp"]) is group
        # Another grid is another set of groups.
        assert HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"]).create_pg(["dp", "cp"]) is not group


@pytest.mark.parametrize("rank", [0, 7, 8, 13, 15])
def test_ranks_outside_an_offset_grid_get_none(rank, no_world_size_env):
    # 16 ranks; the grid is ranks 8..15 (tp=2, dp=4).
    with fake_world(rank, 16):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=8)
        dp_group = grid.create_pg("dp")
        tp_dp_group = grid.create_pg(["dp", "tp"])
        if rank < 8:
            assert dp_group is None and grid.get_pg("dp") is None and tp_dp_group is None
        else:
            expected = group_containing(rank, [[8, 10, 12, 14], [9, 11, 13, 15]])
            assert dist.get_process_group_ranks(dp_group) == expected
            assert dist.get_process_group_ranks(tp_dp_group) == list(range(8, 16))
            assert grid.get_pg(["dp"]) is dp_group


def live_group_count():
    return len(c10d._world.pg_map)


def test_dim_sets_with_the_same_ranks_share_a_group_when_options_match(no_world_size_env):
    # cp has size 1, so ["tp", "cp"] has the groups of ["tp"].
    with fake_world(5, 8):
        grid = HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "pp", "dp"])
        before = live_group_count()
        tp_group = grid.create_pg("tp", group_desc="TENSOR_GROUP")
        assert grid.create_pg(["cp", "tp"]) is tp_group
        assert "TENSOR_GROUP" in tp_group.group_desc
        assert live_group_count() - before == 1

        pp_group = grid.create_pg("pp", timeout=timedelta(seconds=30))
        pp_cp_group = grid.create_pg(["pp", "cp"])  # another timeout: a group of its own
        assert pp_cp_group is not pp_group
        assert dist.get_process_group_ranks(pp_cp_group) == [5, 7]
        assert dist.get_process_group_ranks(pp_group) == [5, 7]
        assert live_group_count() - before == 3

        assert grid.get_pg(["tp", "cp"]) is tp_group and grid.get_pg("tp") is tp_group
        # The whole world is a group of its own, as megatron-core's grid makes it.
        world_group = grid.create_pg(["tp", "cp", "pp", "dp"])
        assert world_group is not dist.group.WORLD
        assert dist.get_process_group_ranks(world_group) == list(range(8))


# ---------------------------------------------------------------- real collectives on 8 gloo ranks

# HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"]): rank = tp + 2*cp + 4*dp.
GLOO_GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "cp-tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "dp-tp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "dp-cp-tp": [[0, 1, 2, 3, 4, 5, 6, 7]],
}


def assert_group_holds(group, expected):
    """``group`` has exactly the ranks ``expected``, in that order, checked by collectives."""
    rank = dist.get_rank()
    assert dist.get_world_size(group) == len(expected)
    assert dist.get_rank(group) == expected.index(rank)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    assert total.item() == sum(expected)
    gathered = [torch.full((1,), -1.0) for _ in expected]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
    assert [int(value.item()) for value in gathered] == expected


@distributed(world_size=8)
def test_gloo_groups_hold_the_enumerated_ranks():
    rank = dist.get_rank()
    grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"], backend="gloo")
    for key, groups in GLOO_GROUPS.items():
        dims = key.split("-")[::-1]  # ask in dim_names order; the key is reversed
        assert grid.get_rank_enum(dims) == groups
        group = grid.create_pg(dims, timeout=timedelta(seconds=45))
        assert grid.get_pg(key.split("-")) is group
        assert dist.get_backend(group) == "gloo"
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=45)
        assert_group_holds(group, group_containing(rank, groups))


@distributed(world_size=8)
def test_gloo_offset_grid_and_shared_groups():
    # Ranks 4..7 form tp=2 x cp=1 x dp=2; ranks 0..3 are outside the grid.
    rank = dist.get_rank()
    grid = HyperCommGrid([2, 1, 2], ["tp", "cp", "dp"], rank_offset=4)
    tp_group = grid.create_pg("tp")
    dp_group = grid.create_pg("dp")
    tp_cp_group = grid.create_pg(["cp", "tp"])
    if rank < 4:
        assert tp_group is None and dp_group is None and tp_cp_group is None
        return
    assert tp_cp_group is tp_group
    assert_group_holds(tp_group, group_containing(rank, [[4, 5], [6, 7]]))
    assert_group_holds(dp_group, group_containing(rank, [[4, 6], [5, 7]]))


# ---------------------------------------------------------------- errors

CONSTRUCTOR_ERRORS = [
    (([2, 2], ["tp"]), {}, ConfigError, r"^len\(shape\) 2 != len\(dim_names\) 1: shape \[2, 2\]"),
    (
        ([4, 4], ["tp", "dp"]),
        {},
        GridSizeError,
        r"^Grid shape \[4, 4\] is over sized with world size 8 and rank offset 0: "
        r"it needs ranks 0\.\.15, the world has ranks 0\.\.7$",
    ),
    (
        ([2, 2], ["tp", "dp"]),
        dict(rank_offset=6),
        GridSizeError,
        r"rank offset 6: it needs ranks 6\.\.9, the world has ranks 0\.\.7$",
    ),
    (([2, 2], ["tp", "dp"]), dict(rank_offset=-1), ConfigError, r"^rank_offset must be >= 0, got -1$"),
    (([2, 0], ["tp", "dp"]), {}, ConfigError, r"^size of axis 'dp' must be a positive integer, got 0$"),
    (([2, 2], ["tp", "tp"]), {}, ConfigError, r"^grid axis names \('tp', 'tp'\) repeat a name$"),
]


@pytest.mark.parametrize("args, kwargs, error, message", CONSTRUCTOR_ERRORS)
def test_constructor_errors(args, kwargs, error, message, world_size_env):
    world_size_env(8)
    with pytest.raises(error, match=message) as raised:
        HyperCommGrid(*args, **kwargs)
    builtin = RuntimeError if error is GridSizeError else ValueError
    assert isinstance(raised.value, builtin) and isinstance(raised.value, MeshStateError)


def test_world_size_must_be_known(no_world_size_env, monkeypatch):
    with pytest.raises(GridSizeError, match="^cannot determine the world size: WORLD_SIZE is not"):
        HyperCommGrid([2], ["tp"])
    monkeypatch.setenv("WORLD_SIZE", "eight")
    with pytest.raises(ConfigError, match="^WORLD_SIZE='eight' is not an integer$"):
        HyperCommGrid([2], ["tp"])


DIM_ERRORS = [
    ("ep", r"^'ep' is not in view 'base' with dims tp, cp, dp \(asked for 'ep'\)$"),
    ("tp-cp", r"^'tp-cp' is not in view 'base' with dims tp, cp, dp \(asked for 'tp-cp'\)$"),
    (["tp", "x"], r"^'x' is not in view 'base' with dims tp, cp, dp \(asked for \['tp', 'x'\]\)$"),
    (["tp", "dp", "tp"], r"^dims \['tp', 'dp', 'tp'\] name 'tp' twice$"),
    ([], r"^a process group needs at least one dim; the dims are tp, cp, dp$"),
]
GRID_METHODS = ["create_pg", "get_pg", "get_rank_enum", "order_dims", "_gen_rank_enum"]


@pytest.mark.parametrize("method", GRID_METHODS)
@pytest.mark.parametrize("dims, message", DIM_ERRORS)
def test_bad_dims(method, dims, message, world_size_env):
    world_size_env(8)
    grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    call = (lambda dims: order_dims(grid, dims)) if method == "order_dims" else getattr(grid, method)
    with pytest.raises(DimError, match=message) as raised:
        call(dims)
    # megatron-core raises ValueError for an unknown dim in a list; meshstate's AxisError is a KeyError.
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, AxisError)


def test_get_pg_before_create_pg(world_size_env):
    world_size_env(8)
    grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    with pytest.raises(KeyError) as raised:
        grid.get_pg(["cp", "dp"])
    assert isinstance(raised.value, GroupKeyError)
    assert str(raised.value) == (
        "Process group for dims 'dp-cp' hasn't been created; call create_pg(['dp', 'cp']) first"
    )


def test_create_pg_needs_an_initialised_world_that_fits_the_grid(world_size_env):
    world_size_env(16)
    grid = HyperCommGrid([16], ["dp"])
    with pytest.raises(ConfigError, match="^torch.distributed is not initialized; call torch.distributed.init_process_group first$"):
        grid.create_pg("dp")
    with fake_world(0, 8):  # WORLD_SIZE says 16, the world has 8
        with pytest.raises(
            ConfigError,
            match=r"^the grid's ranks 0\.\.15 do not fit the initialised world of 8 ranks$",
        ):
            grid.create_pg("dp")
    assert grid._pgs == {}
