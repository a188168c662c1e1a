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

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from meshstate.core import compat as _compat
from meshstate.core.errors import AxisError, ConfigError, MeshStateError, NotInitializedError
from meshstate.core.layout import DENSE_AXES, EXPERT_AXES
from meshstate.core.mesh import OrderedGroup, ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.jax.collectives import gather
from meshstate.jax.sharding import DimAxes, NamedSharding, P, _axes_of, to_placements

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
    What the specs need of a mesh (its view, placements, groups) is worked out
    on the first call and kept; under ``torch.compile`` the call traces as part
    of the caller's graph (with ``check_vma=False``).

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
    specs = _Specs(in_specs, out_specs)

    def mapped(*args: Any) -> Any:
        parallel_mesh = (
            current_mesh() if mesh is None else require_parallel_mesh(mesh, "shard_map(mesh=...)")
        )
        plan = specs.plan_for(parallel_mesh)
        even = [True]
        local_args = _map(in_specs, args, "in_specs", partial(plan.to_local, even=even))
        parallel_mesh.__enter__()  # not `with`: torch.compile traces enter and exit calls only
        try:
            results = f(*local_args)
        finally:
            parallel_mesh.__exit__(None, None, None)
        outputs: list[tuple[P, torch.Tensor]] = []
        _map(out_specs, results, "out_specs", lambda spec, y: outputs.append((spec, y)))
        if check_vma:
            _check_replicated(outputs, plan)
        shapes = iter(plan.global_shapes(outputs, even[0]))
        return _map(out_specs, results, "out_specs", lambda spec, y: plan.to_dtensor(y, spec, next(shapes)))

    return mapped


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
    signature = (spec.dims, spec.unreduced)
    if isinstance(x, DTensor):
        move = _move(x.device_mesh, x.placements, signature, tuple(x.shape))
        if move is None:
            return x.redistribute(x.device_mesh, _placements(x.device_mesh, signature))
        local = x.to_local()
        for dim, group in move.gathers:
            local = _gather_whole(local, dim, group)
        if move.takes:
            local = _take_block(local, move.takes)
        return DTensor.from_local(
            local, x.device_mesh, move.placements, run_check=False,
            shape=x.shape, stride=_contiguous_strides(x.shape),
        )
    parallel_mesh = (
        current_mesh() if mesh is None else require_parallel_mesh(mesh, "reshard(mesh=...)")
    )
    _keep_reshard_plan(parallel_mesh, signature)
    plan = _reshard_specs[signature].plan_for(parallel_mesh)
    local = plan.to_local(spec, x, even=[True], jax_grads=False)
    return plan.to_dtensor(local, spec, x.shape, share=False)


class _Specs:
    """A shard_map's in- and out-spec trees, checked once, and the plan of the last mesh."""

    def __init__(self, in_specs: SpecTree, out_specs: SpecTree) -> None:
        self.all = [*_specs(in_specs), *_specs(out_specs)]
        self.mesh: ParallelMesh | None = None
        self.plan: _Plan | None = None

    def plan_for(self, parallel_mesh: ParallelMesh) -> _Plan:
        """The plan on ``parallel_mesh``, made on first use (under torch.compile, made
        while tracing and then read like any attribute, which torch guards on)."""
        _keep_plan(self, parallel_mesh)
        assert self.plan is not None
        return self.plan


@_compat.constant_when_traced
def _keep_plan(specs: _Specs, parallel_mesh: ParallelMesh) -> bool:
    """Make ``specs.plan`` the plan on ``parallel_mesh``. A constant to torch.compile, so
    it runs while tracing: the plan's groups and views are made outside the graph."""
    if specs.mesh is not parallel_mesh:
        specs.plan = _Plan(parallel_mesh, specs.all)
        specs.mesh = parallel_mesh
    return True


_reshard_specs: dict[tuple[tuple[DimAxes, ...], frozenset[str]], _Specs] = {}
"""reshard's specs by their contents (a spec may be made inside a compiled function)."""


