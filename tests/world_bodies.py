"""Test bodies people write for parallel training code, each run by test_every_world.py in
processes, on a thread per rank and simulated in one process (module level, so workers
import them), and by test_threaded.py and test_simulated_bodies.py for what only one
world does.

Each returns what its rank saw.
"""

import io
import logging
import os
import threading
import time
import warnings
from collections import namedtuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshstate
from meshstate.megatron import parallel_state as mpu

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
    from megatron.core import ModelParallelConfig, tensor_parallel


W = torch.arange(24, dtype=torch.float64).reshape(4, 6)
"""Made outside the bodies, as a test's module-level weights are: every rank holds it."""
MADE_OUTSIDE = torch.Generator()
SENT_FROM_OUTSIDE = torch.tensor([7, 8, 9])
"""Made outside the bodies: every rank sends the same."""
Pair = namedtuple("Pair", "rank tp")


def tp_rank():
    """This rank's place in tp of ``init_mesh(tp=2)`` on 4 ranks: 0 on ranks 0 and 2, 1 on 1 and 3."""
    return meshstate.init_mesh(tp=2).rank("tp")


def seeded(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


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



def slices_at_a_rank():
    """Shards taken by slicing with the tp rank, written through, and a gradient through one."""
    t = tp_rank()
    taken = {"W[:, t*3:(t+1)*3]": W[:, t * 3:(t + 1) * 3], "W[t]": W[t], "W[..., t]": W[..., t],
             "W[None, t, 1:]": W[None, t, 1:]}
    taken = {name: shard.clone() for name, shard in taken.items()}
    mine = W + torch.zeros(1)  # made in the body: each rank's own
    mine[:, t * 3:(t + 1) * 3] *= -1
    mine[t] = 100.0
    mine[t + 2] = torch.full((6,), -5.0, dtype=torch.float64)
    taken["writes through per-rank views of a tensor the body made"] = mine
    weight = nn.Parameter(W.clone())
    (weight[:, t * 3:(t + 1) * 3] * (torch.full((), dist.get_rank()) + 1.0)).sum().backward()
    taken["gradient through a per-rank slice"] = weight.grad
    return taken


def narrow_at_a_rank():
    t = tp_rank()
    weight = nn.Parameter(W.clone())
    weight.narrow(1, t * 3, 3).pow(2).sum().backward()
    return {"W.narrow(1, t*3, 3)": W.narrow(1, t * 3, 3).clone(), "its gradient": weight.grad}


def parts_at_a_rank():
    """``chunk``, ``split``, ``tensor_split`` and ``unbind`` indexed by the tp rank."""
    t = tp_rank()
    return {"W.chunk(2, 1)[t]": W.chunk(2, 1)[t].clone(),
            "torch.split(W, 3, dim=1)[t]": torch.split(W, 3, dim=1)[t].clone(),
            "W.tensor_split(2, 1)[t]": W.tensor_split(2, 1)[t].clone(),
            "W.unbind(0)[t]": W.unbind(0)[t].clone(),
            "torch.chunk(W, 2, -1)[-1 - t]": torch.chunk(W, 2, -1)[-1 - t].clone(),
            "W.tensor_split(4, 1)[t + 1] (parts of 2, 2, 1, 1)": W.tensor_split(4, 1)[t + 1].clone(),
            "vmap of chunk": torch.func.vmap(lambda row: row.chunk(2))(W),
            "tree_map over chunk": torch.utils._pytree.tree_map(lambda part: part * 2, W.chunk(2, 1))}


def index_select_at_a_rank():
    t = tp_rank()
    return W.index_select(1, torch.arange(3) + 3 * t)


def tensors_made_of_ranks():
    rank, t = dist.get_rank(), tp_rank()
    return {"torch.tensor(rank)": torch.tensor(rank), "torch.tensor([rank, 1])": torch.tensor([rank, 1]),
            "torch.as_tensor([[t], [rank]])": torch.as_tensor([[t], [rank]]),
            "torch.tensor([t], dtype=float)": torch.tensor([t], dtype=torch.float64),
            "torch.full((2,), rank)": torch.full((2,), rank)}


def seeded_generators():
    rank = dist.get_rank()
    seeded = torch.Generator().manual_seed(0)
    per_rank = torch.Generator().manual_seed(rank)
    return {"a seeded generator": torch.randn(3, generator=seeded),
            "its next draw": torch.randint(10, (4,), generator=seeded),
            "its initial seed": seeded.initial_seed(),
            "a generator seeded with the rank": torch.randn(3, generator=per_rank),
            "its next draw, in place": torch.zeros(2).normal_(generator=per_rank),
            "isinstance(a generator made outside, torch.Generator)": isinstance(MADE_OUTSIDE, torch.Generator)}


def manual_seeds():
    """``torch.manual_seed``, then the default generator's draws and a layer it initializes."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    answers = {"torch.manual_seed(7)": torch.randn(2), "then nn.Linear": nn.Linear(2, 2).weight.detach(),
               "then dropout": nn.functional.dropout(torch.ones(6), 0.5)}
    torch.manual_seed(rank)
    answers["torch.manual_seed(rank)"] = torch.randn(2)
    answers["torch.initial_seed()"] = torch.initial_seed()
    with torch.random.fork_rng():
        answers["in fork_rng"] = torch.rand(2)
    answers["after fork_rng"] = torch.rand(2)
    return answers


def group_queries():
    mesh = meshstate.init_mesh(tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    rank = dist.get_rank()
    return {"get_process_group_ranks(tp)": dist.get_process_group_ranks(tp),
            "get_process_group_ranks(dp)": dist.get_process_group_ranks(dp),
            "get_process_group_ranks(None)": dist.get_process_group_ranks(None),
            "torch.tensor(get_process_group_ranks(tp))": torch.tensor(dist.get_process_group_ranks(tp)),
            "get_global_rank(tp, 1)": dist.get_global_rank(tp, 1),
            "get_global_rank(dp, tp rank)": dist.get_global_rank(dp, mesh.rank("tp")),
            "get_group_rank(tp, rank)": dist.get_group_rank(tp, rank),
            'mesh["tp"].mesh': mesh["tp"].mesh, 'mesh["dp"].mesh': mesh["dp"].mesh}


def process_group_rank():
    """The C++ ``ProcessGroup``'s own answers, which megatron-core and FSDP2 read."""
    mesh = meshstate.init_mesh(tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    return {"tp.rank()": tp.rank(), "tp.size()": tp.size(), "dp.rank()": dp.rank(),
            "dp.size()": dp.size(), "mesh['tp'].get_local_rank()": mesh["tp"].get_local_rank()}


def f_string_of_a_rank():
    return f"model_tp{tp_rank()}_of_{dist.get_world_size()}.pt"


def logs_each_rank():
    """Lines this rank's thread logged (a threaded world's ranks share the logger)."""
    logger = logging.getLogger("world body")
    lines = []
    me = threading.get_ident()
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record)) if record.thread == me else None
    logger.addHandler(handler)
    try:
        logger.warning("tp rank %s of %d", tp_rank(), 2)
        logger.warning("every rank: %s", 2)
    finally:
        logger.removeHandler(handler)
    return lines


