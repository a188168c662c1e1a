"""A torchtitan-style MLP block in plain code, type-checked strictly by spmd_types.

torchtitan checks a training step's types with spmd_types' strict checker
(``spmd_types.checker.typecheck(strict_mode="strict")``). meshstate's collectives
carry spmd_types' types there (``meshstate.jax.types.spmd_checker``): ``pvary`` is
``convert(I -> R)``, ``psum`` ``all_reduce(-> I)``. The block is Megatron's
column- then row-parallel pair, ``gelu(x @ up) @ down``, on
``ParallelDims(dp_shard=2, tp=2)``: the batch split over dp, ``up`` by columns and
``down`` by rows over tp, each collective named where JAX names it. The output is
``I`` on tp, the loss ``I`` everywhere; losses and gradients equal one process.

Run it (spmd_types is a development dependency: ``pip install --no-deps spmd_types==0.3.1``)::

    torchrun --nproc-per-node 4 examples/spmd_checked_mlp.py
"""

from __future__ import annotations

from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spmd_types.checker import typecheck

from meshstate import pmean, psum, pvary
from meshstate.titan import ParallelDims

IN, HIDDEN, BATCH, STEPS, LEARNING_RATE = 8, 16, 8, 3, 0.01
TOLERANCE = 1e-10


def block(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One rank's share: its batch rows (``V`` on dp), its columns of ``up`` and rows of
    ``down`` (``V`` on tp). The weights are pvary'd over dp, so their gradients are summed
    over it (data parallelism); ``x`` over tp, so its gradient is summed over tp."""
    hidden = F.gelu(pvary(x, "tp") @ pvary(up, "dp"))
    return psum(hidden @ pvary(down, "dp"), "tp")


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch and weights, the same on every rank (float64: results compare exactly)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    up = torch.randn(IN, HIDDEN, generator=generator, dtype=torch.float64)
    down = torch.randn(HIDDEN, IN, generator=generator, dtype=torch.float64)
    return x, up, down


@dataclass
class Result:
    losses: list[float]
    single_losses: list[float]
    """One process's losses, step by step."""
    output_type: dict[str, str]
    """The block's output type on each axis, as spmd_types names it (``{"dp": "V", "tp": "I"}``)."""
    grads: list[torch.Tensor]
    """This rank's gradients of its shards of ``up`` and ``down`` in the last step."""
    single_grads: list[torch.Tensor]
    """One process's gradients of the same shards."""

    def max_difference(self) -> float:
        """The largest difference from one process, in a loss or a gradient."""
        pairs = zip(self.grads, self.single_grads)
        return max(max(abs(a - b) for a, b in zip(self.losses, self.single_losses)),
                   *((a - b).abs().max().item() for a, b in pairs))


def train(steps: int = STEPS) -> Result:
    """``steps`` of SGD on this world under the strict checker, and on one process."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1,
                        world_size=dist.get_world_size())
    dims.build_mesh()
    mesh = dims.mesh
    try:
        dp, tp = mesh.rank("dp"), mesh.rank("tp")
        rows, columns = BATCH // mesh.size("dp"), HIDDEN // mesh.size("tp")
        x, up, down = inputs()
        with mesh, spmd.set_current_mesh(dims.spmd_dense_mesh()):
            shard_x = spmd.assert_type(x[dp * rows:(dp + 1) * rows].clone(),
                                       {"dp": spmd.V, "tp": spmd.I})
            weights = [
                spmd.assert_type(w.clone().requires_grad_(), {"dp": spmd.I, "tp": spmd.V})
                for w in (up[:, tp * columns:(tp + 1) * columns], down[tp * columns:(tp + 1) * columns])
            ]
            losses, output_type = [], {}
            for _ in range(steps):
                with typecheck(strict_mode="strict", local=True):
                    out = block(shard_x, *weights)
                    loss = pmean((out**2).sum(), "dp")
                    loss.backward()
                output_type = {axis: _type_name(out, mesh.group(axis)) for axis in ("dp", "tp")}
                losses.append(loss.item())
                grads = [w.grad.clone() for w in weights]
                _step(weights)
        single = [value.clone().requires_grad_() for value in (x, up, down)]
        single_losses = []
        for _ in range(steps):
            single_loss = ((F.gelu(single[0] @ single[1]) @ single[2]) ** 2).sum() / mesh.size("dp")
            single_loss.backward()
            single_losses.append(single_loss.item())
            single_grads = [single[1].grad.clone(), single[2].grad.clone()]
            _step(single[1:])
        expected = [single_grads[0][:, tp * columns:(tp + 1) * columns],
                    single_grads[1][tp * columns:(tp + 1) * columns]]
        return Result(losses, single_losses, output_type, grads, expected)
    finally:
        mesh.destroy()


def _type_name(value: torch.Tensor, group: dist.ProcessGroup) -> str:
    kind = spmd.get_local_type(value)[spmd.MeshAxis.of(group)]
    return str(kind).rsplit(".", 1)[-1]


def _step(parameters: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for parameter in parameters:
            parameter -= LEARNING_RATE * parameter.grad
            parameter.grad = None


def main() -> None:
    """Entry point under torchrun (4 ranks)."""
    dist.init_process_group("gloo")
    try:
        result = train()
        worst = result.max_difference()
        if dist.get_rank() == 0:
            print(f"spmd_checked_mlp: output typed {result.output_type}, losses "
                  f"{[round(loss, 4) for loss in result.losses]}, max difference {worst:.1e} "
                  f"(tolerance {TOLERANCE}): " + ("OK" if worst <= TOLERANCE else "MISMATCH"))
        if worst > TOLERANCE:
            raise SystemExit(f"rank {dist.get_rank()}: the checked block does not match one process")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
