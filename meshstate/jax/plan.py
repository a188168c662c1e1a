"""What a ``shard_map``'s specs need of a mesh, worked out once, and the blocks' autograd.

A :class:`Plan` holds, for one mesh and one set of specs, the view (dense or
expert DeviceMesh), each spec's placements, the groups of its split dims and of
the axes it leaves out; :func:`plan_on` keeps it with the mesh. Under
``torch.compile`` a plan is made while tracing, outside the graph, and held as
a constant (specs made inside the compiled function included: a plan is found
by the specs' contents).

Example (8 ranks, ``init_mesh(tp=2, cp=2)``)::

    plan = plan_on(mesh, (spec_key(P("tp")),))
    plan.to_local(P("tp"), torch.arange(8.0), even=[True])   # this tp rank's half
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from meshstate.core import compat as _compat
from meshstate.errors import ConfigError
from meshstate.core.mesh import ParallelMesh
from meshstate.core.ordered import OrderedGroup
from meshstate.core.world import each_rank
from meshstate.jax.torch_calls import device_for, gather, summed_gradient
from meshstate.jax.sharding import DimAxes, NamedSharding, P, _axes_of, to_placements

SpecTree = P | None | tuple[Any, ...] | list[Any] | dict[Any, Any]
"""A ``P``, or a tuple, list or dict of spec trees (``None``: pass the value through)."""

SpecKey = tuple[tuple[DimAxes, ...], frozenset[str]]
"""A spec's contents, ``(spec.dims, spec.unreduced)``: what ``torch.compile`` can hold as a
constant, also for a spec made inside the compiled function."""


def spec_key(spec: P) -> SpecKey:
    return spec.dims, spec.unreduced


def plan_on(parallel_mesh: ParallelMesh, keys: tuple[SpecKey, ...]) -> Plan:
    """The plan of the specs ``keys`` on ``parallel_mesh``, made on first use and kept in
    the mesh's store (under ``torch.compile``: made while tracing, then read from the
    store like any attribute, which torch guards on)."""
    _keep_plan(parallel_mesh, keys)
    plan: Plan = parallel_mesh.store[("plan", keys)]
    return plan


@_compat.constant_when_traced
def _keep_plan(parallel_mesh: ParallelMesh, keys: tuple[SpecKey, ...]) -> bool:
    """Put the plan of ``keys`` in the mesh's store. A constant to torch.compile, so it
    runs while tracing: the plan's groups and views are made outside the graph."""
    if ("plan", keys) not in parallel_mesh.store:
        parallel_mesh.check_alive()
        specs = [P(*dims, unreduced=axes) for dims, axes in keys]
        parallel_mesh.store[("plan", keys)] = Plan(parallel_mesh, specs)
    return True


