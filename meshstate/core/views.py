"""The DeviceMeshes of a :class:`~meshstate.core.mesh.ParallelMesh`, built from its groups.

A root DeviceMesh (dense, expert, HSDP) is built from the groups of its axes;
slices and flattened joint meshes are cut from a root with the group of their
axes, and each is checked against the process groups behind it. The mesh
calls these on first request and caches what they return.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.core.errors import AxisError, MeshStateError
from meshstate.core.layout import Grid, Key, MeshLayout
from meshstate.core.ordered import OrderedGroup
from meshstate.core.simulation import differs_anywhere, outside_simulation


class ParallelMesh(Protocol):
    """What the views need of a :class:`~meshstate.core.mesh.ParallelMesh`."""

    layout: MeshLayout
    device_type: str
    global_rank: int

    @property
    def _group_of(self) -> Mapping[Key, dist.ProcessGroup]: ...

    def __getitem__(self, key: str | tuple[str, ...]) -> DeviceMesh: ...
    def _check_alive(self) -> None: ...
    def ordered(self, axes: str | tuple[str, ...]) -> OrderedGroup: ...
    def root_of(self, grid: Grid) -> DeviceMesh: ...
    def cached_view(self, key: tuple[str, ...]) -> DeviceMesh | None: ...
    def keep_view(self, key: tuple[str, ...], view: DeviceMesh) -> None: ...
    def _rank_in_group(self, group: dist.ProcessGroup) -> int: ...
    def _rank_in_view(self, view: DeviceMesh, dim: int) -> int: ...


def build_root_mesh(mesh: ParallelMesh, grid: Grid) -> DeviceMesh:
    """Build ``grid``'s root DeviceMesh from the groups of its axes (O(world): once, cached)."""
    mesh._check_alive()
    groups = [
        mesh._group_of[axis] if axis in mesh._group_of else mesh.ordered(axis).group
        for axis in grid.axes_mesh_order
    ]
    with outside_simulation():  # one rank grid, shared by every simulated rank
        return DeviceMesh.from_group(
            groups, mesh.device_type, mesh=grid.rank_grid(), mesh_dim_names=grid.axes_mesh_order
        )


def flattened_mesh(mesh: ParallelMesh, key: str, view: Grid | None = None) -> DeviceMesh:
    """The flattened 1-D mesh of ``key``, flattened from ``view``'s root (default: its own)."""
    canonical, grid, axes = mesh.layout.resolve(key, view)
    if len(axes) == 1:  # "dp_replicate-dp_shard" is the axis dp
        return mesh[axes[0]]
    cached = view is None or grid is mesh.layout.resolve(key)[1]
    found = mesh.cached_view((canonical,)) if cached else None
    if found is not None:
        return found
    group, root = mesh.ordered(axes).group, mesh.root_of(grid)
    with outside_simulation():
        flattened = _compat.flatten_with_group(root, axes, canonical, group)
    check_consistent(mesh, flattened, (canonical,))
    if cached:
        mesh.keep_view((canonical,), flattened)
    return flattened


def sliced_mesh(mesh: ParallelMesh, names: tuple[str, ...]) -> DeviceMesh:
    valid = mesh.layout.axes_text()
    for name in names:
        known = isinstance(name, str) and ("-" in name or mesh.layout.knows(name))
        if not known:
            raise AxisError(f"mesh has no axis {name!r}; valid are {valid}")
    resolved = mesh.layout.resolve_together(names)
    grids = {id(grid) for _, grid, _ in resolved}
    if len(grids) > 1:
        raise AxisError(f"axes {names} mix dense and expert axes; valid are {valid}")
    root = mesh.root_of(resolved[0][1])
    root_axes = root.mesh_dim_names or ()
    axes = [axis for _, _, joint in resolved for axis in joint]
    in_mesh_order = tuple(axis for axis in root_axes if axis in axes)
    if len(set(axes)) != len(axes):
        raise AxisError(f"axes {names} name an axis twice")
    if tuple(axes) != in_mesh_order:
        raise AxisError(
            f"axes {names} run against mesh order (outer to inner) {root_axes}, and a torch "
            f"DeviceMesh keeps its dims in mesh order; slice mesh{list(in_mesh_order)} and give "
            f"the order in the spec instead: P({tuple(axes)!r}) lays a dim out major to minor"
        )
    for canonical, grid, joint in resolved:
        if len(joint) > 1:
            flattened_mesh(mesh, canonical, grid)
    keys = tuple(canonical if len(joint) > 1 else joint[0] for canonical, _, joint in resolved)
    with outside_simulation():
        view = _compat.slice_with_flattened(root, keys)
        _compat.share_rank_map(view, root)
    return check_consistent(mesh, view, keys)


def check_consistent(mesh: ParallelMesh, view: DeviceMesh, keys: tuple[str, ...]) -> DeviceMesh:
    """Refuse a DeviceMesh whose ranks disagree with the process groups behind it."""
    for dim, key in enumerate(keys):
        mesh_rank, group_rank = mesh._rank_in_view(view, dim), mesh._rank_in_group(view.get_group(dim))
        layout_rank = mesh.ordered(key).index
        if differs_anywhere(mesh_rank, group_rank) or differs_anywhere(mesh_rank, layout_rank):
            raise MeshStateError(
                f"DeviceMesh dim {key!r} puts rank {mesh.global_rank} at {mesh_rank}, but its "
                f"process group at {group_rank} and the layout at {layout_rank}; a "
                "DeviceMesh numbers ranks in mesh order, so the group must list them so too"
            )
    return view
