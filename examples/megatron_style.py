"""A Megatron-style training step written against ``meshstate.megatron.parallel_state``.

A two-stage pipeline (pp=2) of tensor-parallel MLP blocks (tp=2), trained with
data parallelism over the rest of the world (dp=2 on 8 ranks). Everything it
needs comes from the getters legacy Megatron code calls: the tensor-parallel
group for the block's all-reduces, the pipeline neighbours for sending
activations forward and gradients back, the data-parallel group for averaging
gradients. The losses equal a single-process reference of the same model.

Run it::

    torchrun --nproc-per-node 8 examples/megatron_style.py     # gloo on CPU, NCCL on GPUs
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshstate.megatron import parallel_state as mpu

IN, HIDDEN, OUT, BATCH, STEPS, LR = 8, 16, 4, 16, 5, 0.1


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
        return grad


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=mpu.get_tensor_model_parallel_group())
        return x

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def full_weights(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The unsharded weights of both blocks, the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [((HIDDEN, IN), (IN, HIDDEN)), ((HIDDEN, IN), (OUT, HIDDEN))]
    return [
        (torch.randn(*up, generator=generator).to(device) / IN**0.5,
         torch.randn(*down, generator=generator).to(device) / HIDDEN**0.5)
        for up, down in shapes
    ]


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, IN, generator=generator)
    targets = torch.randn(BATCH, OUT, generator=generator)
    return inputs.to(device), targets.to(device)


def block(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel MLP: column-parallel ``up``, row-parallel ``down``."""
    x = _CopyToTensorParallel.apply(x)
    return _ReduceFromTensorParallel.apply(F.gelu(x @ up.t()) @ down.t())


def train(steps: int = STEPS) -> list[float]:
    """Train on an initialised world with tp=2, pp=2; return the loss of every step."""
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        return _train(steps)
    finally:
        mpu.destroy_model_parallel()


def _train(steps: int) -> list[float]:
    device = _device()
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    first = mpu.is_pipeline_first_stage()
    up, down = full_weights(device)[mpu.get_pipeline_model_parallel_rank()]
    shard = HIDDEN // tp_size
    up = up[tp_rank * shard : (tp_rank + 1) * shard].clone().requires_grad_()
    down = down[:, tp_rank * shard : (tp_rank + 1) * shard].clone().requires_grad_()
    inputs, targets = (t.chunk(dp_size)[dp_rank] for t in batch(device))
    losses = []
    for _ in range(steps):
        if first:
            hidden = block(inputs, up, down)
            dist.send(hidden.detach(), mpu.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(hidden)
            dist.recv(grad, mpu.get_pipeline_model_parallel_prev_rank())
            hidden.backward(grad)
            loss = torch.zeros((), device=device)
        else:
            received = torch.empty(inputs.shape[0], IN, device=device)
            dist.recv(received, mpu.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_()
            loss = F.mse_loss(block(received, up, down), targets)
            loss.backward()
            assert received.grad is not None
            dist.send(received.grad, mpu.get_pipeline_model_parallel_next_rank())
        with torch.no_grad():
            for weight in (up, down):
                assert weight.grad is not None
                dist.all_reduce(weight.grad, group=mpu.get_data_parallel_group())
                weight -= LR * weight.grad / dp_size
                weight.grad = None
        # Every rank learns the data-parallel mean loss from the last stage.
        report = loss.detach().clone()
        dist.all_reduce(report, group=mpu.get_data_parallel_group())
        dist.broadcast(report, mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        losses.append(report.item() / dp_size)
    return losses


def reference(steps: int = STEPS) -> list[float]:
    """The same model and data in one process, no parallelism."""
    weights = [(up.clone().requires_grad_(), down.clone().requires_grad_())
               for up, down in full_weights(torch.device("cpu"))]
    inputs, targets = batch(torch.device("cpu"))
    losses = []
    for _ in range(steps):
        hidden = inputs
        for up, down in weights:
            hidden = F.gelu(hidden @ up.t()) @ down.t()
        loss = F.mse_loss(hidden, targets)
        loss.backward()
        with torch.no_grad():
            for up, down in weights:
                for weight in (up, down):
                    assert weight.grad is not None
                    weight -= LR * weight.grad
                    weight.grad = None
        losses.append(loss.item())
    return losses


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main() -> None:
    """Entry point under torchrun: init the world, train, compare with the reference."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        losses = train()
        expected = reference()
        worst = max(abs(a - b) for a, b in zip(losses, expected))
        if dist.get_rank() == 0:
            print("step losses: " + " ".join(f"{loss:.5f}" for loss in losses))
            print("reference:   " + " ".join(f"{loss:.5f}" for loss in expected))
            print(f"max difference {worst:.2e}; loss decreased: {losses[-1] < losses[0]}")
        if worst > 1e-4 or not losses[-1] < losses[0]:
            raise SystemExit(f"rank {dist.get_rank()}: training does not match the reference")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
