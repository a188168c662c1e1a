"""FSDP2 + tensor parallel + context parallel on a meshstate mesh, checked against one process.

A tiny decoder-only transformer (token and position embeddings, causal
attention, MLP, RMSNorm, output head; 2 layers) is trained for a few steps on
8 ranks laid out by ``meshstate.init_mesh(tp=2, cp=2)`` (so dp=2):

- ``mesh["tp"]``: tensor parallel with ``parallelize_module``. Attention
  q/k/v and the first MLP matrix are ``ColwiseParallel`` (each tp rank keeps
  half of the heads and half of the hidden units), the attention output and
  the second MLP matrix are ``RowwiseParallel``; the embedding is sharded by
  vocabulary rows and the output head by vocabulary columns, its logits stay
  sharded and ``loss_parallel`` computes the cross-entropy.
- ``mesh["dp-cp"]``: FSDP2 (``fully_shard``) over the flattened data x context
  mesh: every parameter, TP-sharded or not, is further sharded over these 4
  ranks, and gradients are averaged over them. (HSDP, replicating over dp and
  sharding over cp, is ``fully_shard(..., mesh=mesh["dp", "cp"])``; it gives the
  same numbers.)
- ``mesh["dp"]`` splits the batch and ``mesh["cp"]`` splits the sequence. The
  context parallelism is real but deliberately simple (all-gather, not ring
  attention): each cp rank holds a contiguous chunk of every sequence and
  all-gathers keys and values over ``mesh.group("cp")`` before attention (the
  backward reduce-scatters their gradients), with positions and the causal
  mask offset by the chunk's start. So every dp-cp rank computes the mean loss
  of a distinct, equal-sized set of tokens, and FSDP's average over dp-cp is
  the gradient of the mean loss over the whole batch.

Every rank also trains an unsharded copy of the same model (same seed, the
whole batch at once, same AdamW) and the example checks, at every step, that
the parallel loss equals the reference loss and that every rank's gradient
shards equal the matching slices of the reference gradients; and that the loss
went down.

Run it with::

    torchrun --nproc-per-node 8 examples/fsdp2_tp.py

NCCL when there is a GPU per rank, gloo on CPU otherwise. In torch 2.13 gloo
has every collective FSDP2 uses for float32 training: all-gather into one
tensor, reduce-scatter and ``ReduceOp.AVG`` (which FSDP2 picks for float32 and
bfloat16 gradients), so no special settings are needed. Gloo rejects
``ReduceOp.PREMUL_SUM``, which FSDP2 uses after ``set_gradient_divide_factor``;
pair that with ``set_force_sum_reduction_for_comms(True)`` on gloo.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import meshstate

VOCAB = 64
DIM = 32
HEADS = 4
LAYERS = 2
SEQ = 16
BATCH = 4
STEPS = 6
LR = 1e-2
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Context:
    """Which chunk of every sequence this rank holds: its cp group, rank and size."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1