@_compat.constant_when_traced
def _keep_reshard_plan(
    parallel_mesh: ParallelMesh, signature: tuple[tuple[DimAxes, ...], frozenset[str]]
) -> bool:
    """Keep ``_reshard_specs[signature]`` and its plan on ``parallel_mesh`` (see _keep_plan)."""
    spec = P(*signature[0], unreduced=signature[1])
    specs = _reshard_specs.setdefault(signature, _Specs(spec, spec))
    return _keep_plan(specs, parallel_mesh)


@_compat.constant_when_traced
def _placements(
    device_mesh: DeviceMesh, signature: tuple[tuple[DimAxes, ...], frozenset[str]]
) -> tuple[Placement, ...]:
    """The placements of the spec ``signature`` on ``device_mesh``, a constant to torch.compile."""
    return to_placements(P(*signature[0], unreduced=signature[1]), device_mesh)


@dataclass(frozen=True)
class _Move:
    """How reshard moves a DTensor: the dims to gather whole, each over the group of its
    current axes; the dims to cut, each over its new axes; the new placements."""

    gathers: tuple[tuple[int, OrderedGroup], ...]
    takes: tuple[tuple[int, OrderedGroup], ...]
    placements: tuple[Placement, ...]


_moves: dict[tuple[object, ...], _Move | None] = {}


@_compat.constant_when_traced
def _move(
    view: DeviceMesh,
    placements: tuple[Placement, ...],
    signature: tuple[tuple[DimAxes, ...], frozenset[str]],
    shape: tuple[int, ...],
) -> _Move | None:
    """The move of a DTensor on ``view`` with ``placements`` to the spec ``signature``;
    ``None`` where DTensor's redistribution must do it. Kept per argument set."""
    key = (view, placements, signature, shape)
    if key not in _moves:
        _moves[key] = _plan_move(view, placements, P(*signature[0], unreduced=signature[1]), shape)
    return _moves[key]


def _plan_move(
    view: DeviceMesh, placements: tuple[Placement, ...], target: P, shape: tuple[int, ...]
) -> _Move | None:
    parallel_mesh = _owner(view)
    source = None if parallel_mesh is None else _spec_of(view, placements)
    if parallel_mesh is None or source is None or source.unreduced or target.unreduced:
        return None
    sizes = dict(zip(view.mesh_dim_names or (), view.shape))
    for spec in (source, target):
        if len(spec.dims) > len(shape):
            return None
        for dim, entry in enumerate(spec.dims):
            if shape[dim] % math.prod(sizes[axis] for axis in _axes_of(entry)):
                return None
    gathers, takes = [], []
    for dim in range(len(shape)):
        before, after = (_axes_of(s.dims[dim]) if dim < len(s.dims) else () for s in (source, target))
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
    roots = ("dense", "expert", "hsdp")
    return parallel_mesh if any(parallel_mesh.__dict__.get(r) == view for r in roots) else None


def _spec_of(view: DeviceMesh, placements: tuple[Placement, ...]) -> P | None:
    """The spec without unreduced axes whose placements on ``view`` are ``placements``."""
    mesh_axes = view.mesh_dim_names or ()
    by_dim: dict[int, list[str]] = {}
    for axis, placement in zip(mesh_axes, placements):
        dim = _compat.sharded_dim(placement)
        if dim is not None:
            by_dim.setdefault(dim, []).append(axis)
        elif not isinstance(placement, Replicate):
            return None
    ndim = max(by_dim, default=-1) + 1
    orders = [itertools.permutations(by_dim.get(dim, ())) for dim in range(ndim)]
    for choice in itertools.product(*orders):
        candidate = P(*(tuple(axes) or None for axes in choice))
        if to_placements(candidate, view) == placements:
            return candidate
    return None


