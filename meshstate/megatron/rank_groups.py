"""megatron-core's rank arithmetic and group helpers: ``RankGenerator``, ``create_group`` and friends.

The rank arithmetic is the layout layer's (:class:`~meshstate.layout.layout.Grid`);
groups are made by :func:`~meshstate.core.groups.create_group_family`, and once
``initialize_model_parallel`` has run they belong to its mesh, so
``destroy_model_parallel`` ends them. Example::

    RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp").get_ranks("dp")
    # [[0, 2], [1, 3], [4, 6], [5, 7]]
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.layout.config import parse_order
from meshstate.errors import AxisError, ConfigError
from meshstate.megatron.errors import ParallelStateError
from meshstate.core.groups import ProcessGroupSet, create_group_family
from meshstate.layout.layout import Chunks, Grid, hierarchical_levels
from meshstate.megatron import derived as families
from meshstate.megatron.facts import served_mesh
from meshstate.megatron.getters import is_initialized, process_group_list

ProcessGroup = dist.ProcessGroup

__all__ = [
    "RankGenerator",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "generate_masked_orthogonal_rank_groups",
    "update_pg_timeout",
]


def _owner() -> ProcessGroupSet | None:
    """Where groups made outside the mesh go so that destroy ends them: the mesh's set."""
    mesh = served_mesh()
    return mesh.process_groups if mesh is not None and is_initialized() else None


def create_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup | None:
    """Create one process group of ``ranks`` (every rank of the world by default).

    Every rank calls it with the same ``ranks``; ranks outside get ``None``.
    Once initialised, the group is destroyed by ``destroy_model_parallel``.
    """
    return create_group_family(
        [range(dist.get_world_size()) if ranks is None else ranks],
        description=group_desc or "group",
        backend=backend,
        timeout=timeout,
        pg_options=pg_options,
        owner=_owner(),
    )


def create_hierarchical_groups(
    rank: int,
    ranks: list[int],
    hierarchical_group_sizes: list[int],
    create_gloo_process_groups: bool = False,
    pg_options: Any = None,
    timeout: timedelta | None = None,
    group_desc: str | None = None,
) -> tuple[list[ProcessGroup], list[ProcessGroup | None]]:
    """Create the hierarchical levels of ``ranks``; return ``rank``'s group per level.

    Level ``i`` groups ranks ``prod(sizes[:i])`` apart. Every rank calls it.
    """
    try:
        levels = hierarchical_levels(ranks, hierarchical_group_sizes)
    except ConfigError as error:
        raise ParallelStateError(str(error)) from None
    per_level = pg_options if isinstance(pg_options, list) else [pg_options] * len(levels)
    groups: list[ProcessGroup] = []
    gloo_groups: list[ProcessGroup | None] = []
    for level, parts in enumerate(levels):
        name = f"HIERARCHICAL_{group_desc}_L{level}"
        group = create_group_family(
            parts, description=name, timeout=timeout, pg_options=per_level[level], owner=_owner()
        )
        gloo_group = create_group_family(
            parts, description=f"{name}_GLOO", backend="gloo", timeout=timeout, owner=_owner()
        ) if create_gloo_process_groups else None
        if group is not None:
            groups.append(group)
            gloo_groups.append(gloo_group)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(
    rank: int, ranks: list[int], pg_options: Any
) -> dict[int, ProcessGroup]:
    """Create hybrid data+context groups of every power-of-two size below ``len(ranks)``."""
    created = {
        size: create_group_family(
            Chunks(size).parts(ranks),
            description=f"HYBRID_DP_CP_GROUP_{size}",
            pg_options=pg_options,
            owner=_owner(),
        )
        for size in families.hybrid_sizes(len(ranks))
    }
    return {size: group for size, group in created.items() if group is not None}


def update_pg_timeout(timeout: timedelta, pg: ProcessGroup | None = None) -> None:
    """Set the timeout of ``pg``, or of every group of the caller, after a barrier."""
    dist.barrier(pg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    targets = [pg] if pg is not None else process_group_list() or [None]
    for group in targets:
        _compat.set_group_timeout(timeout, group)


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """Groups of the masked axes of a grid, first axis fastest, as megatron-core.

    Example: ``generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, True, False])``
    is ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
    """
    if math.prod(parallel_size) != world_size:
        raise ParallelStateError(
            f"parallel sizes {list(parallel_size)} multiply to {math.prod(parallel_size)}, "
            f"not to world size {world_size}"
        )
    if len(mask) != len(parallel_size):
        raise ParallelStateError(
            f"mask {list(mask)} has {len(mask)} entries for {len(parallel_size)} sizes"
        )
    names = tuple(f"axis{i}" for i in range(len(parallel_size)))
    masked = [name for name, keep in zip(names, mask) if keep]
    if not masked:
        return [[rank] for rank in range(world_size)]
    grid = Grid(names, tuple(parallel_size))
    groups: list[list[int]] = grid.groups(grid.mesh_order(masked)).tolist()
    return groups


class RankGenerator:
    """megatron-core's rank generator: groups of any token set of an order string.

    Example: ``RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp").get_ranks("dp")``
    is ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
    """

    # The GTP weight-remat axis (megatron-core 0.19), appended to the order when left out.
    gtp_axis: tuple[str, ...] = ("gtp_remat",)

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0,
        gtp_remat: int = 1,
    ) -> None:
        if ep != 1 and cp != 1:
            raise ParallelStateError(
                f"ep={ep} and cp={cp} are both > 1: one rank generator takes CP (dense layers) "
                "or EP (expert layers), not both"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.name_to_size.update(dict.fromkeys(self.gtp_axis, gtp_remat))
        self.world_size = math.prod(self.name_to_size.values())
        named = order.lower().split("-")
        try:
            axes = list(parse_order("-".join(name for name in named if name not in self.gtp_axis)))
        except ConfigError as error:
            raise AxisError(str(error)) from None
        for name, size in self.name_to_size.items():
            if name not in named and size != 1:
                raise ParallelStateError(
                    f"The size of ({name}) is ({size}), but you haven't specified the order ({order})."
                )
        for gtp in self.gtp_axis:  # where the order names it, else last
            axes.insert(named.index(gtp) if gtp in named else len(axes), gtp)
        self.order = "-".join(axes)
        self.ordered_size = [self.name_to_size[name] for name in axes]
        self._grid = Grid(tuple(axes), tuple(self.ordered_size), rank_offset)

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Which axes of ``order`` the hyphenated ``token`` names."""
        ordered = order.split("-")
        tokens = token.split("-")
        unknown = [t for t in tokens if t not in ordered]
        if unknown:
            raise AxisError(f"token {token!r} names {unknown}, not in order {order!r}")
        return [name in tokens for name in ordered]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group of the axes in ``token`` (e.g. ``"tp-dp"``), megatron-core's order."""
        mask = self.get_mask(self.order, token)
        names = [name for name, keep in zip(self._grid.axes_fastest_first, mask) if keep]
        groups: list[list[int]] = self._grid.groups(self._grid.mesh_order(names)).tolist()
        return groups

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """The GTP weight-remat groups (one rank each when ``gtp_remat_size`` is 1)."""
        if self.name_to_size["gtp_remat"] != gtp_remat_size:
            raise ParallelStateError(f"gtp_remat axis size ({self.name_to_size['gtp_remat']}) != "
                                     f"requested gtp_remat_size ({gtp_remat_size})")
        return self.get_ranks("gtp_remat")
