"""``shard_map`` and ``reshard``: JAX's per-shard programming model on a ParallelMesh.

``shard_map(f, in_specs=..., out_specs=...)`` returns a function that cuts each
argument to this rank's block of its :class:`~meshstate.jax.sharding.P`, runs
``f`` on the blocks with the mesh current (so ``psum(x, "tp")`` inside needs
no ``mesh=``), and returns DTensors laid out by the out-specs. The specs pick
the view: dense axes (tp, cp, dp, pp) or expert axes (etp, ep, edp, pp).

Gradients are JAX's. A result that an out-spec leaves replicated over an axis
counts once, not once per rank, and an argument's gradient is summed over the
axes its in-spec does not name. Inside ``f`` each rank holds its share of the
cotangent of a value replicated over an axis (shares sum to the whole), which
is what makes ``psum``'s backward (an all-reduce) right; a plain DTensor round
trip (``to_local`` / ``from_local``) hands every rank the whole cotangent, and
a row-parallel matmul's weight gradient comes out ``tp`` times too large.

Differences from JAX, and why:

- ``check_vma=True`` checks at run time, by comparing the results along each
  axis an out-spec leaves out (JAX proves it while tracing); torch has no
  tracer that knows which values vary over which axes. Off by default.
- Dims need not divide: blocks are DTensor's uneven shards (last ones smaller).
- torch's ``local_map`` does the placement bookkeeping too, but it gives every
  rank the whole cotangent of a replicated result and never sums an input's
  gradient over the axes its spec leaves out, so it does not fit here.

Example (8 ranks, ``init_mesh(tp=2, cp=2)``; a row-parallel matmul)::

    matmul = shard_map(
        lambda x, w: psum(x @ w, "tp"),
        in_specs=(P(None, "tp"), P("tp", None)),
        out_specs=P(),
    )
    matmul(x, w).full_tensor()   # x @ w on every rank
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshstate.core.errors import AxisError, ConfigError, MeshStateError
from meshstate.core.layout import DENSE_AXES, EXPERT_AXES
from meshstate.core.mesh import OrderedGroup, ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.jax.sharding import NamedSharding, P, _axes_of, to_placements

__all__ = ["reshard", "shard_map"]

SpecTree = P | None | tuple[Any, ...] | list[Any] | dict[Any, Any]
"""A ``P``, or a tuple, list or dict of spec trees (``None``: pass the value through)."""


def shard_map(
    f: Callable[..., Any],
    *,
    in_specs: SpecTree,
    out_specs: SpecTree,
    mesh: ParallelMesh | None = None,
    check_vma: bool = False,
) -> Callable[..., Any]:
    """``f`` applied to each rank's blocks of the arguments; results as DTensors.

    Each argument is a ``DTensor`` (redistributed to its in-spec if needed) or
    a plain tensor holding the full global value on every rank. Specs are
    pytrees like JAX's: one ``P`` stands for every argument (or result), a
    tuple, list or dict matches the arguments (results) it describes. While
    ``f`` runs, ``mesh`` (default: the current mesh when called) is current.

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``, so dp=2)::

        gather = shard_map(lambda x: all_gather(x, ("cp", "dp"), tiled=True),
                           in_specs=P(("cp", "dp")), out_specs=P())
        gather(torch.arange(8)).full_tensor()   # tensor([0, 1, ..., 7]) on every rank

    Raises:
        AxisError: a spec names an axis the mesh lacks, or mixes dense and
            expert axes (on every rank, before anything is sent).
        MeshStateError: with ``check_vma``, a result differs along an axis its
            out-spec leaves out; the message names the axis and two ranks.
    """

    def mapped(*args: Any) -> Any:
        parallel_mesh = (
            current_mesh() if mesh is None else require_parallel_mesh(mesh, "shard_map(mesh=...)")
        )
        view = _view(parallel_mesh, [*_specs(in_specs), *_specs(out_specs)])
        local_args = _map(
            in_specs, args, "in_specs", lambda spec, x: _to_local(x, spec, view, parallel_mesh)
        )
        with parallel_mesh:
            results = f(*local_args)
        outputs: list[tuple[P, torch.Tensor]] = []
        _map(out_specs, results, "out_specs", lambda spec, y: outputs.append((spec, y)))
        if check_vma:
            _check_replicated(outputs, view, parallel_mesh)
        shapes = iter(_global_shapes(outputs, view, parallel_mesh))
        return _map(
            out_specs,
            results,
            "out_specs",
            lambda spec, y: _to_dtensor(y, spec, view, next(shapes)),
        )

    return mapped


def reshard(x: torch.Tensor, spec: P, mesh: ParallelMesh | None = None) -> DTensor:
    """``x`` laid out as ``spec`` says, through DTensor's redistribution.

    A ``DTensor`` moves on its own DeviceMesh; a plain tensor (the full global
    value on every rank) is cut on the view of ``mesh`` (default: the current
    mesh) whose axes the spec names. Differentiable.

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``)::

        y = reshard(torch.arange(8), P(("cp", "dp")))   # rank 2 (cp=1, dp=0) holds [4, 5]
        reshard(y, P("tp")).to_local()                  # [0, 1, 2, 3] on tp=0
    """
    if isinstance(x, DTensor):
        return x.redistribute(x.device_mesh, to_placements(spec, x.device_mesh))
    parallel_mesh = (
        current_mesh() if mesh is None else require_parallel_mesh(mesh, "reshard(mesh=...)")
    )
    view = _view(parallel_mesh, [spec])
    NamedSharding(view, spec).shard_shape(x.shape)
    replicated = DTensor.from_local(x, view, [Replicate()] * view.ndim, run_check=False)
    return replicated.redistribute(view, to_placements(spec, view))


def _specs(tree: SpecTree) -> list[P]:
    if isinstance(tree, P):
        return [tree]
    if isinstance(tree, dict):
        return [spec for value in tree.values() for spec in _specs(value)]
    if isinstance(tree, (tuple, list)):
        return [spec for value in tree for spec in _specs(value)]
    if tree is None:
        return []
    raise ConfigError(
        f"a spec tree holds P, None, tuples, lists and dicts, not {type(tree).__name__}"
    )


def _map(tree: SpecTree, values: Any, where: str, apply: Callable[[P, Any], Any]) -> Any:
    """``values`` with ``apply(spec, tensor)`` on each tensor leaf under a spec of ``tree``."""
    if tree is None:
        return values
    if isinstance(tree, P):
        if isinstance(values, torch.Tensor):
            return apply(tree, values)
        if isinstance(values, dict):
            return {key: _map(tree, value, where, apply) for key, value in values.items()}
        if isinstance(values, (tuple, list)):
            return type(values)(_map(tree, value, where, apply) for value in values)
        return values
    if isinstance(tree, dict):
        if not isinstance(values, dict) or set(values) != set(tree):
            raise ConfigError(
                f"{where} is a dict with keys {sorted(map(str, tree))}, "
                f"the value is {_describe(values)}"
            )
        return {key: _map(tree[key], value, where, apply) for key, value in values.items()}
    if not isinstance(values, (tuple, list)) or len(values) != len(tree):
        raise ConfigError(f"{where} has {len(tree)} entries, the value is {_describe(values)}")
    return type(values)(_map(spec, value, where, apply) for spec, value in zip(tree, values))


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


def _view(parallel_mesh: ParallelMesh, specs: Sequence[P]) -> DeviceMesh:
    """The dense or the expert DeviceMesh, whichever holds every axis the specs name."""
    axes = {axis for spec in specs for axis in spec.axes}
    unknown = sorted(axes - set(DENSE_AXES) - set(EXPERT_AXES))
    if unknown:
        raise AxisError(
            f"shard_map: the specs name axis {unknown[0]!r}, which the mesh lacks; valid are "
            f"dense axes {DENSE_AXES}, expert axes {EXPERT_AXES}"
        )
    if axes <= set(DENSE_AXES):
        return parallel_mesh.dense
    if axes <= set(EXPERT_AXES):
        return parallel_mesh.expert
    raise AxisError(
        f"shard_map: the specs name axes {sorted(axes)}, mixing dense axes {DENSE_AXES} "
        f"and expert axes {EXPERT_AXES}; one shard_map runs on one of them"
    )


def _left_out(spec: P, view: DeviceMesh) -> tuple[str, ...]:
    """The view's axes of size > 1 that ``spec`` does not name (unreduced axes are named)."""
    named = set(spec.axes)
    return tuple(
        axis
        for mesh_dim, axis in enumerate(view.mesh_dim_names or ())
        if axis not in named and view.size(mesh_dim) > 1
    )


