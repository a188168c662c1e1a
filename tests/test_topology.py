"""Nodes: locality of every group kind, order advice, hybrid layouts and their DeviceMesh."""

import itertools
import json
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshstate import AxisError, ConfigError, Grid, MeshConfig, MeshStateError, ParallelLayout
from meshstate.core import compat
from meshstate.testing import torch_internals
from meshstate.tools.cli import main
from meshstate.layout.layout import GROUP_KINDS
from meshstate.testing import fake_world
from meshstate import HybridGrid, init_hybrid_mesh
from meshstate.layout.topology import (
    NodeCrossingWarning,
    check_ranks_per_node,
    locality_report,
    nodes_spanned,
    ranks_per_node_from_env,
)


def report_without_warning(config, ranks_per_node):
    with warnings.catch_warnings():
        warnings.simplefilter("error", NodeCrossingWarning)
        return locality_report(ParallelLayout(config), ranks_per_node)


def report_with_warning(config, ranks_per_node, advice):
    with pytest.warns(NodeCrossingWarning) as caught:
        report = locality_report(ParallelLayout(config), ranks_per_node)
    assert [str(w.message) for w in caught] == [advice]
    assert report.advice == advice
    return report


# --- locality -------------------------------------------------------------------------


def test_tp_first_stays_inside_a_node():
    report = report_without_warning(MeshConfig(16, tp=8), 8)
    assert report.nodes_spanned["tp"] == 1 and report.intra_node("tp")
    assert report.nodes_spanned["dp"] == 2 and not report.intra_node("dp")
    assert list(report.nodes_spanned) == list(GROUP_KINDS)
    assert report.suggested_order is None and report.advice is None


def test_tp_after_dp_crosses_nodes_and_tp_first_is_suggested():
    report = report_with_warning(
        MeshConfig(16, order="dp-tp-pp", tp=8), 8,
        "tp groups span 2 nodes, etp groups span 2 nodes in order 'dp-tp-pp' at 8 ranks "
        "per node; order 'tp-dp-pp' keeps tp, etp inside one node",
    )
    assert report.nodes_spanned["tp"] == 2 and report.nodes_spanned["dp"] == 1
    assert report.suggested_order == "tp-dp-pp"
    assert report_without_warning(MeshConfig(16, order="tp-dp-pp", tp=8), 8).intra_node("tp")


def test_expert_axis_brought_inside_a_node():
    report_with_warning(
        MeshConfig(32, order="tp-dp-ep-pp", tp=2, ep=4, etp=1), 8,
        "ep groups span 4 nodes in order 'tp-dp-ep-pp' at 8 ranks per node; "
        "order 'tp-ep-dp-pp' keeps ep inside one node",
    )


def test_tp_is_kept_inside_before_cp():
    # tp=8 and cp=2 cannot both fit in 8 ranks: tp inside wins, cp is named as the cost.
    report = report_with_warning(
        MeshConfig(16, order="cp-tp-ep-dp-pp", tp=8, cp=2), 8,
        "tp groups span 2 nodes in order 'cp-tp-ep-dp-pp' at 8 ranks per node; "
        "order 'tp-cp-ep-dp-pp' keeps tp inside one node (cp groups span 2 nodes there)",
    )
    assert report.nodes_spanned["cp"] == 1
    assert report_without_warning(MeshConfig(16, tp=8, cp=2), 8).nodes_spanned["cp"] == 2


@pytest.mark.parametrize(
    "config, ranks_per_node",
    [
        (MeshConfig(32, tp=16), 8),             # tp wider than a node: crosses in any order
        (MeshConfig(16, tp=8, cp=2), 8),        # cp crosses, but only if tp does not
        (MeshConfig(16, order="dp-tp", tp=8), 16),  # one node: nothing crosses
    ],
    ids=["tp16", "tp8-cp2", "one-node"],
)
def test_no_warning_when_no_order_does_better(config, ranks_per_node):
    assert report_without_warning(config, ranks_per_node).advice is None


def test_suggested_order_is_valid_with_the_same_sizes():
    # pp=2 and dp != edp: only orders ending in pp are valid.
    config = MeshConfig(64, order="dp-ep-tp-pp", tp=2, ep=4, etp=1, pp=2)
    report = report_with_warning(
        config, 8,
        "tp groups span 2 nodes, ep groups span 4 nodes in order 'dp-ep-tp-pp' at 8 ranks "
        "per node; order 'ep-tp-dp-pp' keeps tp, ep inside one node",
    )
    suggested = MeshConfig(64, order=report.suggested_order, tp=2, ep=4, etp=1, pp=2)
    assert suggested.sizes() == config.sizes()


