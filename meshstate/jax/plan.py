"""What a ``shard_map``'s specs need of a mesh, worked out once, and the blocks' autograd.

A :class:`Plan` holds, for one mesh and one tuple of specs, the view (dense or
expert DeviceMesh) and, for each spec by its number in the tuple, its
placements, the groups of its split dims and of the axes it leaves out;
:func:`plan_on` keeps it in the mesh's store, found by the specs. Under
``torch.compile`` a plan is found while tracing, or made outside the graph, and
held as a constant (specs made inside the compiled function included: a plan
is found by the specs' values).

Example (8 ranks, ``init_mesh(tp=2, cp=2)``)::

    plan = plan_on(mesh, (P("tp"),))
    plan.block_of(0, torch.arange(8.0))   # this tp rank's half
"""

from __future__ import annotations

import dataclasses
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
from meshstate.jax.torch_calls import block, device_for, take_block
from meshstate.jax.sharding import DimAxes, NamedSharding, P, entry_axes, to_placements

Leaves = list[tuple[int, torch.Tensor]]
"""Tensors, each with the number of its spec in a plan: a call's flat arguments or results."""


def plan_on(parallel_mesh: ParallelMesh, specs: tuple[P, ...]) -> Plan:
    """The plan of ``specs`` on ``parallel_mesh``, made on first use and kept in the mesh's
    store under ``("plan", specs)``. Under ``torch.compile`` it is made while tracing,
    outside the graph, and read as an attribute of ``mesh.traced``, which torch guards on
    (a trace that makes several plans finds each)."""
    if _compat.tracing():
        name = _keep_plan(parallel_mesh, *((spec.dims, spec.unreduced) for spec in specs))
        traced: Plan = getattr(parallel_mesh.traced, name)
        return traced
    plan: Plan | None = parallel_mesh.store.get(("plan", specs))
    return _new_plan(parallel_mesh, specs) if plan is None else plan


@_compat.constant_when_traced
def _keep_plan(
    parallel_mesh: ParallelMesh, *fields: tuple[tuple[DimAxes, ...], frozenset[str]]
) -> str:
    """The name in ``mesh.traced`` of the plan of the specs with these ``(dims,
    unreduced)``, made and kept there if new. A constant to torch.compile, so it runs while
    tracing and the plan's groups and views are made outside the graph; the specs come as
    their fields, the builtins torch.compile hands such a function (a P made inside the
    compiled function it cannot hand over)."""
    specs = tuple(P(*dims, unreduced=unreduced) for dims, unreduced in fields)
    if ("plan", specs) not in parallel_mesh.store:
        _new_plan(parallel_mesh, specs)
    return _traced_name(specs)


def _traced_name(specs: tuple[P, ...]) -> str:
    """The plan's name in ``mesh.traced``: its specs, alike on every rank (a graph traced
    on one rank reads it on all: ``compile_on_one_rank``)."""
    return f"plan {specs!r}"


def _new_plan(parallel_mesh: ParallelMesh, specs: tuple[P, ...]) -> Plan:
    """A new plan of ``specs``, put in the mesh's store (by the caller's specs, so the next
    calls find it by identity before equality) and in ``mesh.traced``."""
    parallel_mesh.check_alive()
    plan = parallel_mesh.store[("plan", specs)] = Plan(parallel_mesh, specs)
    setattr(parallel_mesh.traced, _traced_name(specs), plan)
    return plan


def plan_group(parallel_mesh: ParallelMesh, axes: Sequence[str]) -> OrderedGroup:
    """``parallel_mesh.ordered(axes)`` as a plan holds it: a copy of its own. A compiled
    call reads a plan through the mesh's store, and a collective's group as a constant
    (:func:`~meshstate.jax.typing.ordered_group`); torch, meeting one object both ways,
    would guard it by a name it cannot read back ("Guard failed on the same frame it was
    created")."""
    return dataclasses.replace(parallel_mesh.ordered(axes))


