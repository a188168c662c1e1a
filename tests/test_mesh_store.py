"""The mesh owns everything derived from it: destroy() empties one store, gc collects the mesh.

Each case uses a mesh through one layer (reshard, shard_map, torchtitan's ParallelDims,
Megatron's getters), destroys it and drops every reference the test holds: the mesh
must then be collected (a weakref to it dies), and every handle meshstate gave out
that still exists refuses with the line that destroyed the mesh.
"""

import gc
import weakref

import pytest
import torch

import meshstate
from meshstate import NotInitializedError, P, reshard, shard_map
from meshstate.jax import collectives as lax
from meshstate.core.facts import FIELDS
from meshstate.megatron import getters, parallel_state as mpu
from meshstate.megatron.facts import ServedFacts
from meshstate.testing import distributed, fake_world
from meshstate.titan import ParallelDims


def collected(ref):
    gc.collect()
    return ref() is None


def test_a_mesh_reshard_and_shard_map_used_is_collected_after_destroy():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with mesh:
            moved = reshard(torch.arange(8.0), P("tp"))
            reshard(moved, P("cp"))
            shard_map(lambda x: lax.psum(x, "tp"), in_specs=P("tp"), out_specs=P())(torch.ones(4))
        ref = weakref.ref(mesh)
        mesh.destroy()
        del mesh, moved
        assert collected(ref)


def test_parallel_dims_refuse_after_destroy_and_let_the_mesh_go():
    with fake_world(0, 8):
        dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
        dims.get_mesh("tp"), dims.get_mesh("batch"), dims.get_optional_mesh("dp_shard")
        ref = weakref.ref(dims.mesh)
        dims.mesh.destroy()
        for ask in (lambda: dims.get_mesh("tp"), lambda: dims.get_mesh("batch"),
                    lambda: dims.get_optional_mesh("dp_shard"), lambda: dims.world_mesh):
            with pytest.raises(NotInitializedError, match=r"destroyed at .*test_mesh_store.py:\d+"):
                ask()
        del dims
        assert collected(ref)


def test_megatron_getters_refuse_after_destroy_and_let_the_mesh_go():
    with fake_world(3, 8):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        assert mpu.get_tensor_model_parallel_rank() == 1
        ref = weakref.ref(mpu.get_mesh())
        mpu.get_mesh().destroy()
        with pytest.raises(NotInitializedError, match=r"destroyed at .*test_mesh_store.py:\d+"):
            mpu.get_tensor_model_parallel_rank()
        assert collected(ref)
        mpu.destroy_model_parallel()


def test_every_getter_reads_one_object_whose_answered_names_read_fastest():
    """One ServedFacts per served mesh; a name the mesh answers has no class attribute (which
    would cost CPython its specialised read), a name it lacks answers as megatron-core does."""
    with fake_world(3, 8):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
        facts = getters._facts  # rank 3: a middle stage of pipeline (1, 3, 5, 7)
        assert isinstance(facts, ServedFacts) and mpu.get_mesh().store[ServedFacts] is facts
        answered = [name for name in vars(facts) if name.endswith(FIELDS)]
        assert {"tp_rank", "pp_ranks", "dp_cp_group"} <= set(answered)
        assert not [name for name in answered if hasattr(type(facts), name)]
        assert facts.tp_rank == mpu.get_tensor_model_parallel_rank() == 1
        assert "embedding_group" not in answered and facts.maybe.embedding_group is None
        with pytest.raises(NotInitializedError, match="^embedding group is not initialized"):
            facts.embedding_group
        mpu.destroy_model_parallel()


def test_a_hybrid_mesh_is_tracked_like_every_mesh():
    from meshstate.core.current import destroy_every_mesh
    from meshstate.layout.hybrid_grid import HybridGrid
    from meshstate.core.hybrid_mesh import init_hybrid_mesh

    with fake_world(0, 8):
        before = len(meshstate.testing.torch_internals.live_groups())
        hybrid = init_hybrid_mesh(HybridGrid(intra={"dp": 2, "tp": 2}, inter={"dp": 2}))
        assert len(meshstate.testing.torch_internals.live_groups()) == before + 2
        destroy_every_mesh()  # as the harness does between tests
        assert len(meshstate.testing.torch_internals.live_groups()) == before
        hybrid.destroy()  # safe twice


@distributed(world_size=8)
def test_shard_map_over_dp_shard_on_an_hsdp_mesh_equals_psum():
    """One rule decides the view of an axis set: dp_shard is an HSDP axis for slicing,
    collectives, shard_map and reshard alike."""
    mesh = meshstate.init_mesh(tp=2, dp_replicate=2)  # dp=4: dp_replicate=2 x dp_shard=2
    rank = torch.full((1,), float(torch.distributed.get_rank()))
    with mesh:
        summed = lax.psum(rank, "dp_shard")
        mapped = shard_map(lambda block: lax.psum(block, "dp_shard"), in_specs=P("dp_shard"),
                           out_specs=P())(torch.arange(4.0))
        assert mapped.to_local().tolist() == [2.0, 4.0]  # [0, 1] + [2, 3]
        moved = reshard(torch.arange(4.0), P("dp_shard"))
        assert moved.to_local().tolist() == [2.0 * mesh.rank("dp_shard"), 2.0 * mesh.rank("dp_shard") + 1]
        assert mesh["dp_shard"].size() == 2 and summed.item() == sum(mesh.ranks("dp_shard"))
    mesh.destroy()


def test_one_public_way_to_ask_a_position_and_no_old_name_left():
    with fake_world(5, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)  # rank 5: tp=1 cp=0 dp=1
        assert mesh.rank("tp") == 1 and mesh.rank("dp-cp") == 2
        assert mesh.rank(("cp", "dp")) == 1 and mesh.rank(("dp", "tp")) == 3
        for old in ("rank_in", "size_of", "group_of", "ranks_of", "facts", "axis_group"):
            assert not hasattr(mesh, old), old
        assert not hasattr(meshstate, "AxisGroup") and not hasattr(mesh.layout.dense, "axes")
        mesh.destroy()