class _Plan:
    """What shard_map's specs need of one mesh, worked out once.

    ``view`` is the dense or expert DeviceMesh; per spec, its placements, the
    groups of its split dims (each dim's axes, major to minor), and the group
    of the view's axes it leaves out (``None`` if none of size > 1).
    """

    def __init__(self, parallel_mesh: ParallelMesh, specs: Sequence[P]) -> None:
        self.parallel_mesh = parallel_mesh
        self.view = _view(parallel_mesh, specs)
        self.mesh_axes = self.view.mesh_dim_names or ()
        self.sizes = dict(zip(self.mesh_axes, self.view.shape))
        self.placements = {spec: to_placements(spec, self.view) for spec in specs}
        self.split_dims = {
            spec: [
                (dim, parallel_mesh.ordered(_axes_of(entry)))
                for dim, entry in enumerate(spec.dims)
                if entry is not None
            ]
            for spec in specs
        }
        self.left_out = {spec: self._left_out(spec) for spec in specs}
        self.replicas = {
            spec: math.prod(self.sizes[axis] for axis in self.left_out_axes(spec)) for spec in specs
        }
        self.whole = parallel_mesh.ordered(self.mesh_axes)

    def left_out_axes(self, spec: P) -> tuple[str, ...]:
        """The view's axes of size > 1 that ``spec`` does not name (unreduced axes are named)."""
        named = set(spec.axes)
        return tuple(a for a in self.mesh_axes if a not in named and self.sizes[a] > 1)

    def _left_out(self, spec: P) -> OrderedGroup | None:
        axes = self.left_out_axes(spec)
        return self.parallel_mesh.ordered(axes) if axes else None

    def to_local(
        self, spec: P, x: torch.Tensor, *, even: list[bool], jax_grads: bool = True
    ) -> torch.Tensor:
        """This rank's block of ``x`` under ``spec``; clears ``even[0]`` for an uneven one.

        With ``jax_grads`` the gradient is also summed over the axes ``spec``
        leaves out (JAX's rule); without, it is DTensor's (each replica's own).
        """
        if isinstance(x, DTensor) and x.device_mesh is not self.view:
            x = x.full_tensor()
        if isinstance(x, DTensor):
            even[0] &= self._divides(spec, x.shape)
            if x.placements != self.placements[spec]:
                x = x.redistribute(self.view, self.placements[spec])
            local = x.to_local()
            left_out = self.left_out[spec]
            if left_out is None or not jax_grads or not local.requires_grad:
                return local
            return _sum_grad(local, left_out.group_name)
        if len(spec.dims) > x.dim():
            raise ConfigError(
                f"{spec!r} has {len(spec.dims)} dims but the shape {tuple(x.shape)} has {x.dim()}"
            )
        if not self._divides(spec, x.shape):
            NamedSharding(self.view, spec).shard_shape(x.shape)  # refuses what DTensor cannot cut
            even[0] = False
            replicated = DTensor.from_local(
                x, self.view, [Replicate()] * self.view.ndim, run_check=False
            )
            return self.to_local(spec, replicated, even=even, jax_grads=jax_grads)
        # The full value on every rank: this rank's block is a slice, whose gradient
        # is gathered back whole (as DTensor's Replicate -> Shard gives it).
        split_dims = self.split_dims[spec]
        if not (x.requires_grad and torch.is_grad_enabled()):
            return _block(x, split_dims)
        local = _take_block(x, split_dims)
        left_out = self.left_out[spec]
        if left_out is None or not jax_grads:
            return local
        return _sum_grad(local, left_out.group_name)

    def _divides(self, spec: P, shape: Sequence[int]) -> bool:
        return all(shape[dim] % len(group.ranks) == 0 for dim, group in self.split_dims[spec])

    def to_dtensor(
        self, y: torch.Tensor, spec: P, shape: Sequence[int], *, share: bool = True
    ) -> DTensor:
        """``y``, this rank's block, as a DTensor of global ``shape`` laid out by ``spec``.

        With ``share``, a result replicated over the axes ``spec`` leaves out
        hands each replica its share of the cotangent (JAX counts it once).
        """
        if isinstance(y, DTensor):
            raise ConfigError("shard_map: f returned a DTensor; return local blocks (plain tensors)")
        if share and self.replicas[spec] > 1 and y.requires_grad:
            y = _share_grad(y, self.replicas[spec])
        return DTensor.from_local(
            y,
            self.view,
            self.placements[spec],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_strides(shape),
        )

    def global_shapes(self, outputs: list[tuple[P, torch.Tensor]], even: bool) -> list[torch.Size]:
        """Each result's global shape: a split dim times its axes' sizes where every
        argument divided (JAX's rule), else summed over the ranks (one all-reduce)."""
        if even:
            shapes = []
            for spec, y in outputs:
                shape = list(y.shape)
                for dim, group in self.split_dims[spec]:
                    if dim < y.dim():
                        shape[dim] *= len(group.ranks)
                shapes.append(torch.Size(shape))
            return shapes
        return _summed_shapes(outputs, self.view, self.parallel_mesh)


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


