"""What megatron-core 0.19 added, against megatron-core 0.19.2 itself.

``create_all_gather_groups``, ``rank_offset`` and ``local_world_size``, GTP sizes
above 1 (refused), ``HyperCommGrid``'s views, ``destroy()`` and
``is_current_rank_in_grid()``, ``ProcessGroupCollection.is_gtp_remat_active``. The
GTP getters' values are in test_parallel_state.py's snapshot. Skipped where an
older megatron-core is installed (the façade then has 0.16's surface). Fake
backend, in this process.
"""

import warnings
from datetime import timedelta
from unittest import mock

import numpy as np
import pytest
import torch.distributed as dist

from meshstate.errors import ConfigError
from meshstate.megatron import parallel_state as ours
from meshstate.megatron import surface
from meshstate.megatron.errors import ParallelStateError
from meshstate.megatron.hyper_comm_grid import HyperCommGrid
from meshstate.megatron.process_groups import ProcessGroupCollection
from meshstate.testing import fake_world

pytestmark = pytest.mark.skipif(surface.FOLLOWS < (0, 19), reason="megatron-core older than 0.19")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as megatron
    from megatron.core.hyper_comm_grid import HyperCommGrid as MegatronGrid


def ranks_of(group):
    return None if group is None else dist.get_process_group_ranks(group)


def reset_megatron():
    megatron.destroy_model_parallel()
    for name in dir(megatron):
        if name.startswith("_") and name.upper() == name and name.strip("_") and "MEMORY" not in name:
            setattr(megatron, name, {} if name == "_HYBRID_DP_CP_GROUPS" else None)


SIZES = dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2,
             expert_tensor_parallel_size=1, create_gloo_process_groups=False)


@pytest.mark.parametrize("rank", [0, 5, 14])
@pytest.mark.parametrize("for_experts", [False, True])
def test_create_all_gather_groups_are_new_groups_of_megatrons_ranks(rank, for_experts):
    with fake_world(rank, 16):
        reset_megatron()
        megatron.initialize_model_parallel(**SIZES)
        expected = [ranks_of(group) for group in megatron.create_all_gather_groups(for_experts)]
        reset_megatron()
        ours.initialize_model_parallel(**SIZES)
        dp_cp_ag, expt_dp_ag = ours.create_all_gather_groups(for_experts)
        assert [ranks_of(dp_cp_ag), ranks_of(expt_dp_ag)] == expected
        assert dp_cp_ag is not ours.get_data_parallel_group(with_context_parallel=True)
        ours.destroy_model_parallel()


def test_create_all_gather_groups_before_init_is_megatrons_error():
    with fake_world(0, 4), pytest.raises(RuntimeError, match="requires parallel state to be initialized"):
        ours.create_all_gather_groups()


def snapshot(module):
    return {
        "initialized": module.is_initialized(),
        **({} if not module.is_initialized() else {
            "tp": ranks_of(module.get_tensor_model_parallel_group()),
            "pp": ranks_of(module.get_pipeline_model_parallel_group()),
            "dp": ranks_of(module.get_data_parallel_group(with_context_parallel=True)),
            "embedding": ranks_of(module.get_embedding_group(check_initialized=False)),
            "ep": ranks_of(module.get_expert_model_parallel_group()),
            "gtp": module.get_gtp_weight_remat_global_ranks(),
            "ranks": module.get_all_ranks(),
        }),
    }


@pytest.mark.parametrize("rank", [2, 8, 13])
def test_rank_offset_and_local_world_size_place_the_groups_as_megatron(rank):
    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, rank_offset=8,
                  local_world_size=8, create_gloo_process_groups=False)
    with fake_world(rank, 16):
        reset_megatron()
        megatron.initialize_model_parallel(**kwargs)
        expected = snapshot(megatron)
        reset_megatron()
        ours.initialize_model_parallel(**kwargs)
        assert snapshot(ours) == expected
        ours.destroy_model_parallel()


def test_gtp_sizes_above_one_are_refused_with_the_numbers():
    with fake_world(0, 8):
        with pytest.raises(ParallelStateError, match="gtp_remat_size=2, expert_gtp_remat_size=1"):
            ours.initialize_model_parallel(gtp_remat_size=2)
        assert not ours.is_initialized()


def grids():
    return HyperCommGrid([2, 4], ["tp", "dp"]), MegatronGrid([2, 4], ["tp", "dp"])


def register(grid):
    grid.register_view("moe", [2, 2, 2], ["tp", "ep", "edp"], shared_dims=["tp"])


@pytest.mark.parametrize("rank", [0, 5])
def test_a_view_enumerates_and_keys_its_groups_as_megatron(rank):
    with fake_world(rank, 8):
        ours_grid, theirs = grids()
        register(ours_grid)
        register(theirs)
        for dims in (["ep"], ["edp"], ["ep", "edp"], ["tp"], ["tp", "ep"]):
            assert ours_grid.get_rank_enum(dims, view="moe") == theirs.get_rank_enum(dims, view="moe"), dims
            group = ours_grid.create_pg(dims, view="moe")
            assert ranks_of(group) == ranks_of(theirs.create_pg(dims, view="moe")), dims
            assert ours_grid.get_pg(dims, view="moe") is group
        assert set(ours_grid._pgs) == set(theirs._pgs)  # a shared dim's group is the base's
        assert ours_grid.get_pg("tp") is ours_grid.get_pg("tp", view="moe")