class Plan:
    """What shard_map's specs need of one mesh, worked out once.

    ``view`` is the dense or expert DeviceMesh; for each spec, by its number in
    ``specs``: its placements, the groups of its split dims (each dim's axes,
    major to minor), and the group of the view's axes it leaves out (``None``
    if none of size > 1).
    """

    def __init__(self, parallel_mesh: ParallelMesh, specs: tuple[P, ...]) -> None:
        self.specs = specs
        self.view = _view(parallel_mesh, specs)
        self.mesh_axes = self.view.mesh_dim_names or ()
        self.sizes = dict(zip(self.mesh_axes, self.view.shape))
        self.placements = tuple(to_placements(spec, self.view) for spec in specs)
        self.named = tuple(frozenset(spec.axes) for spec in specs)
        """The axes each spec names: the type of a value laid out by it."""
        self._dtensor_specs: dict[tuple[object, ...], object] = {}
        """DTensor specs of even results, by spec number and block shape (eager, no autograd)."""
        self.split_dims = tuple(
            [
                (dim, plan_group(parallel_mesh, entry_axes(entry)))
                for dim, entry in enumerate(spec.dims)
                if entry is not None
            ]
            for spec in specs
        )
        self.left_out = tuple(self._left_out(parallel_mesh, spec) for spec in specs)
        self.replicas = tuple(
            math.prod(self.sizes[axis] for axis in self.left_out_axes(spec)) for spec in specs
        )
        self.whole = plan_group(parallel_mesh, self.mesh_axes)
        self.coordinate = parallel_mesh.coordinate

    def left_out_axes(self, spec: P) -> tuple[str, ...]:
        """The view's axes of size > 1 that ``spec`` does not name (unreduced axes are named)."""
        named = set(spec.axes)
        return tuple(a for a in self.mesh_axes if a not in named and self.sizes[a] > 1)

    def _left_out(self, parallel_mesh: ParallelMesh, spec: P) -> OrderedGroup | None:
        axes = self.left_out_axes(spec)
        return plan_group(parallel_mesh, axes) if axes else None

    def block_of(self, number: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``x`` under spec ``number``; its gradient is the block's own."""
        if isinstance(x, DTensor):
            return self._local_of(x, number)
        spec = self.specs[number]
        if len(spec.dims) > x.dim():
            raise ConfigError(
                f"{spec!r} has {len(spec.dims)} dims but the shape {tuple(x.shape)} has {x.dim()}"
            )
        if not self._divides(number, x.shape):
            NamedSharding(self.view, spec).shard_shape(x.shape)  # refuses what DTensor cannot cut
            replicated = DTensor.from_local(
                x, self.view, [Replicate()] * self.view.ndim, run_check=False
            )
            return self._local_of(replicated, number)
        # The full value on every rank: this rank's block is a slice, whose gradient
        # is gathered back whole (as DTensor's Replicate -> Shard gives it).
        split_dims = self.split_dims[number]
        if not (x.requires_grad and torch.is_grad_enabled()):
            return block(x, split_dims)
        return take_block(x, split_dims)

    def _local_of(self, x: DTensor, number: int) -> torch.Tensor:
        """The block of a DTensor laid out as spec ``number`` on the view. One on the view or
        on a slice of it (``mesh["tp"]``: replicated over the view's other axes) that is
        already laid out so keeps its local block; any other is redistributed, or gathered
        whole first where it lives on another mesh."""
        wanted = self.placements[number]
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

    def _divides(self, number: int, shape: Sequence[int]) -> bool:
        for dim, group in self.split_dims[number]:
            if shape[dim] % len(group.ranks):
                return False
        return True

    def to_dtensor(self, number: int, y: torch.Tensor, shape: Sequence[int] | None) -> DTensor:
        """``y``, this rank's block, as a DTensor of global ``shape`` laid out by spec
        ``number`` (``None``: every rank's block has ``y``'s shape, so DTensor works it out)."""
        if isinstance(y, DTensor):
            raise ConfigError("shard_map: f returned a DTensor; return local blocks (plain tensors)")
        placements = self.placements[number]
        if shape is None:
            if _compat.recorded_or_traced(y):
                return DTensor.from_local(y, self.view, placements, run_check=False)
            block_key = (number, y.shape, y.stride(), y.dtype, y.device)
            dtensor_spec = self._dtensor_specs.get(block_key)
            if dtensor_spec is None:
                dtensor_spec = self._dtensor_specs[block_key] = _compat.even_spec(
                    self.view, placements, y
                )
            return _compat.dtensor_of(y, dtensor_spec)
        return DTensor.from_local(
            y,
            self.view,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_strides(shape),
        )

    def to_dtensors(self, outputs: Leaves, arguments: Leaves) -> list[DTensor]:
        """Each result, a block under its spec, as a DTensor of its global shape (see
        :meth:`global_shapes`; ``arguments``: the call's, by their specs)."""
        shapes = self.global_shapes(outputs, arguments)
        return [self.to_dtensor(number, y, shape) for (number, y), shape in zip(outputs, shapes)]

    def global_shapes(self, outputs: Leaves, arguments: Leaves) -> list[torch.Size | None]:
        """Each result's global shape: a split dim times its axes' sizes where every
        argument divided (JAX's rule; ``None``, which DTensor works out alike, where the
        spec has no more dims than the result), else summed over the ranks (one all-reduce)."""
        if not all([self._divides(number, x.shape) for number, x in arguments]):
            return list(_summed_shapes(outputs, self))
        shapes: list[torch.Size | None] = []
        for number, y in outputs:
            if len(self.specs[number].dims) <= y.dim():
                shapes.append(None)
                continue
            shape = list(y.shape)
            for dim, group in self.split_dims[number]:
                if dim < y.dim():
                    shape[dim] *= len(group.ranks)
            shapes.append(torch.Size(shape))
        return shapes


def _view(parallel_mesh: ParallelMesh, specs: Sequence[P]) -> DeviceMesh:
    """The root DeviceMesh (dense, expert or HSDP) of the view holding every axis the specs
    name: the layout's one rule (:meth:`~meshstate.layout.layout.ParallelLayout.view_of`)."""
    axes = [axis for spec in specs for axis in spec.axes]
    grid = parallel_mesh.layout.view_of(axes, f"shard_map: the specs {list(specs)}")
    return parallel_mesh.root_of(grid)


def _summed_shapes(outputs: Leaves, plan: Plan) -> list[torch.Size]:
    """Each result's global shape: its sharded dims summed over their axes (one all-reduce).

    Where an argument was cut unevenly a rank cannot know the others' blocks."""
    split = [
        (tuple(set(plan.mesh_axes) - set(entry_axes(entry))), y.shape[dim])
        for number, y in outputs
        for dim, entry in enumerate(plan.specs[number].dims[: y.dim()])
        if entry is not None
    ]
    if split:
        counted = _first_copies_count(plan.coordinate, split)
        device = device_of(plan.view)
        sizes = torch.stack([torch.full((), n, dtype=torch.int64, device=device) for n in counted])
        dist.all_reduce(sizes, group=plan.whole.group)
        summed = iter(sizes.tolist())
    shapes = []
    for number, y in outputs:
        shape = list(y.shape)
        for dim, entry in enumerate(plan.specs[number].dims[: y.dim()]):
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
share_grad: Callable[[torch.Tensor, int], torch.Tensor] = _ShareGrad.apply
