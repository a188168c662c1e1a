"""``meshstate bench``'s explicit-axes table: a typed op beside the same DTensor op.

One rank of an 8-rank world on torch's fake backend, ``init_mesh(tp=4)`` (dp=2),
values of 32x64 floats laid out ``P("dp", "tp")``. Each op is timed inside
``meshstate.explicit()`` and outside it, on the same DTensors, the rounds taken
in turn; where JAX reduces at once (a sum over a split dim) the DTensor op is
followed by the same redistribution. "recorded" rows time the ops autograd
records (an operand requires grad). Compiled: the graphs (and breaks between them)
``torch.compile`` makes of the typed op on ``aot_eager``.

Example::

    rows = measure_explicit(progress=print)
    print(format_explicit(rows))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshstate.core.build import init_mesh
from meshstate.jax.explicit import device_put, explicit, matmul
from meshstate.jax.sharding import P
from meshstate.testing import torch_internals
from meshstate.testing.fake import fake_world
from meshstate.tools.bench.runtime import _us_per_call

EXPLICIT_WORLD, EXPLICIT_TP = 8, 4
"""The fake world and layout the table is measured on (dp=2)."""


@dataclass(frozen=True)
class ExplicitRow:
    """One op: typed and DTensor's eager cost (microseconds a call), and the typed op's
    compiled graphs and breaks."""

    op: str
    typed_us: float
    dtensor_call: str
    dtensor_us: float
    graphs: int
    graph_breaks: int


def measure_explicit(progress: Callable[[str], object] = lambda message: None) -> list[ExplicitRow]:
    """Time each typed op beside DTensor's, on rank 1 of a fake world."""
    progress("explicit axes: typed ops beside DTensor's")
    with fake_world(1, EXPLICIT_WORLD):
        mesh = init_mesh(tp=EXPLICIT_TP)
        try:
            return _rows(mesh)
        finally:
            mesh.destroy()


def _rows(mesh: Any) -> list[ExplicitRow]:
    torch.manual_seed(0)
    x, y = (device_put(torch.randn(32, 64), P("dp", "tp"), mesh) for _ in range(2))
    rows_first = device_put(torch.randn(32, 64), P("dp", None), mesh)
    weight = device_put(torch.randn(64, 16), P(None, "tp"), mesh)
    split_weight = device_put(torch.randn(64, 16), P("tp", None), mesh)
    learned = x.detach().requires_grad_()
    with explicit(mesh):
        summed: DTensor = x.sum(0)  # type: ignore[assignment]
        reduced = matmul(x, split_weight, out_sharding=P("dp", None))
    cases: list[tuple[str, Callable[[], object], str, Callable[[], object]]] = [
        ("x + y", lambda: x + y, "x + y", lambda: x + y),
        ("gelu(x)", lambda: torch.nn.functional.gelu(x), "gelu(x)",
         lambda: torch.nn.functional.gelu(x)),
        ("a @ w (free dims)", lambda: rows_first @ weight, "a @ w", lambda: rows_first @ weight),
        ("x.t() * 2.0", lambda: x.t() * 2.0, "x.t() * 2.0", lambda: x.t() * 2.0),
        ("x.sum(0) (reduced over dp)", lambda: x.sum(0), "x.sum(0).redistribute",
         lambda: _dtensor(x.sum(0)).redistribute(x.device_mesh, summed.placements)),
        ("matmul(x, w, out_sharding=P(dp))",
         lambda: matmul(x, split_weight, out_sharding=P("dp", None)),
         "(x @ w).redistribute",
         lambda: _dtensor(x @ split_weight).redistribute(x.device_mesh, reduced.placements)),
        ("x + y, recorded", lambda: learned + y, "x + y, recorded", lambda: learned + y),
    ]
    rows = []
    for op, typed, dtensor_call, plain in cases:
        typed_us, dtensor_us = _side_by_side(mesh, typed, plain)
        with explicit(mesh):
            graphs, breaks = _compiled_graphs(typed)
        rows.append(ExplicitRow(op, typed_us, dtensor_call, dtensor_us, graphs, breaks))
    return rows


def _compiled_graphs(typed: Callable[[], object]) -> tuple[int, int]:
    """(graphs, graph breaks) of ``typed`` compiled on ``aot_eager``, counted as dynamo
    hands them over (``explain``'s own backend reruns the graph's torch calls, which the
    explicit mode would see again; every real backend compiles aten ops)."""
    graphs: list[object] = []
    aot_eager = torch_internals.compiler_backend("aot_eager")

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph)
        return aot_eager(graph, example_inputs)

    torch.compiler.reset()
    torch.compile(lambda _: typed(), backend=backend)(torch.zeros(1))
    return len(graphs), len(graphs) - 1


def _dtensor(x: torch.Tensor) -> DTensor:
    assert isinstance(x, DTensor)
    return x


def _side_by_side(
    mesh: Any, typed: Callable[[], object], plain: Callable[[], object],
    calls: int = 500, rounds: int = 15,
) -> tuple[float, float]:
    """The fastest mean microseconds of ``typed`` inside ``explicit`` and ``plain`` outside
    it over ``rounds`` rounds of ``calls``, taken in turn (as the runtime table's)."""
    means: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        with explicit(mesh):
            means[0].append(_us_per_call(typed, calls, repeats=1))
        means[1].append(_us_per_call(plain, calls, repeats=1))
    return min(means[0]), min(means[1])


def format_explicit(rows: list[ExplicitRow]) -> str:
    """The explicit-axes table, one line per op."""
    lines = [
        f"explicit axes, us per call: rank 1 of {EXPLICIT_WORLD} (fake backend), "
        f"init_mesh(tp={EXPLICIT_TP}), 32x64 floats on P('dp', 'tp'); typed inside "
        "meshstate.explicit(), DTensor's op outside it",
        f"  {'typed op':<34} {'typed':>7} {'DTensor op':<24} {'DTensor':>7} {'x':>5} "
        f"{'graphs':>6} {'breaks':>6}",
    ]
    for row in rows:
        lines.append(
            f"  {row.op:<34} {row.typed_us:>7.1f} {row.dtensor_call:<24} {row.dtensor_us:>7.1f} "
            f"{row.typed_us / row.dtensor_us:>5.2f} {row.graphs:>6} {row.graph_breaks:>6}"
        )
    lines.append("  (x: typed / DTensor; a reduction's DTensor op is followed by the "
                 "redistribution JAX makes; graphs, breaks: the typed op compiled)")
    return "\n".join(lines)