def _to_local(
    x: torch.Tensor, spec: P, view: DeviceMesh, parallel_mesh: ParallelMesh
) -> torch.Tensor:
    placements = to_placements(spec, view)
    if isinstance(x, DTensor) and x.device_mesh is not view:
        x = x.full_tensor()
    if not isinstance(x, DTensor):
        NamedSharding(view, spec).shard_shape(x.shape)
        x = DTensor.from_local(x, view, [Replicate()] * view.ndim, run_check=False)
    local = x.redistribute(view, placements).to_local()
    left_out = _left_out(spec, view)
    if not left_out or not local.requires_grad:
        return local
    return _sum_grad(local, parallel_mesh.ordered(left_out))


def _to_dtensor(y: torch.Tensor, spec: P, view: DeviceMesh, shape: torch.Size) -> DTensor:
    if isinstance(y, DTensor):
        raise ConfigError("shard_map: f returned a DTensor; return local blocks (plain tensors)")
    replicated = _left_out(spec, view)
    if replicated and y.requires_grad:
        sizes = math.prod(view.size((view.mesh_dim_names or ()).index(axis)) for axis in replicated)
        y = _share_grad(y, sizes)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        y, view, to_placements(spec, view), run_check=False, shape=shape, stride=stride
    )


def _global_shapes(
    outputs: list[tuple[P, torch.Tensor]], view: DeviceMesh, parallel_mesh: ParallelMesh
) -> list[torch.Size]:
    """Each result's global shape: its sharded dims summed over their axes (one all-reduce)."""
    mesh_axes = view.mesh_dim_names or ()
    coordinate = parallel_mesh.coordinate
    counted = []
    for spec, y in outputs:
        for dim, entry in enumerate(spec.dims[: y.dim()]):
            if entry is not None:
                others = set(mesh_axes) - set(_axes_of(entry))
                first_copy = all(coordinate[axis] == 0 for axis in others)
                counted.append(y.shape[dim] if first_copy else 0)
    if counted:
        sizes = torch.tensor(counted, dtype=torch.int64, device=_device(view))
        dist.all_reduce(sizes, group=parallel_mesh.ordered(mesh_axes).group)
        summed = iter(sizes.tolist())
    shapes = []
    for spec, y in outputs:
        shape = list(y.shape)
        for dim, entry in enumerate(spec.dims[: y.dim()]):
            if entry is not None:
                shape[dim] = next(summed)
        shapes.append(torch.Size(shape))
    return shapes


