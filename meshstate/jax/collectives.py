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

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.errors import ConfigError
from meshstate.core.mesh import ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.core.ordered import OrderedGroup
from meshstate.core.simulation import each_rank
from meshstate.jax.vma import (
    VaryingAxesError,
    axes_text,
    body,
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
    return _recorded(cast(torch.Tensor, x)) or torch.compiler.is_compiling()


def _recorded(x: torch.Tensor) -> bool:
    """Whether autograd records ``x`` (it requires grad and grad mode is on)."""
    return x.requires_grad and torch.is_grad_enabled()


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
        raise ConfigError(f"{name} takes a torch.Tensor, got {type(x).__name__}")
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


def pvary_over(x: torch.Tensor, axes: frozenset[str], parallel_mesh: ParallelMesh) -> torch.Tensor:
    """``x``, typed to vary over ``axes`` too; its gradient is summed over them (JAX's
    ``pvary`` inside a typed body, and what casting an operand up inserts)."""
    if not _recorded(x):
        return typed(x.view_as(x), vma(x) | axes)
    group = _ordered_group(parallel_mesh, tuple(sorted(axes)))
    cast = x.view_as(x) if len(group.ranks) == 1 else _summed_gradient(x, group.group_name)
    return typed(cast, vma(x) | axes)


def axis_index(axes: Axes, *, mesh: ParallelMesh | None = None) -> Any:
    """The caller's index along ``axes`` (row-major over a tuple, first axis major).

    An ``int``; inside a ``shard_map`` body with ``check_vma=True`` (the default)
    JAX's typed value instead: a 0-dim int64 tensor that varies over ``axes``, so
    what is computed from it is typed as varying too.
    """
    group = _ordered(axes, mesh, "axis_index")
    if body.types is None:
        return group.index
    parallel_mesh = current_mesh() if mesh is None else mesh
    with _compat.torch_functions_off():
        device = device_for(parallel_mesh.device_type)
        index = torch.full((), group.index, dtype=torch.int64, device=device)
        return typed(index, _axis_names(axes))


def device_for(device_type: str) -> torch.device:
    """The device a mesh of ``device_type`` computes on: the current CUDA device for ``"cuda"``."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def axis_size(axes: Axes, *, mesh: ParallelMesh | None = None) -> int:
    """The number of ranks along ``axes``."""
    return len(_ordered(axes, mesh, "axis_size").ranks)


def psum(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The sum of ``x`` over ``axes``, on every rank.

    Backward: the identity (JAX's default; megatron-core's
    ``reduce_from_tensor_model_parallel_region``); a ``psum`` inside a
    ``shard_map(check_vma=False)`` body. Type: ``vma(x)`` without ``axes``.
    """
    group = _ordered(axes, mesh, "psum")
    if body.types is None:
        return _sum(x, group, "psum")
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "psum", reduces=True)
        return typed(_sum(x, group, "psum"), before - _axis_names(axes))