def _summed_shapes(
    outputs: list[tuple[P, torch.Tensor]], view: DeviceMesh, parallel_mesh: ParallelMesh
) -> list[torch.Size]:
    """Each result's global shape: its sharded dims summed over their axes (one all-reduce).

    Where an argument was cut unevenly a rank cannot know the others' blocks."""
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


def _check_replicated(outputs: list[tuple[P, torch.Tensor]], plan: _Plan) -> None:
    """Raise on every rank if a result differs along an axis its out-spec leaves out."""
    view, parallel_mesh, mesh_axes = plan.view, plan.parallel_mesh, plan.mesh_axes
    checks = [
        (number, spec, axis)
        for number, (spec, _) in enumerate(outputs)
        for axis in plan.left_out_axes(spec)
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
            ranks = grid.group_ranks(rank, (axis,))
            raise MeshStateError(
                f"shard_map: result {number} has out-spec {spec!r}, which leaves out axis {axis!r} "
                f"(replicated), but ranks {ranks[0]} and {rank} of {axis!r} group {list(ranks)} "
                f"hold different values; name {axis!r} in the out-spec or psum/all_gather over it"
            )


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``: ``(6, 2, 1)`` for ``(4, 3, 2)``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _device(view: DeviceMesh) -> torch.device:
    if view.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(view.device_type)


def _block(x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]) -> torch.Tensor:
    """The caller's block of ``x``: each split dim narrowed to its chunk along the dim's axes."""
    for dim, group in split_dims:
        step = x.shape[dim] // len(group.ranks)
        x = x.narrow(dim, group.index * step, step)
    return x


class _GatherWhole(torch.autograd.Function):
    """Dim ``dim`` gathered whole over ``group``; backward keeps the caller's block, as
    DTensor's Shard -> Replicate does (every replica holds the whole cotangent)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: OrderedGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return gather(x, group, dim, tiled=True, traced=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _block(grad, [(ctx.dim, ctx.group)]), None, None


class _TakeBlock(torch.autograd.Function):
    """The caller's block of a value every rank holds whole; backward gathers the
    gradient whole again. Hand-written: torch has no slice whose backward gathers."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]
    ) -> torch.Tensor:
        ctx.split_dims = split_dims
        return _block(x, split_dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for dim, group in ctx.split_dims:
            grad = gather(grad, group, dim, tiled=True, traced=True)
        return grad, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group named ``group_name``.

    Hand-written: torch's functional collectives have no identity-forward op."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _compat.traced_all_reduce(grad.contiguous(), "sum", ctx.group_name), None


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient into ``parts`` equal shares.

    Hand-written: torch has no identity-forward op that scales the gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, parts: int) -> torch.Tensor:
        ctx.parts = parts
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.parts, None


# Function.apply is untyped; these name each one's signature.
_gather_whole: Callable[[torch.Tensor, int, OrderedGroup], torch.Tensor] = _GatherWhole.apply
_take_block: Callable[
    [torch.Tensor, Sequence[tuple[int, OrderedGroup]]], torch.Tensor
] = _TakeBlock.apply
_sum_grad: Callable[[torch.Tensor, str], torch.Tensor] = _SumGrad.apply
_share_grad: Callable[[torch.Tensor, int], torch.Tensor] = _ShareGrad.apply
