"""What a rank knows of its group over an ordered list of axes (a value, no process group made).

A :class:`~meshstate.core.mesh.ParallelMesh` makes these (``mesh.ordered(axes)``);
the JAX layer and the views read them.

Example, on rank 2 of 8 with ``init_mesh(tp=2, cp=2)`` (so dp=2)::

    group = mesh.ordered(("cp", "dp"))
    group.ranks, group.index     # (0, 4, 2, 6), 2: cp major, dp minor
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from meshstate.errors import ArgumentTypeError


@dataclass(frozen=True)
class OrderedGroup:
    """The caller's group over an ordered list of axes.

    ``ranks`` are the global ranks in row-major order of the axes (first axis
    major) and ``index`` the caller's position among them; ``group`` is the
    process group of the same ranks, in which ``ranks[i]`` has group rank
    ``group_rank_at[i]``.
    """

    ranks: tuple[int, ...]
    index: int
    group: dist.ProcessGroup
    group_rank_at: tuple[int, ...]
    group_name: str
    """The name torch's traceable collectives call ``group`` by: on every rank the same where
    the mesh gave its groups names alike (``ProcessGroupSet.name_for_every_rank``)."""
    by_group_rank: tuple[int, ...] | None
    """The axis index of each group rank; ``None`` where they agree (no reordering)."""

    @classmethod
    def of(
        cls, ranks: tuple[int, ...], caller: int, group: dist.ProcessGroup,
        group_name: str | None = None,
    ) -> OrderedGroup:
        """``caller``'s group ``group`` over the axis-ordered ``ranks``, called ``group_name``
        in traced graphs (default: its own name).

        Example: ``OrderedGroup.of((0, 4, 2, 6), 2, group).group_rank_at`` is
        ``(0, 2, 1, 3)`` for a group of ranks 0, 2, 4 and 6.
        """
        position = {rank: index for index, rank in enumerate(dist.get_process_group_ranks(group))}
        group_rank_at = tuple(position[rank] for rank in ranks)
        by_group_rank = [0] * len(ranks)
        for index, group_rank in enumerate(group_rank_at):
            by_group_rank[group_rank] = index
        return cls(
            ranks=ranks, index=ranks.index(caller), group=group, group_rank_at=group_rank_at,
            group_name=group.group_name if group_name is None else group_name,
            by_group_rank=None if group_rank_at == tuple(range(len(ranks))) else tuple(by_group_rank),
        )

    @classmethod
    def in_group_order(cls, group: dist.ProcessGroup) -> OrderedGroup:
        """The caller's group ``group`` in its own rank order (axis index = group rank).

        Example: for a group of ranks 1 and 3, on rank 3 ``ranks`` is ``(1, 3)`` and
        ``index`` 1.
        """
        ranks = tuple(dist.get_process_group_ranks(group))
        return cls(
            ranks=ranks, index=dist.get_rank(group), group=group,
            group_rank_at=tuple(range(len(ranks))), group_name=group.group_name, by_group_rank=None,
        )


def axis_tuple(axes: object) -> tuple[str, ...]:
    """``axes`` (a sequence of axis names) as a tuple, else an ArgumentTypeError."""
    if isinstance(axes, (tuple, list)) and all(isinstance(axis, str) for axis in axes):
        return tuple(axes)
    raise ArgumentTypeError(f"axes must be an axis name or a tuple of axis names, got {axes!r}")
