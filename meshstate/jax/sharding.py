"""JAX-style partition specs on torch ``DeviceMesh``es.

A :class:`P` says, for each tensor dim, which mesh axes split it: ``None``
(not split), one axis name, or a tuple of axis names, major to minor. A dim
split over ``("dp", "cp")`` is cut into ``dp*cp`` equal chunks and a rank holds
chunk ``dp_coordinate * cp + cp_coordinate``, whatever the order of those axes
in the mesh, exactly as JAX's ``NamedSharding`` lays it out.
:func:`to_placements` turns a spec into DTensor placements (``Shard``, torch's
strided shard where a tuple runs against mesh order, ``Replicate``,
``Partial``), :class:`NamedSharding` answers shard shapes and which rank holds
which slice, and :func:`distribute` makes the DTensor.

Example, on a ``DeviceMesh`` ``("dp", "cp", "tp")`` of shape ``(2, 2, 2)``::

    to_placements(P(("dp", "cp"), "tp"), mesh)
    # (Shard(dim=0), Shard(dim=0), Shard(dim=1))
    to_placements(P(("cp", "dp")), mesh)
    # (_StridedShard(dim=0, sf=2), Shard(dim=0), Replicate())
    distribute(torch.arange(16).view(8, 2), mesh, P(("cp", "dp")))
    # rank 2 (dp=0, cp=1) holds rows 4 and 5; rank 4 (dp=1, cp=0) rows 2 and 3
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from meshstate.core import compat as _compat
from meshstate.errors import AxisError, ConfigError, WrongMeshError

__all__ = ["NamedSharding", "P", "distribute", "to_placements"]

DimAxes = str | tuple[str, ...] | None
"""What one entry of a :class:`P` holds: no axis, one axis, or axes major to minor."""


@dataclass(frozen=True, init=False, repr=False)
class P:
    """A partition spec: one entry per tensor dim, plus the unreduced axes.

    Each entry is ``None`` (the dim is not split), an axis name, or a tuple of
    axis names (major to minor). Trailing dims without an entry are not split.
    ``unreduced`` names the axes over which the tensor holds partial sums.
    Specs compare and hash by value; ``("dp",)`` is the same entry as ``"dp"``
    and ``()`` the same as ``None``.

    Example::

        P("dp", None, ("cp", "tp"))          # P('dp', None, ('cp', 'tp'))
        P(None, "tp", unreduced={"dp"})      # a gradient not yet summed over dp
    """

    dims: tuple[DimAxes, ...]
    unreduced: frozenset[str]

    def __init__(self, *dims: DimAxes, unreduced: Iterable[str] = frozenset()) -> None:
        if isinstance(unreduced, str):
            raise ConfigError(
                f"unreduced must be a collection of axis names, not the string {unreduced!r}; "
                f"write unreduced={{{unreduced!r}}}"
            )
        unreduced = tuple(sorted(unreduced, key=str)) if unreduced else ()
        canonical = tuple(_canonical_entry(entry, dim, dims, unreduced) for dim, entry in enumerate(dims))
        for name in unreduced:
            if not isinstance(name, str):
                raise ConfigError(
                    f"{_format_spec(dims, unreduced)}: unreduced holds {name!r}, which is not "
                    "an axis name")
        used = [axis for entry in canonical for axis in entry_axes(entry)] + list(unreduced)
        if len(set(used)) != len(used):
            axis = next(axis for axis in used if used.count(axis) > 1)
            raise ConfigError(
                f"{_format_spec(dims, unreduced)}: axis {axis!r} is used more than once; a mesh "
                "axis splits at most one dim and cannot also be unreduced"
            )
        object.__setattr__(self, "dims", canonical)
        object.__setattr__(self, "unreduced", frozenset(unreduced))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, dims first (in order), then the unreduced ones sorted."""
        split_axes = tuple(axis for entry in self.dims for axis in entry_axes(entry))
        return split_axes + tuple(sorted(self.unreduced))

    def __repr__(self) -> str:
        return _format_spec(self.dims, tuple(sorted(self.unreduced)))


