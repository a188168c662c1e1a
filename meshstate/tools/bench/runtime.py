"""``meshstate bench``'s runtime table: what a JAX-layer call costs beside torch's own.

One rank of an 8-rank world on torch's fake backend (collectives move nothing,
so the figures are the Python and dispatch cost of a call), ``init_mesh(tp=2,
cp=2)``, a 1024-float tensor. Each meshstate call is timed eager beside the
hand-written torch call that does the same work (its output allocated with the
input's dtype and device, as generic code such as Megatron's does), torch's
functional collective
and, for ``shard_map``, torch's ``local_map``; then compiled
(``torch.compile(fullgraph=True, backend="aot_eager")``), with the graphs and
breaks ``torch._dynamo.explain`` counts. Each row times eager before it traces: a trace
leaves torch's DTensor sharding cache holding results on the tracer's wrapper of the
mesh (a ``FakeScriptObject``), which later eager ops of the same layout meet and
compare slowly (15 us more per partial-manual call, torch 2.13 and 2.14).

Example::

    rows = measure_runtime(progress=print)
    print(format_runtime(rows))
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
import timeit
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor.experimental import local_map

from meshstate.testing import torch_internals
from meshstate.core import compat as _compat
from meshstate.core.build import init_mesh
from meshstate.core.mesh import ParallelMesh
from meshstate.jax import collectives as lax
from meshstate.jax.reshard import reshard
from meshstate.jax.shard_map import shard_map
from meshstate.jax.sharding import P
from meshstate.testing.fake import fake_world

RUNTIME_WORLD = 8
RUNTIME_TP, RUNTIME_CP = 2, 2
"""The fake world and layout the runtime table is measured on (dp=2)."""


@dataclass(frozen=True)
class RuntimeRow:
    """One call: meshstate's eager and compiled cost beside torch's, microseconds per call."""

    call: str
    eager_us: float
    torch_call: str
    torch_us: float
    functional_us: float | None
    """torch's functional collective (or ``local_map``) doing the same, eager."""
    compiled_us: float | None
    graphs: int
    graph_breaks: int


@contextlib.contextmanager
def _without_gc() -> Iterator[None]:
    """Timed rounds without the cyclic collector, as ``timeit`` times them: a collection
    costs what everything else the process holds costs (a bench that built a world of
    millions of ranks), not the call."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _us_per_call(call: Callable[[], object], calls: int = 2000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean microseconds of ``calls`` calls, after a warm-up."""
    for _ in range(50):
        call()
    means = []
    with _without_gc():
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                call()
            means.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(means)


def _us_per_call_side_by_side(
    first: Callable[[], object], second: Callable[[], object], calls: int = 500, repeats: int = 15
) -> tuple[float, float]:
    """The fastest mean microseconds of two calls over ``repeats`` rounds of ``calls``,
    their rounds taken in turn, so a load that comes and goes on the machine weighs on
    both alike (the fastest round is the one it weighed on least)."""
    for _ in range(50):
        first(), second()
    means: tuple[list[float], list[float]] = ([], [])
    with _without_gc():
        for _ in range(repeats):
            for call, kept in zip((first, second), means):
                started = time.perf_counter()
                for _ in range(calls):
                    call()
                kept.append((time.perf_counter() - started) / calls * 1e6)
    return min(means[0]), min(means[1])


def _explain(function: Callable[..., object], *args: torch.Tensor) -> tuple[int, int]:
    """(graphs, graph breaks) that ``torch._dynamo.explain`` counts for ``function(*args)``."""
    torch.compiler.reset()
    return torch_internals.graphs_and_breaks(function, *args)


def _compiled_us(function: Callable[..., object], *args: torch.Tensor) -> float:
    compiled = torch.compile(function, fullgraph=True, backend="aot_eager")
    return _us_per_call(lambda: compiled(*args), calls=500)


