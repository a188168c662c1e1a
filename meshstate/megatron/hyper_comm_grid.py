"""A drop-in for megatron-core's ``HyperCommGrid``, built on meshstate.

``HyperCommGrid(shape, dim_names)`` names the dims of a grid of ranks, the first
dim fastest-varying as in a Megatron order string; ``create_pg(dims)`` creates the
process groups over some of those dims, once per dim set, and ``get_pg(dims)``
returns them later. The rank arithmetic is :class:`meshstate.layout.layout.Grid`, and
the groups are created by :func:`meshstate.core.groups.create_group_family`.

Example, as rank 5 of 8 (a fake world: torch's fake backend)::

    >>> import torch.distributed as dist
    >>> from meshstate.testing import fake_world
    >>> with fake_world(5, 8):
    ...     grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    ...     print(grid.get_rank_enum(["dp", "tp"]))
    ...     dp_tp_group = grid.create_pg(["tp", "dp"])
    ...     print(dist.get_process_group_ranks(dp_tp_group))
    ...     print(grid.get_pg(["dp", "tp"]) is dp_tp_group)
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    [0, 1, 4, 5]
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate.errors import AxisError, ConfigError, MeshStateError
from meshstate.core.groups import create_group_family, require_default_group
from meshstate.layout.layout import Grid

__all__ = ["DimError", "GridSizeError", "GroupKeyError", "HyperCommGrid"]


class GridSizeError(MeshStateError, RuntimeError):
    """The world is too small for the grid, or its size cannot be found.

    A ``RuntimeError``, as megatron-core raises in these cases.
    """


class DimError(AxisError, ValueError):
    """A dim list naming a dim the grid does not have, naming one twice, or empty.

    An :class:`~meshstate.errors.AxisError` (so a ``KeyError``) and, as
    megatron-core's lookup of an unknown dim in a list raises, a ``ValueError``.
    """


class GroupKeyError(MeshStateError, KeyError):
    """``create_pg`` for a dim set that has its groups already, or ``get_pg`` before it.

    A ``KeyError``, as megatron-core raises in both cases.
    """

    def __str__(self) -> str:
        # KeyError would print the message repr-quoted; show it as written.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class _CreatedGroup:
    """A group this grid created, and what it can be reused for."""

    axes: tuple[str, ...]
    timeout: timedelta | None
    pg_options: Any
    group: dist.ProcessGroup | None


class HyperCommGrid:
    """Ranks ``rank_offset .. rank_offset + prod(shape) - 1`` on named dims.

    ``dim_names`` run fastest-varying first, like the ``order`` of megatron-core's
    ``initialize_model_parallel``: ``HyperCommGrid([2, 3, 4, 5], ["tp", "cp",
    "pp", "dp"])`` has the groups of ``order="tp-cp-pp-dp"`` with tp=2, cp=3,
    pp=4 on 120 ranks. The world size comes from ``WORLD_SIZE`` or, without
    it, from the initialised default group; the grid must fit in it after
    ``rank_offset``. ``backend`` reaches every group the grid creates.

    Args:
        shape: Size of each dim.
        dim_names: Name of each dim, fastest-varying first.
        rank_offset: First global rank of the grid.
        backend: Backend of the groups; ``None`` for the default group's.

    Example, the grid on ranks 4 to 7 of 8, as rank 5::

        >>> import torch.distributed as dist
        >>> from meshstate.testing import fake_world
        >>> with fake_world(5, 8):
        ...     grid = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
        ...     dist.get_process_group_ranks(grid.create_pg("dp"))
        [5, 7]
    """

    def __init__(
        self,
        shape: Sequence[int],
        dim_names: Sequence[str],
        rank_offset: int = 0,
        backend: str | None = None,
    ) -> None:
        if len(shape) != len(dim_names):
            raise ConfigError(
                f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)}: "
                f"shape {list(shape)}, dim_names {list(dim_names)}"
            )
        self._grid = Grid(tuple(dim_names), tuple(shape), rank_offset)
        world_size = _world_size()
        if rank_offset + self.size > world_size:
            raise GridSizeError(
                f"Grid shape {list(shape)} is over sized with world size {world_size} and "
                f"rank offset {rank_offset}: it needs ranks {rank_offset}.."
                f"{rank_offset + self.size - 1}, the world has ranks 0..{world_size - 1}"
            )
        self.backend = backend
        self._pgs: dict[str, dist.ProcessGroup | None] = {}
        self._created: list[_CreatedGroup] = []

    @property
    def shape(self) -> list[int]:
        """Size of each dim, in ``dim_names`` order."""
        return list(self._grid.sizes)

    @property
    def dim_names(self) -> list[str]:
        """The dim names, fastest-varying first."""
        return list(self._grid.axes_fastest_first)

    @property
    def rank_offset(self) -> int:
        """The grid's first global rank."""
        return self._grid.rank_offset

    @property
    def size(self) -> int:
        """Number of ranks on the grid."""
        return self._grid.world_size

    def create_pg(
        self,
        dims: str | Sequence[str],
        *,
        timeout: timedelta | None = None,
        pg_options: Any = None,
        group_desc: str | None = None,
    ) -> dist.ProcessGroup | None:
        """Create the groups over ``dims``; return the calling rank's.

        Every rank of the world calls it, in the same order as the other ranks;
        a rank outside the grid gets ``None``. The groups are kept under the key
        of :meth:`_order_dims` (``["tp", "dp"]`` and ``["dp", "tp"]`` are one
        key), and a key is created once: asking again raises
        :class:`GroupKeyError` (a ``KeyError``), since the options of the first
        call cannot be compared. Dim sets that differ only by size-1 dims have
        the same groups; asked for with the same ``timeout`` and the same
        ``pg_options`` object, they share one process group, named by the
        first call's ``group_desc``. Groups are made as
        :func:`~meshstate.core.groups.create_group_family` makes them: a group of
        the whole world without options is the default group itself.

        Args:
            dims: A dim name or a list of them.
            timeout: Timeout of the groups' collectives.
            pg_options: Backend options, e.g. ``ProcessGroupNCCL.Options``.
            group_desc: Description of the groups (default: the key).

        Example (8 ranks, ``HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])``)::

            grid.create_pg(["cp", "tp"])   # on rank 6: the group of ranks 4, 5, 6, 7
        """
        ordered, key = self._order_dims(dims)
        if key in self._pgs:
            raise GroupKeyError(
                f"Process group for dims {key!r} has already been created on this grid; "
                f"create_pg runs once per dim set (the options of the first call cannot be "
                f"compared), use get_pg({ordered}) to get it"
            )
        self._check_world()
        axes = tuple(axis for axis in ordered if self._grid.size(axis) > 1)
        same = (done for done in self._created
                if done.axes == axes and done.timeout == timeout and done.pg_options is pg_options)
        created = next(same, None)
        if created is None:
            group = create_group_family(
                self._grid.groups(ordered).tolist(),
                description=group_desc or key,
                backend=self.backend,
                timeout=timeout,
                pg_options=pg_options,
            )
            created = _CreatedGroup(axes, timeout, pg_options, group)
            self._created.append(created)
        self._pgs[key] = created.group
        return created.group

    def get_pg(self, dims: str | Sequence[str]) -> dist.ProcessGroup | None:
        """The calling rank's group over ``dims``, made by :meth:`create_pg`.

        ``None`` on a rank outside the grid. Raises :class:`GroupKeyError` (a
        ``KeyError``) if ``create_pg`` has not been called for these dims.

        Example: after ``grid.create_pg(["cp", "dp"])``, ``grid.get_pg(["dp", "cp"])``
        returns the same group.
        """
        ordered, key = self._order_dims(dims)
        if key not in self._pgs:
            raise GroupKeyError(
                f"Process group for dims {key!r} hasn't been created; "
                f"call create_pg({ordered}) first"
            )
        return self._pgs[key]

    def get_rank_enum(self, dims: str | Sequence[str]) -> list[list[int]]:
        """Every group over ``dims``, as :meth:`create_pg` creates them.

        Example: ``HyperCommGrid([2, 2], ["tp", "dp"]).get_rank_enum("dp")`` is
        ``[[0, 2], [1, 3]]``.
        """
        ordered, _ = self._order_dims(dims)
        return self._gen_rank_enum(ordered)

    def _gen_rank_enum(self, dims: str | Sequence[str]) -> list[list[int]]:
        """Every group over ``dims`` taken in the order given: the last varies fastest.

        ``create_pg`` passes dims in reversed ``dim_names`` order, which gives
        each group in ascending rank order; another order permutes each group.
        Groups run over the remaining dims, the last dim name outermost.

        Example: ``HyperCommGrid([2, 2, 2], ["a", "b", "c"])._gen_rank_enum(["a", "b"])``
        is ``[[0, 2, 1, 3], [4, 6, 5, 7]]``; with ``["b", "a"]`` it is
        ``[[0, 1, 2, 3], [4, 5, 6, 7]]``.
        """
        groups: list[list[int]] = self._grid.groups(self._checked(dims)).tolist()
        return groups

    def _order_dims(self, dims: str | Sequence[str]) -> tuple[list[str], str]:
        """``dims`` in reversed ``dim_names`` order, and the key they are kept under.

        Example: with ``dim_names=["tp", "cp", "dp"]``, ``_order_dims(["tp", "dp"])``
        is ``(["dp", "tp"], "dp-tp")``.
        """
        ordered = list(self._grid.mesh_order(self._checked(dims)))
        return ordered, "-".join(ordered)

    def _checked(self, dims: str | Sequence[str]) -> tuple[str, ...]:
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        valid = ", ".join(self._grid.axes_fastest_first)
        for name in names:
            if name not in self._grid.axes_fastest_first:
                raise DimError(f"unknown dim {name!r} in {dims!r}; the grid's dims are {valid}")
            if names.count(name) > 1:
                raise DimError(f"dims {list(names)} name {name!r} twice")
        if not names:
            raise DimError(f"a process group needs at least one dim; the grid's dims are {valid}")
        return names

    def _check_world(self) -> None:
        require_default_group(ConfigError)
        world_size = dist.get_world_size()
        if self.rank_offset + self.size > world_size:
            raise ConfigError(
                f"the grid's ranks {self.rank_offset}..{self.rank_offset + self.size - 1} do "
                f"not fit the initialised world of {world_size} ranks"
            )


def _world_size() -> int:
    """``WORLD_SIZE`` if set, else the default group's size (megatron-core's rule)."""
    value = os.environ.get("WORLD_SIZE")
    if value is not None:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"WORLD_SIZE={value!r} is not an integer") from None
    if dist.is_initialized():
        return dist.get_world_size()
    raise GridSizeError(
        "cannot determine the world size: WORLD_SIZE is not set and torch.distributed is "
        "not initialized; set WORLD_SIZE or call init_process_group before HyperCommGrid"
    )
