"""The ``DeviceMesh`` of a :class:`~meshstate.layout.hybrid_grid.HybridGrid`, built by every rank.

The mesh layer's: one process group per axis, created by
:func:`meshstate.core.groups.create_process_groups` (the one place groups are
made), then ``DeviceMesh.from_group`` over them, which creates none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core.arguments import resolve_device_type
from meshstate.errors import ConfigError
from meshstate.core.groups import GroupSpec, ProcessGroupSet, create_process_groups, require_default_group
from meshstate.layout.hybrid_grid import HybridGrid
from meshstate.core.current import track_mesh
from meshstate.core.world import refuse_simulation


@dataclass(eq=False)
class HybridMesh:
    """The calling rank's ``DeviceMesh`` of a :class:`HybridGrid` and the groups behind it;
    :func:`~meshstate.core.current.destroy_every_mesh` destroys it like every mesh."""

    grid: HybridGrid
    device_mesh: DeviceMesh
    process_groups: ProcessGroupSet

    def __post_init__(self) -> None:
        track_mesh(self)

    def destroy(self) -> None:
        """Destroy the process groups this build created; safe to call twice."""
        self.process_groups.destroy()


def init_hybrid_mesh(
    grid: HybridGrid,
    *,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> HybridMesh:
    """Build ``grid``'s ``DeviceMesh`` (dims ``grid.axes_mesh_order``); every rank must call it.

    Creates one group per axis in one :func:`meshstate.core.groups.create_process_groups`
    build and builds the mesh from them (``DeviceMesh.from_group`` creates none).
    ``device_type`` defaults to ``"cuda"`` on an NCCL world and ``"cpu"`` otherwise.

    Example, on rank 9 of 16 with ``HybridGrid(intra={"dp": 2, "tp": 4}, inter={"dp": 2})``::

        hybrid = init_hybrid_mesh(grid)
        hybrid.device_mesh["dp"].mesh.tolist()   # [0, 1, 8, 9]
        hybrid.device_mesh["tp"].mesh.tolist()   # [9, 11, 13, 15]
        hybrid.device_mesh.get_coordinate()      # (0, 3): tp=0, dp=3
        hybrid.destroy()
    """
    require_default_group()
    refuse_simulation("init_hybrid_mesh()")
    if dist.get_world_size() != grid.world_size:
        raise ConfigError(
            f"hybrid grid has {grid.world_size} ranks "
            f"({' '.join(f'{a}={s}' for a, s in zip(grid.axes_fastest_first, grid.sizes))}) "
            f"but the world has {dist.get_world_size()}"
        )
    device_type = resolve_device_type(device_type)
    rank = dist.get_rank()
    specs = [
        GroupSpec(
            axis,
            tuple(sorted(grid.group_ranks(rank, [axis]))),
            functools.partial(_sorted_groups, grid, axis),
        )
        for axis in grid.axes_mesh_order
    ]
    process_groups = create_process_groups(specs, backend=backend, timeout=timeout)
    try:
        device_mesh = DeviceMesh.from_group(
            [process_groups.by_name[axis] for axis in grid.axes_mesh_order],
            device_type,
            mesh=grid.rank_grid(),
            mesh_dim_names=grid.axes_mesh_order,
        )
    except BaseException:
        process_groups.destroy()
        raise
    return HybridMesh(grid, device_mesh, process_groups)


def _sorted_groups(grid: HybridGrid, axis: str) -> list[list[int]]:
    """Every group of ``axis``, each sorted as a process group numbers its members."""
    return [sorted(ranks) for ranks in grid.groups([axis]).tolist()]
