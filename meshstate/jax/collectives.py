"""JAX-style collectives over named mesh axes, with JAX's default types and gradients.

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

Gradients are JAX's default (``check_vma=True``) transposes: ``psum``'s
backward is the identity (a ``pvary``) and ``pvary``'s a ``psum``, so in
plain torch code, where a value is taken to vary over the axes a collective
names, a rank's ``loss.backward()`` on a replicated loss gives the gradient
one process would (megatron-core's ``reduce_from_`` / ``copy_to_tensor_model_parallel_region``).
``all_gather``'s backward is ``psum_scatter`` and the reverse;
``all_gather_invariant``'s keeps the rank's own slice, ``ppermute``'s is the
inverse permutation, ``all_to_all``'s the swapped one; ``pmax`` and ``pmin``
refuse tensors that require grad. Inside a ``shard_map`` body each collective
also follows JAX's type rule (see :mod:`meshstate.jax.types.vma`); inside a
``shard_map(check_vma=False)`` body ``psum``, ``pmean`` and ``pvary`` have
JAX's legacy transposes (``psum``'s backward a ``psum``, ``pvary``'s the identity).
While torchtitan's type checker runs, each is also typed as its table says
(:mod:`meshstate.jax.typing` asks which types apply, once per call).

Compiled and eager alike: under ``torch.compile`` (or any torch tracer), and
wherever a gradient is needed, each call is one of torch's traceable functional
collectives, so ``torch.compile(fullgraph=True)`` sees one graph with no break.
In eager code that needs no gradient the call is the in-place c10d collective
in tensor form (``all_reduce`` on a copy, ``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``), the cost of the hand-written
call. No copy is made to reorder shards where the axis order is the group's
rank order.

Example (8 ranks, ``init_mesh(tp=2, cp=2)`` so dp=2)::

    with mesh:
        axis_index(("cp", "dp"))            # cp * 2 + dp
        psum(torch.ones(1), "tp")           # tensor([2.])
        all_gather(x, ("cp", "dp"))         # x of every rank, stacked in (cp, dp) order
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, TypeVar, overload

import torch

from meshstate.errors import ArgumentTypeError, ConfigError
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, require_parallel_mesh
from meshstate.core.one_rank import index_when_run, tracing_for_every_rank
from meshstate.core.ordered import OrderedGroup
from meshstate.jax import typing
from meshstate.jax.torch_calls import (
    Axes,
    all_gather_on,
    check_perm,
    exchange,
    gather_invariant,
    permute,
    recorded,
    reduce,
    scatter,
    sum_over,
    summed_gradient,
)

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "raise_on_ppermute_sort_diff",
]


NUMBERS = (int, float)
"""The Python numbers ``psum`` and ``pmean`` take as JAX does (``psum(1, "tp")``)."""

Number = int | float
Summed = TypeVar("Summed", torch.Tensor, int, float)
"""What ``psum`` takes and gives: a tensor, or a Python number (JAX's ``psum(1, "tp")``)."""


def _axes_and_group(
    axes: Axes | None, axis_name: Axes | None, mesh: ParallelMesh | None, name: str
) -> tuple[Axes, OrderedGroup]:
    """The axes a collective was given, as ``axes`` or by JAX's keyword ``axis_name``, and
    the caller's group over them (:func:`~meshstate.jax.typing.ordered_group`)."""
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, name)
    if mesh is None:
        return axes, typing.ordered_group(current_mesh(), axes)
    return axes, typing.ordered_group(require_parallel_mesh(mesh, f"{name}(mesh=...)"), axes)


def _spelled(axes: Axes | None, axis_name: Axes | None, name: str) -> Axes:
    if axis_name is None:
        if axes is None:
            raise ArgumentTypeError(f"{name}() missing its axes: pass axes= (or JAX's axis_name=)")
        return axes
    if axes is not None:
        raise ArgumentTypeError(
            f"{name}() got axes={axes!r} and axis_name={axis_name!r}; they are one "
            "argument, pass one of them"
        )
    return axis_name