def measure_runtime(progress: Callable[[str], object] = lambda message: None) -> list[RuntimeRow]:
    """Every row of the runtime table, measured in this process on one intra-op thread (the
    figures are what a call costs around its kernels; a second thread only adds waits)."""
    threads = torch.get_num_threads()
    with fake_world(0, RUNTIME_WORLD), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's fake backend and funcol deprecations
        torch.set_num_threads(1)
        mesh = init_mesh(tp=RUNTIME_TP, cp=RUNTIME_CP)
        try:
            with mesh:
                return _rows(mesh, progress)
        finally:
            mesh.destroy()
            torch.set_num_threads(threads)


def _rows(mesh: ParallelMesh, progress: Callable[[str], object]) -> list[RuntimeRow]:
    return [*_collective_rows(mesh, progress), *_shard_map_rows(mesh, progress),
            *_typed_rows(mesh, progress), _slice_row(mesh, progress),
            _partial_manual_row(mesh, progress), _reshard_row(mesh, progress)]


def _collective_rows(mesh: ParallelMesh, progress: Callable[[str], object]) -> list[RuntimeRow]:
    tp, cp = mesh.group("tp"), mesh.group("cp")
    x = torch.ones(1024)
    ring = [(0, 1), (1, 0)]

    def empty(size: int) -> torch.Tensor:
        """An output as generic code makes one (Megatron's gathers do it so)."""
        return torch.empty(size, dtype=x.dtype, device=x.device)

    collectives: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], str, Callable[[], object],
                            Callable[[], object]]] = [
        ("psum(x, 'tp')", lambda v: lax.psum(v, "tp"),
         "all_reduce(x.clone())", lambda: dist.all_reduce(x.clone(), group=tp),
         lambda: _compat.traced_all_reduce(x, "sum", tp.group_name)),
        ("all_gather(x, 'tp', tiled=True)", lambda v: lax.all_gather(v, "tp", tiled=True),
         "all_gather_single", lambda: dist.all_gather_single(empty(2048), x, group=tp),
         lambda: _compat.traced_all_gather(x, 2, tp.group_name)),
        ("psum_scatter(x, 'tp', tiled=True)", lambda v: lax.psum_scatter(v, "tp", tiled=True),
         "reduce_scatter_single",
         lambda: dist.reduce_scatter_single(empty(512), x, group=tp),
         lambda: _compat.traced_reduce_scatter(x, 2, tp.group_name)),
        ("all_to_all(x, 'tp', 0, 0, tiled=True)",
         lambda v: lax.all_to_all(v, "tp", 0, 0, tiled=True),
         "all_to_all_single", lambda: dist.all_to_all_single(torch.empty_like(x), x, group=tp),
         lambda: _compat.traced_all_to_all(x, [512, 512], [512, 512], tp.group_name)),
        ("ppermute(x, 'cp', ring)", lambda v: lax.ppermute(v, "cp", ring),
         "all_to_all_single(splits)",
         lambda: dist.all_to_all_single(
             torch.zeros_like(x), x, [0, 1024], [0, 1024], group=cp),
         lambda: _compat.traced_all_to_all(x, [0, 1024], [0, 1024], cp.group_name)),
    ]
    rows = []
    for name, call, torch_name, torch_call, functional in collectives:
        progress(f"runtime: {name}")
        eager_us, torch_us = _us_per_call_side_by_side(lambda: call(x), torch_call)
        functional_us = _us_per_call(functional)
        graphs, breaks = _explain(call, x)
        rows.append(RuntimeRow(name, eager_us, torch_name, torch_us, functional_us,
                               _compiled_us(call, x), graphs, breaks))
    return rows


@dataclass(frozen=True)
class QueryRow:
    """A mesh query's cost beside the same question asked of torch's DeviceMesh, ns per call."""

    query: str
    ns: float
    torch_query: str
    torch_ns: float


