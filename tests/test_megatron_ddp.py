"""megatron-core's DistributedDataParallel under meshstate.megatron.install(), on 8 gloo ranks.

The oracle is the same run on megatron-core's own ``parallel_state``: every
gradient after ``finish_grad_sync`` must be equal, and the groups DDP and the
optimizer setup take must have the same ranks. On CPU, as Megatron-LM's own
tests do, ``Tensor.cuda``/``Module.cuda`` are no-ops and
``torch.cuda.current_device()`` answers the CPU device. What still needs CUDA:
megatron-core's optimizers (each makes ``device="cuda"`` tensors in its
constructor) and DDP with several distributed-optimizer instances (CUDA streams);
their group choice is checked against megatron-core's on the fake backend below.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from meshstate.megatron import install, uninstall
from meshstate.megatron import parallel_state as ours
from meshstate.megatron.process_groups import ProcessGroupCollection

MeshstateCollection = ProcessGroupCollection  # install() rebinds no meshstate name
from meshstate.testing import fake_world
from meshstate.testing.launch import LocalWorld

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
    from megatron.core import parallel_state as megatron
    from megatron.core.process_groups_config import ProcessGroupCollection as Theirs

TP, HIDDEN, FFN = 2, 8, 16


def without_cuda():
    """What Megatron-LM's CPU tests do: moving to CUDA keeps the tensor on CPU."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: torch.device("cpu")
    # megatron-core 0.19's grad sync takes the current stream, used only after CUDA-graph replays
    torch.cuda.current_stream = lambda *args, **kwargs: None


def ranks_of(groups):
    return {role: None if group is None else dist.get_process_group_ranks(group)
            for role, group in groups.items()}


def ddp_step(meshstate):
    """A tensor-parallel MLP in megatron-core's DDP, one backward and grad sync per
    ``use_distributed_optimizer``: the main grads and the groups DDP and the optimizer took."""
    without_cuda()
    if meshstate:
        install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as mpu
            from megatron.core import tensor_parallel
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.core.transformer import TransformerConfig
            from megatron.core.transformer.module import MegatronModule
        assert (ProcessGroupCollection is MeshstateCollection) == meshstate
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=TP, tensor_model_parallel_size=TP,
            use_cpu_initialization=True, gradient_accumulation_fusion=False)

        class MLP(MegatronModule):
            def __init__(self):
                super().__init__(config)
                self.up = tensor_parallel.ColumnParallelLinear(
                    HIDDEN, FFN, config=config, init_method=torch.nn.init.normal_, gather_output=False)
                self.down = tensor_parallel.RowParallelLinear(
                    FFN, HIDDEN, config=config, init_method=torch.nn.init.normal_, bias=True,
                    input_is_parallel=True, skip_bias_add=False)

            def forward(self, inputs):
                hidden, _ = self.up(inputs)
                return self.down(torch.relu(hidden))[0]

        results = {}
        for distributed_optimizer in (False, True):
            mpu.initialize_model_parallel(tensor_model_parallel_size=TP)
            torch.manual_seed(0)
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=distributed_optimizer, bucket_size=None)
            model = DistributedDataParallel(config, ddp_config, MLP())
            torch.manual_seed(1 + mpu.get_data_parallel_rank())
            model.zero_grad_buffer()
            model(torch.randn(3, 2, HIDDEN)).pow(2).sum().backward()
            local_grads = {name: p.main_grad.clone() for name, p in model.named_parameters()}
            model.finish_grad_sync()
            results[distributed_optimizer] = {
                "local grads": local_grads,
                "grads": {name: p.main_grad.clone() for name, p in model.named_parameters()},
                "ddp groups": ranks_of({"dp_cp": model.dp_cp_group, "tp": model.tp_group,
                                        "intra_dp_cp": model.intra_dp_cp_group}),
                "optimizer groups": ranks_of(
                    ProcessGroupCollection.setup_process_groups_for_optimizer(None, [model])),
            }
            mpu.destroy_model_parallel()
        return results
    finally:
        uninstall()