def comparisons():
    """``allclose``, ``equal`` and a passing ``assert_close`` on per-rank values."""
    t = tp_rank()
    mine = torch.full((2,), t) * 0.5
    torch.testing.assert_close(mine * 2, torch.full((2,), t) * 1.0)
    return {"allclose(mine, 0)": torch.allclose(mine, torch.zeros(2)),
            "mine.allclose(mine + 1e-9)": mine.allclose(mine + 1e-9),
            "equal(mine, 0)": torch.equal(mine, torch.zeros(2))}


def object_collectives():
    mesh = meshstate.init_mesh(tp=2)
    rank, tp = dist.get_rank(), mesh.group("tp")
    everyone = [None] * 4
    dist.all_gather_object(everyone, {"rank": rank, "row": W[rank], "pair": Pair(rank, mesh.rank("tp"))})
    partners = [None] * 2
    dist.all_gather_object(partners, (rank, "same text"), group=tp)
    from_one = [rank, "x"]
    dist.broadcast_object_list(from_one, src=1)
    from_first = [rank * 10, mesh.ranks("tp"), rank % 3 == 0]
    dist.broadcast_object_list(from_first, src=mesh.first_rank("tp"), group=tp)
    from_second = [{"rank": rank}]
    dist.broadcast_object_list(from_second, group=tp, group_src=1)
    return {"all_gather_object": everyone, "all_gather_object over tp": partners,
            "broadcast_object_list(src=1)": from_one,
            "broadcast_object_list(src=first of tp, group=tp)": from_first,
            "broadcast_object_list(group=tp, group_src=1)": from_second}


