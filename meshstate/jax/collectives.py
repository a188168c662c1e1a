"""JAX-style collectives over named mesh axes.

``axes`` is one axis (``"tp"``), a joint key (``"dp-cp"``: mesh order) or any
tuple of axes of one view (dense: tp, cp, dp, pp; expert: etp, ep, edp, pp),
the first major: over ``("cp", "dp")`` a rank's index is ``cp * dp_size + dp``
and ``all_gather`` returns the shards in that order, exactly as ``jax.lax``
does under ``shard_map``. Nothing needs declaring: each call runs on the
process group of the same axis set, the mesh's own or, for a set it was not
built with, one made on the first call by the set's members (every one of
them reaches the call in SPMD code) and cached; a tuple out of mesh order only
permutes which chunk goes where, so it shares that group.

One deliberate difference: ``ppermute``'s ``perm`` holds ``axis_index`` values
of the same tuple, also against mesh order. JAX 0.10 reads ``perm`` there in
mesh order (its lowering sorts each replica group) while its ``axis_index``
follows the tuple; meshstate keeps the two consistent.
Every function takes ``mesh=`` and defaults to :func:`meshstate.current_mesh`.

``psum``, ``pmean``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and
``ppermute`` are differentiable (the backward of each is its transpose);
``pmax`` and ``pmin`` refuse tensors that require grad.

Compiled and eager alike: under ``torch.compile`` (or any torch tracer), and
wherever a gradient is needed, each call is one of torch's traceable functional
collectives, so ``torch.compile(fullgraph=True)`` sees one graph with no break
and autograd gets torch's own backward. In eager code that needs no gradient
the call is the in-place c10d collective in tensor form (``all_reduce`` on a
copy, ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``),
the cost of the hand-written call. No copy is made
to reorder shards where the axis order is the group's rank order.

Example (8 ranks, ``init_mesh(tp=2, cp=2)`` so dp=2)::

    with mesh:
        axis_index(("cp", "dp"))            # cp * 2 + dp
        psum(torch.ones(1), "tp")           # tensor([2.])
        all_gather(x, ("cp", "dp"))         # x of every rank, stacked in (cp, dp) order
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.errors import ConfigError
from meshstate.core.mesh import OrderedGroup, ParallelMesh, current_mesh, require_parallel_mesh

Axes = str | tuple[str, ...]

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]


def _ordered(axes: Axes, mesh: ParallelMesh | None, name: str) -> OrderedGroup:
    if mesh is None:
        return _ordered_group(current_mesh(), axes)
    return _ordered_group(require_parallel_mesh(mesh, f"{name}(mesh=...)"), axes)


@_compat.constant_when_traced
def _ordered_group(mesh: ParallelMesh, axes: Axes) -> OrderedGroup:
    """``mesh.ordered(axes)``. To ``torch.compile`` a constant, made while tracing (a
    first use creates its group there, outside the graph) and guarded by the mesh's
    identity, so a compiled call under another mesh traces again."""
    return mesh.ordered(axes)


def _traced(x: object, name: str) -> bool:
    """Whether ``x`` must go through torch's traceable collectives: torch.compile is
    tracing, ``x`` is a tensor subclass (a tracer's fake or functional tensor, a DTensor),
    or autograd records ``x``. A ConfigError if ``x`` is not a tensor."""
    kind = type(x)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"{name} takes a torch.Tensor, got {kind.__name__}")
        return True
    recorded: bool = x.requires_grad and torch.is_grad_enabled()  # type: ignore[attr-defined]
    return recorded or torch.compiler.is_compiling()


def axis_index(axes: Axes, *, mesh: ParallelMesh | None = None) -> int:
    """The caller's index along ``axes`` (row-major over a tuple, first axis major)."""
    return _ordered(axes, mesh, "axis_index").index


def axis_size(axes: Axes, *, mesh: ParallelMesh | None = None) -> int:
    """The number of ranks along ``axes``."""
    return len(_ordered(axes, mesh, "axis_size").ranks)


def psum(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The sum of ``x`` over ``axes``, on every rank."""
    group = _ordered(axes, mesh, "psum")
    if _traced(x, "psum"):
        return _compat.traced_all_reduce(x, "sum", group.group_name)
    result: torch.Tensor = x.clone()
    dist.all_reduce(result, group=group.group)
    return result


def pmean(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The mean of ``x`` over ``axes``, on every rank."""
    group = _ordered(axes, mesh, "pmean")
    return _all_reduce(x, group, "sum", "pmean") / len(group.ranks)


def pmax(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axes`` (not differentiable)."""
    return _all_reduce(x, _ordered(axes, mesh, "pmax"), "max", "pmax")


def pmin(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise minimum of ``x`` over ``axes`` (not differentiable)."""
    return _all_reduce(x, _ordered(axes, mesh, "pmin"), "min", "pmin")


def all_gather(
    x: torch.Tensor,
    axes: Axes,
    *,
    axis: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Every rank's ``x`` along ``axes``, in axis-index order.

    Stacked along a new dim ``axis``; with ``tiled=True`` concatenated along ``axis``.
    """
    group = _ordered(axes, mesh, "all_gather")
    traced = _traced(x, "all_gather")
    if tiled and axis == 0 and _in_place(x, traced, group):
        gathered = x.new_empty((len(group.ranks) * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(gathered, x, group=group.group)
        return gathered
    axis = _dim(axis, x.dim() + (not tiled), "all_gather", "axis")
    return gather(x, group, axis, tiled=tiled, traced=traced)


def gather(
    x: torch.Tensor, group: OrderedGroup, axis: int, *, tiled: bool, traced: bool
) -> torch.Tensor:
    """:func:`all_gather` over ``group`` with ``axis`` checked (non-negative); ``traced``
    picks torch's traceable collective over the in-place one."""
    n = len(group.ranks)
    source = x.contiguous()
    if traced:
        stacked = _compat.traced_all_gather(source, n, group.group_name)
    else:
        stacked = source.new_empty((n * source.numel(),))
        dist.all_gather_single(stacked, source.view(-1), group=group.group)
    stacked = stacked.view(n, *x.shape)
    if group.by_group_rank is not None:
        stacked = stacked[list(group.group_ranks)]
    if not tiled:
        return stacked.movedim(0, axis)
    if axis == 0:
        return stacked.view(n * x.shape[0], *x.shape[1:])
    return stacked.movedim(0, axis).flatten(axis, axis + 1)


def psum_scatter(
    x: torch.Tensor,
    axes: Axes,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Sum ``x`` over ``axes`` and keep the caller's chunk of ``scatter_dimension``.

    Without ``tiled`` that dim must equal the axis size and is removed; with
    ``tiled=True`` it is split into axis-size chunks and the caller keeps its own.
    """
    group = _ordered(axes, mesh, "psum_scatter")
    traced = _traced(x, "psum_scatter")
    n = len(group.ranks)
    if tiled and scatter_dimension == 0 and _in_place(x, traced, group) and x.shape[0] % n == 0:
        scattered = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        dist.reduce_scatter_single(scattered, x, group=group.group)
        return scattered
    chunks = _chunks(x, group, scatter_dimension, tiled, "psum_scatter", "scatter_dimension")
    if traced:
        flat = _compat.traced_reduce_scatter(chunks.reshape(-1), n, group.group_name)
    else:
        flat = x.new_empty((chunks[0].numel(),))
        dist.reduce_scatter_single(flat, chunks.reshape(-1), group=group.group)
    return flat.view(chunks.shape[1:])


def all_to_all(
    x: torch.Tensor,
    axes: Axes,
    split_axis: int,
    concat_axis: int,
    *,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Send chunk ``i`` of ``split_axis`` to the rank of axis index ``i``; join what arrives.

    Received chunks are joined along ``concat_axis`` in sender order. Without
    ``tiled`` ``split_axis`` must equal the axis size and is removed, and a new
    dim of that size appears at ``concat_axis``; with ``tiled=True`` no dim is
    added or removed.
    """
    group = _ordered(axes, mesh, "all_to_all")
    traced = _traced(x, "all_to_all")
    if tiled and split_axis == concat_axis == 0 and _in_place(x, traced, group) and (
        x.shape[0] % len(group.ranks) == 0
    ):
        exchanged = torch.empty_like(x)
        dist.all_to_all_single(exchanged, x, group=group.group)
        return exchanged
    chunks = _chunks(x, group, split_axis, tiled, "all_to_all", "split_axis")
    concat_axis = _dim(concat_axis, chunks.dim() - 1 + (not tiled), "all_to_all", "concat_axis")
    n = len(group.ranks)
    if traced:
        splits = [chunks[0].numel()] * n
        flat = _compat.traced_all_to_all(chunks.reshape(-1), splits, splits, group.group_name)
    else:
        flat = torch.empty_like(chunks).view(-1)
        dist.all_to_all_single(flat, chunks.reshape(-1), group=group.group)
    received = flat.view(chunks.shape)
    if group.by_group_rank is not None:
        received = received[list(group.group_ranks)]
    if not tiled:
        return received.movedim(0, concat_axis)
    return received.movedim(0, concat_axis).flatten(concat_axis, concat_axis + 1)


def ppermute(
    x: torch.Tensor,
    axes: Axes,
    perm: Sequence[tuple[int, int]],
    *,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Send ``x`` from axis index ``source`` to ``destination`` for each pair in ``perm``.

    A rank no pair sends to receives zeros. Each index may appear at most once
    as a source and once as a destination.
    """
    group = _ordered(axes, mesh, "ppermute")
    traced = _traced(x, "ppermute")
    pairs = _check_perm(perm, len(group.ranks))
    # One all_to_all_single whose only non-empty pieces go to the destination and come
    # from the source: a point-to-point exchange that traces, and whose backward (the
    # splits swapped) is the inverse permutation.
    if traced:
        return _traced_ppermute(x, group, pairs)
    numel, n = x.numel(), len(group.ranks)
    sends, receives = [0] * n, [0] * n
    for source, destination in pairs:
        if source == group.index:
            sends[group.group_ranks[destination]] = numel
        if destination == group.index:
            receives[group.group_ranks[source]] = numel
    arrived = x.new_zeros(x.shape)
    dist.all_to_all_single(
        arrived.view(-1)[: sum(receives)], x.contiguous().view(-1)[: sum(sends)],
        receives, sends, group=group.group,
    )
    return arrived


def _traced_ppermute(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """ppermute with the same shapes on every rank, as a compiled graph needs.

    A compiled backward orders independent collectives by its graph, which must
    then be the same on every rank: the perm is completed to a whole one (each
    index that sends nothing sends to one that receives nothing) and a rank
    outside ``pairs`` as a destination masks what it gets to zeros (no gradient
    goes back through the mask).
    """
    n = len(group.ranks)
    destination_of = dict(pairs)
    idle_sources = [i for i in range(n) if i not in destination_of]
    idle_destinations = [i for i in range(n) if i not in set(destination_of.values())]
    destination_of.update(zip(idle_sources, idle_destinations))
    source = next(s for s, d in destination_of.items() if d == group.index)
    numel = x.numel()
    sends, receives = [0] * n, [0] * n
    sends[group.group_ranks[destination_of[group.index]]] = numel
    receives[group.group_ranks[source]] = numel
    arrived = _compat.traced_all_to_all(x.contiguous().view(-1), receives, sends, group.group_name)
    received = torch.tensor((source, group.index) in pairs)
    return arrived.view(x.shape).where(received, 0)


def _in_place(x: torch.Tensor, traced: bool, group: OrderedGroup) -> bool:
    """Whether a tiled collective along dim 0 can run on ``x`` as it is: eager,
    contiguous, with dims, chunks in the group's rank order."""
    return not traced and group.by_group_rank is None and x.is_contiguous() and x.dim() > 0


def _all_reduce(x: torch.Tensor, group: OrderedGroup, op: str, name: str) -> torch.Tensor:
    traced = _traced(x, name)
    if op != "sum" and x.requires_grad:
        raise ConfigError(f"{name} is not differentiable; call it on x.detach()")
    if traced:
        return _compat.traced_all_reduce(x, op, group.group_name)
    result: torch.Tensor = x.clone()
    dist.all_reduce(result, op=_REDUCE_OPS[op], group=group.group)
    return result


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _dim(dim: int, ndim: int, name: str, parameter: str) -> int:
    """``dim`` as a non-negative dim of a tensor of ``ndim`` dims, else a ConfigError."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ConfigError(f"{name}: {parameter}={dim!r} is not a dim of a {ndim}-dim result")
    return dim % ndim


def _chunks(
    x: torch.Tensor, group: OrderedGroup, dim: int, tiled: bool, name: str, parameter: str
) -> torch.Tensor:
    """``x`` cut along ``dim`` into one chunk per rank, stacked on a new dim 0 in group-rank
    order (the chunk for axis index ``i`` at group rank ``group_ranks[i]``); contiguous."""
    n = len(group.ranks)
    dim = _dim(dim, x.dim(), name, parameter)
    size = x.shape[dim]
    if tiled:
        if size % n:
            raise ConfigError(
                f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, "
                f"not divisible by the axis size {n}"
            )
        chunks = x.reshape(*x.shape[:dim], n, size // n, *x.shape[dim + 1 :]).movedim(dim, 0)
    else:
        if size != n:
            raise ConfigError(
                f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, but without "
                f"tiled=True it must equal the axis size {n}"
            )
        chunks = x.movedim(dim, 0)
    if group.by_group_rank is not None:
        chunks = chunks[list(group.by_group_rank)]
    return chunks.contiguous()


def _check_perm(perm: Sequence[tuple[int, int]], size: int) -> tuple[tuple[int, int], ...]:
    pairs = tuple((int(source), int(destination)) for source, destination in perm)
    sources = [source for source, _ in pairs]
    destinations = [destination for _, destination in pairs]
    for index in sources + destinations:
        if not 0 <= index < size:
            raise ConfigError(f"ppermute pair index {index} is outside 0..{size - 1} in {list(perm)}")
    if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
        raise ConfigError(f"ppermute perm {list(perm)} repeats a source or a destination")
    return pairs
