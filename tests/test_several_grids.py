"""Several live meshes on a rank: the Megatron façade answers for the mesh picked, or refuses.

megatron-core deprecates its globals because getters silently answered for the
wrong grid (Megatron-LM#6307). meshstate's getters answer from the mesh
``initialize_model_parallel`` built while it is the only live mesh of the rank;
with another one alive they answer inside ``with mesh:`` for that mesh, and
refuse without it, naming both meshes and ``with mesh:``. Fake backend, rank 5 of 8.
"""

import pytest
import torch.distributed as dist

import meshstate
from meshstate.errors import AmbiguousMeshError
from meshstate.megatron import parallel_state as mpu
from meshstate.megatron.process_groups import ProcessGroupCollection
from meshstate.testing import fake_world


@pytest.fixture
def served_and_other():
    """initialize_model_parallel's mesh (tp=2) and a second live mesh (tp=4), rank 5 of 8."""
    with fake_world(5, 8):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        served = mpu.get_mesh()
        other = meshstate.init_mesh(tp=4)
        yield served, other
        other.destroy()
        mpu.destroy_model_parallel()


def test_a_getter_with_two_live_meshes_and_no_pick_refuses_naming_both(served_and_other):
    served, other = served_and_other
    for getter in (mpu.get_tensor_model_parallel_world_size, mpu.get_tensor_model_parallel_group,
                   mpu.get_data_parallel_rank, mpu.get_mesh):
        with pytest.raises(AmbiguousMeshError) as refused:
            getter()
        message = str(refused.value)
        assert "2 live meshes on rank 5" in message and "with mesh:" in message
        assert "initialize_model_parallel" in message and other.built_at in message
        assert getter.__name__ in message
    assert isinstance(refused.value, RuntimeError)


def test_with_mesh_picks_the_mesh_that_answers(served_and_other):
    served, other = served_and_other
    with other:
        assert mpu.get_tensor_model_parallel_world_size() == 4
        assert dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()) == [4, 5, 6, 7]
        assert mpu.get_data_parallel_world_size() == 2 and mpu.get_mesh() is other
        with served:
            assert mpu.get_tensor_model_parallel_world_size() == 2
            assert dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()) == [4, 5]
        assert mpu.get_tensor_model_parallel_rank() == 1


def test_process_group_collection_follows_the_same_rule(served_and_other):
    served, other = served_and_other
    with pytest.raises(AmbiguousMeshError, match="use_mpu_process_groups"):
        ProcessGroupCollection.use_mpu_process_groups(["tp"])
    with other:
        assert dist.get_process_group_ranks(ProcessGroupCollection.use_mpu_process_groups(["tp"]).tp) == [4, 5, 6, 7]


def test_once_the_other_mesh_is_destroyed_the_served_mesh_answers_again(served_and_other):
    served, other = served_and_other
    other.destroy()
    assert mpu.get_tensor_model_parallel_world_size() == 2 and mpu.get_mesh() is served


def test_a_mesh_over_other_ranks_is_no_rival():
    with fake_world(5, 8):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        assert meshstate.init_mesh(tp=2, ranks=range(4)) is None  # ranks 0-3: none on rank 5
        assert mpu.get_tensor_model_parallel_world_size() == 2
        mpu.destroy_model_parallel()


def test_only_a_mesh_not_served_answers_inside_its_with_block():
    with fake_world(5, 8):
        mesh = meshstate.init_mesh(tp=4)
        with mesh:
            assert mpu.get_tensor_model_parallel_world_size() == 4
        with pytest.raises(AssertionError, match="not initialized"):
            mpu.get_tensor_model_parallel_group()
        mesh.destroy()
