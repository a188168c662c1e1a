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

Example (8 ranks, ``init_mesh(tp=2, cp=2)`` so dp=2)::

    with mesh:
        axis_index(("cp", "dp"))            # cp * 2 + dp
        psum(torch.ones(1), "tp")           # tensor([2.])
        all_gather(x, ("cp", "dp"))         # x of every rank, stacked in (cp, dp) order
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

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
        return current_mesh().ordered(axes)
    return require_parallel_mesh(mesh, f"{name}(mesh=...)").ordered(axes)


def axis_index(axes: Axes, *, mesh: ParallelMesh | None = None) -> int:
    """The caller's index along ``axes`` (row-major over a tuple, first axis major)."""
    return _ordered(axes, mesh, "axis_index").index


def axis_size(axes: Axes, *, mesh: ParallelMesh | None = None) -> int:
    """The number of ranks along ``axes``."""
    return len(_ordered(axes, mesh, "axis_size").ranks)


def psum(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The sum of ``x`` over ``axes``, on every rank."""
    return _all_reduce_sum(x, _ordered(axes, mesh, "psum"))


def pmean(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The mean of ``x`` over ``axes``, on every rank."""
    group = _ordered(axes, mesh, "pmean")
    return _all_reduce_sum(x, group) / len(group.ranks)


def pmax(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axes`` (not differentiable)."""
    return _all_reduce_no_grad(x, _ordered(axes, mesh, "pmax"), dist.ReduceOp.MAX, "pmax")


def pmin(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise minimum of ``x`` over ``axes`` (not differentiable)."""
    return _all_reduce_no_grad(x, _ordered(axes, mesh, "pmin"), dist.ReduceOp.MIN, "pmin")


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
    pieces = _all_gather(x, _ordered(axes, mesh, "all_gather"))
    return torch.cat(pieces, dim=axis) if tiled else torch.stack(pieces, dim=axis)


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
    chunks = _split(x, scatter_dimension, len(group.ranks), tiled, "psum_scatter")
    return _reduce_scatter_op(group, *chunks)


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
    chunks = _split(x, split_axis, len(group.ranks), tiled, "all_to_all")
    received = _all_to_all(group, *chunks)
    return torch.cat(received, dim=concat_axis) if tiled else torch.stack(received, dim=concat_axis)


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
    pairs = _check_perm(perm, len(group.ranks))
    return _ppermute(x, group, pairs)


def _all_reduce_no_grad(
    x: torch.Tensor, group: OrderedGroup, op: Any, name: str
) -> torch.Tensor:
    if x.requires_grad:
        raise ConfigError(f"{name} is not differentiable; call it on x.detach()")
    result = x.clone()
    dist.all_reduce(result, op=op, group=group.group)
    return result


def _split(
    x: torch.Tensor, dim: int, parts: int, tiled: bool, name: str
) -> tuple[torch.Tensor, ...]:
    size = x.shape[dim]
    if tiled:
        if size % parts:
            raise ConfigError(
                f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, "
                f"not divisible by the axis size {parts}"
            )
        return tuple(chunk.contiguous() for chunk in x.chunk(parts, dim=dim))
    if size != parts:
        raise ConfigError(
            f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, but without "
            f"tiled=True it must equal the axis size {parts}"
        )
    return tuple(piece.contiguous() for piece in x.unbind(dim))


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


def _gather(x: torch.Tensor, group: OrderedGroup) -> tuple[torch.Tensor, ...]:
    by_group_rank = [torch.empty_like(x) for _ in group.ranks]
    dist.all_gather(by_group_rank, x.contiguous(), group=group.group)
    return tuple(by_group_rank[group_rank] for group_rank in group.group_ranks)


def _reduce_scatter(chunks: Sequence[torch.Tensor], group: OrderedGroup) -> torch.Tensor:
    by_group_rank: list[torch.Tensor] = [chunks[0]] * len(chunks)
    for index, group_rank in enumerate(group.group_ranks):
        by_group_rank[group_rank] = chunks[index]
    result = torch.empty_like(chunks[group.index])
    dist.reduce_scatter(result, by_group_rank, group=group.group)
    return result


def _exchange(chunks: Sequence[torch.Tensor], group: OrderedGroup) -> tuple[torch.Tensor, ...]:
    outgoing: list[torch.Tensor] = [chunks[0]] * len(chunks)
    for index, group_rank in enumerate(group.group_ranks):
        outgoing[group_rank] = chunks[index]
    incoming = [torch.empty_like(chunk) for chunk in outgoing]
    dist.all_to_all(incoming, outgoing, group=group.group)
    return tuple(incoming[group_rank] for group_rank in group.group_ranks)


def _permute(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    result = torch.zeros_like(x)
    operations = []
    for source, destination in pairs:
        if source == group.index and destination == group.index:
            result = x.clone()
        elif source == group.index:
            operations.append(
                dist.P2POp(dist.isend, x.contiguous(), group.ranks[destination], group.group)
            )
        elif destination == group.index:
            operations.append(dist.P2POp(dist.irecv, result, group.ranks[source], group.group))
    if operations:
        for work in dist.batch_isend_irecv(operations):
            work.wait()
    return result


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
        ctx.group = group
        result = x.clone()
        dist.all_reduce(result, group=group.group)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        result = grad.clone()
        dist.all_reduce(result, group=ctx.group.group)
        return result, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: OrderedGroup) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter([grad.contiguous() for grad in grads], ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: OrderedGroup, *chunks: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(chunks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *_gather(grad.contiguous(), ctx.group))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: OrderedGroup, *chunks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return _exchange(chunks, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *_exchange([grad.contiguous() for grad in grads], ctx.group))


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        ctx.group, ctx.pairs = group, pairs
        return _permute(x, group, pairs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        inverse = tuple((destination, source) for source, destination in ctx.pairs)
        return _permute(grad, ctx.group, inverse), None, None


# Function.apply is untyped; these name each one's signature.
_all_reduce_sum: Callable[[torch.Tensor, OrderedGroup], torch.Tensor] = _AllReduceSum.apply
_all_gather: Callable[[torch.Tensor, OrderedGroup], tuple[torch.Tensor, ...]] = _AllGather.apply
_reduce_scatter_op: Callable[..., torch.Tensor] = _ReduceScatter.apply
_all_to_all: Callable[..., tuple[torch.Tensor, ...]] = _AllToAll.apply
_ppermute: Callable[
    [torch.Tensor, OrderedGroup, tuple[tuple[int, int], ...]], torch.Tensor
] = _Permute.apply