class _GatherSequence(torch.autograd.Function):
    """All-gather dim 1 (the sequence) over the cp group; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        chunks = local.transpose(0, 1).contiguous()
        size = dist.get_world_size(group)
        gathered = chunks.new_empty((chunks.shape[0] * size, *chunks.shape[1:]))
        dist.all_gather_single(gathered, chunks, group=group)
        return gathered.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        grads = grad.transpose(0, 1).contiguous()
        local = grads.new_empty((grads.shape[0] // dist.get_world_size(group), *grads.shape[1:]))
        dist.reduce_scatter_single(local, grads, group=group)
        return local.transpose(0, 1), None


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1: under tensor parallel this rank holds HEADS / tp of the heads.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if context.size > 1:
            k = _GatherSequence.apply(k, context.group)
            v = _GatherSequence.apply(v, context.group)
        query_pos = context.rank * seq + torch.arange(seq, device=x.device)
        key_pos = torch.arange(k.shape[1], device=x.device)
        causal = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.ffn = FeedForward()

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), context)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, context: Context = Context()) -> torch.Tensor:
        seq = tokens.shape[1]
        positions = context.rank * seq + torch.arange(seq, device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x, context)
        return self.output(self.norm(x))


def parallelize(model: Transformer, mesh: meshstate.ParallelMesh) -> Transformer:
    """Tensor parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp-cp"]``."""
    fsdp_mesh = mesh["dp-cp"]
    parallelize_tp(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model


def parallelize_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """The tensor-parallel plan: attention and FFN column/row parallel over ``tp_mesh``."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            # Logits stay sharded by vocabulary; loss_parallel computes the loss.
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "ffn.w1": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(),
            },
        )


def make_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (same on every rank): inputs and next-token labels."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@dataclass(frozen=True)
class Result:
    losses: list[float]
    reference_losses: list[float]
    max_loss_diff: float
    max_grad_diff: float
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return (
            self.losses[-1] < self.losses[0]
            and self.max_loss_diff <= self.tolerance
            and self.max_grad_diff <= self.tolerance
        )


def checked_result(
    name: str,
    summary: str,
    losses: list[float],
    reference_losses: list[float],
    grad_diffs: list[float],
    tolerance: float = TOLERANCE,
    digits: int = 4,
) -> Result:
    """A run's :class:`Result`, printed on rank 0 under ``name: summary``; a ``RuntimeError``
    on every rank if the loss did not go down or it differs from the reference."""
    result = Result(
        losses=losses,
        reference_losses=reference_losses,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, reference_losses)),
        max_grad_diff=max(grad_diffs),
        tolerance=tolerance,
    )
    if dist.get_rank() == 0:
        print(f"{name}: {summary}")
        print("  loss      " + " ".join(f"{x:.{digits}f}" for x in losses))
        print("  reference " + " ".join(f"{x:.{digits}f}" for x in reference_losses))
        print(
            f"  max |loss - reference| = {result.max_loss_diff:.1e}, "
            f"max |grad - reference| = {result.max_grad_diff:.1e} "
            f"(tolerance {tolerance:g}): {'OK' if result.ok else 'FAILED'}"
        )
    if not result.ok:
        raise RuntimeError(f"{name} check failed on rank {dist.get_rank()}: {result}")
    return result


def destroying(mesh: meshstate.ParallelMesh, train: Callable[..., Result], *args: Any) -> Result:
    """``train(mesh, *args)``; the mesh is destroyed afterwards, whatever happens."""
    try:
        return train(mesh, *args)
    finally:
        mesh.destroy()


def torchrun_main(train: Callable[[], object]) -> None:
    """Run ``train`` under ``torchrun --nproc-per-node 8``: NCCL with a GPU per rank, else
    gloo; the default group is destroyed afterwards."""
    use_cuda = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        train()
    finally:
        dist.destroy_process_group()


def train(tp: int = 2, cp: int = 2, steps: int = STEPS) -> Result:
    """Train on every rank of an initialised world; check against the reference.

    Every rank must call it (``dp`` is what is left of the world after ``tp``
    and ``cp``). Prints a summary on rank 0 and raises ``RuntimeError`` if the
    loss did not go down or the loss or gradients differ from the reference.
    """
    return destroying(meshstate.init_mesh(tp=tp, cp=cp), _train, steps)


def _train(mesh: meshstate.ParallelMesh, steps: int) -> Result:
    device = _device(mesh)
    torch.manual_seed(0)
    reference = Transformer()
    model = copy.deepcopy(reference)
    reference.to(device)
    model = parallelize(model.to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    inputs, labels = make_batch(device)
    context = Context(mesh.group("cp"), mesh.rank("cp"), mesh.size("cp"))
    batch_rows = BATCH // mesh.size("dp")
    rows = slice(mesh.rank("dp") * batch_rows, (mesh.rank("dp") + 1) * batch_rows)
    chunk = SEQ // context.size
    cols = slice(context.rank * chunk, (context.rank + 1) * chunk)
    local_inputs, local_labels = inputs[rows, cols], labels[rows, cols]

    losses, reference_losses, grad_diffs = [], [], []
    for _ in range(steps):
        with loss_parallel():
            loss = loss_of(model(local_inputs, context), local_labels)
            loss.backward()
        reference_loss = loss_of(reference(inputs), labels)
        reference_loss.backward()

        global_loss = loss.to_local().detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=mesh.group("dp-cp"))
        losses.append(global_loss.item())
        reference_losses.append(reference_loss.item())
        grad_diffs.append(_max_grad_diff(model, reference))

        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()

    sizes = " ".join(f"{axis}={mesh.size(axis)}" for axis in ("tp", "cp", "dp"))
    return checked_result("fsdp2_tp", f"{sizes}, {steps} steps on {device.type}", losses,
                          reference_losses, grad_diffs)


def _max_grad_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest difference between this rank's gradient shards and the reference's.

    Each reference gradient is cut the way the sharded parameter is
    (``distribute_tensor`` with ``src_data_rank=None`` slices locally, no
    communication); the maximum is then taken over all ranks.
    """
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}
    diff = torch.zeros((), device=next(reference.parameters()).device)
    for name, param in model.named_parameters():
        grad = param.grad
        assert isinstance(grad, DTensor)
        expected = distribute_tensor(
            reference_grads[name], grad.device_mesh, grad.placements, src_data_rank=None
        ).to_local()
        diff = torch.maximum(diff, (grad.to_local() - expected).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def _device(mesh: meshstate.ParallelMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


if __name__ == "__main__":
    torchrun_main(train)