def test_ddp_under_install_syncs_the_gradients_megatron_core_syncs():
    with LocalWorld(8) as world:
        theirs = world.run(ddp_step, False)
        mine = world.run(ddp_step, True)
    for rank, (got, want) in enumerate(zip(mine, theirs, strict=True)):
        for distributed_optimizer, expected in want.items():
            assert got[distributed_optimizer]["ddp groups"] == expected["ddp groups"]
            assert got[distributed_optimizer]["optimizer groups"] == expected["optimizer groups"]
            for name, grad in expected["grads"].items():
                assert torch.equal(got[distributed_optimizer]["grads"][name], grad), (rank, name)
    assert theirs[5][True]["ddp groups"]["dp_cp"] == [1, 3, 5, 7]
    assert theirs[5][True]["optimizer groups"]["intra_dp_cp_group_gloo"] == [1, 3, 5, 7]
    # Data-parallel replicas saw different batches: the synced gradient is not the rank's own.
    assert not torch.equal(theirs[0][False]["grads"]["module.down.bias"],
                           theirs[0][False]["local grads"]["module.down.bias"])


class Chunk:
    """What the optimizer setup reads of a model chunk: its configs."""

    def __init__(self, instances, distributed_optimizer, cp=1):
        self.ddp_config = type("DDPConfig", (), dict(
            num_distributed_optimizer_instances=instances,
            use_distributed_optimizer=distributed_optimizer))()
        self.config = type("Config", (), dict(context_parallel_size=cp))()


# (initialize_model_parallel arguments, distributed-optimizer instances), on 8 ranks.
LAYOUTS = [
    (dict(tensor_model_parallel_size=2), 1),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2), 2),
    (dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1), 2),
]


def setups(cls, collection, chunk, use_gloo=False):
    ddp = cls.setup_process_groups_for_ddp(collection, chunk.config, chunk.ddp_config)
    optimizer = cls.setup_process_groups_for_optimizer(collection, [chunk], use_gloo)
    return ranks_of(ddp), ranks_of(optimizer)


@pytest.mark.parametrize(("arguments", "instances"), LAYOUTS)
@pytest.mark.parametrize("rank", [0, 6])
def test_setup_helpers_choose_the_groups_megatron_core_chooses(arguments, instances, rank):
    """With no collection (the current groups) and with ``use_mpu_process_groups()``'s."""
    chunk = Chunk(instances, distributed_optimizer=True, cp=arguments.get("context_parallel_size", 1))
    with fake_world(rank, 8):
        megatron.initialize_model_parallel(
            num_distributed_optimizer_instances=instances, create_gloo_process_groups=False,
            **arguments)
        expected = [setups(Theirs, None, chunk), setups(Theirs, Theirs.use_mpu_process_groups(), chunk)]
        megatron.destroy_model_parallel()
        ours.initialize_model_parallel(num_distributed_optimizer_instances=instances, **arguments)
        try:
            got = [setups(ProcessGroupCollection, None, chunk),
                   setups(ProcessGroupCollection, ProcessGroupCollection.use_mpu_process_groups(), chunk)]
            assert got == expected
            _, with_gloo = setups(ProcessGroupCollection, None, chunk, use_gloo=True)
            assert with_gloo["intra_dp_cp_group_gloo"] == with_gloo["intra_dp_cp_group"]
            assert with_gloo["intra_expt_dp_group_gloo"] == with_gloo["intra_expt_dp_group"]
        finally:
            ours.destroy_model_parallel()


def test_setup_helpers_refuse_what_megatron_core_refuses():
    chunk = Chunk(2, distributed_optimizer=True, cp=2)
    with fake_world(0, 8):
        ours.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        try:
            groups = vars(ProcessGroupCollection.use_mpu_process_groups(
                ["dp", "tp", "pp", "ep", "expt_dp", "mp"]))
            for cls in (Theirs, ProcessGroupCollection):
                partial = cls(**groups)
                with pytest.raises(ValueError, match="^dp_cp process group is required when "
                                   "context_parallel_size > 1"):
                    cls.setup_process_groups_for_ddp(partial, chunk.config, chunk.ddp_config)
                partial.dp_cp = partial.dp
                with pytest.raises(ValueError, match="^intra_dp_cp, intra_expt_dp, and inter_dist_opt "
                                   r"process groups are required when using multiple optimizer"):
                    cls.setup_process_groups_for_ddp(partial, chunk.config, chunk.ddp_config)
                with pytest.raises(ValueError, match="^tp_ep_pp process group is required"):
                    cls.setup_process_groups_for_optimizer(partial, [Chunk(1, False)], True)
                partial.tp_ep_pp = None
                with pytest.raises(ValueError, match="^Gloo process groups are not supported"):
                    cls.setup_process_groups_for_optimizer(partial, [Chunk(1, False)], True)
        finally:
            ours.destroy_model_parallel()