def to_placements(spec: P, device_mesh: DeviceMesh) -> tuple[Placement, ...]:
    """DTensor placements, one per mesh dim, that lay a tensor out as JAX would.

    A dim split over axes in mesh order gets ``Shard(dim)`` on each of them.
    Torch cuts in mesh-dim order, so an axis that has tuple-major axes coming
    after it in the mesh must leave their chunks uncut: it gets torch's strided
    shard with ``split_factor`` = the product of those axes' sizes. Axes the
    spec does not name are ``Replicate()``; unreduced axes are ``Partial()``.

    The layout equals JAX's when every split dim divides evenly by the
    product of its axes' sizes; otherwise it is DTensor's uneven layout (see
    :meth:`NamedSharding.shard_shape`).

    Example, mesh ``("dp", "cp", "tp")`` of shape ``(2, 2, 2)``::

        to_placements(P(("tp", "dp"), unreduced={"cp"}), mesh)
        # (_StridedShard(dim=0, sf=2), Partial(sum), Shard(dim=0))

    Raises:
        AxisError: the spec names an axis the mesh does not have.
        WrongMeshError: ``device_mesh`` is not a DeviceMesh (a ParallelMesh, say).
    """
    _require_device_mesh(device_mesh, "to_placements()")
    mesh_axes = device_mesh.mesh_dim_names or ()
    for axis in spec.axes:
        if axis not in mesh_axes:
            raise AxisError(f"{spec!r}: mesh has no axis {axis!r}; valid axes are {mesh_axes}")
    placements: list[Placement] = [Replicate()] * device_mesh.ndim
    for dim, entry in enumerate(spec.dims):
        dim_axes = entry_axes(entry)
        for position, axis in enumerate(dim_axes):
            mesh_dim = mesh_axes.index(axis)
            split_factor = math.prod(
                device_mesh.size(mesh_axes.index(major))
                for major in dim_axes[:position]
                if mesh_axes.index(major) > mesh_dim
            )
            placements[mesh_dim] = (
                Shard(dim) if split_factor == 1 else _compat.strided_shard(dim, split_factor)
            )
    for axis in spec.unreduced:
        placements[mesh_axes.index(axis)] = Partial()
    return tuple(placements)


def spec_of(view: DeviceMesh, placements: tuple[Placement, ...]) -> P | None:
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


