"""meshstate.megatron.parallel_state on 8 real gloo ranks: collectives, destroy, re-init."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshstate.megatron import parallel_state as mpu
from meshstate.testing import distributed

CONFIGS = [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
         expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
         num_distributed_optimizer_instances=2),
    dict(tensor_model_parallel_size=4, context_parallel_size=2, hierarchical_context_parallel_sizes=[1, 2]),
]


def reduce_ranks(group):
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=group)
    return value.item()


@distributed(world_size=8)
def test_init_collectives_destroy_reinit_cycles():
    rank = dist.get_rank()
    for _ in range(2):
        for kwargs in CONFIGS:
            mpu.initialize_model_parallel(**kwargs)
            mesh = mpu.get_mesh()
            for getter, key in [
                (mpu.get_tensor_model_parallel_group, "tp"),
                (mpu.get_pipeline_model_parallel_group, "pp"),
                (mpu.get_model_parallel_group, "tp-pp"),
                (mpu.get_context_parallel_group, "cp"),
                (mpu.get_expert_model_parallel_group, "ep"),
                (mpu.get_expert_data_parallel_group, "edp"),
            ]:
                assert reduce_ranks(getter()) == sum(mesh.ranks(key))
            assert reduce_ranks(mpu.get_data_parallel_group(with_context_parallel=True)) == sum(
                mesh.ranks("dp-cp"))
            # The gloo copies are the data-parallel groups on a gloo world.
            assert mpu.get_data_parallel_group_gloo() is mpu.get_data_parallel_group()
            assert reduce_ranks(mpu.get_data_parallel_group_gloo(with_context_parallel=True,
                                                                  partial_data_parallel=True)) == sum(
                dist.get_process_group_ranks(mpu.get_data_parallel_group(True, partial_data_parallel=True)))
            # Pipeline point-to-point with the neighbours the getters name.
            if mpu.get_pipeline_model_parallel_world_size() > 1:
                outgoing = torch.tensor([float(rank)])
                incoming = torch.zeros(1)
                ops = [dist.P2POp(dist.isend, outgoing, mpu.get_pipeline_model_parallel_next_rank()),
                       dist.P2POp(dist.irecv, incoming, mpu.get_pipeline_model_parallel_prev_rank())]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                assert incoming.item() == mpu.get_pipeline_model_parallel_prev_rank()
            if mpu.is_rank_in_embedding_group():
                assert reduce_ranks(mpu.get_embedding_group()) == sum(mpu._EMBEDDING_GLOBAL_RANKS)
            for group in mpu.get_hierarchical_context_parallel_groups(check_initialized=False) or []:
                reduce_ranks(group)
            mpu.destroy_model_parallel()
            assert mpu._TENSOR_MODEL_PARALLEL_GROUP is None
            assert mpu._DATA_PARALLEL_GLOBAL_RANKS is None
            assert mpu._PIPELINE_GLOBAL_RANKS is None
            assert not mpu.is_initialized()


@distributed(world_size=8)
def test_distributed_timeout_minutes_reaches_every_group():
    mpu.initialize_model_parallel(2, 2, distributed_timeout_minutes=3)
    mesh = mpu.get_mesh()
    for key in mesh.keys():
        if mesh.has_group(key):
            backend = mesh.group(key)._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(minutes=3), key
    mpu.update_pg_timeout(timedelta(minutes=7), mpu.get_tensor_model_parallel_group())
    mpu.destroy_model_parallel()


@distributed(world_size=8)
def test_nccl_options_are_ignored_with_a_warning_on_gloo():
    with pytest.warns(UserWarning, match="NCCL communicator options \\['dp_cp'\\] have no effect"):
        mpu.initialize_model_parallel(2, high_priority_stream_groups=["dp_cp"])
    assert mpu.get_data_parallel_world_size() == 4
    mpu.destroy_model_parallel()


@distributed(world_size=8)
def test_create_group_and_hierarchical_groups():
    mpu.initialize_model_parallel(2)
    rank = dist.get_rank()
    group = mpu.create_group([1, 3, 5], group_desc="odd")
    if rank in (1, 3, 5):
        assert reduce_ranks(group) == 9
    else:
        assert group is None
    levels, gloo_levels = mpu.create_hierarchical_groups(
        rank, list(range(8)), [2, 4], create_gloo_process_groups=True, group_desc="H")
    assert [dist.get_process_group_ranks(g) for g in levels] == [
        [rank - rank % 2, rank - rank % 2 + 1], [rank % 2 + 2 * i for i in range(4)]]
    assert all(g is not None for g in gloo_levels)
    mpu.destroy_model_parallel()
    from torch.distributed import distributed_c10d as c10d
    assert group is None or group not in c10d._world.pg_map