class Plan:
    """What shard_map's specs need of one mesh, worked out once.

    ``view`` is the dense or expert DeviceMesh; per spec (by :func:`spec_key`),
    its placements, the groups of its split dims (each dim's axes, major to
    minor), and the group of the view's axes it leaves out (``None`` if none of
    size > 1).
    """

    def __init__(self, parallel_mesh: ParallelMesh, specs: Sequence[P]) -> None:
        self.view = _view(parallel_mesh, specs)
        self.mesh_axes = self.view.mesh_dim_names or ()
        self.sizes = dict(zip(self.mesh_axes, self.view.shape))
        self.placements = {spec_key(spec): to_placements(spec, self.view) for spec in specs}
        self.named = {spec_key(spec): frozenset(spec.axes) for spec in specs}
        """The axes each spec names: the type of a value laid out by it."""
        self._specs: dict[tuple[object, ...], object] = {}
        """DTensor specs of even results, by spec and block shape (eager, no autograd)."""
        self.split_dims = {
            spec_key(spec): [
                (dim, parallel_mesh.ordered(_axes_of(entry)))
                for dim, entry in enumerate(spec.dims)
                if entry is not None
            ]
            for spec in specs
        }
        self.left_out = {spec_key(spec): self._left_out(parallel_mesh, spec) for spec in specs}
        self.replicas = {
            spec_key(spec): math.prod(self.sizes[axis] for axis in self.left_out_axes(spec))
            for spec in specs
        }
        self.whole = parallel_mesh.ordered(self.mesh_axes)
        self.coordinate = parallel_mesh.coordinate

    def left_out_axes(self, spec: P) -> tuple[str, ...]:
        """The view's axes of size > 1 that ``spec`` does not name (unreduced axes are named)."""
        named = set(spec.axes)
        return tuple(a for a in self.mesh_axes if a not in named and self.sizes[a] > 1)

    def _left_out(self, parallel_mesh: ParallelMesh, spec: P) -> OrderedGroup | None:
        axes = self.left_out_axes(spec)
        return parallel_mesh.ordered(axes) if axes else None

    def to_local(
        self, spec: P, x: torch.Tensor, *, even: list[bool], jax_grads: bool = True
    ) -> torch.Tensor:
        """This rank's block of ``x`` under ``spec``; clears ``even[0]`` for an uneven one.

        With ``jax_grads`` the gradient is also summed over the axes ``spec``
        leaves out (JAX's legacy rule); without, it is each replica's own.
        """
        key = spec_key(spec)
        if isinstance(x, DTensor):
            even[0] &= self._divides(key, x.shape)
            local = self._local_of(x, key)
            left_out = self.left_out[key]
            if left_out is None or not jax_grads or not local.requires_grad:
                return local
            return summed_gradient(local, left_out.group_name)
        if len(spec.dims) > x.dim():
            raise ConfigError(
                f"{spec!r} has {len(spec.dims)} dims but the shape {tuple(x.shape)} has {x.dim()}"
            )
        if not self._divides(key, x.shape):
            NamedSharding(self.view, spec).shard_shape(x.shape)  # refuses what DTensor cannot cut
            even[0] = False
            replicated = DTensor.from_local(
                x, self.view, [Replicate()] * self.view.ndim, run_check=False
            )
            return self.to_local(spec, replicated, even=even, jax_grads=jax_grads)
        # The full value on every rank: this rank's block is a slice, whose gradient
        # is gathered back whole (as DTensor's Replicate -> Shard gives it).
        split_dims = self.split_dims[key]
        if not (x.requires_grad and torch.is_grad_enabled()):
            return block(x, split_dims)
        local = take_block(x, split_dims)
        left_out = self.left_out[key]
        if left_out is None or not jax_grads:
            return local
        return summed_gradient(local, left_out.group_name)

    def _local_of(self, x: DTensor, key: SpecKey) -> torch.Tensor:
        """The block of a DTensor laid out as ``key`` on the view. One on the view or on a
        slice of it (``mesh["tp"]``: replicated over the view's other axes) that is already
        laid out so keeps its local block; any other is redistributed, or gathered whole
        first where it lives on another mesh."""
        wanted = self.placements[key]
        if x.device_mesh is self.view:
            if x.placements == wanted:
                return _compat.local_tensor(x)
            placements = x.placements
        else:
            names = x.device_mesh.mesh_dim_names or ()
            if _compat.root_of(x.device_mesh) != self.view or not set(names) <= set(self.mesh_axes):
                whole = x.full_tensor()
                return DTensor.from_local(
                    whole, self.view, [Replicate()] * self.view.ndim, run_check=False
                ).redistribute(self.view, wanted).to_local()
            by_axis = dict(zip(names, x.placements))
            placements = tuple(by_axis.get(axis, Replicate()) for axis in self.mesh_axes)
            if placements == wanted:
                return _compat.local_tensor(x)
            x = DTensor.from_local(x.to_local(), self.view, placements, run_check=False,
                                   shape=x.shape, stride=x.stride())
        if placements != wanted:
            x = x.redistribute(self.view, wanted)
        return x.to_local()

    def _divides(self, key: SpecKey, shape: Sequence[int]) -> bool:
        return all(shape[dim] % len(group.ranks) == 0 for dim, group in self.split_dims[key])

    def to_dtensor(
        self, y: torch.Tensor, spec: P, shape: Sequence[int] | None, *, share: bool = True
    ) -> DTensor:
        """``y``, this rank's block, as a DTensor of global ``shape`` laid out by ``spec``
        (``None``: every rank's block has ``y``'s shape, so DTensor works it out).

        With ``share``, a result replicated over the axes ``spec`` leaves out
        hands each replica its share of the cotangent (JAX's legacy rule).
        """
        key = spec_key(spec)
        if isinstance(y, DTensor):
            raise ConfigError("shard_map: f returned a DTensor; return local blocks (plain tensors)")
        if share and self.replicas[key] > 1 and y.requires_grad:
            y = share_grad(y, self.replicas[key])
        if shape is None:
            if (y.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
                return DTensor.from_local(y, self.view, self.placements[key], run_check=False)
            block_key = (key, y.shape, y.stride(), y.dtype, y.device)
            dtensor_spec = self._specs.get(block_key)
            if dtensor_spec is None:
                dtensor_spec = self._specs[block_key] = _compat.even_spec(
                    self.view, self.placements[key], y
                )
            return _compat.dtensor_of(y, dtensor_spec)
        return DTensor.from_local(
            y,
            self.view,
            self.placements[key],
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_strides(shape),
        )

    def global_shapes(
        self, outputs: list[tuple[P, torch.Tensor]], even: bool
    ) -> list[torch.Size | None]:
        """Each result's global shape: a split dim times its axes' sizes where every
        argument divided (JAX's rule; ``None``, which DTensor works out alike, where the
        spec has no more dims than the result), else summed over the ranks (one all-reduce)."""
        if not even:
            return list(_summed_shapes(outputs, self))
        shapes: list[torch.Size | None] = []
        for spec, y in outputs:
            if len(spec.dims) <= y.dim():
                shapes.append(None)
                continue
            shape = list(y.shape)
            for dim, group in self.split_dims[spec_key(spec)]:
                if dim < y.dim():
                    shape[dim] *= len(group.ranks)
            shapes.append(torch.Size(shape))
        return shapes


def spec_branches(tree: SpecTree, path: str) -> dict[Any, tuple[SpecTree, str]]:
    """The branches of a spec tree's inner node, each with its path as JAX words it
    (``out_specs['a'][1]``): a dict's items, a tuple's or list's entries by number.

    The one rule of what a tree holds (P, None, tuples, lists and dicts); anything
    else is a :class:`ConfigError`. Example: ``spec_branches((P("tp"), None), "in_specs")
    == {0: (P("tp"), "in_specs[0]"), 1: (None, "in_specs[1]")}``.
    """
    if isinstance(tree, dict):
        return {key: (branch, f"{path}[{key!r}]") for key, branch in tree.items()}
    if isinstance(tree, (tuple, list)):
        return {number: (branch, f"{path}[{number}]") for number, branch in enumerate(tree)}
    raise ConfigError(
        f"{path}: a spec tree holds P, None, tuples, lists and dicts, not {type(tree).__name__}"
    )


def spec_leaves(tree: SpecTree, path: str = "specs") -> list[P]:
    """Every P of ``tree``, in order."""
    if tree is None:
        return []
    if isinstance(tree, P):
        return [tree]
    branches = spec_branches(tree, path).values()
    return [spec for branch, where in branches for spec in spec_leaves(branch, where)]


def _view(parallel_mesh: ParallelMesh, specs: Sequence[P]) -> DeviceMesh:
    """The root DeviceMesh (dense, expert or HSDP) of the view holding every axis the specs
    name: the layout's one rule (:meth:`~meshstate.layout.layout.ParallelLayout.view_of`)."""
    axes = [axis for spec in specs for axis in spec.axes]
    grid = parallel_mesh.layout.view_of(axes, f"shard_map: the specs {list(specs)}")
    return parallel_mesh.root_of(grid)


def _summed_shapes(outputs: list[tuple[P, torch.Tensor]], plan: Plan) -> list[torch.Size]:
    """Each result's global shape: its sharded dims summed over their axes (one all-reduce).

    Where an argument was cut unevenly a rank cannot know the others' blocks."""
    split = [
        (tuple(set(plan.mesh_axes) - set(_axes_of(entry))), y.shape[dim])
        for spec, y in outputs
        for dim, entry in enumerate(spec.dims[: y.dim()])
        if entry is not None
    ]
    if split:
        counted = _first_copies_count(plan.coordinate, split)
        device = device_of(plan.view)
        sizes = torch.stack([torch.full((), n, dtype=torch.int64, device=device) for n in counted])
        dist.all_reduce(sizes, group=plan.whole.group)
        summed = iter(sizes.tolist())
    shapes = []
    for spec, y in outputs:
        shape = list(y.shape)
        for dim, entry in enumerate(spec.dims[: y.dim()]):
            if entry is not None:
                shape[dim] = next(summed)
        shapes.append(torch.Size(shape))
    return shapes


@each_rank
def _first_copies_count(
    coordinate: dict[str, int], split: list[tuple[tuple[str, ...], int]]
) -> list[int]:
    """Each split dim's size where the caller is the first copy of its block (coordinate 0
    on every other axis), else 0: summed over the view, the dim's global size."""
    return [
        size if all(coordinate[axis] == 0 for axis in others) else 0 for others, size in split
    ]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``: ``(6, 2, 1)`` for ``(4, 3, 2)``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def device_of(view: DeviceMesh) -> torch.device:
    return device_for(view.device_type)


def block(x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]) -> torch.Tensor:
    """The caller's block of ``x``: each split dim narrowed to its chunk along the dim's axes."""
    for dim, group in split_dims:
        step = x.shape[dim] // len(group.ranks)
        x = x.narrow(dim, group.index * step, step)
    return x


class _TakeBlock(torch.autograd.Function):
    """The caller's block of a value every rank holds whole; backward gathers the
    gradient whole again. Hand-written: torch has no slice whose backward gathers."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]
    ) -> torch.Tensor:
        ctx.split_dims = split_dims
        return block(x, split_dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for dim, group in ctx.split_dims:
            grad = gather(grad, group, dim, tiled=True, traced=True)
        return grad, None


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
take_block: Callable[
    [torch.Tensor, Sequence[tuple[int, OrderedGroup]]], torch.Tensor
] = _TakeBlock.apply
share_grad: Callable[[torch.Tensor, int], torch.Tensor] = _ShareGrad.apply
