"""What a rank knows of its group over an ordered list of axes (a value, no process group made).

A :class:`~meshstate.core.mesh.ParallelMesh` makes these (``mesh.ordered(axes)``);
the JAX layer and the views read them.

Example, on rank 2 of 8 with ``init_mesh(tp=2, cp=2)`` (so dp=2)::

    group = mesh.ordered(("cp", "dp"))
    group.ranks, group.index     # (0, 4, 2, 6), 2: cp major, dp minor
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from meshstate.core.layout import Key


@dataclass(frozen=True)
class AxisGroup:
    """The calling rank's group of one kind: its global ranks, the caller's
    position in it, and the process group.
    """

    key: Key
    ranks: Sequence[int]
    rank: int
    group: dist.ProcessGroup


@dataclass(frozen=True)
class OrderedGroup:
    """The caller's group over an ordered list of axes.

    ``ranks`` are the global ranks in row-major order of the axes (first axis
    major) and ``index`` the caller's position among them; ``group`` is the
    process group of the same ranks, in which ``ranks[i]`` has group rank
    ``group_ranks[i]``.
    """

    ranks: tuple[int, ...]
    index: int
    group: dist.ProcessGroup
    group_ranks: tuple[int, ...]
    group_name: str
    """``group.group_name``, which torch's traceable collectives take."""
    by_group_rank: tuple[int, ...] | None
    """The axis index of each group rank; ``None`` where they agree (no reordering)."""