def measure_queries(progress: Callable[[str], object] = lambda message: None) -> list[QueryRow]:
    """The mesh queries a training step asks (a position, a size, a group, a DeviceMesh),
    each beside torch's DeviceMesh answering it, in the runtime table's fake world."""
    progress("runtime: mesh queries")
    with fake_world(0, RUNTIME_WORLD), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = init_mesh(tp=RUNTIME_TP, cp=RUNTIME_CP)
        try:
            dense, dp_cp, tp_cp = mesh.dense, mesh["dp-cp"], mesh["tp-cp"]
            queries: list[tuple[str, str, Callable[..., object], str, str, Callable[..., object]]] = [
                ("mesh.rank('dp-cp')", "f('dp-cp')", mesh.rank, "dp_cp.get_local_rank()",
                 "f()", dp_cp.get_local_rank),
                ("mesh['tp']", "f('tp')", mesh.__getitem__, "dense['tp']", "f('tp')",
                 dense.__getitem__),
                ("mesh.size('cp-dp')", "f('cp-dp')", mesh.size, "dp_cp.size()", "f()", dp_cp.size),
                ("mesh.group('cp-tp')", "f('cp-tp')", mesh.group, "tp_cp.get_group()", "f()",
                 tp_cp.get_group),
            ]
            return [QueryRow(name, _ns_per_call(statement, query), torch_name,
                             _ns_per_call(torch_statement, torch_query))
                    for name, statement, query, torch_name, torch_statement, torch_query in queries]
        finally:
            mesh.destroy()


def _ns_per_call(statement: str, function: Callable[..., object]) -> float:
    """Nanoseconds per call of ``statement`` on ``f``, the timing loop's own cost taken off
    (the best of 7 rounds of 100,000)."""
    calls = 100_000
    best = min(timeit.repeat(statement, globals={"f": function}, number=calls, repeat=7))
    loop = min(timeit.repeat("pass", number=calls, repeat=7))
    return (best - loop) / calls * 1e9


def format_queries(rows: list[QueryRow]) -> str:
    """The mesh-query table, one line per query."""
    lines = [f"mesh queries, ns per call: rank 0 of {RUNTIME_WORLD} (fake backend), "
             f"init_mesh(tp={RUNTIME_TP}, cp={RUNTIME_CP}); the loop's own cost taken off",
             f"  {'meshstate query':<22} {'ns':>6}   {'torch DeviceMesh':<24} {'ns':>6}"]
    lines += [f"  {row.query:<22} {row.ns:>6.0f}   {row.torch_query:<24} {row.torch_ns:>6.0f}"
              for row in rows]
    return "\n".join(lines)


