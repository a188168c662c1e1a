"""``shard_map(..., axis_names={...})``: manual over some mesh axes, global over the others.

JAX's partial manual mode. The specs name only the manual axes; inside the body each
argument is its block over the manual axes and stays global over the view's other axes
(those of size > 1): a DTensor on the mesh of those axes, laid out as the argument was
(an FSDP2-sharded weight stays sharded over dp). Collectives over the manual axes move
the DTensor's local block; over another axis they are refused with JAX's words
(:func:`meshstate.jax.typing.refuse_unbound`). Types (``vma``) name manual axes only. A result is a
DTensor on the other axes' mesh (or a plain tensor, replicated over them); it leaves as a
DTensor on the whole view, its manual axes laid out by its out-spec.

Differences from JAX, and why: a dim split by a spec and also sharded over another axis
is gathered over that axis first (DTensor cuts in mesh order, the body's block is cut
manual-major); dims split by a spec must divide evenly.

Example (8 ranks, ``init_mesh(tp=2, cp=2)``; ``w`` FSDP2-sharded over dp)::

    mlp = shard_map(lambda x, w: psum(x @ w, "tp"), in_specs=(P(None, "tp"), P("tp")),
                    out_specs=P(), axis_names={"tp"})
    mlp(x, w)    # inside: x @ w a DTensor over (dp, cp), psum'd over tp
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from meshstate.core import compat as _compat
from meshstate.core.mesh import ParallelMesh
from meshstate.errors import ConfigError
from meshstate.jax.plan import Leaves, contiguous_strides, plan_group
from meshstate.jax.sharding import DimAxes, P, entry_axes, to_placements
from meshstate.jax.torch_calls import summed_gradient
from meshstate.jax.typing import typed, vma

__all__ = ["PartialPlan", "check_manual", "partial_plan_on"]


def check_manual(specs: Sequence[P], paths: Sequence[str], manual: frozenset[str]) -> None:
    """Refuse a spec that names an axis outside ``manual``, in JAX 0.12's words.

    Example: ``check_manual([P("dp")], ["in_specs"], frozenset({"tp"}))`` raises
    ``shard_map in_specs argument must refer to an axis marked as manual ...``.
    """
    for spec, path in zip(specs, paths):
        outside = [axis for axis in spec.axes if axis not in manual]
        if outside:
            argument = path.split("[")[0]
            raise ConfigError(
                f"shard_map {argument} argument must refer to an axis marked as manual "
                f"({manual!r}), but: {argument} refers to {outside[0]!r} ({path} is {spec!r})"
            )


def partial_plan_on(parallel_mesh: ParallelMesh, specs: tuple[P, ...],
                    manual: tuple[str, ...]) -> PartialPlan:
    """The plan of ``specs`` manual over ``manual`` (sorted) on ``parallel_mesh``, made on
    first use and kept in the mesh's store (under ``torch.compile``, made outside the graph
    and read from ``mesh.traced``, as :func:`~meshstate.jax.plan.plan_on` reads its plans)."""
    if _compat.tracing():
        name = _keep_plan(parallel_mesh, manual, *((spec.dims, spec.unreduced) for spec in specs))
        traced: PartialPlan = getattr(parallel_mesh.traced, name)
        return traced
    return _kept_plan(parallel_mesh, specs, manual)


@_compat.constant_when_traced
def _keep_plan(parallel_mesh: ParallelMesh, manual: tuple[str, ...],
               *fields: tuple[tuple[DimAxes, ...], frozenset[str]]) -> str:
    """The name in ``mesh.traced`` of the partial plan of the specs with these ``(dims,
    unreduced)``, kept there."""
    specs = tuple(P(*dims, unreduced=unreduced) for dims, unreduced in fields)
    _kept_plan(parallel_mesh, specs, manual)
    return _traced_name(specs, manual)


def _traced_name(specs: tuple[P, ...], manual: tuple[str, ...]) -> str:
    """The partial plan's name in ``mesh.traced``, alike on every rank."""
    return f"partial plan {specs!r} manual over {manual!r}"


def _kept_plan(parallel_mesh: ParallelMesh, specs: tuple[P, ...],
               manual: tuple[str, ...]) -> PartialPlan:
    """The partial plan in the mesh's store, put there (and in ``mesh.traced``) on first use."""
    key = ("partial plan", specs, manual)
    plan: PartialPlan | None = parallel_mesh.store.get(key)
    if plan is None:
        parallel_mesh.check_alive()
        plan = parallel_mesh.store[key] = PartialPlan(parallel_mesh, specs, manual)
        setattr(parallel_mesh.traced, _traced_name(specs, manual), plan)
    return plan