def pmean(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The mean of ``x`` over ``axes``, on every rank (``psum(x, axes) / axis_size(axes)``)."""
    group = _ordered(axes, mesh, "pmean")
    if body.types is None:
        return _sum(x, group, "pmean") / len(group.ranks)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "pmean", reduces=True)
        return typed(_sum(x, group, "pmean") / len(group.ranks), before - _axis_names(axes))


def pmax(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axes`` (not differentiable)."""
    return _extreme(x, axes, mesh, "max", "pmax")


def pmin(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The elementwise minimum of ``x`` over ``axes`` (not differentiable)."""
    return _extreme(x, axes, mesh, "min", "pmin")


def _extreme(
    x: torch.Tensor, axes: Axes, mesh: ParallelMesh | None, op: str, name: str
) -> torch.Tensor:
    group = _ordered(axes, mesh, name)
    if body.types is None:
        return _reduce(x, group, op, name)
    with _compat.torch_functions_off():
        return typed(_reduce(x, group, op, name), vma(x) - _axis_names(axes))


def _reduce(x: torch.Tensor, group: OrderedGroup, op: str, name: str) -> torch.Tensor:
    traced = _traced(x, name)
    if x.requires_grad:
        raise ConfigError(f"{name} is not differentiable; call it on x.detach()")
    if traced:
        return _compat.traced_all_reduce(x, op, group.group_name)
    result = x.clone()
    dist.all_reduce(result, op=_REDUCE_OPS[op], group=group.group)
    return result


def pvary(x: torch.Tensor, axes: Axes, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
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
    group = _ordered(axes, mesh, "pvary")
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"pvary takes a torch.Tensor, got {type(x).__name__}")
    if body.legacy:
        return x
    if body.types is None:
        if len(group.ranks) == 1 or not _recorded(x):
            return x
        return _summed_gradient(x, group.group_name)
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
    axes: Axes,
    *,
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
    group = _ordered(axes, mesh, "all_gather")
    if body.types is None:
        return _all_gather(x, group, axis, tiled)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "all_gather", reduces=False)
        return typed(_all_gather(x, group, axis, tiled), before | _axis_names(axes))


def _all_gather(x: torch.Tensor, group: OrderedGroup, axis: int, tiled: bool) -> torch.Tensor:
    traced = _traced(x, "all_gather")
    if tiled and axis == 0 and _in_place(x, traced, group):
        gathered = x.new_empty((len(group.ranks) * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(gathered, x, group=group.group)
        return gathered
    axis = _dim(axis, x.dim() + (not tiled), "all_gather", "axis")
    return gather(x, group, axis, tiled=tiled, traced=traced)


def all_gather_invariant(
    x: torch.Tensor,
    axes: Axes,
    *,
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
    group = _ordered(axes, mesh, "all_gather_invariant")
    if body.types is None:
        return _gather_invariant(x, group, axis, tiled)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "all_gather_invariant", reduces=False)
        return typed(_gather_invariant(x, group, axis, tiled), before - _axis_names(axes))


def _gather_invariant(x: torch.Tensor, group: OrderedGroup, axis: int, tiled: bool) -> torch.Tensor:
    if not _recorded(x):
        return _all_gather(x, group, axis, tiled)
    axis = _dim(axis, x.dim() + (not tiled), "all_gather_invariant", "axis")
    return _gather_keeping_slice(x, group, axis, tiled)


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
    Backward: ``all_gather`` (megatron-core's ``reduce_scatter_to_sequence_parallel_region``).
    Type: ``vma(x)`` and ``axes``.
    """
    group = _ordered(axes, mesh, "psum_scatter")
    if body.types is None:
        return _scatter(x, group, scatter_dimension, tiled)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "psum_scatter", reduces=True)
        return typed(_scatter(x, group, scatter_dimension, tiled), before | _axis_names(axes))


def _scatter(x: torch.Tensor, group: OrderedGroup, scatter_dimension: int, tiled: bool) -> torch.Tensor:
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
    added or removed. Backward: the swapped ``all_to_all``. Type: ``vma(x)`` and ``axes``.
    """
    group = _ordered(axes, mesh, "all_to_all")
    if body.types is None:
        return _exchange(x, group, split_axis, concat_axis, tiled)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "all_to_all", reduces=False)
        exchanged = _exchange(x, group, split_axis, concat_axis, tiled)
        return typed(exchanged, before | _axis_names(axes))


def _exchange(
    x: torch.Tensor, group: OrderedGroup, split_axis: int, concat_axis: int, tiled: bool
) -> torch.Tensor:
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
    as a source and once as a destination. Backward: the inverse permutation.
    Type: ``vma(x)`` and ``axes``.
    """
    group = _ordered(axes, mesh, "ppermute")
    pairs = _check_perm(perm, len(group.ranks))
    if body.types is None:
        return _permute(x, group, pairs)
    with _compat.torch_functions_off():
        x, before = _typed_input(x, axes, mesh, "ppermute", reduces=False)
        return typed(_permute(x, group, pairs), before | _axis_names(axes))


def _permute(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    # One all_to_all_single whose only non-empty pieces go to the destination and come
    # from the source: a point-to-point exchange that traces, and whose backward (the
    # splits swapped) is the inverse permutation.
    if _traced(x, "ppermute"):
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
    goes back through the mask). The split sizes are each rank's own, also for
    every rank of a simulated world.
    """
    n, numel = len(group.ranks), x.numel()
    pieces = _exchange_pieces(group.index, pairs, group.group_ranks)
    sends = [piece * numel for piece in pieces[:n]]
    receives = [piece * numel for piece in pieces[n : 2 * n]]
    received = pieces[2 * n]
    arrived = _compat.traced_all_to_all(x.contiguous().view(-1), receives, sends, group.group_name)
    mask = torch.full((), received, dtype=torch.bool, device=x.device)
    return arrived.view(x.shape).where(mask, 0)


@_compat.constant_when_traced
@each_rank
def _exchange_pieces(
    index: int, pairs: tuple[tuple[int, int], ...], group_ranks: tuple[int, ...]
) -> list[int]:
    """Whether the rank at axis ``index`` sends its piece to each group rank in the
    completed perm (1 or 0), then whether it receives one from each, then whether
    ``pairs`` sends it anything: one flat list, as a simulated world makes per-rank
    values of."""
    n = len(group_ranks)
    destination_of = dict(pairs)
    idle_sources = [i for i in range(n) if i not in destination_of]
    idle_destinations = [i for i in range(n) if i not in set(destination_of.values())]
    destination_of.update(zip(idle_sources, idle_destinations))
    source = next(s for s, d in destination_of.items() if d == index)
    sends, receives = [0] * n, [0] * n
    sends[group_ranks[destination_of[index]]] = 1
    receives[group_ranks[source]] = 1
    return [*sends, *receives, int((source, index) in pairs)]


def _sum(x: torch.Tensor, group: OrderedGroup, name: str) -> torch.Tensor:
    """``x`` summed over ``group``: backward the identity, or a sum in a legacy body."""
    if _recorded(x) and not body.legacy:
        return _sum_with_identity_gradient(x, group.group_name)
    if _traced(x, name):
        return _compat.traced_all_reduce(x, "sum", group.group_name)
    result: torch.Tensor = x.clone()
    dist.all_reduce(result, group=group.group)
    return result


class _SumWithIdentityGradient(torch.autograd.Function):
    """``psum`` with JAX's default transpose: the gradient passes through unchanged.

    Hand-written: torch's functional all-reduce has the legacy transpose (another
    all-reduce) as its registered backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _compat.traced_all_reduce(x, "sum", group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SummedGradient(torch.autograd.Function):
    """``pvary``: the identity forward; backward sums the gradient over the group.

    Hand-written: torch's functional collectives have no identity-forward op."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _compat.traced_all_reduce(grad.contiguous(), "sum", ctx.group_name), None


class _GatherKeepingSlice(torch.autograd.Function):
    """``all_gather_invariant``: gather forward; backward keeps the caller's slice of
    the gradient (every rank holds the whole gradient of an invariant value)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: OrderedGroup, axis: int, tiled: bool
    ) -> torch.Tensor:
        ctx.group, ctx.axis, ctx.tiled, ctx.size = group, axis, tiled, x.shape[axis] if tiled else 1
        return gather(x, group, axis, tiled=tiled, traced=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        index = ctx.group.index
        if ctx.tiled:
            return grad.narrow(ctx.axis, index * ctx.size, ctx.size), None, None, None
        return grad.select(ctx.axis, index), None, None, None


# Function.apply is untyped; these name each one's signature.
_sum_with_identity_gradient: Callable[[torch.Tensor, str], torch.Tensor] = (
    _SumWithIdentityGradient.apply
)
_summed_gradient: Callable[[torch.Tensor, str], torch.Tensor] = _SummedGradient.apply
_gather_keeping_slice: Callable[[torch.Tensor, OrderedGroup, int, bool], torch.Tensor] = (
    _GatherKeepingSlice.apply
)


def _in_place(x: torch.Tensor, traced: bool, group: OrderedGroup) -> bool:
    """Whether a tiled collective along dim 0 can run on ``x`` as it is: eager,
    contiguous, with dims, chunks in the group's rank order."""
    return not traced and group.by_group_rank is None and x.is_contiguous() and x.dim() > 0


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
