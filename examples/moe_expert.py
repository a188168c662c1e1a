"""A mixture-of-experts layer sharded over meshstate's expert mesh, checked against one process.

A tiny MoE layer (a dense input projection, a top-2 router and 8 two-layer
GELU experts) is trained for a few steps on 8 ranks laid out by
``meshstate.init_mesh(tp=2, ep=2, etp=2)`` (so edp=2 on the expert side):

- ``mesh["ep"]``: expert parallel. Each ep rank holds ``8 / ep`` of the
  experts. Tokens go to the rank holding their expert with
  ``torch.distributed.all_to_all_single`` over ``mesh.group("ep")`` (first the
  per-expert token counts, then the tokens; the outputs come back the same way,
  and the backward runs the all-to-all the other way round).
- ``mesh["etp"]``: expert tensor parallel. Every expert's hidden units are
  split over etp: the first matrix by columns, the second by rows, so each etp
  rank computes a partial output and the partials are all-reduced over
  ``mesh.group("etp")`` (the input gradient is all-reduced in the backward).
  The etp ranks of one expert shard see the same tokens.
- ``mesh["edp"]``: expert data parallel. The ``edp`` replicas of an expert
  shard see different tokens; expert gradients are averaged over
  ``mesh.group("edp")``.

Every (edp, ep) coordinate owns a distinct batch of tokens. The dense
parameters (projection and router) are replicated on all ranks; their
gradients are averaged over ep and then over edp, which is the average over
all token batches. The dense ``tp`` axis is part of the layout (a Megatron job
would use it for its attention layers) but this layer does not use it.

Every rank also trains an unsharded copy (same seed, all experts local, all
token batches at once) and the example checks that the loss and every gradient
shard equal that reference and that the loss went down.

Run it with::

    torchrun --nproc-per-node 8 examples/moe_expert.py

NCCL on GPUs when there is one per rank, gloo on CPU otherwise (gloo supports
``all_to_all_single`` with uneven splits, which dropless routing needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshstate
from fsdp2_tp import Result, _device, checked_result, torchrun_main

DIM = 16
HIDDEN = 32
EXPERTS = 8
TOP_K = 2
TOKENS = 16  # per token batch, i.e. per (edp, ep) coordinate
STEPS = 6
LR = 1e-2
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Axis:
    """The calling rank's group of one mesh axis; the default is a single rank."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, mesh: meshstate.ParallelMesh, key: str) -> Axis:
        return cls(mesh.group(key), mesh.rank(key), mesh.size(key))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward sends gradients back."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return back, None, None, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the (partial) input gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce of partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def initial_weights() -> dict[str, torch.Tensor]:
    """The full (unsharded) weights, the same on every rank."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / fan_in**0.5

    return {
        "proj": normal(DIM, DIM, fan_in=DIM),
        "router": normal(DIM, EXPERTS, fan_in=DIM),
        "w1": normal(EXPERTS, DIM, HIDDEN, fan_in=DIM),
        "w2": normal(EXPERTS, HIDDEN, DIM, fan_in=HIDDEN),
    }


class MoE(nn.Module):
    """Projection, top-k router and experts; experts sharded over ``ep`` and ``etp``.

    With the default single-rank axes it is the unsharded reference.
    """

    def __init__(
        self, weights: dict[str, torch.Tensor], ep: Axis = Axis(), etp: Axis = Axis()
    ) -> None:
        super().__init__()
        self.ep, self.etp = ep, etp
        self.local_experts = EXPERTS // ep.size
        experts = slice(ep.rank * self.local_experts, (ep.rank + 1) * self.local_experts)
        hidden = slice(etp.rank * HIDDEN // etp.size, (etp.rank + 1) * HIDDEN // etp.size)
        self.shards = {
            "proj": (),
            "router": (),
            "w1": (experts, slice(None), hidden),
            "w2": (experts, hidden),
        }
        self.proj = nn.Parameter(self.shard("proj", weights["proj"]).clone())
        self.router = nn.Parameter(self.shard("router", weights["router"]).clone())
        self.w1 = nn.Parameter(self.shard("w1", weights["w1"]).clone())
        self.w2 = nn.Parameter(self.shard("w2", weights["w2"]).clone())

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor ``full`` of parameter ``name``."""
        return full[self.shards[name]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.proj
        gates, chosen = (x @ self.router).softmax(dim=-1).topk(TOP_K, dim=-1)
        # One row per (token, chosen expert), sorted by expert.
        order = chosen.flatten().argsort(stable=True)
        routed = x.repeat_interleave(TOP_K, dim=0)[order]
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)
        out = self._dispatch_and_compute(routed, counts)
        unsorted = torch.zeros_like(out).index_copy(0, order, out)
        return (unsorted.view(-1, TOP_K, DIM) * gates.unsqueeze(-1)).sum(dim=1)

    def _dispatch_and_compute(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send rows to the ep rank of their expert, run the experts, send results back."""
        if self.ep.size == 1:
            return self._experts(routed, counts.view(1, EXPERTS))
        # counts_by_source[s, e]: rows ep rank s sends to my local expert e.
        send_counts = counts.view(self.ep.size, self.local_experts)
        counts_by_source = torch.empty_like(send_counts)
        dist.all_to_all_single(counts_by_source, send_counts, group=self.ep.group)
        sent = send_counts.sum(dim=1).tolist()
        received = counts_by_source.sum(dim=1).tolist()
        mine = _AllToAll.apply(routed, received, sent, self.ep.group)
        out = self._experts(mine, counts_by_source)
        return _AllToAll.apply(out, sent, received, self.ep.group)

    def _experts(self, rows: torch.Tensor, counts_by_source: torch.Tensor) -> torch.Tensor:
        """Rows arrive grouped by source rank, then by local expert."""
        expert_of_row = torch.arange(self.local_experts, device=rows.device).repeat(
            counts_by_source.shape[0]
        ).repeat_interleave(counts_by_source.flatten())
        if self.etp.size > 1:
            rows = _CopyToGroup.apply(rows, self.etp.group)
        out = rows.new_zeros(rows.shape)
        for expert in range(self.local_experts):
            index = (expert_of_row == expert).nonzero().squeeze(1)
            hidden = F.gelu(rows[index] @ self.w1[expert])
            out = out.index_copy(0, index, hidden @ self.w2[expert])
        if self.etp.size > 1:
            out = _ReduceFromGroup.apply(out, self.etp.group)
        return out


def make_batches(device: torch.device, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` token batches and their regression targets (same on every rank)."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, TOKENS, DIM, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(DIM, DIM, generator=generator))
    return inputs.to(device), targets.to(device)


def average_gradients(model: MoE, mesh: meshstate.ParallelMesh) -> None:
    """Make every gradient shard that of the mean loss over all token batches.

    Dense parameters: average over ep, then over edp (all token batches).
    Expert parameters: the all-to-all backward already summed the contributions
    of the ep token batches that used them, so average over edp and divide by ep.
    """
    for param in (model.proj, model.router):
        assert param.grad is not None
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=mesh.group("ep"))
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=mesh.group("edp"))
    for param in (model.w1, model.w2):
        assert param.grad is not None
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=mesh.group("edp"))
        param.grad.div_(mesh.size("ep"))


def train(tp: int = 2, ep: int = 2, etp: int = 2, steps: int = STEPS) -> Result:
    """Train on every rank of an initialised world; check against the reference.

    Every rank must call it. Prints a summary on rank 0 and raises
    ``RuntimeError`` if the loss did not go down or the loss or gradients
    differ from the reference.
    """
    mesh = meshstate.init_mesh(tp=tp, ep=ep, etp=etp)
    try:
        return _train(mesh, steps)
    finally:
        mesh.destroy()


def _train(mesh: meshstate.ParallelMesh, steps: int) -> Result:
    device = _device(mesh)
    weights = {name: w.to(device) for name, w in initial_weights().items()}
    model = MoE(weights, ep=Axis.of(mesh, "ep"), etp=Axis.of(mesh, "etp"))
    reference = MoE(weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    ep, edp = mesh.size("ep"), mesh.size("edp")
    inputs, targets = make_batches(device, count=ep * edp)
    batch = mesh.rank("edp") * ep + mesh.rank("ep")

    losses, reference_losses, grad_diffs = [], [], []
    for _ in range(steps):
        loss = F.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        average_gradients(model, mesh)
        reference_loss = F.mse_loss(reference(inputs.flatten(0, 1)), targets.flatten(0, 1))
        reference_loss.backward()

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=mesh.group("ep"))
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=mesh.group("edp"))
        losses.append(global_loss.item())
        reference_losses.append(reference_loss.item())
        grad_diff = torch.zeros((), device=device)
        for name, param in model.named_parameters():
            expected = model.shard(name, reference.get_parameter(name).grad)
            grad_diff = torch.maximum(grad_diff, (param.grad - expected).abs().max())
        dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)
        grad_diffs.append(grad_diff.item())

        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()

    return checked_result('moe_expert', (
        " ".join(f"{axis}={mesh.size(axis)}" for axis in ("ep", "etp", "edp"))
        + f", {EXPERTS} experts, top-{TOP_K}, {steps} steps on {device.type}"
    ), losses, reference_losses, grad_diffs)


if __name__ == "__main__":
    torchrun_main(train)