@dataclass(frozen=True)
class NamedSharding:
    """A spec on a mesh: its placements, shard shapes and who holds what.

    Example, mesh ``("dp", "tp")`` of shape ``(2, 4)``, ranks ``[[0..3], [4..7]]``::

        sharding = NamedSharding(mesh, P("tp", "dp"))
        sharding.shard_shape((8, 6))           # (2, 3)
        sharding.index_map((8, 6))[5]          # (slice(2, 4), slice(3, 6))
    """

    device_mesh: DeviceMesh
    spec: P
    placements: tuple[Placement, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        _require_device_mesh(self.device_mesh, "NamedSharding()")
        object.__setattr__(self, "placements", to_placements(self.spec, self.device_mesh))

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the first rank's shard: every rank's where each dim divides.

        A dim that does not divide by the product of its axes' sizes is cut as
        DTensor cuts it: axis by axis in mesh order, each time into chunks of
        the rounded-up size, so the last shards are smaller (some may be
        empty); the first is the largest. :meth:`index_map` has every rank's.

        Raises:
            ConfigError: the spec has more dims than the shape, or a dim that
                does not divide is split over axes against mesh order.
        """
        return tuple(stop - start for start, stop in self._blocks(tuple(global_shape), None))

    def index_map(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """The slice of the global tensor each global rank holds (JAX's ``devices_indices_map``).

        Covers every rank of the mesh's root, also for a slice such as
        ``root["dp", "cp"]``: each rank holds what its coordinates on the
        mesh's axes say. Unreduced axes do not change the slice (the rank holds
        a partial sum of it). Uneven dims as in :meth:`shard_shape`.
        """
        global_shape = tuple(global_shape)
        coordinates = list(itertools.product(*(range(size) for size in self.device_mesh.shape)))
        index_map = {}
        for copy_ranks in _compat.mesh_copies(self.device_mesh).flatten(1).tolist():
            for rank, coordinate in zip(copy_ranks, coordinates):
                blocks = self._blocks(global_shape, coordinate)
                index_map[rank] = tuple(slice(start, stop) for start, stop in blocks)
        return index_map

    def _blocks(
        self, global_shape: tuple[int, ...], coordinate: Sequence[int] | None
    ) -> list[tuple[int, int]]:
        """``(start, stop)`` per dim of the shard at ``coordinate`` (``None``: all zeros)."""
        if len(self.spec.dims) > len(global_shape):
            raise ConfigError(
                f"{self.spec!r} has {len(self.spec.dims)} dims but the shape "
                f"{global_shape} has {len(global_shape)}"
            )
        mesh_axes = self.device_mesh.mesh_dim_names or ()
        mesh_shape = self.device_mesh.shape
        coordinate = coordinate or (0,) * len(mesh_shape)
        blocks = []
        for dim, size in enumerate(global_shape):
            dim_axes = _split_axes(self.spec, dim)
            mesh_dims = [mesh_axes.index(axis) for axis in dim_axes]
            chunks = math.prod(mesh_shape[mesh_dim] for mesh_dim in mesh_dims)
            if size % chunks == 0:
                chunk = _chunk_of(coordinate, mesh_shape, mesh_dims)
                blocks.append((chunk * (size // chunks), (chunk + 1) * (size // chunks)))
                continue
            if mesh_dims != sorted(mesh_dims):
                axis_sizes = [mesh_shape[mesh_dim] for mesh_dim in mesh_dims]
                raise ConfigError(
                    f"{self.spec!r}: dim {dim} of shape {global_shape} has size {size}, which "
                    f"is not divisible by {_product_text(dim_axes, axis_sizes)}; "
                    f"an uneven dim must be split over axes in mesh order {mesh_axes}"
                )
            start, stop = 0, size
            for mesh_dim in mesh_dims:
                step = -(-(stop - start) // mesh_shape[mesh_dim])
                start, stop = (
                    min(start + coordinate[mesh_dim] * step, stop),
                    min(start + (coordinate[mesh_dim] + 1) * step, stop),
                )
            blocks.append((start, stop))
        return blocks


def distribute(tensor: torch.Tensor, device_mesh: DeviceMesh, spec: P) -> DTensor:
    """Distribute ``tensor`` from rank 0 of each mesh dim as ``spec`` says.

    Every rank of the mesh calls it with the same global tensor (only the
    source ranks' data is used, as in ``distribute_tensor``). For unreduced
    axes the rank at coordinate 0 of all of them holds its shard and the
    others hold zeros, so summing over those axes gives ``tensor`` exactly,
    in every dtype (torch's ``distribute_tensor`` would hold ``tensor / n``,
    inexact and a float even for integer tensors).

    Example, mesh ``("dp", "tp")`` of shape ``(2, 4)``::

        distribute(torch.arange(8), mesh, P("tp")).to_local()   # [2, 3] on ranks 1 and 5

    Raises:
        AxisError, ConfigError: as :class:`NamedSharding` and its ``shard_shape``
            (a dim that does not divide is cut as DTensor cuts it, last shards smaller).
        WrongMeshError: ``device_mesh`` is not a DeviceMesh (a ParallelMesh, say).
    """
    _require_device_mesh(device_mesh, "distribute()")
    sharding = NamedSharding(device_mesh, spec)
    sharding.shard_shape(tensor.shape)
    if not spec.unreduced:
        return distribute_tensor(tensor, device_mesh, sharding.placements)
    summed_placements = [
        Replicate() if isinstance(placement, Partial) else placement
        for placement in sharding.placements
    ]
    local_tensor = distribute_tensor(tensor.detach(), device_mesh, summed_placements).to_local()
    coordinate = device_mesh.get_coordinate()
    mesh_axes = device_mesh.mesh_dim_names or ()
    if coordinate is not None:
        # A tensor test, not a Python branch: in a simulated world the coordinate is per rank.
        holders = torch.tensor([coordinate[mesh_axes.index(axis)] for axis in spec.unreduced])
        local_tensor = torch.where((holders == 0).all(), local_tensor, torch.zeros_like(local_tensor))
    partial_tensor = DTensor.from_local(
        local_tensor,
        device_mesh,
        sharding.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
    )
    partial_tensor.requires_grad_(tensor.requires_grad)
    return partial_tensor


def entry_axes(entry: DimAxes) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def _split_axes(spec: P, dim: int) -> tuple[str, ...]:
    return entry_axes(spec.dims[dim]) if dim < len(spec.dims) else ()


def _chunk_of(
    coordinate: Sequence[int], mesh_shape: Sequence[int], mesh_dims: Sequence[int]
) -> int:
    """JAX's chunk: the row-major index of ``coordinate`` over ``mesh_dims``, first major."""
    chunk = 0
    for mesh_dim in mesh_dims:
        chunk = chunk * mesh_shape[mesh_dim] + coordinate[mesh_dim]
    return chunk


def _canonical_entry(
    entry: object, dim: int, dims: Sequence[object], unreduced: Sequence[object]
) -> DimAxes:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, tuple) and all(isinstance(axis, str) for axis in entry):
        if len(entry) > 1:
            return entry
        return entry[0] if entry else None
    raise ConfigError(
        f"{_format_spec(dims, unreduced)}: dim {dim} is {entry!r}; each entry must be None, "
        "an axis name or a tuple of axis names"
    )


def _format_spec(dims: Sequence[object], unreduced: Sequence[object]) -> str:
    parts = [repr(entry) for entry in dims]
    if unreduced:
        parts.append("unreduced={" + ", ".join(repr(axis) for axis in unreduced) + "}")
    return f"P({', '.join(parts)})"


def _product_text(axes: Sequence[str], sizes: Sequence[int]) -> str:
    if len(axes) == 1:
        return f"{axes[0]} = {sizes[0]}"
    return f"{'*'.join(axes)} = {'*'.join(map(str, sizes))} = {math.prod(sizes)}"


def _require_device_mesh(device_mesh: object, where: str) -> None:
    if not isinstance(device_mesh, DeviceMesh):
        raise WrongMeshError(
            f"{where} takes a torch DeviceMesh, got {type(device_mesh).__name__}; "
            'pass mesh.dense, mesh.expert or a slice such as mesh["dp"]'
        )