def _check_replicated(
    outputs: list[tuple[P, torch.Tensor]], view: DeviceMesh, parallel_mesh: ParallelMesh
) -> None:
    """Raise on every rank if a result differs along an axis its out-spec leaves out."""
    mesh_axes = view.mesh_dim_names or ()
    checks = [
        (number, spec, axis)
        for number, (spec, _) in enumerate(outputs)
        for axis in _left_out(spec, view)
    ]
    if not checks:
        return
    differing, nobody = [], parallel_mesh.config.world_size
    with torch.no_grad():
        for number, _, axis in checks:
            group = parallel_mesh.ordered((axis,))
            local = outputs[number][1].detach()
            pieces = [torch.empty_like(local) for _ in group.ranks]
            dist.all_gather(pieces, local.contiguous(), group=group.group)
            by_index = [pieces[group_rank] for group_rank in group.group_ranks]
            odd = [i for i, piece in enumerate(by_index) if not torch.equal(piece, by_index[0])]
            differing.append(group.ranks[odd[0]] if odd else nobody)
        found = torch.tensor(differing, dtype=torch.int64, device=_device(view))
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=parallel_mesh.ordered(mesh_axes).group)
    for (number, spec, axis), rank in zip(checks, found.tolist()):
        if rank != nobody:
            layout = parallel_mesh.layout
            grid = layout.dense if view is parallel_mesh.dense else layout.expert
            ranks = grid.group_of(rank, (axis,))
            raise MeshStateError(
                f"shard_map: result {number} has out-spec {spec!r}, which leaves out axis {axis!r} "
                f"(replicated), but ranks {ranks[0]} and {rank} of {axis!r} group {list(ranks)} "
                f"hold different values; name {axis!r} in the out-spec or psum/all_gather over it"
            )


def _device(view: DeviceMesh) -> torch.device:
    if view.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(view.device_type)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group.group)
        return summed, None


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient into ``parts`` equal shares."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, parts: int) -> torch.Tensor:
        ctx.parts = parts
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.parts, None


# Function.apply is untyped; these name each one's signature.
_sum_grad: Callable[[torch.Tensor, OrderedGroup], torch.Tensor] = _SumGrad.apply
_share_grad: Callable[[torch.Tensor, int], torch.Tensor] = _ShareGrad.apply
