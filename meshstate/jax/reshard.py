"""``reshard``: a tensor laid out as a partition spec says, on a meshstate view.

A DTensor on a meshstate view moves by gathering each dim whose axes change
once, over the joint group of its old axes, and cutting its new block locally;
a plain tensor is cut by slicing. Traced by ``torch.compile``.

Example (8 ranks, ``init_mesh(tp=2, cp=2)``)::

    y = reshard(torch.arange(8), P(("cp", "dp")))   # rank 2 (cp=1, dp=0) holds [4, 5]
    reshard(y, P("tp")).to_local()                  # [0, 1, 2, 3] on tp=0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from meshstate.core import compat as _compat
from meshstate.errors import NotInitializedError
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, require_parallel_mesh
from meshstate.core.ordered import OrderedGroup
from meshstate.jax.plan import contiguous_strides, plan_on
from meshstate.jax.torch_calls import block, gather, gather_whole, take_block
from meshstate.jax.sharding import DimAxes, P, entry_axes, spec_of, to_placements

__all__ = ["reshard"]


def reshard(x: torch.Tensor, spec: P, mesh: ParallelMesh | None = None) -> DTensor:
    """``x`` laid out as ``spec`` says.

    A ``DTensor`` on a meshstate view moves on it: each dim whose axes change
    is gathered in one collective over the joint group of its old axes (in
    their spec order) and cut locally to its new block, so moving
    ``P(("dp", "cp"))`` to ``P("tp")`` is one all-gather over dp-cp, not one
    per mesh dim; partial sums, uneven dims and other meshes go through
    DTensor's own redistribution. A plain tensor (the full global value on
    every rank) is cut on the view of ``mesh`` (default: the current mesh)
    whose axes the spec names, by local slicing where its dims divide.
    Differentiable with DTensor's gradients, and traced by ``torch.compile``.

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``)::

        y = reshard(torch.arange(8), P(("cp", "dp")))   # rank 2 (cp=1, dp=0) holds [4, 5]
        reshard(y, P("tp")).to_local()                  # [0, 1, 2, 3] on tp=0
    """
    if isinstance(x, DTensor):
        pending = _pending(x.device_mesh, tuple(x.placements))
        if spec.unreduced - pending:
            return _into_pending(x, spec, pending)
        move = _move(x.device_mesh, x.placements, spec.dims, spec.unreduced, tuple(x.shape))
        if move is None:
            placements = _placements(x.device_mesh, spec.dims, spec.unreduced)
            return x.redistribute(x.device_mesh, placements)
        local = x.to_local()
        for dim, group in move.gathers:
            local = gather_whole(local, dim, group)
        if move.takes:
            local = take_block(local, move.takes)
        return DTensor.from_local(
            local, x.device_mesh, move.placements, run_check=False,
            shape=x.shape, stride=contiguous_strides(x.shape),
        )
    parallel_mesh = (
        current_mesh() if mesh is None else require_parallel_mesh(mesh, "reshard(mesh=...)")
    )
    if spec.unreduced:
        return _into_pending(reshard(x, P(*spec.dims), parallel_mesh), spec, frozenset())
    plan = plan_on(parallel_mesh, (spec,))
    return plan.to_dtensor(0, plan.block_of(0, x), x.shape)


@_compat.constant_when_traced
def _pending(view: DeviceMesh, placements: tuple[Placement, ...]) -> frozenset[str]:
    """The axes over which a DTensor with ``placements`` on ``view`` is a pending sum."""
    return frozenset(
        axis for axis, placement in zip(view.mesh_dim_names or (), placements)
        if placement.is_partial()
    )


def _into_pending(x: DTensor, spec: P, pending: frozenset[str]) -> DTensor:
    """``x`` made a pending sum over ``spec``'s unreduced axes as JAX's ``reshard`` makes
    it: a rank keeps its block in place where such an axis split a dim and zeros elsewhere;
    over an axis that split nothing, coordinate 0 keeps the value. Each such axis first
    becomes the minor one of its dim (a move, where it was not), so a block sits whole
    inside the block without it."""
    view, names = x.device_mesh, x.device_mesh.mesh_dim_names or ()
    reduced = tuple(Replicate() if p.is_partial() else p for p in x.placements)
    source = spec_of(view, reduced)
    if source is None:
        x = x.redistribute(view, [p if p.is_partial() else Replicate() for p in x.placements])
        source = P()
    new = sorted(spec.unreduced - pending)
    dims = [entry_axes(source.dims[d]) if d < len(source.dims) else () for d in range(x.dim())]
    for axis in new:
        dims = [tuple(a for a in entry if a != axis) + ((axis,) if axis in entry else ()) for entry in dims]
    x = reshard(x, P(*dims, unreduced=pending))
    local, coordinate = x.to_local(), view.get_coordinate() or [0] * view.ndim
    for axis in new:
        size, mine = view.size(names.index(axis)), coordinate[names.index(axis)]
        hot = (torch.arange(size, device=local.device) == mine).to(local.dtype)
        split = [d for d, entry in enumerate(dims) if axis in entry]
        if not split:
            local = local * hot[0]
            continue
        d = split[0]
        local = (local.unsqueeze(d) * hot.view([-1] + [1] * (local.dim() - d))).flatten(d, d + 1)
        dims[d] = dims[d][:-1]
    placements = to_placements(P(*dims, unreduced=spec.unreduced | pending), view)
    y = DTensor.from_local(local, view, placements, run_check=False, shape=x.shape,
                           stride=contiguous_strides(x.shape))
    return reshard(y, spec)


@_compat.constant_when_traced
def _placements(
    device_mesh: DeviceMesh, dims: tuple[DimAxes, ...], unreduced: frozenset[str]
) -> tuple[Placement, ...]:
    """The placements on ``device_mesh`` of the spec of ``dims`` and ``unreduced``, a
    constant to torch.compile (which hands such a function a spec's fields, not the spec)."""
    return to_placements(P(*dims, unreduced=unreduced), device_mesh)


@dataclass(frozen=True)
class _Move:
    """How reshard moves a DTensor: the dims to gather whole, each over the group of its
    current axes; the dims to cut, each over its new axes; the new placements."""

    gathers: tuple[tuple[int, OrderedGroup], ...]
    takes: tuple[tuple[int, OrderedGroup], ...]
    placements: tuple[Placement, ...]


_MOVES = ("reshard", "moves")
"""The key in a mesh's store of the moves worked out on it, by placements, target spec
and shape."""
MOVES_KEPT = 256
"""A mesh forgets its moves past this many (shapes vary, say with sequence length)."""


@_compat.constant_when_traced
def _move(
    view: DeviceMesh,
    placements: tuple[Placement, ...],
    dims: tuple[DimAxes, ...],
    unreduced: frozenset[str],
    shape: tuple[int, ...],
) -> _Move | None:
    """The move of a DTensor on ``view`` with ``placements`` to the spec of ``dims`` and
    ``unreduced`` (a spec's fields: what torch.compile hands a constant function); ``None``
    where DTensor's redistribution must do it. Kept in the store of the mesh that owns
    ``view``."""
    parallel_mesh = _owner(view)
    if parallel_mesh is None:
        return None
    moves: dict[tuple[object, ...], _Move | None] = parallel_mesh.store.setdefault(_MOVES, {})
    key = (placements, dims, unreduced, shape)
    if key not in moves:
        if len(moves) >= MOVES_KEPT:
            moves.clear()
        target = P(*dims, unreduced=unreduced)
        moves[key] = _plan_move(parallel_mesh, view, placements, target, shape)
    return moves[key]


def _plan_move(
    parallel_mesh: ParallelMesh,
    view: DeviceMesh,
    placements: tuple[Placement, ...],
    target: P,
    shape: tuple[int, ...],
) -> _Move | None:
    source = spec_of(view, placements)
    if source is None or source.unreduced or target.unreduced:
        return None
    sizes = dict(zip(view.mesh_dim_names or (), view.shape))
    for spec in (source, target):
        if len(spec.dims) > len(shape):
            return None
        for dim, entry in enumerate(spec.dims):
            if shape[dim] % math.prod(sizes[axis] for axis in entry_axes(entry)):
                return None
    gathers, takes = [], []
    for dim in range(len(shape)):
        before, after = (entry_axes(s.dims[dim]) if dim < len(s.dims) else () for s in (source, target))
        if before != after:
            if before:
                gathers.append((dim, parallel_mesh.ordered(before)))
            if after:
                takes.append((dim, parallel_mesh.ordered(after)))
    return _Move(tuple(gathers), tuple(takes), to_placements(target, view))


def _owner(view: DeviceMesh) -> ParallelMesh | None:
    """The current mesh if ``view`` is one of its root DeviceMeshes, else ``None``.

    Compared by value: torch.compile hands a traced DTensor's mesh over as an equal copy.
    """
    try:
        parallel_mesh = current_mesh()
    except NotInitializedError:
        return None
    return parallel_mesh if any(root == view for root in parallel_mesh.root_meshes()) else None
