"""FSDP2 HSDP + tensor parallel through meshstate's torchtitan adapter, checked against one process.

The model of ``fsdp2_tp.py`` (a tiny decoder-only transformer) trained on 8
ranks laid out by ``meshstate.titan.ParallelDims(dp_replicate=2, dp_shard=2,
tp=2)``, the way torchtitan code asks for its meshes:

- ``get_mesh("tp")``: tensor parallel with ``parallelize_module``, as in
  ``fsdp2_tp.py``;
- ``get_mesh(["dp_replicate", "dp_shard"])``: FSDP2 HSDP, parameters sharded
  over ``dp_shard`` and replicated over ``dp_replicate``; gradients are
  averaged over both;
- ``get_mesh("batch")`` splits the batch.

Every rank also trains an unsharded copy (same seed, whole batch, same AdamW)
and the example checks at every step that the loss and every gradient shard
equal the reference's, and that the loss went down.

Run it with::

    torchrun --nproc-per-node 8 examples/titan_hsdp_tp.py
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from fsdp2_tp import (
    BATCH,
    LR,
    STEPS,
    Result,
    Transformer,
    checked_result,
    _max_grad_diff,
    loss_of,
    make_batch,
    parallelize_tp,
)
from meshstate.titan import ParallelDims


def train(dp_replicate: int = 2, tp: int = 2, steps: int = STEPS) -> Result:
    """Train on every rank of an initialised gloo or NCCL world; check against the reference.

    ``dp_shard`` is what is left of the world. Prints a summary on rank 0 and
    raises ``RuntimeError`` if the loss did not go down or differs from the reference.
    """
    dims = ParallelDims(
        dp_replicate=dp_replicate, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1,
        world_size=dist.get_world_size(),
    )
    try:
        return _train(dims, steps)
    finally:
        dims.mesh.destroy()


def _train(dims: ParallelDims, steps: int) -> Result:
    device = torch.device(dims.mesh.device_type)
    torch.manual_seed(0)
    reference = Transformer().to(device)
    model = copy.deepcopy(reference)
    hsdp_mesh = dims.get_mesh(["dp_replicate", "dp_shard"])
    parallelize_tp(model, dims.get_mesh("tp"))
    for block in model.layers:
        fully_shard(block, mesh=hsdp_mesh)
    fully_shard(model, mesh=hsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    inputs, labels = make_batch(device)
    batch = dims.get_mesh("batch")
    rows_per_rank = BATCH // batch.size()
    rows = slice(batch.get_local_rank() * rows_per_rank, (batch.get_local_rank() + 1) * rows_per_rank)

    losses, reference_losses, grad_diffs = [], [], []
    for _ in range(steps):
        with loss_parallel():
            loss = loss_of(model(inputs[rows]), labels[rows])
            loss.backward()
        reference_loss = loss_of(reference(inputs), labels)
        reference_loss.backward()
        global_loss = loss.to_local().detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=batch.get_group())
        losses.append(global_loss.item())
        reference_losses.append(reference_loss.item())
        grad_diffs.append(_max_grad_diff(model, reference))
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()

    return checked_result('titan_hsdp_tp', (
        f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp}, "
        f"{steps} steps on {device.type}"
    ), losses, reference_losses, grad_diffs)


def main() -> None:
    """Entry point under ``torchrun --nproc-per-node 8`` (gloo on CPU)."""
    dist.init_process_group("gloo")
    try:
        train()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
