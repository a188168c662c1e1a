"""Bodies test_threaded.py runs on threads and on processes (module level, so workers import them).

Each returns what its rank saw; the test compares the two worlds rank by rank.
Random numbers come from a ``torch.Generator`` of the body's own: a threaded
world's ranks share the process's default generator.
"""

import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

import meshstate
from meshstate.megatron import parallel_state as mpu

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
    from megatron.core import ModelParallelConfig, tensor_parallel


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def collectives_on_a_tp_mesh():
    """torch's collectives on the world and on tp, and meshstate's JAX-style ones over tp."""
    rank = dist.get_rank()
    mesh = meshstate.init_mesh(tp=2)
    mine = torch.arange(4.0) + 10 * rank
    summed = mine.clone()
    dist.all_reduce(summed)
    gathered = [torch.zeros(4) for _ in range(4)]
    dist.all_gather(gathered, mine)
    broadcast = mine.clone()
    dist.broadcast(broadcast, src=3)
    scattered = torch.zeros(1)
    dist.reduce_scatter_single(scattered, mine)
    tp_summed = mine.clone()
    dist.all_reduce(tp_summed, group=mesh.group("tp"))
    with mesh:
        return {
            "all_reduce": summed, "all_gather": torch.stack(gathered), "broadcast": broadcast,
            "reduce_scatter": scattered, "tp all_reduce": tp_summed,
            "psum": meshstate.psum(mine, "tp"),
            "all_gather tp": meshstate.all_gather(mine, "tp"),
            "ppermute": meshstate.ppermute(mine, "tp", perm=[(0, 1), (1, 0)]),
            "axis_index": meshstate.axis_index("tp"),
        }


def megatron_getters_per_rank():
    """Overrides, virtual stages, groups, buffers and destroy: each rank's own.

    A barrier between each write and its read: state shared between ranks would
    show the last rank's write to every rank.
    """
    rank = dist.get_rank()
    mpu.set_tensor_model_parallel_world_size(rank + 1)
    dist.barrier()
    before_init = mpu.get_tensor_model_parallel_world_size()
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    mpu.set_virtual_pipeline_model_parallel_world_size(rank + 5)
    dist.barrier()
    answers = {
        "tp size override before init": before_init,
        "vpp size": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "vpp size by megatron-core's name": mpu._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
        "tp rank": mpu.get_tensor_model_parallel_rank(),
        "dp rank": mpu.get_data_parallel_rank(),
        "dp size": mpu.get_data_parallel_world_size(),
        "tp group": dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
        "dp group": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
        "dp group by megatron-core's name": dist.get_process_group_ranks(mpu._DATA_PARALLEL_GROUP),
        "memory buffer": mpu.get_global_memory_buffer().get_tensor((2,), torch.float32, "x").shape,
    }
    if rank == 0:
        mpu.destroy_model_parallel()
    dist.barrier()
    answers["initialized after rank 0 destroyed"] = mpu.is_initialized()
    answers["memory buffer after rank 0 destroyed"] = mpu._GLOBAL_MEMORY_BUFFER is not None
    mpu.destroy_model_parallel()
    answers["initialized after destroy"] = mpu.is_initialized()
    return answers


def ddp_step():
    """One DistributedDataParallel step of a linear layer, a batch per rank."""
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(seeded(0, 2, 4))
        model.bias.zero_()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(seeded(1 + dist.get_rank(), 3, 4)).pow(2).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    return {"weight.grad": model.weight.grad, "weight": model.weight.detach()}


def fsdp_step():
    """One FSDP2 (``fully_shard``) step of a two-layer model over the world, a batch per rank."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        for seed, parameter in enumerate(model.parameters()):
            parameter.copy_(seeded(seed, *parameter.shape))
    mesh = meshstate.init_mesh()  # dp over the world
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh.dense["dp"])
    model(seeded(10 + dist.get_rank(), 3, 4)).pow(2).sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"grads": grads,
            "parameters": {name: p.full_tensor().detach() for name, p in model.named_parameters()}}


def send_receive_and_ring():
    """A send and a receive, then a ring of ``batch_isend_irecv`` that posts its receive
    first (a receive that blocked until its wait would deadlock it)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    pair = torch.zeros(3)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1)
    elif rank == 1:
        dist.recv(pair, src=0)
    from_left = torch.zeros(2)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.irecv, from_left, (rank - 1) % size),
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % size),
    ])
    for work in works:
        work.wait()
    return {"pair": pair, "ring": from_left}


STAGE_WIDTHS = [(4, 6), (6, 3)]
MICROBATCHES = 4


