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
also follows JAX's type rule (see :mod:`meshstate.jax.vma`); inside a
``shard_map(check_vma=False)`` body ``psum``, ``pmean`` and ``pvary`` have
JAX's legacy transposes (``psum``'s backward a ``psum``, ``pvary``'s the identity).
While spmd_types' checker runs (torchtitan's), each is also typed as spmd_types'
table says (:mod:`meshstate.jax.spmd_checker`).

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

import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar, overload

import torch

from meshstate.core import compat as _compat
from meshstate.errors import ArgumentTypeError
from meshstate.core.mesh import ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.core.one_rank import tracing_for_every_rank
from meshstate.core.ordered import OrderedGroup, index_when_run
from meshstate.jax.torch_calls import (
    all_gather_on,
    check_perm,
    device_for,
    exchange,
    gather_invariant,
    permute,
    recorded,
    reduce,
    scatter,
    sum_over,
    summed_gradient,
)
from meshstate.jax.spmd_checker import Collective, checked, spmd_typed
from meshstate.jax.vma import (
    VaryingAxesError,
    axes_text,
    body,
    spmd_types_checking,
    type_text,
    typed,
    vma,
)

Axes = str | tuple[str, ...]

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
]


NUMBERS = (int, float)
"""The Python numbers ``psum`` and ``pmean`` take as JAX does (``psum(1, "tp")``)."""

Number = int | float
Summed = TypeVar("Summed", torch.Tensor, int, float)
"""What ``psum`` takes and gives: a tensor, or a Python number (JAX's ``psum(1, "tp")``)."""


def _spelled(axes: Axes | None, axis_name: Axes | None, name: str) -> Axes:
    """The axes a collective was given, as ``axes`` or by JAX's keyword ``axis_name``."""
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


@_compat.constant_when_traced
def _axis_names(axes: Axes) -> frozenset[str]:
    """The mesh axes a collective names: ``"dp-cp"`` and ``("cp", "dp")`` name dp and cp."""
    names = _names_of.get(axes)
    if names is None:
        spelled = axes.split("-") if isinstance(axes, str) else "-".join(axes).split("-")
        names = _names_of[axes] = frozenset(spelled)
    return names


_names_of: dict[Axes, frozenset[str]] = {}


