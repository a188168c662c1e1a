"""A tensor-parallel MLP block written with ``meshstate.shard_map``, as in JAX.

The block is ``gelu(x @ up) @ down``. ``up`` is split by columns over tp and
``down`` by rows (Megatron's column- then row-parallel pair), the batch is split
over ``("dp", "cp")``, and one ``psum`` over tp inside the per-shard function
finishes the block. shard_map gives JAX's gradients: the weights' gradients are
summed over the axes their specs leave out (dp and cp) without a line of code
for it. Output and gradients equal a single-process computation.

Run it::

    torchrun --nproc-per-node 8 examples/shard_map_mlp.py      # tp=2, cp=2, dp=2
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshstate
from meshstate import P

IN, HIDDEN, BATCH = 8, 16, 16
TOLERANCE = 1e-10


def block(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One rank's share: its batch rows, its columns of ``up``, its rows of ``down``."""
    return meshstate.psum(F.gelu(x @ up) @ down, "tp")


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same batch and weights on every rank (float64, so results compare exactly)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    up = torch.randn(IN, HIDDEN, generator=generator, dtype=torch.float64)
    down = torch.randn(HIDDEN, IN, generator=generator, dtype=torch.float64)
    return x, up, down


def max_difference(tp: int = 2, cp: int = 2) -> float:
    """Run the block on this world and one process; the largest difference in output or gradient."""
    mesh = meshstate.init_mesh(tp=tp, cp=cp)
    try:
        with mesh:
            mlp = meshstate.shard_map(
                block,
                in_specs=(P(("dp", "cp")), P(None, "tp"), P("tp", None)),
                out_specs=P(("dp", "cp")),
            )
            sharded = [value.clone().requires_grad_() for value in inputs()]
            out = mlp(*sharded).full_tensor()
            (out**2).sum().backward()
        single = [value.clone().requires_grad_() for value in inputs()]
        expected = F.gelu(single[0] @ single[1]) @ single[2]
        (expected**2).sum().backward()
        pairs = [(out, expected)] + [(a.grad, b.grad) for a, b in zip(sharded, single)]
        return max((a - b).abs().max().item() for a, b in pairs if a is not None and b is not None)
    finally:
        mesh.destroy()


def main() -> None:
    """Entry point under torchrun."""
    dist.init_process_group("gloo")
    try:
        worst = max_difference()
        if dist.get_rank() == 0:
            print(f"shard_map_mlp: tp=2 cp=2 dp={dist.get_world_size() // 4}, "
                  f"max difference {worst:.1e} (tolerance {TOLERANCE}): "
                  + ("OK" if worst <= TOLERANCE else "MISMATCH"))
        if worst > TOLERANCE:
            raise SystemExit(f"rank {dist.get_rank()}: shard_map block does not match one process")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