@pytest.mark.parametrize("shape, dim_names, shared", [
    ([2, 2], ["tp", "ep"], None),                 # size 4, the grid's is 8
    ([2, 2, 2], ["tp", "tp", "edp"], None),       # a name twice
    ([2, 2, 2], ["ep", "tp", "edp"], ["tp"]),     # tp enumerated differently
    ([2, 2, 2], ["tp", "ep", "edp"], ["cp"]),     # not in the base
    ([2, 2, 2], ["tp", "ep", "edp"], ["tp", "tp"]),
])
def test_register_view_refuses_what_megatron_refuses(shape, dim_names, shared):
    with fake_world(0, 8):
        ours_grid, theirs = grids()
        with pytest.raises(ValueError):
            theirs.register_view("v", shape, dim_names, shared_dims=shared)
        with pytest.raises(ValueError):
            ours_grid.register_view("v", shape, dim_names, shared_dims=shared)


def test_unknown_view_and_dim_are_megatrons_errors():
    with fake_world(0, 8):
        for grid in grids():
            register(grid)
            with pytest.raises(KeyError):
                grid.create_pg("ep", view="nope")
            with pytest.raises(ValueError):
                grid.get_rank_enum("dp", view="moe")


def test_destroy_ends_the_grids_groups_and_they_can_be_made_again():
    with fake_world(3, 8):
        grid, _ = grids()
        first = grid.create_pg("dp")
        grid.destroy()
        with pytest.raises(KeyError):
            grid.get_pg("dp")
        again = grid.create_pg("dp")
        assert again is not first and ranks_of(again) == [1, 3, 5, 7]
        grid.destroy()


@pytest.mark.parametrize("rank", [3, 4, 7])
def test_is_current_rank_in_grid_as_megatron(rank):
    with fake_world(rank, 8):
        ours_grid = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
        theirs = MegatronGrid([2, 2], ["tp", "dp"], rank_offset=4)
        assert ours_grid.is_current_rank_in_grid() == theirs.is_current_rank_in_grid() == (rank >= 4)


def test_is_gtp_remat_active_reads_the_setup_helpers_groups():
    with fake_world(0, 8):
        ours.initialize_model_parallel(tensor_model_parallel_size=2)
        groups = ProcessGroupCollection.setup_process_groups_for_optimizer(None, [object()], False)
        assert ranks_of(groups["gtp_remat_group"]) == [0] == ranks_of(groups["expt_gtp_remat_group"])
        assert not ProcessGroupCollection.is_gtp_remat_active(groups)
        assert ProcessGroupCollection.is_gtp_remat_active({"gtp_remat_group": dist.group.WORLD})
        ours.destroy_model_parallel()


# -- HyperCommGrid as megatron-core 0.19.2 behaves without a process group (its unit tests) --