def axis_index(
    axes: Axes | None = None, *, axis_name: Axes | None = None, mesh: ParallelMesh | None = None
) -> Any:
    """The caller's index along ``axes`` (row-major over a tuple, first axis major).

    An ``int``; inside a ``shard_map`` body with ``check_vma=True`` (the default)
    JAX's typed value instead: a 0-dim int64 tensor that varies over ``axes``, so
    what is computed from it is typed as varying too. Traced by
    :func:`~meshstate.compile_on_one_rank`, a 0-dim int64 tensor read when the graph runs.
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "axis_index")
    body = typing.body
    if body.manual is not None:
        typing.refuse_unbound("axis_index", typing.axis_names(axes))
    every_rank = tracing_for_every_rank()
    if body.types is None and body.auto_mesh is None:
        return index_when_run(group) if every_rank else group.index

    def index(device: torch.device) -> torch.Tensor:
        if every_rank:
            return index_when_run(group).to(device)
        return torch.full((), group.index, dtype=torch.int64, device=device)

    parallel_mesh = current_mesh() if mesh is None else mesh
    if body.types is None:  # a legacy partial-manual body: a value global over its other axes
        return typing.global_value(index(torch.device(parallel_mesh.device_type)))
    return typing.global_value(typing.typed_index(index, axes, parallel_mesh))


def axis_size(
    axes: Axes | None = None, *, axis_name: Axes | None = None, mesh: ParallelMesh | None = None
) -> int:
    """The number of ranks along ``axes``."""
    if typing.body.manual is not None:  # JAX refuses an unbound name before any lookup
        axes, axis_name = _spelled(axes, axis_name, "axis_size"), None
        typing.refuse_unbound("axis_size", typing.axis_names(axes))
    return len(_axes_and_group(axes, axis_name, mesh, "axis_size")[1].ranks)


def psum(
    x: Summed, axes: Axes | None = None, *, axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> Summed:
    """The sum of ``x`` over ``axes``, on every rank.

    Backward: the identity (JAX's default; megatron-core's
    ``reduce_from_tensor_model_parallel_region``); a ``psum`` inside a
    ``shard_map(check_vma=False)`` body. Type: ``vma(x)`` without ``axes``. Of a
    Python number, JAX's answer: ``x`` times the axis size (``psum(1, "tp")`` is tp's
    size), a number.
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "psum")
    if isinstance(x, NUMBERS):
        return x * len(group.ranks)
    return typing.collective(typing.PSUM, x, axes, mesh, group, _summed)