def two_stage_model():
    stages = [nn.Linear(width_in, width_out) for width_in, width_out in STAGE_WIDTHS]
    with torch.no_grad():
        for seed, parameter in enumerate(p for stage in stages for p in stage.parameters()):
            parameter.copy_(seeded(seed, *parameter.shape))
    return stages


def pipeline_1f1b():
    """A 2-stage 1F1B pipeline (torch's pipelining) over ``pp`` of ``init_mesh(pp=2, tp=2)``:
    each stage's gradients, and the same model's in one process, for comparison."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def loss_fn(outputs, targets):
        return (outputs - targets).pow(2).sum()

    mesh = meshstate.init_mesh(pp=2, tp=2)
    stage_index = mesh.rank("pp")
    stages = two_stage_model()
    stage = PipelineStage(stages[stage_index], stage_index, 2, torch.device("cpu"),
                          group=mesh.group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    inputs, targets = seeded(100, 8, 4), seeded(101, 8, 3)
    if stage_index == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=[])
    whole = two_stage_model()
    for inputs_part, targets_part in zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES)):
        loss_fn(whole[1](whole[0](inputs_part)), targets_part).backward()
    return {"pipelined": {name: p.grad for name, p in stages[stage_index].named_parameters()},
            "one process": {name: p.grad for name, p in whole[stage_index].named_parameters()}}


def dcp_save_and_load(directory):
    """A row-sharded tensor saved with torch.distributed.checkpoint and loaded into zeros."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = meshstate.init_mesh()  # dp over the world
    full = torch.arange(32.0).reshape(8, 4)
    saved = {"weight": distribute_tensor(full, mesh.dense["dp"], [Shard(0)]),
             "step": torch.tensor(7)}
    dcp.save(saved, checkpoint_id=os.fspath(directory))
    loaded = {"weight": distribute_tensor(torch.zeros(8, 4), mesh.dense["dp"], [Shard(0)]),
              "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=os.fspath(directory))
    return {"local shard": loaded["weight"].to_local(), "step": loaded["step"],
            "whole": loaded["weight"].full_tensor()}


def say_hello():
    print(f"hello from {dist.get_rank()}")


def raise_on_rank_one_while_others_wait():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    dist.all_reduce(torch.ones(1))


def receive_forever_on_rank_two():
    if dist.get_rank() == 2:
        dist.recv(torch.zeros(1), src=0)  # nobody sends
    return dist.get_rank()


def receive_on_two_and_sleep_on_three():
    if dist.get_rank() == 2:
        dist.recv(torch.zeros(1), src=0)  # woken when the run times out
    if dist.get_rank() == 3:
        time.sleep(3.0)  # cannot be woken
    return dist.get_rank()


def megatron_core_layers():
    """megatron-core's ColumnParallelLinear and RowParallelLinear under install():
    output and gradients, from the same full weights on every rank."""
    from meshstate.megatron import install

    install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False)
    column = tensor_parallel.ColumnParallelLinear(
        4, 8, config=config, init_method=nn.init.zeros_, gather_output=False)
    row = tensor_parallel.RowParallelLinear(
        8, 4, config=config, init_method=nn.init.zeros_, bias=True, input_is_parallel=True,
        skip_bias_add=False)
    with torch.no_grad():  # each rank's shard of the same full weights
        column.weight.copy_(seeded(0, 8, 4).chunk(2, dim=0)[tp_rank])
        column.bias.zero_()
        row.weight.copy_(seeded(1, 4, 8).chunk(2, dim=1)[tp_rank])
        row.bias.zero_()
    inputs = seeded(2 + parallel_state.get_data_parallel_rank(), 3, 4).requires_grad_()
    hidden, _ = column(inputs)
    outputs, _ = row(torch.relu(hidden))
    outputs.pow(2).sum().backward()
    parallel_state.destroy_model_parallel()
    return {"outputs": outputs.detach(), "inputs.grad": inputs.grad,
            "column.weight.grad": column.weight.grad, "row.weight.grad": row.weight.grad}


def groups_made_without_an_agreed_name():
    """Megatron's create_group family, which names groups by a count of this rank's builds:
    each thread is a rank of its own, so each counts its own."""
    from meshstate.core.groups import create_group_family

    pairs = create_group_family([[0, 1], [2, 3]], description="pairs")
    halves = create_group_family([[0, 2], [1, 3]], description="halves")
    total = torch.ones(1) * dist.get_rank()
    dist.all_reduce(total, group=pairs)
    dist.all_reduce(total, group=halves)
    return total