@pytest.fixture
def grid_pair(monkeypatch):
    """A function making ours and megatron-core's grid alike, sized by ``WORLD_SIZE=8``
    without a process group, as megatron-core's unit tests make them."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    return lambda *args, **kwargs: (HyperCommGrid(*args, **kwargs), MegatronGrid(*args, **kwargs))


def test_create_pg_creates_through_torchs_new_subgroups_by_enumeration(grid_pair):
    # No world: the groups are torch's call's to make, so a patch of it is what runs.
    for grid in grid_pair([2, 2, 2], ["tp", "dp", "pp"], backend="gloo"):
        grid.register_view("expert", [2, 2, 2], ["expt_tp", "ep", "pp"], shared_dims=["pp"])
        made = [mock.MagicMock(spec=dist.ProcessGroup) for _ in range(3)]
        options = object()
        with mock.patch("torch.distributed.new_subgroups_by_enumeration",
                        side_effect=[(group, None) for group in made]) as create, \
                mock.patch("torch.distributed.get_rank", side_effect=AssertionError("get_rank")):
            assert grid.create_pg(["tp", "dp"], pg_options=options, timeout=timedelta(seconds=9)) is made[0]
            assert grid.create_pg(["expt_tp", "ep"], view="expert") is made[1]
            assert grid.create_pg("pp", view="expert") is made[2] is grid.get_pg("pp")
        calls = create.call_args_list
        assert [call.args for call in calls] == [
            ([[0, 1, 2, 3], [4, 5, 6, 7]],), ([[0, 1, 2, 3], [4, 5, 6, 7]],), ([[0, 4], [1, 5], [2, 6], [3, 7]],)]
        assert calls[0].kwargs["backend"] == "gloo" and calls[0].kwargs["pg_options"] is options
        assert calls[0].kwargs["timeout"] == timedelta(seconds=9)
        assert set(grid._pgs) == {"dp-tp", ("expert", ("ep", "expt_tp")), "pp"}


def test_create_pg_without_a_world_is_meshstates_error(grid_pair):
    grid, _ = grid_pair([2], ["tp"])
    with pytest.raises(ConfigError, match="^torch.distributed is not initialized; call "):
        grid.create_pg("tp")
    assert grid._pgs == {}


def test_order_dims_for_orders_against_the_dim_names_given(grid_pair):
    for grid in grid_pair([2, 2, 2], ["tp", "cp", "dp"]):
        assert grid._order_dims_for(grid.dim_names, "cp") == (["cp"], "cp")
        assert grid._order_dims_for(grid.dim_names, ["tp", "dp"]) == (["dp", "tp"], "dp-tp")
        assert grid._order_dims_for(["ep", "edp"], ["ep", "edp"]) == (["edp", "ep"], "edp-ep")


# megatron-core 0.19.2's unit tests match these texts.
REGISTER_VIEW_ERRORS = [
    (([2, 2, 2], ["ep", "expt_dp"], None), r"len\(shape\).*!= len\(dim_names\)"),
    (([2, 2, 2], ["ep", "ep", "expt_dp"], None), "duplicate dim_names"),
    (([4, 2], ["ep", "pp"], ["pp"]), "Shared dim 'pp' .* is not in the base view"),
    (([4, 2], ["ep", "expt_dp"], ["tp"]), "Shared dim 'tp' .* is not in the view's dim_names"),
    (([2, 4], ["ep", "tp"], ["tp"]), "Shared dim 'tp' has different membership"),
]


@pytest.mark.parametrize("view, message", REGISTER_VIEW_ERRORS)
def test_register_view_errors_read_as_megatrons(view, message, grid_pair):
    for grid in grid_pair([2, 2, 2], ["tp", "cp", "dp"]):
        with pytest.raises(ValueError, match=message):
            grid.register_view("expert", view[0], view[1], shared_dims=view[2])


def test_a_registered_view_reads_as_megatrons_and_takes_numpy_sizes(grid_pair):
    for grid in grid_pair([2, 2, 2], ["tp", "dp", "pp"]):
        shape, dim_names = [np.int64(2), np.int64(2), np.int64(2)], ["expt_tp", "ep", "pp"]
        assert grid.register_view("expert", shape, dim_names, shared_dims=["pp"]) is None
        view = grid._views["expert"]
        assert (view.name, view.shape, view.dim_names, view.shared_dims) == (
            "expert", [2, 2, 2], dim_names, ["pp"])
        assert view.shape is not shape and view.dim_names is not dim_names
        assert grid.get_rank_enum("pp", view="expert") == grid.get_rank_enum("pp")


def test_unknown_dims_and_missing_view_groups_name_the_view(grid_pair):
    for grid in grid_pair([2, 2, 2], ["tp", "dp", "pp"]):
        grid.register_view("expert", [2, 2, 2], ["expt_tp", "ep", "pp"], shared_dims=["pp"])
        with pytest.raises(ValueError, match="'ep' is not in view 'base'"):
            grid.get_rank_enum("ep")
        with pytest.raises(KeyError, match="for view 'expert' hasn't been created"):
            grid.get_pg("ep", view="expert")
        with mock.patch("torch.distributed.new_subgroups_by_enumeration",
                        return_value=(mock.MagicMock(spec=dist.ProcessGroup), None)):
            grid.create_pg(["ep", "expt_tp"], view="expert")
            with pytest.raises(KeyError, match="for view 'expert' has already been created"):
                grid.create_pg(["expt_tp", "ep"], view="expert")


def test_destroy_destroys_each_member_group_once_with_torchs_call(grid_pair):
    for grid in grid_pair([2, 4], ["tp", "dp"]):
        member = mock.MagicMock(spec=dist.ProcessGroup)
        grid._pgs = {"tp": member, "dp": dist.GroupMember.NON_GROUP_MEMBER, "cp": None, "dp-tp": member}
        with mock.patch("torch.distributed.destroy_process_group") as destroy:
            grid.destroy()
        destroy.assert_called_once_with(member)
        assert grid._pgs == {}


def _a_grid_reduces_over_its_groups():
    import torch

    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    summed = torch.ones(1) * dist.get_rank()
    dist.all_reduce(summed, group=grid.create_pg("tp"))
    grid.destroy()
    assert torch.equal(summed, torch.tensor([1.0, 1.0, 5.0, 5.0])[dist.get_rank()].view(1))  # 0+1, 2+3


def test_a_grid_makes_its_groups_through_torch_in_threads_and_simulated_too():
    """create_pg through torch's new_subgroups_by_enumeration, in the one-process worlds."""
    from meshstate.testing import simulated_world, threaded_world

    for world in (threaded_world(4), simulated_world(4)):
        with world:
            world.run(_a_grid_reduces_over_its_groups)