def _typed_input(
    x: torch.Tensor, axes: Axes, mesh: ParallelMesh | None, name: str, *, reduces: bool
) -> tuple[torch.Tensor, frozenset[str]]:
    """``x`` made to vary over the collective's axes (pvary'd where it does not), and
    its type before: JAX's rule inside a typed body. A reduction (psum, pmean,
    psum_scatter) over axes of which ``x`` varies over some and not others is refused."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} takes a torch.Tensor, got {type(x).__name__}")
    names, before = _axis_names(axes), vma(x)
    varying = names & before
    if varying == names:
        return x, before
    if reduces and varying:
        raise VaryingAxesError(
            f"meshstate.{name} can only accept axis_name which corresponds to one of varying "
            f"or invarying state of the input. Got input type: {type_text(x)}, axes: "
            f"{axes!r} and input state: {{'invarying', 'varying'}}; pvary the input over "
            f"{tuple(sorted(names - before))!r} or reduce over {tuple(sorted(varying))!r} alone"
        )
    parallel_mesh = current_mesh() if mesh is None else mesh
    return pvary_over(x, names - before, parallel_mesh), before


def _collective(
    x: torch.Tensor,
    axes: Axes,
    mesh: ParallelMesh | None,
    group: OrderedGroup,
    run: Callable[[torch.Tensor, OrderedGroup], torch.Tensor],
    kind: str,
    dims: tuple[int, ...] = (0,),
    tiled: bool = False,
) -> torch.Tensor:
    """``run(x, group)``; while spmd_types' checker runs, typed by its rule ``kind``
    (:mod:`meshstate.jax.spmd_checker`; with ``tiled``, ``dims`` are the dims its axes
    split). (Outside a typed body and the checker each collective calls
    its own work itself: the eager path costs one call less.)"""
    if spmd_types_checking():
        parallel_mesh = current_mesh() if mesh is None else mesh
        call = Collective(kind, run, group, _axis_groups(parallel_mesh, axes), dims, tiled)
        return checked(x, group, call)
    return run(x, group)


def _in_body(
    axes: Axes,
    mesh: ParallelMesh | None,
    name: str,
    run: Callable[[torch.Tensor, OrderedGroup], torch.Tensor],
    *,
    reduces: bool = False,
    keeps_axes: bool = True,
) -> Callable[[torch.Tensor, OrderedGroup], torch.Tensor]:
    """``run``, with JAX's rule inside a typed body: ``x`` cast up to vary over ``axes``
    first, the result typed with them (``keeps_axes``) or without them, a reduction over a
    mix of varying and invariant axes refused."""

    def typed_run(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
        if body.types is None:
            return run(x, group)
        with _compat.torch_functions_off():
            x, before = _typed_input(x, axes, mesh, name, reduces=reduces)
            names = _axis_names(axes)
            return typed(run(x, group), before | names if keeps_axes else before - names)

    return typed_run


_SPMD_TYPES = "spmd_types"
_loaded = sys.modules
"""Each collective's plain path asks ``_SPMD_TYPES in _loaded`` before
``spmd_types_checking()``: where spmd_types was never imported, one dict lookup."""


def _axis_groups(parallel_mesh: ParallelMesh, axes: Axes) -> tuple[Any, ...]:
    """The process group of each axis ``axes`` names, size 1 left out (spmd_types' axes)."""
    return tuple(parallel_mesh.group(axis) for axis in sorted(_axis_names(axes))
                 if parallel_mesh.size(axis) > 1)


def pvary_over(x: torch.Tensor, axes: frozenset[str], parallel_mesh: ParallelMesh) -> torch.Tensor:
    """``x``, typed to vary over ``axes`` too; its gradient is summed over them (JAX's
    ``pvary`` inside a typed body, and what casting an operand up inserts)."""
    if spmd_types_checking():
        spelled = tuple(sorted(axes))
        group = _ordered_group(parallel_mesh, spelled)
        return _collective(x, spelled, parallel_mesh, group,
                           lambda v, on: pvary_over(v, axes, parallel_mesh), "convert")
    if not recorded(x):
        return typed(x.view_as(x), vma(x) | axes)
    group = _ordered_group(parallel_mesh, tuple(sorted(axes)))
    aliased = x.view_as(x) if len(group.ranks) == 1 else summed_gradient(x, group.group_name)
    return typed(aliased, vma(x) | axes)


def axis_index(
    axes: Axes | None = None, *, axis_name: Axes | None = None, mesh: ParallelMesh | None = None
) -> Any:
    """The caller's index along ``axes`` (row-major over a tuple, first axis major).

    An ``int``; inside a ``shard_map`` body with ``check_vma=True`` (the default)
    JAX's typed value instead: a 0-dim int64 tensor that varies over ``axes``, so
    what is computed from it is typed as varying too. Traced by
    :func:`~meshstate.compile_on_one_rank`, a 0-dim int64 tensor read when the graph runs.
    """
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "axis_index")
    group = _ordered(axes, mesh, "axis_index")
    every_rank = tracing_for_every_rank()
    if body.types is None:
        return index_when_run(group) if every_rank else group.index
    parallel_mesh = current_mesh() if mesh is None else mesh
    checked = spmd_types_checking()  # asked before torch functions go off: it reads the modes
    with _compat.torch_functions_off():
        device = device_for(parallel_mesh.device_type)
        if every_rank:
            index = index_when_run(group).to(device)
        else:
            index = torch.full((), group.index, dtype=torch.int64, device=device)
        names = _axis_names(axes)
        if checked:
            view_axes = parallel_mesh.layout.view_of(names).axes_fastest_first
            spmd_typed(index, index, names, view_axes, parallel_mesh)
        return typed(index, names)


def axis_size(
    axes: Axes | None = None, *, axis_name: Axes | None = None, mesh: ParallelMesh | None = None
) -> int:
    """The number of ranks along ``axes``."""
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "axis_size")
    return len(_ordered(axes, mesh, "axis_size").ranks)


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "psum")
    group = _ordered(axes, mesh, "psum")
    if isinstance(x, NUMBERS):
        return x * len(group.ranks)
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return sum_over(x, group, "psum")
    run = _in_body(axes, mesh, "psum", _summed, reduces=True, keeps_axes=False)
    return _collective(x, axes, mesh, group, run, "sum")


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "pmean")
    group = _ordered(axes, mesh, "pmean")
    if isinstance(x, NUMBERS):
        return x * len(group.ranks) / len(group.ranks)
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return _mean(x, group)
    run = _in_body(axes, mesh, "pmean", _mean, reduces=True, keeps_axes=False)
    return _collective(x, axes, mesh, group, run, "sum")