def test_nodes_spanned_is_the_most_over_all_groups():
    # tp groups [0..3] [4..7] [8..11] on nodes of 6: the first fits, the second does not.
    report = report_without_warning(MeshConfig(12, tp=4), 6)
    assert report.nodes_spanned["tp"] == 2
    assert nodes_spanned(torch.tensor([[0, 1], [2, 9]]), 8) == 2
    assert nodes_spanned(torch.tensor([[3], [12]]), 8) == 1


def test_131072_ranks():
    config = MeshConfig(131072, tp=8, cp=2, pp=8, ep=8, etp=1)
    report = report_without_warning(config, 8)
    assert report.nodes_spanned == {
        "tp": 1, "cp": 2, "dp": 1024, "pp": 8, "tp-cp": 2, "dp-cp": 2048, "tp-dp": 1024,
        "tp-dp-cp": 2048, "tp-pp": 8, "ep": 1, "etp": 1, "etp-ep": 1, "etp-ep-pp": 8,
        "edp": 2048,
    }
    swapped = MeshConfig(131072, order="cp-tp-ep-dp-pp", tp=8, cp=2, pp=8, ep=8, etp=1)
    report_with_warning(
        swapped, 8,
        "tp groups span 2 nodes in order 'cp-tp-ep-dp-pp' at 8 ranks per node; "
        "order 'tp-cp-ep-dp-pp' keeps tp inside one node (cp groups span 2 nodes there)",
    )


@pytest.mark.parametrize(
    "ranks_per_node, message",
    [
        (3, "world size 16 is not divisible by 3 ranks per node"),
        (0, "ranks per node must be a positive integer, got 0"),
        (True, "ranks per node must be a positive integer, got True"),
        ("8", "ranks per node must be a positive integer, got '8'"),
    ],
)
def test_bad_ranks_per_node(ranks_per_node, message):
    with pytest.raises(ConfigError) as error:
        locality_report(ParallelLayout(MeshConfig(16, tp=2)), ranks_per_node)
    assert str(error.value) == message
    with pytest.raises(ConfigError) as error:
        check_ranks_per_node(16, ranks_per_node)
    assert str(error.value) == message


def test_ranks_per_node_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_node_from_env() == 8
    for text in ("eight", "0", "-2", ""):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", text)
        with pytest.raises(ConfigError) as error:
            ranks_per_node_from_env()
        assert str(error.value) == f"LOCAL_WORLD_SIZE must be a positive integer, got {text!r}"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError) as error:
        ranks_per_node_from_env()
    assert str(error.value) == (
        "LOCAL_WORLD_SIZE is not set; launch with torchrun or pass ranks_per_node"
    )


# --- hybrid grid ----------------------------------------------------------------------

# 2 nodes of 8: dp twice inside a node and twice across nodes, tp=4 inside a node.
HYBRID = HybridGrid(intra={"dp": 2, "tp": 4}, inter={"dp": 2})


