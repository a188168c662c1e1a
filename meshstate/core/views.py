"""The DeviceMeshes of a :class:`~meshstate.core.mesh.ParallelMesh`, built from its groups.

A root DeviceMesh (dense, expert, HSDP) is built from the groups of its axes;
slices and flattened joint meshes are cut from a root with the group of their
axes, and each is checked against the process groups behind it. The mesh
calls these on first request and caches what they return.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.core.facts import MeshTables
from meshstate.errors import AxisError, MeshStateError, WrongMeshError
from meshstate.layout.layout import Grid, MeshLayout
from meshstate.core.ordered import OrderedGroup
from meshstate.core.world import differs_anywhere, group_rank, outside_simulation, view_rank


class ViewedMesh(Protocol):
    """What the views need of the :class:`~meshstate.core.mesh.ParallelMesh` they are cut
    from (a protocol: the mesh imports this module)."""

    layout: MeshLayout
    device_type: str
    global_rank: int

    tables: MeshTables

    def __getitem__(self, key: str | tuple[str, ...]) -> DeviceMesh: ...
    def check_alive(self) -> None: ...
    def ordered(self, axes: str | tuple[str, ...]) -> OrderedGroup: ...
    def traced_name(self, group: dist.ProcessGroup) -> str: ...
    def root_of(self, grid: Grid) -> DeviceMesh: ...
    def cached_view(self, key: tuple[str, ...]) -> DeviceMesh | None: ...
    def keep_view(self, key: tuple[str, ...], view: DeviceMesh) -> None: ...


class DeviceMeshOnly:
    """A torch DeviceMesh attribute that a ParallelMesh lacks, on purpose.

    Reading it raises :class:`~meshstate.errors.WrongMeshError`, which says
    to pass one of the mesh's DeviceMeshes: torch's APIs given a ParallelMesh
    by mistake (``fully_shard(model, mesh=mesh)``) stop at their first read. It
    is an ``AttributeError``, so ``hasattr(mesh, "mesh_dim_names")`` stays
    ``False``. A descriptor on the class, not a ``__getattr__``: a class with
    ``__getattr__`` loses CPython's specialised reads of every attribute.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, mesh: ViewedMesh | None, owner: type | None = None) -> Any:
        if mesh is None:
            return self
        mesh.check_alive()
        raise WrongMeshError(
            f"a ParallelMesh is not a torch DeviceMesh (it has no {self.name!r}); pass one "
            'of its DeviceMeshes: mesh.dense, mesh.expert or a slice such as mesh["dp-cp"]'
        )


def build_root_mesh(mesh: ViewedMesh, grid: Grid) -> DeviceMesh:
    """Build ``grid``'s root DeviceMesh from the groups of its axes (O(world): once, cached)."""
    mesh.check_alive()
    groups = [
        mesh.tables.group[axis] if axis in mesh.tables.group else mesh.ordered(axis).group
        for axis in grid.axes_mesh_order
    ]
    with outside_simulation():  # one rank grid, shared by every simulated rank
        root = DeviceMesh.from_group(
            groups, mesh.device_type, mesh=grid.rank_grid(), mesh_dim_names=grid.axes_mesh_order
        )
    _compat.call_groups_by(root, [mesh.traced_name(group) for group in groups], groups)
    return root


def flattened_mesh(mesh: ViewedMesh, key: str, view: Grid | None = None) -> DeviceMesh:
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
        flattened = _compat.flatten_with_group(root, axes, canonical, group, mesh.traced_name(group))
    check_consistent(mesh, flattened, (canonical,))
    if cached:
        mesh.keep_view((canonical,), flattened)
    return flattened


def sliced_mesh(mesh: ViewedMesh, names: tuple[str, ...]) -> DeviceMesh:
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


def check_consistent(mesh: ViewedMesh, view: DeviceMesh, keys: tuple[str, ...]) -> DeviceMesh:
    """Refuse a DeviceMesh whose ranks disagree with the process groups behind it."""
    for dim, key in enumerate(keys):
        in_view, in_group = view_rank(view, dim), group_rank(view.get_group(dim))
        in_layout = mesh.ordered(key).index
        if differs_anywhere(in_view, in_group) or differs_anywhere(in_view, in_layout):
            raise MeshStateError(
                f"DeviceMesh dim {key!r} puts rank {mesh.global_rank} at {in_view}, but its "
                f"process group at {in_group} and the layout at {in_layout}; a "
                "DeviceMesh numbers ranks in mesh order, so the group must list them so too"
            )
    return view