def _shard_map_rows(mesh: ParallelMesh, progress: Callable[[str], object]) -> list[RuntimeRow]:
    tp = mesh.group("tp")
    rows = []
    progress("runtime: shard_map row-parallel matmul")
    dense = mesh.dense
    tp_dim = (dense.mesh_dim_names or ()).index("tp")
    x_full, w_full = torch.ones(16, 32), torch.ones(32, 8)
    x_dt = distribute_tensor(x_full, dense, [Replicate()] * tp_dim + [Shard(1)])
    w_dt = distribute_tensor(w_full, dense, [Replicate()] * tp_dim + [Shard(0)])
    x_block, w_block = x_full[:, :16].contiguous(), w_full[:16].contiguous()

    def row_parallel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return lax.psum(a @ b, "tp")

    mapped = shard_map(row_parallel, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())

    def local_body(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _compat.traced_all_reduce(a @ b, "sum", tp.group_name)

    torch_mapped = local_map(
        local_body, out_placements=((Replicate(),) * dense.ndim,),
        in_placements=(x_dt.placements, w_dt.placements), device_mesh=dense,
    )

    def by_hand() -> torch.Tensor:
        y = x_block @ w_block
        dist.all_reduce(y, group=tp)
        return y

    dtensors_us, by_hand_us = _us_per_call(lambda: mapped(x_dt, w_dt)), _us_per_call(by_hand)
    local_map_us = _us_per_call(lambda: torch_mapped(x_dt, w_dt))
    graphs, breaks = _explain(mapped, x_dt, w_dt)
    rows.append(RuntimeRow(
        "shard_map row-parallel (DTensors)", dtensors_us, "local matmul + all_reduce",
        by_hand_us, local_map_us, _compiled_us(mapped, x_dt, w_dt), graphs, breaks,
    ))
    plain_us = _us_per_call(lambda: mapped(x_full, w_full))
    graphs, breaks = _explain(mapped, x_full, w_full)
    rows.append(RuntimeRow(
        "shard_map row-parallel (plain)", plain_us, "local matmul + all_reduce", by_hand_us,
        None, _compiled_us(mapped, x_full, w_full), graphs, breaks,
    ))
    return rows


MLP_BATCH, MLP_MODEL, MLP_HIDDEN = 64, 256, 1024
"""The shard_map'd MLP of the typed rows: x (64, 256) through a hidden layer of 1024, so
each rank's block computes (16, 256) @ (256, 512) and back."""


def _typed_rows(mesh: ParallelMesh, progress: Callable[[str], object]) -> list[RuntimeRow]:
    """A shard_map'd 2-layer MLP (column-parallel up, gelu, row-parallel down, psum over tp)
    with check_vma=True beside the same with check_vma=False, then the latter beside the
    hand-written local matmuls and all-reduce; eager and compiled."""
    progress("runtime: shard_map mlp, check_vma=True and False")
    tp = mesh.group("tp")

    def mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return lax.psum(torch.nn.functional.gelu(x @ up) @ down, "tp")

    specs = (P(("dp", "cp")), P(None, "tp"), P("tp", None))
    typed = shard_map(mlp, in_specs=specs, out_specs=P(("dp", "cp")))
    legacy = shard_map(mlp, in_specs=specs, out_specs=P(("dp", "cp")), check_vma=False)
    args = (torch.ones(MLP_BATCH, MLP_MODEL), torch.ones(MLP_MODEL, MLP_HIDDEN),
            torch.ones(MLP_HIDDEN, MLP_MODEL))
    blocks = (args[0][: MLP_BATCH // 4], args[1][:, : MLP_HIDDEN // 2].contiguous(),
              args[2][: MLP_HIDDEN // 2])

    def by_hand() -> torch.Tensor:
        y = torch.nn.functional.gelu(blocks[0] @ blocks[1]) @ blocks[2]
        dist.all_reduce(y, group=tp)
        return y

    typed_us, legacy_us = _us_per_call_side_by_side(lambda: typed(*args), lambda: legacy(*args))
    rows = []
    for name, mapped, eager_us, torch_name, torch_us in (
        ("shard_map mlp check_vma=True", typed, typed_us, "same, check_vma=False", legacy_us),
        ("shard_map mlp check_vma=False", legacy, legacy_us, "local matmuls + all_reduce",
         _us_per_call(by_hand)),
    ):
        graphs, breaks = _explain(mapped, *args)
        rows.append(RuntimeRow(name, eager_us, torch_name, torch_us, None,
                               _compiled_us(mapped, *args), graphs, breaks))
    return rows


def _slice_row(mesh: ParallelMesh, progress: Callable[[str], object]) -> RuntimeRow:
    """shard_map on DTensors laid out on the 1-D slice ``mesh["tp"]`` beside torch's
    ``local_map`` of the same body on that slice."""
    progress("runtime: shard_map on DTensors of mesh['tp']")
    tp_mesh, tp = mesh["tp"], mesh.group("tp")
    x = distribute_tensor(torch.ones(16, 32), tp_mesh, [Shard(1)])
    w = distribute_tensor(torch.ones(32, 8), tp_mesh, [Shard(0)])

    def row_parallel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return lax.psum(a @ b, "tp")

    mapped = shard_map(row_parallel, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())

    def local_body(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _compat.traced_all_reduce(a @ b, "sum", tp.group_name)

    torch_mapped = local_map(local_body, out_placements=((Replicate(),),),
                             in_placements=(x.placements, w.placements), device_mesh=tp_mesh)
    mapped_us, torch_us = _us_per_call(lambda: mapped(x, w)), _us_per_call(lambda: torch_mapped(x, w))
    graphs, breaks = _explain(mapped, x, w)
    return RuntimeRow("shard_map row-parallel (mesh['tp'])", mapped_us, "local_map on mesh['tp']",
                      torch_us, torch_us, _compiled_us(mapped, x, w), graphs, breaks)


def _partial_manual_row(mesh: ParallelMesh, progress: Callable[[str], object]) -> RuntimeRow:
    """shard_map manual over tp only (``axis_names={"tp"}``) on DTensors split over dp and
    tp, beside torch's ``local_map`` of the same body on the same DTensors."""
    progress("runtime: shard_map manual over tp, on DTensors split over dp")
    dense, tp = mesh.dense, mesh.group("tp")
    names = dense.mesh_dim_names or ()

    def laid_out(over_tp: Placement, over_dp: Placement) -> list[Placement]:
        return [over_tp if axis == "tp" else over_dp if axis == "dp" else Replicate()
                for axis in names]

    x = distribute_tensor(torch.ones(16, 32), dense, laid_out(Shard(1), Shard(0)))
    w = distribute_tensor(torch.ones(32, 8), dense, laid_out(Shard(0), Replicate()))

    def row_parallel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return lax.psum(a @ b, "tp")

    mapped = shard_map(row_parallel, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(),
                       axis_names={"tp"})

    def local_body(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _compat.traced_all_reduce(a @ b, "sum", tp.group_name)

    torch_mapped = local_map(local_body, out_placements=(laid_out(Replicate(), Shard(0)),),
                             in_placements=(x.placements, w.placements), device_mesh=dense)
    mapped_us, torch_us = _us_per_call_side_by_side(lambda: mapped(x, w),
                                                    lambda: torch_mapped(x, w))
    graphs, breaks = _explain(mapped, x, w)
    return RuntimeRow("shard_map manual over tp (dp DTensors)", mapped_us,
                      "local_map, same DTensors", torch_us, torch_us,
                      _compiled_us(mapped, x, w), graphs, breaks)


def _reshard_row(mesh: ParallelMesh, progress: Callable[[str], object]) -> RuntimeRow:
    dense = mesh.dense
    progress("runtime: reshard")
    table = torch.ones(16, 8)
    source = reshard(table, P(("dp", "cp")))
    target = P("tp")

    def move(t: torch.Tensor) -> torch.Tensor:
        return reshard(t, target)

    target_placements = tuple(
        Shard(0) if axis == "tp" else Replicate() for axis in dense.mesh_dim_names or ()
    )
    # DTensor logs a warning per call for this move (two gathers where one would do).
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        torch_us = _us_per_call(lambda: source.redistribute(dense, target_placements), calls=200)
    finally:
        redistribute_log.setLevel(level)
    move_us = _us_per_call(lambda: move(source), calls=200)
    graphs, breaks = _explain(move, source)
    return RuntimeRow("reshard P(('dp','cp')) -> P('tp')", move_us, "DTensor.redistribute",
                      torch_us, None, _compiled_us(move, source), graphs, breaks)




def format_runtime(rows: list[RuntimeRow]) -> str:
    """The runtime table, one line per call."""
    sizes = f"tp={RUNTIME_TP}, cp={RUNTIME_CP}"
    lines = [
        f"runtime per call, us: rank 0 of {RUNTIME_WORLD} (fake backend), init_mesh({sizes}), "
        "1024 floats; compiled: torch.compile(fullgraph=True, backend='aot_eager')",
        f"  {'meshstate call':<36} {'eager':>7} {'torch call':<27} {'torch':>7} {'x':>5} "
        f"{'funcol':>7} {'compiled':>8} {'graphs':>6} {'breaks':>6}",
    ]
    for row in rows:
        functional = "-" if row.functional_us is None else f"{row.functional_us:7.1f}"
        compiled = "-" if row.compiled_us is None else f"{row.compiled_us:8.1f}"
        lines.append(
            f"  {row.call:<36} {row.eager_us:>7.1f} {row.torch_call:<27} {row.torch_us:>7.1f} "
            f"{row.eager_us / row.torch_us:>5.2f} {functional:>7} {compiled:>8} "
            f"{row.graphs:>6} {row.graph_breaks:>6}"
        )
    lines.append("  (funcol: torch's functional collective, or local_map for shard_map; "
                 "x: meshstate eager / torch call)")
    return "\n".join(lines)