def loss_items():
    """``.item()`` of a loss every rank agrees on (summed over the world), and of ints and bools."""
    rank = dist.get_rank()
    loss = seeded(rank, 4, dtype=torch.float64).pow(2).mean()
    dist.all_reduce(loss)
    return {"loss.item() after all_reduce": loss.item(), "item() of an int": torch.full((1,), rank).item(),
            "item() of a bool": (torch.full((1,), tp_rank()) > 0).item(),
            "item() of a float every rank shares": (torch.ones(1) * 0.25).item()}


def tp_step(backend=None):
    """Two SGD steps of a Colwise/Rowwise pair over tp; compiled with ``backend`` unless None."""
    mesh = meshstate.init_mesh(tp=2)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        for seed, parameter in enumerate(model.parameters()):
            parameter.copy_(seeded(seed, *parameter.shape))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    run = step if backend is None else torch.compile(step, backend=backend, dynamic=False)
    x = torch.arange(8.0).reshape(2, 4) + dist.get_rank() // 2
    for _ in range(2):
        optimizer.zero_grad()
        loss = run(x)
        optimizer.step()
    return loss.detach(), model[0].weight.to_local().detach()


def jax_style_tp_step_compiled():
    """Three SGD steps of ``psum(gelu(pvary(x) @ a) @ b)`` over tp=2, dp=2, compiled
    (fullgraph, aot_eager); weights and data drawn after ``torch.manual_seed`` in the body,
    each rank's data while other ranks may be compiling (their compile must not touch it)."""
    mesh = meshstate.init_mesh(tp=2)
    t, d = mesh.rank("tp"), mesh.rank("dp")
    torch.manual_seed(0)
    a = (torch.randn(4, 8, dtype=torch.float64) / 4)[:, 4 * t:4 * t + 4].clone().requires_grad_()
    b = (torch.randn(8, 4, dtype=torch.float64) / 4)[4 * t:4 * t + 4].clone().requires_grad_()

    def step(x, y, a, b):
        h = torch.nn.functional.gelu(meshstate.pvary(x, "tp") @ a)
        return ((meshstate.psum(h @ b, "tp") - y) ** 2).mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    losses = []
    with mesh:
        for s in range(3):
            torch.manual_seed(100 + s)
            xs, ys = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
            loss = compiled(xs[2 * d:2 * d + 2], ys[2 * d:2 * d + 2], a, b)
            loss.backward()
            with torch.no_grad():
                for weight in (a, b):
                    weight -= 0.1 * meshstate.pmean(weight.grad, "dp")
                    weight.grad = None
            losses.append(meshstate.pmean(loss.detach(), "dp"))
    return {"losses": torch.stack(losses), "a": a.detach(), "b": b.detach()}