@overload
def pmean(
    x: torch.Tensor, axes: Axes | None = None, *, axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor: ...


@overload
def pmean(
    x: Number, axes: Axes | None = None, *, axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> Number: ...


def pmean(
    x: torch.Tensor | Number,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor | Number:
    """The mean of ``x`` over ``axes``, on every rank (``psum(x, axes) / axis_size(axes)``);
    of a Python number, that number as a float (JAX's answer)."""
    axes, group = _axes_and_group(axes, axis_name, mesh, "pmean")
    if isinstance(x, NUMBERS):
        return x * len(group.ranks) / len(group.ranks)
    return typing.collective(typing.PMEAN, x, axes, mesh, group, _mean)


def _summed(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    return sum_over(x, group, "psum", typing.body.legacy)


def _mean(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    return sum_over(x, group, "pmean", typing.body.legacy) / len(group.ranks)


def pmax(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axes`` (not differentiable)."""
    axes, group = _axes_and_group(axes, axis_name, mesh, "pmax")
    return typing.collective(typing.PMAX, x, axes, mesh, group,
                             partial(_reduced, op="max", name="pmax"))


def pmin(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """The elementwise minimum of ``x`` over ``axes`` (not differentiable)."""
    axes, group = _axes_and_group(axes, axis_name, mesh, "pmin")
    return typing.collective(typing.PMIN, x, axes, mesh, group,
                             partial(_reduced, op="min", name="pmin"))


def _reduced(x: torch.Tensor, group: OrderedGroup, op: str, name: str) -> torch.Tensor:
    return reduce(x, group, op, name)


def pvary(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """``x``, cast to vary over ``axes``: the identity forward, a ``psum`` backward.

    JAX's ``jax.lax.pcast(x, axes, to="varying")``; megatron-core's
    ``copy_to_tensor_model_parallel_region``. In plain code it makes a value
    every rank holds (a replicated input) enter per-rank work along ``axes``,
    so its gradient is summed over them. Inside a ``shard_map`` body an axis
    ``x`` already varies over is refused; inside a ``shard_map(check_vma=False)``
    body it is the identity both ways (JAX's legacy mode).

    Example (4 ranks, ``init_mesh(tp=2)``): ``pvary(x, "tp")`` equals ``x``;
    after ``(pvary(x, "tp") * (axis_index("tp") + 1)).sum().backward()``,
    ``x.grad`` is 3 on every rank.
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "pvary")
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"pvary takes a torch.Tensor, got {type(x).__name__}")
    if typing.body.legacy:
        typing.refuse_unbound("pvary", typing.axis_names(axes))
        return x
    return typing.collective(typing.PVARY, x, axes, mesh, group, _varying)


def _varying(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    """``pvary`` in plain code: ``x`` itself where no gradient is recorded."""
    if len(group.ranks) == 1 or not recorded(x):
        return x
    return summed_gradient(x, group.group_name)


def all_gather(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    axis: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Every rank's ``x`` along ``axes``, in axis-index order.

    Stacked along a new dim ``axis``; with ``tiled=True`` concatenated along ``axis``.
    Backward: ``psum_scatter`` (megatron-core's ``gather_from_sequence_parallel_region``).
    Type: ``vma(x)`` and ``axes`` (every rank holds the same values, typed varying;
    :func:`all_gather_invariant` gives them the invariant type).
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "all_gather")
    return typing.collective(typing.ALL_GATHER, x, axes, mesh, group,
                             lambda v, on: all_gather_on(v, on, axis, tiled), (axis,), tiled)


def all_gather_invariant(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    axis: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """:func:`all_gather`, typed invariant over ``axes``; its backward keeps the caller's slice
    (inside a ``shard_map(check_vma=False)`` body, sums the copies as :func:`all_gather`'s).

    JAX's ``jax.lax.all_gather(x, axes, to="invarying")``; with ``axis=-1,
    tiled=True`` megatron-core's ``gather_from_tensor_model_parallel_region``.
    Type: ``vma(x)`` without ``axes``, so the result may leave a ``shard_map``
    under an out-spec that leaves ``axes`` out.
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "all_gather_invariant")
    # A check_vma=False body transposes it as all_gather (a sum of the copies), as JAX 0.12.
    move = all_gather_on if typing.body.legacy else gather_invariant
    return typing.collective(typing.ALL_GATHER_INVARIANT, x, axes, mesh, group,
                             lambda v, on: move(v, on, axis, tiled), (axis,), tiled)


def psum_scatter(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    scatter_dimension: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Sum ``x`` over ``axes`` and keep the caller's chunk of ``scatter_dimension``.

    Without ``tiled`` that dim must equal the axis size and is removed; with
    ``tiled=True`` it is split into axis-size chunks and the caller keeps its own.
    Backward: ``all_gather`` (megatron-core's ``reduce_scatter_to_sequence_parallel_region``).
    Type: ``vma(x)`` and ``axes``.
    """
    axes, group = _axes_and_group(axes, axis_name, mesh, "psum_scatter")
    return typing.collective(typing.PSUM_SCATTER, x, axes, mesh, group,
                             lambda v, on: scatter(v, on, scatter_dimension, tiled),
                             (scatter_dimension,), tiled)


def all_to_all(
    x: torch.Tensor,
    axes: Axes | None = None,
    split_axis: int | None = None,
    concat_axis: int | None = None,
    *,
    axis_name: Axes | None = None,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Send chunk ``i`` of ``split_axis`` to the rank of axis index ``i``; join what arrives.

    Received chunks are joined along ``concat_axis`` in sender order. Without
    ``tiled`` ``split_axis`` must equal the axis size and is removed, and a new
    dim of that size appears at ``concat_axis``; with ``tiled=True`` no dim is
    added or removed. Backward: the swapped ``all_to_all``. Type: ``vma(x)`` and ``axes``.
    """
    if split_axis is None or concat_axis is None:
        missing = "split_axis" if split_axis is None else "concat_axis"
        raise ArgumentTypeError(f"all_to_all() missing its argument {missing!r}")
    split, concat = split_axis, concat_axis
    axes, group = _axes_and_group(axes, axis_name, mesh, "all_to_all")
    return typing.collective(typing.ALL_TO_ALL, x, axes, mesh, group,
                             lambda v, on: exchange(v, on, split, concat, tiled), (split, concat),
                             tiled)


def ppermute(
    x: torch.Tensor,
    axes: Axes | None = None,
    perm: Sequence[tuple[int, int]] | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """Send ``x`` from axis index ``source`` to ``destination`` for each pair in ``perm``.

    A rank no pair sends to receives zeros. Each index may appear at most once
    as a source and once as a destination. Backward: the inverse permutation.
    Type: ``vma(x)`` and ``axes``.
    """
    if perm is None:
        raise ArgumentTypeError("ppermute() missing its argument 'perm'")
    axes, group = _axes_and_group(axes, axis_name, mesh, "ppermute")
    if not isinstance(axes, str) and len(axes) > 1 and _ppermute_order.refuses:
        _refuse_against_mesh_order(axes, current_mesh() if mesh is None else mesh)
    pairs = check_perm(perm, len(group.ranks))
    return typing.collective(typing.PPERMUTE, x, axes, mesh, group,
                             lambda v, on: permute(v, on, pairs))


class _PpermuteOrder(threading.local):
    refuses = True


_ppermute_order = _PpermuteOrder()


@contextlib.contextmanager
def raise_on_ppermute_sort_diff(refuse: bool) -> Iterator[None]:
    """JAX's ``jax.raise_on_ppermute_sort_diff``: with ``False``, :func:`ppermute` over a
    tuple of axes against mesh order reads ``perm`` in the tuple's order (as JAX 0.12 with
    the check off) instead of refusing it; in this thread, until the block ends.

    Example: ``with raise_on_ppermute_sort_diff(False): ppermute(x, ("tp", "cp"), perm)``.
    """
    before, _ppermute_order.refuses = _ppermute_order.refuses, refuse
    try:
        yield
    finally:
        _ppermute_order.refuses = before


def _refuse_against_mesh_order(axes: Sequence[str], mesh: ParallelMesh) -> None:
    grid, named = mesh.layout.resolve_base(tuple(axes))
    if grid.mesh_order(named) != tuple(named):
        raise ConfigError(
            f"ppermute over {tuple(axes)!r}: make sure that the axis_name passed to "
            f"meshstate.ppermute is in the same order as the axis_names declared on the mesh "
            f"({grid.mesh_order(named)!r}), as JAX 0.12 checks; to allow another order, "
            "use `with meshstate.raise_on_ppermute_sort_diff(False):`"
        )


