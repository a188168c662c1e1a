"""Pipeline + tensor + data parallel on a meshstate mesh, checked against one process.

A small residual MLP (an input layer, 4 blocks ``x + w2(gelu(w1(norm(x))))``,
a norm and an output layer; float64) is trained for a few steps on 8 ranks laid
out by ``meshstate.init_mesh(tp=2, pp=2)`` (so dp=2):

- ``mesh.group("pp")``: torch's ``torch.distributed.pipelining``. Each pp rank
  holds one stage (the first the input layer and blocks 0-1, the last blocks
  2-3 and the output layer) as a ``PipelineStage`` over the pp group, and
  ``Schedule1F1B`` runs the local batch as microbatches, sending activations
  and their gradients between the stages.
- ``mesh["tp"]``: tensor parallel inside each stage with
  ``parallelize_module``: every block's ``w1`` is ``ColwiseParallel`` and its
  ``w2`` ``RowwiseParallel``, so the activations between stages are whole.
- ``mesh["dp"]``: FSDP2 (``fully_shard``) over the data-parallel ranks of each
  stage, and the batch split between them.

The schedule calls the loss function once per microbatch and divides the
gradients by the number of microbatches itself (``scale_grads=True``), so the
loss function is the plain mean over its microbatch: dividing there too would
train with gradients too small. FSDP2 averages over dp, and the result is the
gradient of the mean loss over the whole batch.

Every rank also trains an unsharded copy of the whole model (same seed, the
whole batch at once, same AdamW) and the example checks at every step that the
loss and every gradient shard of the rank's stage equal the reference's, and
that the loss went down.

Run it with::

    torchrun --nproc-per-node 8 examples/pipeline_tp_fsdp.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshstate
from fsdp2_tp import Result, _device, _max_grad_diff, checked_result, destroying, torchrun_main

IN = 8
DIM = 16
OUT = 4
LAYERS = 4
BATCH = 16
MICROBATCHES = 4
STEPS = 4
LR = 1e-2
TOLERANCE = 1e-10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.w2(F.gelu(self.w1(self.norm(x))))
        return x + update


class Model(nn.Module):
    """The whole model, or one pipeline stage of it: the parts a stage lacks are None."""

    def __init__(self) -> None:
        super().__init__()
        self.input: nn.Linear | None = nn.Linear(IN, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(DIM)
        self.output: nn.Linear | None = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input is not None:
            x = self.input(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.output is not None:
            x = self.output(self.norm(x))
        return x


def stage_of(part: Model, stage: int, stages: int) -> Model:
    """``part``, a whole model, cut down in place to the layers of ``stage`` (of ``stages``).

    Parameter names stay those of the whole model (``layers.2.w1.weight``). Built in place,
    not copied: ``copy.deepcopy`` of a module costs time quadratic in the ranks a simulated
    world holds.
    """
    per_stage = LAYERS // stages
    for name in list(part.layers):
        if int(name) // per_stage != stage:
            del part.layers[name]
    if stage != 0:
        part.input = None
    if stage != stages - 1:
        part.norm = part.output = None
    return part


def parallelize(part: Model, mesh: meshstate.ParallelMesh) -> Model:
    """Tensor parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``."""
    for block in part.layers.values():
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    return part


def make_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (same on every rank): inputs and regression targets."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    targets = torch.randn(BATCH, OUT, generator=generator, dtype=torch.float64)
    return inputs.to(device), targets.to(device)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over the rows given; the schedule divides by the microbatch count itself."""
    return F.mse_loss(output, target)


def train(tp: int = 2, pp: int = 2, steps: int = STEPS) -> Result:
    """``steps`` pipelined steps on every rank (dp is what ``tp`` and ``pp`` leave of the
    world), checked against one process as :func:`fsdp2_tp.checked_result` says."""
    return destroying(meshstate.init_mesh(tp=tp, pp=pp), _train, steps)


def _train(mesh: meshstate.ParallelMesh, steps: int) -> Result:
    device = _device(mesh)
    torch.manual_seed(0)
    reference = Model().to(device, torch.float64)
    torch.manual_seed(0)  # the same weights again, for the stage
    stage, stages = mesh.rank("pp"), mesh.size("pp")
    model = parallelize(stage_of(Model().to(device, torch.float64), stage, stages), mesh)
    pipeline = Schedule1F1B(
        PipelineStage(model, stage, stages, device, group=mesh.group("pp")),
        n_microbatches=MICROBATCHES,
        loss_fn=loss_of,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    inputs, targets = make_batch(device)
    rows_per_rank = BATCH // mesh.size("dp")
    rows = slice(mesh.rank("dp") * rows_per_rank, (mesh.rank("dp") + 1) * rows_per_rank)

    losses, reference_losses, grad_diffs = [], [], []
    for _ in range(steps):
        microbatch_losses: list[torch.Tensor] = []
        if stage == 0:
            pipeline.step(inputs[rows])
        elif stage == stages - 1:
            pipeline.step(target=targets[rows], losses=microbatch_losses)
        else:
            pipeline.step()
        reference_loss = loss_of(reference(inputs), targets)
        reference_loss.backward()

        # The last stage has each microbatch's loss: their mean, averaged over dp, sent to every stage.
        loss = torch.zeros((), dtype=torch.float64, device=device)
        if microbatch_losses:
            loss = torch.stack(microbatch_losses).mean().detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.group("dp"))
        dist.broadcast(loss, group=mesh.group("pp"), group_src=stages - 1)
        losses.append(loss.item())
        reference_losses.append(reference_loss.item())
        grad_diffs.append(_max_grad_diff(model, reference))

        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()

    return checked_result('pipeline_tp_fsdp', (
        " ".join(f"{axis}={mesh.size(axis)}" for axis in ("tp", "pp", "dp"))
        + f", {MICROBATCHES} microbatches, {steps} steps on {device.type}"
    ), losses, reference_losses, grad_diffs, TOLERANCE, digits=6)


if __name__ == "__main__":
    torchrun_main(train)
