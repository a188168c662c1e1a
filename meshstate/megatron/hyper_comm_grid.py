"""A drop-in for megatron-core's ``HyperCommGrid``, built on meshstate.

``HyperCommGrid(shape, dim_names)`` names the dims of a grid of ranks, the first
dim fastest-varying as in a Megatron order string; ``create_pg(dims)`` creates the
process groups over some of those dims, once per dim set, and ``get_pg(dims)``
returns them later. The rank arithmetic is :class:`meshstate.layout.layout.Grid`; the
groups are created and destroyed by :mod:`meshstate.core.groups` through torch's
``new_subgroups_by_enumeration`` and ``destroy_process_group``, as megatron-core's are.

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

import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate.errors import AxisError, ConfigError, MeshStateError
from meshstate.core.groups import create_enumerated_groups, destroy_groups
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
    """A group this grid created, and what it can be reused for: its family (every group
    of its rank lists) with the same options."""

    family: list[list[int]]
    timeout: timedelta | None
    pg_options: Any
    group: dist.ProcessGroup | None


@dataclass(frozen=True)
class _View:
    """A named factorization of the grid's ranks, and the dims it shares with the base.

    Read as megatron-core's ``_RankViewSpec``: ``name``, and ``shape``, ``dim_names``
    and ``shared_dims`` as new lists.
    """

    name: str
    grid: Grid
    shared: tuple[str, ...]

    @property
    def shape(self) -> list[int]:
        return list(self.grid.sizes)

    @property
    def dim_names(self) -> list[str]:
        return list(self.grid.axes_fastest_first)

    @property
    def shared_dims(self) -> list[str]:
        return list(self.shared)


_BASE_VIEW = "base"


class HyperCommGrid:
    """Ranks ``rank_offset .. rank_offset + prod(shape) - 1`` on named dims.

    ``dim_names`` run fastest-varying first, like the ``order`` of megatron-core's
    ``initialize_model_parallel``: ``HyperCommGrid([2, 3, 4, 5], ["tp", "cp",
    "pp", "dp"])`` has the groups of ``order="tp-cp-pp-dp"`` with tp=2, cp=3,
    pp=4 on 120 ranks. The world size comes from ``WORLD_SIZE`` or, without
    it, from the initialised default group; the grid must fit in it after
    ``rank_offset``. ``backend`` reaches every group the grid creates.

    :meth:`register_view` adds another factorization of the same ranks, which
    ``create_pg``, ``get_pg`` and ``get_rank_enum`` take as ``view=``.

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
        self._grid = Grid(tuple(dim_names), _sizes(shape), rank_offset)
        world_size = _world_size()
        if rank_offset + self.size > world_size:
            raise GridSizeError(
                f"Grid shape {list(shape)} is over sized with world size {world_size} and "
                f"rank offset {rank_offset}: it needs ranks {rank_offset}.."
                f"{rank_offset + self.size - 1}, the world has ranks 0..{world_size - 1}"
            )
        self.backend = backend
        self._views = {_BASE_VIEW: _View(_BASE_VIEW, self._grid, ())}
        # Base groups by their key ("dp-tp"); a view's own by (view, dims in its order).
        self._pgs: dict[str | tuple[str, tuple[str, ...]], dist.ProcessGroup | None] = {}
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

    def register_view(
        self,
        name: str,
        shape: list[int],
        dim_names: list[str],
        shared_dims: list[str] | None = None,
    ) -> None:
        """Register another factorization ``shape``/``dim_names`` of the grid's ranks.

        A dim of ``shared_dims`` is in both views with the same groups; a view's group
        over shared dims only is the base view's. Raises ``ConfigError`` (a
        ``ValueError``, as megatron-core's) naming what does not fit.

        Example: on ``HyperCommGrid([2, 4], ["tp", "dp"])``,
        ``register_view("moe", [2, 2, 2], ["tp", "ep", "edp"], shared_dims=["tp"])``;
        then ``get_rank_enum("ep", view="moe")`` is ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
        """
        if name in self._views:
            raise ConfigError(f"View {name!r} is already registered")
        if len(shape) != len(dim_names):
            raise ConfigError(f"View {name!r}: len(shape) {len(shape)} != len(dim_names) "
                              f"{len(dim_names)}: shape {list(shape)}, dim_names {list(dim_names)}")
        if len(set(dim_names)) != len(dim_names):
            raise ConfigError(f"View {name!r} has duplicate dim_names: {list(dim_names)}")
        if any(not _is_int(size) or size <= 0 for size in shape):
            raise ConfigError(f"View {name!r} shape must be positive ints, got {list(shape)}")
        grid = Grid(tuple(dim_names), _sizes(shape), self.rank_offset)
        if grid.world_size != self.size:
            raise ConfigError(f"View {name!r} shape {list(shape)} has size {grid.world_size}, "
                              f"but the grid size is {self.size}")
        shared = list(shared_dims or ())
        if len(set(shared)) != len(shared):
            raise ConfigError(f"View {name!r} has duplicate shared_dims: {shared}")
        for dims in [*([dim] for dim in shared), *([shared] if len(shared) > 1 else [])]:
            self._check_shared(name, grid, dims)
        self._views[name] = _View(name, grid, tuple(shared))

    def _check_shared(self, name: str, grid: Grid, dims: list[str]) -> None:
        """Refuse shared ``dims`` missing from a view or enumerated differently there."""
        for dim in dims:
            if dim not in self._grid.axes_fastest_first:
                raise ConfigError(f"Shared dim {dim!r} of view {name!r} is not in the base view "
                                  f"{self.dim_names}")
            if dim not in grid.axes_fastest_first:
                raise ConfigError(f"Shared dim {dim!r} of view {name!r} is not in the view's "
                                  f"dim_names {list(grid.axes_fastest_first)}")
        base = self._grid.groups(self._grid.mesh_order(dims)).tolist()
        view = grid.groups(grid.mesh_order(dims)).tolist()
        if base != view:
            shared = f"Shared dim {dims[0]!r} has" if len(dims) == 1 else f"Shared dims {dims} have"
            raise ConfigError(f"{shared} different membership across views: base "
                              f"enumeration {base} != view {name!r} enumeration {view}")

    def create_pg(
        self,
        dims: str | Sequence[str],
        *,
        view: str | None = None,
        timeout: timedelta | None = None,
        pg_options: Any = None,
        group_desc: str | None = None,
    ) -> dist.ProcessGroup | None:
        """Create the groups over ``dims`` (of ``view``, the base view by default); return
        the calling rank's.

        Every rank of the world calls it, in the same order as the other ranks;
        a rank outside the grid gets ``None``. The groups are kept under the key
        of :meth:`_order_dims_for` (``["tp", "dp"]`` and ``["dp", "tp"]`` are one
        key), and a key is created once: asking again raises
        :class:`GroupKeyError` (a ``KeyError``), since the options of the first
        call cannot be compared. Dim sets with the same groups (they differ only
        by size-1 dims, or a view's) asked for with the same ``timeout`` and the
        same ``pg_options`` object share one process group, named by the first
        call's ``group_desc``. Groups are made by
        :func:`~meshstate.core.groups.create_enumerated_groups` (torch's
        ``new_subgroups_by_enumeration``, as megatron-core makes them), and
        :meth:`destroy` ends them.

        Args:
            dims: A dim name or a list of them.
            view: A view of :meth:`register_view`; ``None`` for the base view.
            timeout: Timeout of the groups' collectives.
            pg_options: Backend options, e.g. ``ProcessGroupNCCL.Options``.
            group_desc: Description of the groups (default: the key).

        Example (8 ranks, ``HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])``)::

            grid.create_pg(["cp", "tp"])   # on rank 6: the group of ranks 4, 5, 6, 7
        """
        key, grid, ordered = self._key(dims, view)
        if key in self._pgs:
            raise GroupKeyError(
                f"Process group for dims {_named(key)} has already been created on this grid; "
                f"create_pg runs once per dim set (the options of the first call cannot be "
                f"compared), use get_pg({_call(ordered, key)}) to get it"
            )
        if dist.is_initialized():
            self._check_world()
        family = grid.groups(ordered).tolist()
        same = (done for done in self._created
                if done.family == family and done.timeout == timeout and done.pg_options is pg_options)
        created = next(same, None)
        if created is None:
            group = create_enumerated_groups(
                family, backend=self.backend, timeout=timeout, pg_options=pg_options,
                group_desc=group_desc or _description(key),
            )
            created = _CreatedGroup(family, timeout, pg_options, group)
            self._created.append(created)
        self._pgs[key] = created.group
        return created.group

    def get_pg(self, dims: str | Sequence[str], *, view: str | None = None) -> dist.ProcessGroup | None:
        """The calling rank's group over ``dims`` (of ``view``), made by :meth:`create_pg`.

        ``None`` on a rank outside the grid. Raises :class:`GroupKeyError` (a
        ``KeyError``) if ``create_pg`` has not been called for these dims.

        Example: after ``grid.create_pg(["cp", "dp"])``, ``grid.get_pg(["dp", "cp"])``
        returns the same group.
        """
        key, _, ordered = self._key(dims, view)
        if key not in self._pgs:
            raise GroupKeyError(
                f"Process group for dims {_named(key)} hasn't been created; "
                f"call create_pg({_call(ordered, key)}) first"
            )
        return self._pgs[key]

    def destroy(self) -> None:
        """Destroy the process groups of this grid that the calling rank is in, each once;
        :meth:`create_pg` may then create them again.

        Example: ``grid.create_pg("tp"); grid.destroy(); grid.get_pg("tp")`` raises
        :class:`GroupKeyError`.
        """
        destroy_groups(self._pgs.values())
        self._pgs.clear()
        self._created.clear()

    def is_current_rank_in_grid(self) -> bool:
        """Whether the calling rank is one of the grid's.

        Example: on rank 5, ``HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)`` answers True.
        """
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    def get_rank_enum(
        self, dims: str | Sequence[str], *, view: str | None = None
    ) -> list[list[int]]:
        """Every group over ``dims`` (of ``view``), as :meth:`create_pg` creates them.

        Example: ``HyperCommGrid([2, 2], ["tp", "dp"]).get_rank_enum("dp")`` is
        ``[[0, 2], [1, 3]]``.
        """
        spec = self._view(view)
        ordered, _ = self._order_dims_for(spec.dim_names, dims)
        groups: list[list[int]] = spec.grid.groups(ordered).tolist()
        return groups

    def _gen_rank_enum(self, dims: str | Sequence[str]) -> list[list[int]]:
        """Every group over ``dims`` taken in the order given: the last varies fastest.

        ``create_pg`` passes dims in reversed ``dim_names`` order, which gives
        each group in ascending rank order; another order permutes each group.
        Groups run over the remaining dims, the last dim name outermost.

        Example: ``HyperCommGrid([2, 2, 2], ["a", "b", "c"])._gen_rank_enum(["a", "b"])``
        is ``[[0, 2, 1, 3], [4, 6, 5, 7]]``; with ``["b", "a"]`` it is
        ``[[0, 1, 2, 3], [4, 5, 6, 7]]``.
        """
        groups: list[list[int]] = self._grid.groups(self._checked(dims, self.dim_names)).tolist()
        return groups

    def _order_dims_for(
        self, dim_names: Sequence[str], dims: str | Sequence[str]
    ) -> tuple[list[str], str]:
        """``dims`` in reversed ``dim_names`` order, and the key they are kept under.

        Example: ``_order_dims_for(["tp", "cp", "dp"], ["tp", "dp"])`` is
        ``(["dp", "tp"], "dp-tp")``.
        """
        names = self._checked(dims, dim_names)
        ordered = [name for name in reversed(dim_names) if name in names]
        return ordered, "-".join(ordered)

    def _key(
        self, dims: str | Sequence[str], view: str | None
    ) -> tuple[str | tuple[str, tuple[str, ...]], Grid, list[str]]:
        """The key ``dims`` of ``view`` are kept under, the grid enumerating them, and
        ``dims`` in its mesh order: a view's dims that are all shared are the base's."""
        spec = self._view(view)
        ordered, _ = self._order_dims_for(spec.dim_names, dims)
        if spec.grid is self._grid or all(dim in spec.shared for dim in ordered):
            base_ordered, key = self._order_dims_for(self.dim_names, ordered)
            return key, self._grid, base_ordered
        return (spec.name, tuple(ordered)), spec.grid, ordered

    def _view(self, view: str | None) -> _View:
        spec = self._views.get(_BASE_VIEW if view is None else view)
        if spec is None:
            raise GroupKeyError(f"View {view!r} is not registered. Registered views: {sorted(self._views)}")
        return spec

    def _checked(self, dims: str | Sequence[str], dim_names: Sequence[str]) -> tuple[str, ...]:
        """``dims`` as a tuple, each a distinct name of ``dim_names`` (a view's)."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        valid = ", ".join(dim_names)
        for name in names:
            if name not in dim_names:
                view = next((spec.name for spec in self._views.values()
                             if spec.grid.axes_fastest_first == tuple(dim_names)), None)
                where = f"view {view!r}" if view is not None else f"dim_names {list(dim_names)}"
                raise DimError(f"{name!r} is not in {where} with dims {valid} (asked for {dims!r})")
            if names.count(name) > 1:
                raise DimError(f"dims {list(names)} name {name!r} twice")
        if not names:
            raise DimError(f"a process group needs at least one dim; the dims are {valid}")
        return names

    def _check_world(self) -> None:
        world_size = dist.get_world_size()
        if self.rank_offset + self.size > world_size:
            raise ConfigError(
                f"the grid's ranks {self.rank_offset}..{self.rank_offset + self.size - 1} do "
                f"not fit the initialised world of {world_size} ranks"
            )


def _named(key: str | tuple[str, tuple[str, ...]]) -> str:
    """A group key as messages write it: ``'dp-tp'``, or ``'ep-edp' for view 'moe'``."""
    return repr(key) if isinstance(key, str) else f"{'-'.join(key[1])!r} for view {key[0]!r}"


def _description(key: str | tuple[str, tuple[str, ...]]) -> str:
    """A group key as the groups' description: ``dp-tp``, or ``moe:ep-edp``."""
    return key if isinstance(key, str) else f"{key[0]}:{'-'.join(key[1])}"


def _call(ordered: list[str], key: str | tuple[str, tuple[str, ...]]) -> str:
    """The arguments that ask for ``key`` again: ``['dp', 'tp']``, or ``['ep'], view='moe'``."""
    return repr(ordered) if isinstance(key, str) else f"{ordered!r}, view={key[0]!r}"


def _is_int(size: object) -> bool:
    """An integer of any kind (numpy's too, as megatron-core takes them), not a bool."""
    return isinstance(size, numbers.Integral) and not isinstance(size, bool)


def _sizes(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as Python ints where its sizes are integers of another kind (numpy's);
    anything else is left for :class:`Grid` to refuse."""
    return tuple(int(size) if _is_int(size) else size for size in shape)


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