def ring_attention():
    """Causal attention over 4 blocks of a sequence, one per cp rank, keys and values passed
    round the ring; a block after this rank's is skipped by a Python ``if`` on its index."""
    mesh = meshstate.init_mesh(cp=4)
    rank, size = mesh.rank("cp"), mesh.size("cp")
    q, k, v = (seeded(seed, 8, 3, dtype=torch.float64) for seed in range(3))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    whole = (q @ k.T).masked_fill(~causal, float("-inf")).softmax(-1) @ v
    q_mine, keys, values = q.chunk(size)[rank], k.chunk(size)[rank], v.chunk(size)[rank]
    weighted, total = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)
    to_next = [(i, (i + 1) % size) for i in range(size)]
    with mesh:
        for step in range(size):
            block = (rank - step) % size
            if block <= rank:
                scores = (q_mine @ keys.T).exp()
                if block == rank:
                    scores = scores * causal[:2, :2]
                weighted, total = weighted + scores @ values, total + scores.sum(-1, keepdim=True)
            keys = meshstate.ppermute(keys, "cp", perm=to_next)
            values = meshstate.ppermute(values, "cp", perm=to_next)
    return {"ring": weighted / total, "one process": whole.chunk(size)[rank]}


def prints():
    """What a rank prints: its rank and its loss."""
    out, rank = io.StringIO(), dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()}", file=out)
    print("loss", torch.tensor(rank) * 0.5, file=out)
    return out.getvalue()


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


def point_to_point():
    """Every way values cross between the two stages of init_mesh(tp=2, pp=2) on 8 ranks."""
    mesh = meshstate.init_mesh(tp=2, pp=2)
    pp, stage, rank = mesh.group("pp"), mesh.rank("pp"), dist.get_rank()
    mine = torch.tensor([rank, 10 * rank])
    received = torch.zeros(2, dtype=torch.long)
    if stage == 0:
        dist.send(mine, dst=mesh.next_rank("pp"), group=pp)  # a peer per rank: 0 -> 4, 1 -> 5, ...
        sender = dist.recv(received, group=pp, group_src=1)
    else:
        sender = dist.recv(received, src=mesh.prev_rank("pp"), group=pp)
        dist.send(mine * 2, group=pp, group_dst=0)
    batched = torch.zeros(2, dtype=torch.long)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, mine + 100, group=pp, group_peer=1 - stage),
        dist.P2POp(dist.irecv, batched, group=pp, group_peer=1 - stage),
    ])
    for work in works:
        work.wait()
    objects = [None, None]
    shared = torch.zeros(3, dtype=torch.long)
    if stage == 0:
        dist.send_object_list([{"from": rank}, "text"], group=pp, group_dst=1)
        dist.send(SENT_FROM_OUTSIDE, group=pp, group_dst=1)  # every rank's the same
    else:
        dist.recv_object_list(objects, group=pp, group_src=0)
        dist.recv(shared, group=pp, group_src=0)
    over_pp, over_world = torch.tensor([rank]), torch.tensor([rank])
    dist.all_reduce(over_pp, group=pp, async_op=True).wait()
    dist.all_reduce(over_world, op=dist.ReduceOp.MAX)
    gathered, gathered_too = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    dist.all_gather_single(gathered, torch.tensor([rank]), group=mesh.group("tp-pp"))
    with warnings.catch_warnings():  # torch names all_gather_single its successor
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(gathered_too, torch.tensor([-rank]), group=mesh.group("tp-pp"))
    return {"received": received, "sender": sender, "batched": batched, "objects": objects,
            "a tensor made outside": shared, "all_reduce over pp": over_pp,
            "max over the world": over_world, "all_gather over tp-pp": gathered,
            "all_gather_into_tensor over tp-pp": gathered_too}


def seeded_then_drawn_between_barriers():
    """Every rank seeds, draws, waits for the others to have drawn, draws again."""
    torch.manual_seed(0)
    first = torch.randn(2)
    dist.barrier()
    return {"first": first, "second": torch.randn(2), "initial seed": torch.initial_seed()}