class PartialPlan:
    """What a partial-manual shard_map's specs need of one mesh, worked out once.

    ``view``: the root DeviceMesh holding the manual axes and the specs'; ``auto_axes``:
    its other axes of size > 1 (mesh order), ``auto_mesh`` their DeviceMesh (``None`` if
    none: then the call is a plain shard_map). For each spec, by number: its placements on
    the view, the axes it names, its split dims with their manual sizes, the group of the
    manual axes it leaves out and their number of replicas (JAX's legacy transposes).
    """

    def __init__(self, parallel_mesh: ParallelMesh, specs: tuple[P, ...],
                 manual: tuple[str, ...]) -> None:
        self.specs = specs
        named_axes = {axis for spec in specs for axis in spec.axes} | set(manual)
        grid = parallel_mesh.layout.view_of(named_axes, f"shard_map(axis_names={set(manual)})")
        self.view = parallel_mesh.root_of(grid)
        self.mesh_axes = self.view.mesh_dim_names or ()
        self.sizes = dict(zip(self.mesh_axes, self.view.shape))
        self.auto_axes = tuple(a for a in self.mesh_axes if a not in manual and self.sizes[a] > 1)
        self.auto_dims = tuple(self.mesh_axes.index(axis) for axis in self.auto_axes)
        self.auto_mesh: DeviceMesh | None = self.view[self.auto_axes] if self.auto_axes else None
        self.placements = tuple(to_placements(spec, self.view) for spec in specs)
        self.named = tuple(frozenset(spec.axes) for spec in specs)
        self.split = tuple(
            {dim: math.prod(self.sizes[axis] for axis in entry_axes(entry))
             for dim, entry in enumerate(spec.dims) if entry is not None}
            for spec in specs
        )
        left_out = [tuple(a for a in manual if a not in spec.axes and self.sizes[a] > 1)
                    for spec in specs]
        self.left_out = tuple(plan_group(parallel_mesh, axes) if axes else None for axes in left_out)
        self.replicas = tuple(math.prod(self.sizes[a] for a in axes) for axes in left_out)
        self._specs: dict[tuple[object, ...], Any] = {}
        """DTensor specs of blocks and results, by mesh, placements, shape and dtype."""

    def enter(self, number: int, x: torch.Tensor, typed_mode: bool) -> torch.Tensor:
        """``x``'s block over the manual axes under spec ``number``, a DTensor global over
        the other axes: typed by the spec (``typed_mode``) or with its gradient summed over
        the manual axes the spec leaves out (JAX's legacy transposes)."""
        on_view = self._on_view(x)
        wanted = self._wanted(number, on_view.placements)
        if tuple(on_view.placements) != wanted:
            on_view = on_view.redistribute(self.view, wanted)
        local = _compat.local_tensor(on_view)
        left_out = self.left_out[number]
        if not typed_mode and left_out is not None and local.requires_grad:
            local = summed_gradient(local, left_out.group_name)
        shape = self._block_shape(number, on_view.shape)
        assert self.auto_mesh is not None  # a plan without other axes runs as a plain shard_map
        block = self._dtensor(local, self.auto_mesh,
                              tuple(wanted[dim] for dim in self.auto_dims), shape)
        return typed(block, self.named[number]) if typed_mode else block

    def _dtensor(self, local: torch.Tensor, device_mesh: DeviceMesh,
                 placements: tuple[Placement, ...], shape: Sequence[int]) -> DTensor:
        """``DTensor.from_local(local, device_mesh, placements)`` of global ``shape``
        (contiguous); where autograd does not record ``local`` and nothing traces, with a
        spec made once per layout and shape (``from_local`` makes one each call)."""
        stride = contiguous_strides(shape)
        if _compat.recorded_or_traced(local):
            return DTensor.from_local(local, device_mesh, placements, run_check=False,
                                      shape=torch.Size(shape), stride=stride)
        key = (device_mesh is self.view, placements, tuple(shape), local.dtype)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = _compat.dtensor_spec(device_mesh, placements, shape,
                                                           stride, local.dtype)
        return _compat.dtensor_of(local, spec)

    def _on_view(self, x: torch.Tensor) -> DTensor:
        """``x`` as a DTensor on the whole view: a plain tensor replicated, a DTensor on a
        slice of the view (FSDP2's ``mesh["dp"]``) with its placements on its axes, one on
        another mesh gathered whole first."""
        replicated = [Replicate()] * self.view.ndim
        if not isinstance(x, DTensor):
            return DTensor.from_local(x, self.view, replicated, run_check=False)
        if x.device_mesh is self.view:
            return x
        names = x.device_mesh.mesh_dim_names or ()
        if _compat.root_of(x.device_mesh) != self.view or not set(names) <= set(self.mesh_axes):
            return DTensor.from_local(x.full_tensor(), self.view, replicated, run_check=False)
        by_axis = dict(zip(names, x.placements))
        placements = [by_axis.get(axis, Replicate()) for axis in self.mesh_axes]
        return DTensor.from_local(x.to_local(), self.view, placements, run_check=False,
                                  shape=x.shape, stride=x.stride())

    def _wanted(self, number: int, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        """The view's placements a block under spec ``number`` is cut from: the spec's on the
        manual axes, ``placements`` on the others but for a shard of a dim the spec splits."""
        split = self.split[number]
        wanted = list(self.placements[number])
        for dim in self.auto_dims:
            placement = placements[dim]
            cut_too = isinstance(placement, Shard) and placement.dim in split
            wanted[dim] = Replicate() if cut_too else placement
        return tuple(wanted)

    def _block_shape(self, number: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a block under spec ``number`` of a value of ``shape``."""
        spec, split = self.specs[number], self.split[number]
        if len(spec.dims) > len(shape):
            raise ConfigError(
                f"{spec!r} has {len(spec.dims)} dims but the shape {tuple(shape)} has {len(shape)}"
            )
        for dim, parts in split.items():
            if shape[dim] % parts:
                raise ConfigError(
                    f"shard_map(axis_names=...): {spec!r} splits dim {dim} of size {shape[dim]} "
                    f"into {parts} blocks; it must divide evenly"
                )
        return tuple(size // split.get(dim, 1) for dim, size in enumerate(shape))

    def local_of(self, number: int, y: Any) -> tuple[torch.Tensor, tuple[Placement, ...], torch.Size]:
        """A result under out-spec ``number``: its local block, typed as ``y``, with its
        placements on the other axes and its shape (global over them). ``y``: a DTensor on
        ``auto_mesh`` (a shard of a dim the out-spec splits gathered first: torch cuts in
        mesh order, the result is laid out manual-major) or a plain tensor (replicated)."""
        if not isinstance(y, DTensor):
            if not isinstance(y, torch.Tensor):
                raise ConfigError(f"shard_map: f returned a {type(y).__name__}, not a tensor")
            return y, (Replicate(),) * len(self.auto_axes), y.shape
        if y.device_mesh != self.auto_mesh:
            raise ConfigError(
                f"shard_map(axis_names=...): f returned a DTensor on {y.device_mesh}; return "
                f"one on the mesh of the other axes {self.auto_axes} (or a plain tensor)"
            )
        axes = vma(y)
        split = self.split[number]
        kept = tuple(Replicate() if isinstance(p, Shard) and p.dim in split else p
                     for p in y.placements)
        if kept != tuple(y.placements):
            y = y.redistribute(self.auto_mesh, kept)
        local = _compat.local_tensor(y)
        return (typed(local, axes) if axes else local), kept, y.shape

    def leave(self, number: int, local: torch.Tensor, auto_placements: tuple[Placement, ...],
              shape: torch.Size) -> DTensor:
        """A result's block ``local`` (checked and untyped by the mode) as a DTensor on the
        whole view: its out-spec's placements on the manual axes, its own on the others."""
        placements = list(self.placements[number])
        for dim, placement in zip(self.auto_dims, auto_placements):
            placements[dim] = placement
        if len(self.specs[number].dims) > len(shape):
            raise ConfigError(f"out_specs {self.specs[number]!r} has more dims than the result's "
                              f"shape {tuple(shape)}")
        split = self.split[number]
        whole = tuple(size * split.get(dim, 1) for dim, size in enumerate(shape))
        return self._dtensor(local, self.view, tuple(placements), whole)


def run_partial(
    plan: PartialPlan,
    mode: Any,
    typed_mode: bool,
    arguments: Leaves,
    body: Callable[[list[torch.Tensor]], Leaves],
    parallel_mesh: ParallelMesh,
) -> list[DTensor]:
    """One call: the blocks of ``arguments`` (numbered by spec) handed to ``body``, whose
    results (numbered by out-spec) are checked by ``mode`` (shard_map's typed or legacy
    mode, which reads the plan's ``specs``, ``named`` and ``replicas``) and leave as
    DTensors on the whole view."""
    blocks: list[torch.Tensor] = [plan.enter(number, x, typed_mode) for number, x in arguments]
    results = body(blocks)
    found = [(number, *plan.local_of(number, y)) for number, y in results]
    checked = mode.leave(plan, parallel_mesh, [(number, local) for number, local, _, _ in found])
    return [
        plan.leave(number, local, placements, shape)
        for (number, _, placements, shape), (_, local) in zip(found, checked)
    ]