def test_hybrid_groups_by_hand():
    assert HYBRID.axes_fastest_first == ("dp", "tp") and HYBRID.sizes == (4, 4)
    assert HYBRID.axes_mesh_order == ("tp", "dp") and HYBRID.mesh_shape == (4, 4)
    assert (HYBRID.world_size, HYBRID.ranks_per_node, HYBRID.num_nodes) == (16, 8, 2)
    assert HYBRID.rank_grid().tolist() == [
        [0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15],
    ]
    assert HYBRID.groups(["dp"]).tolist() == [
        [0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15],
    ]
    assert HYBRID.groups(["tp"]).tolist() == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15],
    ]
    assert HYBRID.groups(["tp", "dp"]).tolist() == [list(HYBRID.rank_grid().flatten().tolist())]
    assert HYBRID.groups(["dp", "tp"]).tolist() == [
        [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    ]
    assert HYBRID.coordinate(9) == {"dp": 3, "tp": 0}
    assert HYBRID.coordinate(6) == {"dp": 0, "tp": 3}
    assert HYBRID.group_ranks(11, ["dp"]) == (2, 3, 10, 11)
    assert HYBRID.index_in_group(11, ["dp"]) == 3
    assert HYBRID.group_ranks(11, ["tp"]) == (9, 11, 13, 15)
    assert HYBRID.index_in_group(11, ["tp"]) == 1


def test_no_order_string_expresses_the_hybrid_grid():
    def group_sets(grid, axis):
        return {frozenset(group) for group in grid.groups([axis]).tolist()}

    for axes in itertools.permutations(HYBRID.axes_fastest_first):
        grid = Grid(axes, tuple(HYBRID.size(axis) for axis in axes))
        assert any(group_sets(grid, a) != group_sets(HYBRID, a) for a in HYBRID.axes_fastest_first), axes
    for order in ("tp-dp", "dp-tp"):
        layout = ParallelLayout(MeshConfig(16, order=order, tp=4))
        assert {frozenset(g) for g in layout.groups("dp").tolist()} != group_sets(HYBRID, "dp")


def test_hybrid_grid_equals_a_grid_when_one_exists():
    hybrid = HybridGrid(intra={"tp": 4, "dp": 2}, inter={"dp": 2, "pp": 2})
    grid = Grid(("tp", "dp", "pp"), (4, 4, 2))
    assert torch.equal(hybrid.rank_grid(), grid.rank_grid())
    for axes in (["tp"], ["dp"], ["pp"], ["dp", "tp"], ["pp", "tp"]):
        assert torch.equal(hybrid.groups(axes), grid.groups(axes))


def jax_hybrid_rank_grid(intra_mesh_shape, inter_mesh_shape):
    """JAX's create_hybrid_device_mesh on ranks: node n holds ranks n*per_node.."""
    per_node = int(np.prod(intra_mesh_shape))
    node_meshes = [
        np.arange(node * per_node, (node + 1) * per_node).reshape(intra_mesh_shape)
        for node in range(int(np.prod(inter_mesh_shape)))
    ]
    node_grid = np.arange(len(node_meshes)).reshape(inter_mesh_shape)
    blocks = np.vectorize(lambda node: node_meshes[node], otypes=[object])(node_grid)
    return np.block(blocks.tolist())


@pytest.mark.parametrize(
    "intra, inter",
    [
        ({"dp": 2, "tp": 4}, {"dp": 2}),
        ({"tp": 2, "cp": 2, "dp": 2}, {"dp": 2, "cp": 2, "pp": 3}),
        ({"ep": 4}, {"ep": 2, "dp": 2}),
        ({"tp": 8}, {}),
    ],
)
def test_hybrid_grid_matches_jax_and_its_own_arithmetic(intra, inter):
    grid = HybridGrid(intra, inter)
    expected = jax_hybrid_rank_grid(grid.intra_sizes[::-1], grid.inter_sizes[::-1])
    assert grid.rank_grid().tolist() == expected.tolist()
    rank_grid = grid.rank_grid()
    axis_sets = [list(axes) for n in (1, 2) for axes in itertools.permutations(grid.axes_fastest_first, n)]
    for axes in axis_sets:
        rows = grid.groups(axes).tolist()
        row_of = {rank: row for row in rows for rank in row}
        assert sorted(row_of) == list(range(grid.world_size))
        for rank in range(grid.world_size):
            coordinate = grid.coordinate(rank)
            assert rank_grid[tuple(coordinate[a] for a in grid.axes_mesh_order)] == rank
            assert list(grid.group_ranks(rank, axes)) == row_of[rank]
            assert row_of[rank][grid.index_in_group(rank, axes)] == rank


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: HybridGrid({"tp": 0}, {}), ConfigError,
         "intra size of axis 'tp' must be a positive integer, got 0"),
        (lambda: HybridGrid({"tp": 2}, {"dp": 1.5}), ConfigError,
         "inter size of axis 'dp' must be a positive integer, got 1.5"),
        (lambda: HybridGrid({}, {}), ConfigError,
         "a hybrid grid needs at least one axis in intra or inter"),
        (lambda: HYBRID.coordinate(16), ConfigError, "rank 16 is outside the grid's ranks 0..15"),
        (lambda: HYBRID.groups(["pp"]), AxisError, "unknown axis 'pp'; valid axes are dp, tp"),
        (lambda: HYBRID.group_ranks(0, ["tp", "tp"]), AxisError,
         "axis list ('tp', 'tp') names an axis twice"),
    ],
)
def test_hybrid_grid_errors(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == message


# --- hybrid DeviceMesh on the fake backend ------------------------------------------


@pytest.mark.parametrize(
    "grid, ranks",
    [
        (HYBRID, [0, 5, 9, 14]),
        (HybridGrid({"tp": 2, "cp": 2, "dp": 2}, {"dp": 2, "cp": 2, "pp": 3}), [0, 7, 33, 95]),
    ],
    ids=["dp-tp", "tp-cp-dp-pp"],
)
def test_init_hybrid_mesh(grid, ranks):
    for rank in ranks:
        with fake_world(rank, grid.world_size):
            before = len(c10d._world.pg_map)
            hybrid = init_hybrid_mesh(grid)
            mesh = hybrid.device_mesh
            assert mesh.mesh_dim_names == grid.axes_mesh_order
            assert mesh.mesh.tolist() == grid.rank_grid().tolist()
            coordinate = grid.coordinate(rank)
            assert mesh.get_coordinate() == tuple(coordinate[a] for a in grid.axes_mesh_order)
            for axis in grid.axes_fastest_first:
                members = list(grid.group_ranks(rank, [axis]))
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == members
                assert mesh[axis].mesh.tolist() == members
                assert mesh.get_local_rank(axis) == coordinate[axis]
            hybrid.destroy()
            hybrid.destroy()
            assert len(c10d._world.pg_map) == before


def test_hybrid_mesh_groups_are_created_by_meshstate_groups_alone():
    # One family per axis; DeviceMesh.from_group registers the groups and creates none.
    with fake_world(9, 16):
        with torch_internals.counting_group_creation() as calls:
            hybrid = init_hybrid_mesh(HYBRID)
        assert calls[0] == hybrid.process_groups.creation_calls == 2
        assert hybrid.process_groups.by_name == {
            "tp": hybrid.device_mesh.get_group("tp"), "dp": hybrid.device_mesh.get_group("dp")}
        hybrid.destroy()


def test_a_failed_hybrid_build_leaves_no_groups(monkeypatch):
    new_member_group = compat.new_member_group

    def fail_on_dp(ranks, name, *, description, **options):
        if description == "meshstate:dp":
            raise RuntimeError("connection refused")
        return new_member_group(ranks, name, description=description, **options)

    monkeypatch.setattr(compat, "new_member_group", fail_on_dp)
    with fake_world(9, 16):
        before = len(c10d._world.pg_map)
        with pytest.raises(MeshStateError, match=r"the 'dp' group of ranks \[0, 1, 8, 9\] did not form"):
            init_hybrid_mesh(HYBRID)  # tp's group is made first, then destroyed
        assert len(c10d._world.pg_map) == before


def test_init_hybrid_mesh_needs_a_matching_world():
    with fake_world(0, 8):
        with pytest.raises(ConfigError) as error:
            init_hybrid_mesh(HYBRID)
    assert str(error.value) == "hybrid grid has 16 ranks (dp=4 tp=4) but the world has 8"


# --- meshstate plan --gpus-per-node ---------------------------------------------------

PLAN = ["plan", "--world-size", "16", "--order", "dp-tp-pp", "--tp", "8"]
ADVICE = (
    "tp groups span 2 nodes, etp groups span 2 nodes in order 'dp-tp-pp' at 8 ranks per "
    "node; order 'tp-dp-pp' keeps tp, etp inside one node"
)


def test_plan_table_with_gpus_per_node(capsys):
    assert main([*PLAN, "--gpus-per-node", "8"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[:5] == [
        "world size 16, order dp-tp-pp, tp=8 cp=1 ep=1 etp=8 pp=1 dp=2 edp=2",
        "nodes: 2 of 8 ranks each",
        "",
        "kind         size  groups  locality  first groups",
        "tp              8       2   2 nodes  [0, 2, 4, 6, 8, 10, 12, 14] [1, 3, 5, 7, 9, 11, 13, 15]",
    ]
    assert "dp              2       8      node  [0, 1] [2, 3] [4, 5] …" in lines
    assert lines[-2:] == ["", f"advice: {ADVICE}"]
    assert err == ""


def test_plan_json_with_gpus_per_node(capsys):
    assert main(["plan", "--json", *PLAN[1:], "--gpus-per-node", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ranks_per_node"] == 8
    assert list(plan["locality"]) == list(GROUP_KINDS)
    assert plan["locality"]["tp"] == {"nodes_spanned": 2, "intra_node": False}
    assert plan["locality"]["dp"] == {"nodes_spanned": 1, "intra_node": True}
    assert plan["advice"] == [ADVICE]
    assert main(["plan", "--json", "--world-size", "16", "--tp", "8", "--gpus-per-node", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["advice"] == []


def test_plan_without_gpus_per_node_has_no_locality(capsys):
    assert main(["plan", "--json", *PLAN[1:]]) == 0
    assert not {"locality", "advice", "ranks_per_node"} & set(json.loads(capsys.readouterr().out))
    assert main(PLAN) == 0
    assert "locality" not in capsys.readouterr().out


def test_plan_bad_gpus_per_node_exits_2_with_one_line(capsys):
    assert main([*PLAN, "--gpus-per-node", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "meshstate plan: error: world size 16 is not divisible by 3 ranks per node"
    ]
    with pytest.raises(SystemExit) as exit:
        main([*PLAN, "--gpus-per-node", "0"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate plan: error: argument --gpus-per-node: expected a positive integer, got 0"
    ]

