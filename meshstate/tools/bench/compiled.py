"""``meshstate bench``'s compile time of a training step on N local ranks, both ways.

Every rank compiling the step with ``torch.compile``, then one rank compiling it for all
with :func:`~meshstate.compile_on_one_rank`: the wall seconds until every rank has run
its first compiled step (forward and backward, the slowest rank), and the graphs dynamo
traced in the whole world. The step is a TP MLP in a typed ``shard_map`` (blocks over cp
and tp, ``axis_index``, ``psum``) with a DTensor gathered whole and a ``pmean``, on
``COMPILE_SIZES``, compiled on ``aot_eager`` (inductor would add its C++ build per rank).

Example: ``measure_compile([8], print)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshstate.core.build import init_mesh
from meshstate.layout.config import sizes_text
from meshstate.core.one_rank import compile_on_one_rank
from meshstate.jax.collectives import axis_index, pmean, psum
from meshstate.jax.shard_map import shard_map
from meshstate.jax.sharding import P
from meshstate.testing.launch import LocalWorld
from meshstate.testing.torch_internals import graphs_traced
from meshstate.tools.bench.settings import COMPILE_SIZES

BACKEND = "aot_eager"


@dataclass(frozen=True)
class CompileRow:
    """Compiling one step on ``world_size`` gloo ranks, each rank its own and one for all."""

    world_size: int
    every_rank_seconds: float
    every_rank_graphs: int
    one_rank_seconds: float
    one_rank_graphs: int


def tp_step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A TP MLP over cp-sharded rows, its output gathered whole: a loss."""

    def body(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(x @ w1) * (axis_index("cp") + 1)
        summed: torch.Tensor = psum(hidden @ w2, "tp")
        return summed

    mapped = shard_map(body, in_specs=(P("cp", None), P(None, "tp"), P("tp", None)),
                       out_specs=P("cp", None))
    out = mapped(x, w1, w2).full_tensor()
    loss: torch.Tensor = pmean((out**2).mean(), ("cp", "dp"))
    return loss


def time_compiles_on_rank() -> tuple[float, int, float, int]:
    """On this rank: seconds to its first compiled step and graphs traced, each way."""
    mesh = init_mesh(**COMPILE_SIZES)
    with mesh:
        x = torch.randn(64, 32)
        w1, w2 = torch.randn(32, 64, requires_grad=True), torch.randn(64, 32, requires_grad=True)
        timings: list[float | int] = []
        for compile_step in (_every_rank, _one_rank):
            torch.compiler.reset()
            traced = graphs_traced()
            dist.barrier()
            started = time.perf_counter()
            compile_step(x, w1, w2)(x, w1, w2).backward()  # type: ignore[no-untyped-call, unused-ignore]
            dist.barrier()
            timings += [time.perf_counter() - started, graphs_traced() - traced]
    mesh.destroy()
    every_seconds, every_graphs, one_seconds, one_graphs = timings
    return float(every_seconds), int(every_graphs), float(one_seconds), int(one_graphs)


def _every_rank(*args: torch.Tensor) -> Callable[..., torch.Tensor]:
    return torch.compile(tp_step, fullgraph=True, backend=BACKEND)


def _one_rank(*args: torch.Tensor) -> Callable[..., torch.Tensor]:
    return compile_on_one_rank(tp_step, args, backend=BACKEND)


def measure_compile(world_sizes: Sequence[int], progress: Callable[[str], object]) -> list[CompileRow]:
    """A row per world of local gloo ranks."""
    rows = []
    for world_size in world_sizes:
        progress(f"{world_size} local ranks: compiling a step on every rank, then on one")
        with LocalWorld(world_size, backend="gloo") as world:
            timings = world.run(time_compiles_on_rank)
        every_seconds, every_graphs, one_seconds, one_graphs = zip(*timings)
        rows.append(CompileRow(world_size, max(every_seconds), sum(every_graphs),
                               max(one_seconds), sum(one_graphs)))
    return rows


def format_compile(rows: Sequence[CompileRow]) -> str:
    """The compile table."""
    lines = [
        f"compile a step ({sizes_text(COMPILE_SIZES)}, shard_map + DTensor, backend {BACKEND}): "
        "wall seconds to every rank's first step, graphs traced",
        f"  {'ranks':>5} {'every rank':>11} {'graphs':>6} {'one rank':>9} {'graphs':>6} {'speed-up':>8}",
    ]
    for row in rows:
        lines.append(
            f"  {row.world_size:>5} {row.every_rank_seconds:>10.1f}s {row.every_rank_graphs:>6} "
            f"{row.one_rank_seconds:>8.1f}s {row.one_rank_graphs:>6} "
            f"{row.every_rank_seconds / row.one_rank_seconds:>7.1f}x"
        )
    return "\n".join(lines)