def _summed(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    return sum_over(x, group, "psum")


def _mean(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    return sum_over(x, group, "pmean") / len(group.ranks)


def pmax(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axes`` (not differentiable)."""
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "pmax")
    return _extreme(x, axes, mesh, "max", "pmax")


def pmin(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """The elementwise minimum of ``x`` over ``axes`` (not differentiable)."""
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "pmin")
    return _extreme(x, axes, mesh, "min", "pmin")


def _extreme(
    x: torch.Tensor, axes: Axes, mesh: ParallelMesh | None, op: str, name: str
) -> torch.Tensor:
    group = _ordered(axes, mesh, name)
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return reduce(x, group, op, name)
    run = _in_body(axes, mesh, name, partial(_reduced, op=op, name=name), keeps_axes=False)
    return _collective(x, axes, mesh, group, run, "extreme")


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "pvary")
    group = _ordered(axes, mesh, "pvary")
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"pvary takes a torch.Tensor, got {type(x).__name__}")
    if body.legacy:
        return x
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return _varying(x, group)
    return _collective(x, axes, mesh, group, partial(_pvary_typed, axes=axes, mesh=mesh),
                       "convert")


def _varying(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
    """``pvary`` in plain code: ``x`` itself where no gradient is recorded."""
    if len(group.ranks) == 1 or not recorded(x):
        return x
    return summed_gradient(x, group.group_name)


def _pvary_typed(
    x: torch.Tensor, group: OrderedGroup, axes: Axes, mesh: ParallelMesh | None
) -> torch.Tensor:
    """``pvary`` in plain code, or with JAX's rule inside a typed body."""
    if body.types is None:
        return _varying(x, group)
    names = _axis_names(axes)
    if names & vma(x):
        raise VaryingAxesError(
            f"meshstate.pvary: x of type {type_text(x)} already varies over "
            f"{axes_text(names & vma(x))}; pvary only casts invariant axes to varying "
            "(JAX: Unsupported pcast from=varying, to='varying')"
        )
    with _compat.torch_functions_off():
        return pvary_over(x, names, current_mesh() if mesh is None else mesh)


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "all_gather")
    group = _ordered(axes, mesh, "all_gather")
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return all_gather_on(x, group, axis, tiled)
    run = _in_body(axes, mesh, "all_gather", lambda v, on: all_gather_on(v, on, axis, tiled))
    return _collective(x, axes, mesh, group, run, "gather", (axis,), tiled)


def all_gather_invariant(
    x: torch.Tensor,
    axes: Axes | None = None,
    *,
    axis_name: Axes | None = None,
    axis: int = 0,
    tiled: bool = False,
    mesh: ParallelMesh | None = None,
) -> torch.Tensor:
    """:func:`all_gather`, typed invariant over ``axes``; its backward keeps the caller's slice.

    JAX's ``jax.lax.all_gather(x, axes, to="invarying")``; with ``axis=-1,
    tiled=True`` megatron-core's ``gather_from_tensor_model_parallel_region``.
    Type: ``vma(x)`` without ``axes``, so the result may leave a ``shard_map``
    under an out-spec that leaves ``axes`` out.
    """
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "all_gather_invariant")
    group = _ordered(axes, mesh, "all_gather_invariant")
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return gather_invariant(x, group, axis, tiled)
    run = _in_body(axes, mesh, "all_gather_invariant",
                   lambda v, on: gather_invariant(v, on, axis, tiled), keeps_axes=False)
    return _collective(x, axes, mesh, group, run, "gather_invariant", (axis,), tiled)


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "psum_scatter")
    group = _ordered(axes, mesh, "psum_scatter")
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return scatter(x, group, scatter_dimension, tiled)
    run = _in_body(axes, mesh, "psum_scatter",
                   lambda v, on: scatter(v, on, scatter_dimension, tiled), reduces=True)
    return _collective(x, axes, mesh, group, run, "scatter", (scatter_dimension,), tiled)


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "all_to_all")
    if split_axis is None or concat_axis is None:
        missing = "split_axis" if split_axis is None else "concat_axis"
        raise ArgumentTypeError(f"all_to_all() missing its argument {missing!r}")
    split, concat = split_axis, concat_axis
    group = _ordered(axes, mesh, "all_to_all")
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return exchange(x, group, split, concat, tiled)
    run = _in_body(axes, mesh, "all_to_all", lambda v, on: exchange(v, on, split, concat, tiled))
    return _collective(x, axes, mesh, group, run, "exchange", (split, concat), tiled)


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
    if axis_name is not None or axes is None:
        axes = _spelled(axes, axis_name, "ppermute")
    if perm is None:
        raise ArgumentTypeError("ppermute() missing its argument 'perm'")
    group = _ordered(axes, mesh, "ppermute")
    pairs = check_perm(perm, len(group.ranks))
    if body.types is None and not (_SPMD_TYPES in _loaded and spmd_types_checking()):
        return permute(x, group, pairs)
    run = _in_body(axes, mesh, "ppermute", lambda v, on: permute(v, on, pairs))
    return _collective(x, axes, mesh, group, run, "permute")


