"""A transformer block in JAX's style, compiled: shard_map, tensor and sequence parallel, ring attention.

The block is ``h = x + attention(norm(x))``, ``y = h + mlp(norm(h))``, written
per shard with ``meshstate.shard_map`` and compiled whole with
``torch.compile(fullgraph=True)``:

- the batch is split over dp and the sequence over ``("cp", "tp")``: between
  the tensor-parallel regions each tp rank holds its own slice of the tokens
  (Megatron's sequence parallelism);
- attention and the MLP are tensor parallel: heads (and the MLP's hidden
  units) split over tp; each region starts with ``all_gather`` over tp along
  the sequence and ends with ``psum_scatter`` over tp back to the slices;
- attention is a ring over cp: each rank keeps its queries while the key and
  value blocks travel round the cp ring with ``ppermute``, softmax kept
  online (running maximum and sum), so no rank ever holds the whole sequence.

Output and every gradient equal a single-process run of the plain block.

Run it::

    torchrun --nproc-per-node 8 examples/compiled_block.py      # tp=2, cp=2, dp=2
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshstate
from meshstate import P, all_gather, axis_size, ppermute, psum_scatter, shard_map

BATCH, SEQUENCE, MODEL, HEADS, HEAD_DIM, HIDDEN = 2, 8, 8, 4, 2, 16
TOLERANCE = 1e-10
WEIGHT_SPECS = {
    "wq": P(None, "tp", None), "wk": P(None, "tp", None), "wv": P(None, "tp", None),
    "wo": P("tp", None, None), "up": P(None, "tp"), "down": P("tp", None),
}
"""Heads and hidden units split over tp: column-parallel in, row-parallel out."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of this rank's queries over every cp rank's keys and values.

    ``q``, ``k``, ``v``: (batch, tokens, heads, head_dim) of this rank's tokens.
    The key and value blocks go round the cp ring; the softmax is accumulated
    online, rescaling what came before whenever a larger score arrives.
    """
    ring = [(i, (i + 1) % axis_size("cp")) for i in range(axis_size("cp"))]
    scale = 1 / math.sqrt(q.shape[-1])
    running_max = torch.full(q.shape[:3], -math.inf, dtype=q.dtype)
    running_sum = torch.zeros(q.shape[:3], dtype=q.dtype)
    weighted = torch.zeros_like(q)
    for step in range(axis_size("cp")):
        scores = torch.einsum("bshd,bthd->bsht", q, k) * scale
        new_max = torch.maximum(running_max, scores.amax(-1))
        probabilities = torch.exp(scores - new_max.unsqueeze(-1))
        rescale = torch.exp(running_max - new_max)
        running_sum = running_sum * rescale + probabilities.sum(-1)
        weighted = weighted * rescale.unsqueeze(-1) + torch.einsum("bsht,bthd->bshd", probabilities, v)
        running_max = new_max
        if step + 1 < axis_size("cp"):
            k, v = ppermute(k, "cp", ring), ppermute(v, "cp", ring)
    return weighted / running_sum.unsqueeze(-1)


def block_shard(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """One rank's share of the block: its tokens in, its tokens out."""
    tokens = all_gather(F.layer_norm(x, x.shape[-1:]), "tp", axis=1, tiled=True)
    q, k, v = (torch.einsum("bsm,mhd->bshd", tokens, weights[w]) for w in ("wq", "wk", "wv"))
    mixed = torch.einsum("bshd,hdm->bsm", attention(q, k, v), weights["wo"])
    h = x + psum_scatter(mixed, "tp", scatter_dimension=1, tiled=True)
    tokens = all_gather(F.layer_norm(h, h.shape[-1:]), "tp", axis=1, tiled=True)
    hidden = F.gelu(tokens @ weights["up"]) @ weights["down"]
    return h + psum_scatter(hidden, "tp", scatter_dimension=1, tiled=True)


def block_whole(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same block on one process, with plain softmax attention."""
    tokens = F.layer_norm(x, x.shape[-1:])
    q, k, v = (torch.einsum("bsm,mhd->bshd", tokens, weights[w]) for w in ("wq", "wk", "wv"))
    scores = torch.einsum("bshd,bthd->bsht", q, k) / math.sqrt(HEAD_DIM)
    mixed = torch.einsum("bsht,bthd->bshd", scores.softmax(-1), v)
    h = x + torch.einsum("bshd,hdm->bsm", mixed, weights["wo"])
    tokens = F.layer_norm(h, h.shape[-1:])
    return h + F.gelu(tokens @ weights["up"]) @ weights["down"]


def inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same activations and weights on every rank (float64, so results compare exactly)."""
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[0])

    x = random(BATCH, SEQUENCE, MODEL)
    weights = {name: random(MODEL, HEADS, HEAD_DIM) for name in ("wq", "wk", "wv")}
    weights.update(wo=random(HEADS, HEAD_DIM, MODEL), up=random(MODEL, HIDDEN),
                   down=random(HIDDEN, MODEL))
    return x, weights


def max_difference(tp: int = 2, cp: int = 2) -> tuple[float, int, int]:
    """Run the compiled block on this world and the plain one on this process.

    Returns the largest difference in output or gradient, and the graphs and
    graph breaks ``torch._dynamo.explain`` counts for the compiled step.
    """
    mesh = meshstate.init_mesh(tp=tp, cp=cp)
    try:
        with mesh:
            sharded_block = shard_map(
                block_shard, in_specs=(P("dp", ("cp", "tp")), WEIGHT_SPECS),
                out_specs=P("dp", ("cp", "tp")),
            )

            def step(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
                return (sharded_block(x, weights).to_local() ** 2).sum()

            x, weights = inputs()
            explained = torch._dynamo.explain(step)(x, weights)
            torch._dynamo.reset()
            compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
            x.requires_grad_()
            for weight in weights.values():
                weight.requires_grad_()
            compiled_step(x, weights).backward()
            out = sharded_block(x.detach(), {k: w.detach() for k, w in weights.items()})
            out = out.full_tensor()
        x_whole, weights_whole = inputs()
        x_whole.requires_grad_()
        for weight in weights_whole.values():
            weight.requires_grad_()
        expected = block_whole(x_whole, weights_whole)
        (expected**2).sum().backward()
        # Each rank's loss is the sum over its own block, so the ranks' losses add up to the
        # whole one; shard_map's gradients (JAX's) are those of that sum, on every rank.
        pairs = [(out, expected), (x.grad, x_whole.grad)]
        pairs += [(weights[name].grad, weights_whole[name].grad) for name in weights]
        worst = max((a - b).abs().max().item() for a, b in pairs)
        return worst, explained.graph_count, explained.graph_break_count
    finally:
        mesh.destroy()


def main() -> None:
    """Entry point under torchrun."""
    dist.init_process_group("gloo")
    try:
        worst, graphs, breaks = max_difference()
        if dist.get_rank() == 0:
            print(f"compiled_block: tp=2 cp=2 dp={dist.get_world_size() // 4}, "
                  f"{graphs} graph(s), {breaks} break(s), max difference {worst:.1e} "
                  f"(tolerance {TOLERANCE}): " + ("OK" if worst <= TOLERANCE else "MISMATCH"))
        if worst > TOLERANCE or breaks:
            raise SystemExit(f"rank {dist.get_rank()}: compiled block does not match one process")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
