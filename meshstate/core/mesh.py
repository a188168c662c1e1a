"""The mesh: one object holding a rank's process groups and named DeviceMeshes.

``init_mesh`` validates the config, creates the groups this rank belongs to
(see :mod:`meshstate.core.groups`) and assembles from them the dense ``DeviceMesh``
(dims outer to inner: the order string reversed), the expert ``DeviceMesh`` and
the flattened 1-D meshes of Megatron's joint groups. Creating groups takes every
rank, so it all happens inside ``init_mesh``; slicing and flattening a mesh
whose groups exist is local work, so those views are made on first request and
cached.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from datetime import timedelta
from typing import Any, NoReturn, TypeVar, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.core.agreement import agree
from meshstate.core.arguments import (
    check_agree_on,
    check_backend,
    check_device_type,
    check_group_creation,
    check_group_options,
    check_ranks,
    check_sequence,
    check_timeout,
)
from meshstate.core.config import DEFAULT_ORDER, MeshConfig
from meshstate.core.errors import (
    AxisError,
    ConfigError,
    MeshStateError,
    NotInitializedError,
    WrongMeshError,
)
from meshstate.core.groups import (
    GroupCreation,
    GroupOptions,
    GroupSpec,
    ProcessGroupSet,
    create_axis_set_group,
    create_process_groups,
)
from meshstate.core.layout import (
    DENSE_AXES,
    EXPERT_AXES,
    GROUP_KINDS,
    HSDP_AXES,
    HSDP_KINDS,
    DerivedGroup,
    Grid,
    Key,
    ParallelLayout,
    spellings,
    splits_dp,
)

V = TypeVar("V")


class Table(dict[Key, V]):
    """One of a mesh's tables (``rank_in``, ``size_of``, ``group_of``, ``ranks_of``).

    A dict; ``destroy()`` empties it, and from then on a lookup by ``[]`` raises
    the error that names where the mesh was destroyed, so whoever holds the
    table (the Megatron façade does) learns it from the mesh.
    """

    __slots__ = ("destroyed",)

    def __init__(self) -> None:
        super().__init__()
        self.destroyed: str | None = None  # why a lookup fails once the mesh is destroyed

    def __missing__(self, key: Key) -> V:
        if self.destroyed is not None:
            raise NotInitializedError(self.destroyed)
        raise KeyError(key)


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


class Facts:
    """A mesh's tables for its axes and joint keys, read by attribute.

    ``facts.tp_rank`` is ``mesh.rank_in["tp"]``, ``facts.dp_cp_size`` is
    ``mesh.size_of["dp-cp"]`` (a key's ``-`` is ``_``), and likewise ``*_group``
    and ``*_ranks``. Written once, with the tables, when the mesh is made; an
    attribute read costs less than a dict lookup, so code that asks one key
    millions of times (Megatron's getters) reads these.

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)``::

        mesh.facts.tp_rank, mesh.facts.dp_cp_size   # (1, 2)
    """

    def __init__(self, mesh: ParallelMesh) -> None:
        for key in mesh.kinds:
            if key in mesh.group_of:
                name = key.replace("-", "_")
                setattr(self, f"{name}_rank", mesh.rank_in[key])
                setattr(self, f"{name}_size", mesh.size_of[key])
                setattr(self, f"{name}_group", mesh.group_of[key])
                setattr(self, f"{name}_ranks", mesh.ranks_of[key])


class _DestroyedFacts(Facts):
    """A destroyed mesh's ``facts``: every read raises the error naming where.

    Its own class, so a live mesh's facts keep Python's fastest attribute reads
    (a class with ``__getattr__`` loses them).
    """

    destroyed: str

    def __getattr__(self, name: str) -> Any:
        raise NotInitializedError(self.destroyed)


class ParallelMesh:
    """A rank's view of a parallel layout: groups, ranks and DeviceMeshes by axis.

    Build one with :func:`init_mesh`. Keys name one axis (``"tp"``), a
    Megatron joint group (``"dp-cp"``; a set, so ``"cp-dp"`` is the same) or a
    :class:`~meshstate.core.layout.DerivedGroup` declared at init; ``in``, ``len``
    and iteration follow :meth:`keys`. Every query reads a table made at init:
    ``rank_in``, ``size_of``, ``group_of`` and ``ranks_of`` map every spelling of
    every key whose group holds the calling rank to its answer.

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)`` (so dp=2)::

        mesh.ranks("dp")        # (5, 7)
        mesh.rank("tp-dp")      # 1
        mesh.size_of["cp-dp"]   # 2, a dict lookup
        mesh["tp"]              # DeviceMesh([4, 5], mesh_dim_names=("tp",))
        mesh["dp", "tp"]        # 2-D DeviceMesh [[4, 5], [6, 7]]
        mesh.next_rank("pp")    # 1 (the ring wraps around)
        "cp-dp" in mesh         # True
    """

    def __init__(
        self,
        layout: ParallelLayout,
        process_groups: ProcessGroupSet,
        members: Mapping[Key, Sequence[int] | None],
        *,
        device_type: str,
        kinds: tuple[str, ...] = GROUP_KINDS,
        derived: tuple[DerivedGroup, ...] = (),
    ) -> None:
        self.destroyed_at: str | None = None
        self.config = layout.config
        self.layout = layout
        self.device_type = device_type
        self.global_rank = dist.get_rank()
        self._process_groups = process_groups
        self.kinds = kinds
        self.derived = derived
        self._ordered_groups: dict[str | tuple[str, ...], OrderedGroup] = {}
        # Groups made on first use are made one key at a time in this process (threads).
        self._creating = threading.Lock()
        self._creating_axes: dict[tuple[str, ...], threading.Lock] = {}
        # Every spelling of every key -> the key as declared. Spellings are interned, so a
        # lookup by an interned string (as a façade's constants are) matches by identity.
        split_dp = splits_dp(self.keys())  # "dp_replicate-dp_shard" spells "dp" beside HSDP keys
        self._declared: dict[Key, Key] = {
            sys.intern(spelling) if isinstance(spelling, str) else spelling: key
            for key in self.keys()
            for spelling in spellings(key, split_dp=split_dp)
        }
        self.rank_in: Table[int] = Table()
        self.size_of: Table[int] = Table()
        self.group_of: Table[dist.ProcessGroup] = Table()
        self.ranks_of: Table[Sequence[int]] = Table()
        for spelling, key in self._declared.items():
            ranks = members[key]
            if ranks is not None:
                self.rank_in[spelling] = ranks.index(self.global_rank)
                self.size_of[spelling] = len(ranks)
                self.group_of[spelling] = process_groups.by_name[key]
                self.ranks_of[spelling] = ranks
        self.facts = Facts(self)
        self._device_meshes: dict[str | tuple[str, ...], DeviceMesh] = {}
        _live_meshes.add(self)

    @property
    def process_groups(self) -> ProcessGroupSet:
        """The groups this mesh's build made (``destroy()`` ends them)."""
        self._check_alive()
        return self._process_groups

    @cached_property
    def dense(self) -> DeviceMesh:
        """The dense DeviceMesh (dims pp, dp, cp, tp for the default order), made on first use.

        torch builds a DeviceMesh from a rank grid of the whole world, so this
        costs O(world) once; the groups, getters and tables never need it.
        """
        dense = self._root_mesh(self.layout.dense)
        if "expert" in self.__dict__:
            _compat.share_rank_map(dense, self.expert)
        return dense

    @cached_property
    def expert(self) -> DeviceMesh:
        """The expert DeviceMesh (dims pp, edp, ep, etp for the default order), made on first use."""
        expert = self._root_mesh(self.layout.expert)
        if "dense" in self.__dict__:
            _compat.share_rank_map(expert, self.dense)
        return expert

    @cached_property
    def hsdp(self) -> DeviceMesh:
        """The HSDP DeviceMesh (dims pp, dp_replicate, dp_shard, cp, tp for the default
        order, torchtitan's world mesh), made on first use; ``mesh["dp_replicate",
        "dp_shard"]`` slices it for FSDP2's HSDP.
        """
        hsdp = self._root_mesh(self.layout.hsdp)
        if "dense" in self.__dict__:
            _compat.share_rank_map(hsdp, self.dense)
        return hsdp

    def keys(self) -> tuple[Key, ...]:
        """Every group key: the kinds, the declared joint groups, then the derived groups."""
        self._check_alive()
        return self.kinds + self.derived

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is one of :meth:`keys`, in any spelling (``"cp-dp"``)."""
        self._check_alive()
        return isinstance(key, (str, DerivedGroup)) and key in self._declared

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def has_group(self, key: Key) -> bool:
        """Whether the calling rank is in a group of ``key`` (always, for axis keys)."""
        self._check_alive()
        return key in self.group_of

    @property
    def coordinate(self) -> dict[str, int]:
        """The calling rank's position on every dense and expert axis."""
        self._check_alive()
        return self.layout.coordinate(self.global_rank)

    def ordered(self, axes: str | Sequence[str]) -> OrderedGroup:
        """The caller's group over ``axes`` with its ranks in the caller's axis order.

        ``axes`` is one axis, a joint key (mesh order) or a sequence of axes of
        one view, the first major: ``ordered(("cp", "dp")).index == cp * dp_size + dp``.
        A declared key's group serves; any other axis set gets its group on
        first use (only its members take part, as they do in SPMD code), cached
        and destroyed with the mesh; the same axes in another order share it.
        """
        key = axes if isinstance(axes, str) else tuple(axes)
        found = self._ordered_groups.get(key)
        if found is not None:
            return found
        self._check_alive()
        grid, major_to_minor = self.layout.resolve_base(key)
        mesh_axes = grid.mesh_order(major_to_minor)
        # Threads asking for one axis set at once make its group once; others go on beside.
        with self._creating:
            creating = self._creating_axes.setdefault(mesh_axes, threading.Lock())
        with creating:
            ranks = grid.group_ranks(self.global_rank, major_to_minor)
            group = self._axis_set_group(mesh_axes, ranks)
        position = {rank: index for index, rank in enumerate(dist.get_process_group_ranks(group))}
        group_ranks = tuple(position[rank] for rank in ranks)
        in_group_order = group_ranks == tuple(range(len(ranks)))
        found = OrderedGroup(
            ranks=ranks,
            index=ranks.index(self.global_rank),
            group=group,
            group_ranks=group_ranks,
            group_name=group.group_name,
            by_group_rank=None if in_group_order else _inverse(group_ranks),
        )
        self._ordered_groups[key] = found
        return found

    def _axis_set_group(
        self, mesh_axes: tuple[str, ...], ranks: tuple[int, ...]
    ) -> dist.ProcessGroup:
        """The group of a declared key with these axes or these ranks, else a new one."""
        joint = "-".join(mesh_axes)
        if joint in self.group_of:
            return self.group_of[joint]
        members = tuple(sorted(ranks))
        for spelling, declared_ranks in self.ranks_of.items():
            if isinstance(spelling, str) and len(declared_ranks) == len(members):
                if tuple(sorted(declared_ranks)) == members:
                    return self.group_of[spelling]
        return create_axis_set_group(self._process_groups, joint, members)

    def axis_group(self, key: Key) -> AxisGroup:
        """Everything the calling rank knows about its group of ``key``."""
        ranks = self.ranks(key)
        return AxisGroup(self._declared[key], ranks, self.rank_in[key], self.group_of[key])

    def group(self, key: Key) -> dist.ProcessGroup:
        """The process group of ``key`` that the calling rank is in."""
        try:
            return self.group_of[key]
        except KeyError:
            raise self._missing(key) from None

    def rank(self, key: Key) -> int:
        """The calling rank's position in its group of ``key``."""
        try:
            return self.rank_in[key]
        except KeyError:
            raise self._missing(key) from None

    def size(self, key: Key) -> int:
        """Number of ranks in a group of ``key``."""
        try:
            return self.size_of[key]
        except KeyError:
            raise self._missing(key) from None

    def ranks(self, key: Key) -> Sequence[int]:
        """Global ranks of the calling rank's group of ``key``, in group order.

        A sequence equal to the tuple of them; a large group's is kept as strides
        (:class:`~meshstate.core.ranks.Ranks`), so ``[i]``, ``in`` and ``index`` cost no list.
        """
        try:
            return self.ranks_of[key]
        except KeyError:
            raise self._missing(key) from None

    def next_rank(self, key: Key) -> int:
        """Global rank after the caller in its group, wrapping around.

        ``next_rank("pp")`` is the next pipeline stage; ``next_rank("cp")`` is
        where a context-parallel ring sends.
        """
        ranks = self.ranks(key)
        return ranks[(self.rank_in[key] + 1) % len(ranks)]

    def prev_rank(self, key: Key) -> int:
        """Global rank before the caller in its group, wrapping around.

        ``prev_rank("cp")`` is where a context-parallel ring receives from.
        """
        ranks = self.ranks(key)
        return ranks[(self.rank_in[key] - 1) % len(ranks)]

    def first_rank(self, key: Key) -> int:
        """Global rank of the first member of the caller's group."""
        return self.ranks(key)[0]

    def last_rank(self, key: Key) -> int:
        """Global rank of the last member of the caller's group."""
        return self.ranks(key)[-1]

    def is_first(self, key: Key) -> bool:
        """Whether the caller is first in its group (``is_first("pp")``: first stage)."""
        try:
            return self.rank_in[key] == 0
        except KeyError:
            raise self._missing(key) from None

    def is_last(self, key: Key) -> bool:
        """Whether the caller is last in its group (``is_last("pp")``: last stage)."""
        return self.rank(key) == self.size_of[key] - 1

    def __getitem__(self, key: str | tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh by axis name, tuple of axis names, or joint key.

        ``mesh["tp"]`` is 1-D, ``mesh["dp", "cp"]`` is 2-D in mesh order (for
        FSDP2's HSDP), ``mesh["dp-cp"]`` is the flattened 1-D mesh of the joint
        group and ``mesh["dp-cp", "tp"]`` puts it beside a plain axis (any axis
        set flattens, declared or not). Dims follow mesh order: a torch
        DeviceMesh cannot hold them in another, so ``mesh["cp", "dp"]`` raises
        and points to ``P(("cp", "dp"))``. The same request returns the same object.
        """
        cached = self._device_meshes.get(key)  # the request as made: one dict lookup
        if cached is not None:
            return cached
        self._check_alive()
        names = (key,) if isinstance(key, str) else tuple(key)
        if len(names) == 1 and isinstance(names[0], str) and "-" in names[0]:
            mesh = self._flattened(names[0])
        else:
            mesh = self._slice(names)
        self._device_meshes[names] = self._device_meshes[key] = mesh
        return mesh

    def destroy(self) -> None:
        """Destroy the process groups this mesh created; safe to call twice.

        Every later use of the mesh, its tables and ``facts`` (so every Megatron
        getter served by it) raises :class:`~meshstate.core.errors.NotInitializedError`
        naming the line that destroyed it, as does :func:`current_mesh` inside its
        ``with`` block; here it stops being what :func:`set_mesh` set. A default process group that :func:`init_mesh` initialised stays
        (torch cannot form it again under torchrun) until exit or
        ``torch.distributed.destroy_process_group()``.
        """
        if self.destroyed_at is not None:
            return
        self.destroyed_at = _first_caller_outside_meshstate()
        if _current.set_mesh is self:  # no longer this thread's mesh; a `with` block still names it
            _current.set_mesh = None
        self._process_groups.destroy()
        roots = [name for name in ("dense", "expert", "hsdp") if name in self.__dict__]
        if self._device_meshes or roots:
            _compat.forget_sharding_decisions()
        self._device_meshes.clear()
        self._ordered_groups.clear()
        for name in roots:
            del self.__dict__[name]
        for table in (self.rank_in, self.size_of, self.group_of, self.ranks_of):
            table.clear()
            table.destroyed = str(self._destroyed_error())
        self.facts.__dict__.clear()
        self.facts.__class__ = _DestroyedFacts
        self.facts.__dict__["destroyed"] = str(self._destroyed_error())
        _live_meshes.discard(self)

    def __enter__(self) -> ParallelMesh:
        """Make this the current mesh inside a ``with`` block (see :func:`current_mesh`)."""
        self._check_alive()
        _current.entered = (*_current.entered, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        entered = _current.entered
        if entered and entered[-1] is self:
            _current.entered = entered[:-1]

    def __repr__(self) -> str:
        sizes = " ".join(f"{name}={size}" for name, size in self.config.sizes().items())
        return (
            f"ParallelMesh(rank {self.global_rank} of {self.config.world_size}, "
            f"order={self.config.order!r}, {sizes})"
        )

    def _destroyed_error(self) -> NotInitializedError:
        return NotInitializedError(
            f"this mesh was destroyed at {self.destroyed_at}; build a new one with "
            "meshstate.init_mesh"
        )

    def _check_alive(self) -> None:
        if self.destroyed_at is not None:
            raise self._destroyed_error()

    def _missing(self, key: Key) -> MeshStateError:
        """Why the tables lack ``key``: a derived group without the caller, or no such key."""
        if key in self:
            return MeshStateError(f"rank {self.global_rank} is in no {str(key)!r} group")
        valid = ", ".join(map(str, self.keys()))
        return AxisError(f"mesh has no group {str(key)!r}; valid keys are {valid}")

    def _root_mesh(self, grid: Grid) -> DeviceMesh:
        self._check_alive()
        return DeviceMesh.from_group(
            [
                self.group_of[axis] if axis in self.group_of else self.ordered(axis).group
                for axis in grid.mesh_axes
            ],
            self.device_type,
            mesh=grid.rank_grid(),
            mesh_dim_names=grid.mesh_axes,
        )

    def _root(self, grid: Grid) -> DeviceMesh:
        if grid is self.layout.hsdp:
            return self.hsdp
        return self.dense if grid is self.layout.dense else self.expert

    def _flattened(self, key: str, view: Grid | None = None) -> DeviceMesh:
        """The flattened 1-D mesh of ``key``, flattened from ``view``'s root (default: its own)."""
        canonical, grid, axes = self.layout.resolve(key, view)
        if len(axes) == 1:  # "dp_replicate-dp_shard" is the axis dp
            return self[axes[0]]
        cached = view is None or grid is self.layout.resolve(key)[1]
        if cached and (canonical,) in self._device_meshes:
            return self._device_meshes[(canonical,)]
        group = self.ordered(axes).group
        flattened = _compat.flatten_with_group(self._root(grid), axes, canonical, group)
        self._check_consistent(flattened, (canonical,))
        if cached:
            self._device_meshes[(canonical,)] = flattened
        return flattened

    def _slice(self, names: tuple[str, ...]) -> DeviceMesh:
        valid = f"dense axes {DENSE_AXES}, expert axes {EXPERT_AXES}"
        if self.config.dp_replicate > 1:
            valid += f", HSDP axes {HSDP_AXES}"
        for name in names:
            known = isinstance(name, str) and (
                "-" in name or name in DENSE_AXES + EXPERT_AXES + HSDP_AXES
            )
            if not known:
                raise AxisError(f"mesh has no axis {name!r}; valid are {valid}")
        resolved = self.layout.resolve_together(names)
        grids = {id(grid) for _, grid, _ in resolved}
        if len(grids) > 1:
            raise AxisError(f"axes {names} mix dense and expert axes; valid are {valid}")
        root = self._root(resolved[0][1])
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
                self._flattened(canonical, grid)
        keys = tuple(canonical if len(joint) > 1 else joint[0] for canonical, _, joint in resolved)
        view = _compat.slice_with_flattened(root, keys)
        _compat.share_rank_map(view, root)
        return self._check_consistent(view, keys)

    def _check_consistent(self, view: DeviceMesh, keys: tuple[str, ...]) -> DeviceMesh:
        """Refuse a DeviceMesh whose ranks disagree with the process groups behind it."""
        for dim, key in enumerate(keys):
            mesh_rank, group_rank = view.get_local_rank(dim), dist.get_rank(view.get_group(dim))
            layout_rank = self.ordered(key).index
            if mesh_rank != group_rank or mesh_rank != layout_rank:
                raise MeshStateError(
                    f"DeviceMesh dim {key!r} puts rank {self.global_rank} at {mesh_rank}, but its "
                    f"process group at {group_rank} and the layout at {layout_rank}; a "
                    "DeviceMesh numbers ranks in mesh order, so the group must list them so too"
                )
        return view


def _not_a_device_mesh(name: str) -> property:
    def refuse(mesh: ParallelMesh) -> NoReturn:
        mesh._check_alive()
        raise WrongMeshError(
            f"a ParallelMesh is not a torch DeviceMesh (it has no {name!r}); pass one "
            'of its DeviceMeshes: mesh.dense, mesh.expert or a slice such as mesh["dp-cp"]'
        )

    return property(refuse)


# What a DeviceMesh has and a ParallelMesh lacks: asking a ParallelMesh for one is a mix-up
# (torch's fully_shard given a ParallelMesh). WrongMeshError is an AttributeError, so
# hasattr() stays False.
_INSTANCE_ATTRIBUTES = {"device_type"}
for _name in sorted(set(dir(DeviceMesh)) - set(dir(ParallelMesh)) - _INSTANCE_ATTRIBUTES):
    if not _name.startswith("__"):
        setattr(ParallelMesh, _name, _not_a_device_mesh(_name))

class _CurrentMeshes(threading.local):
    """The calling thread's current meshes: what set_mesh() set, under the meshes of the
    `with mesh:` blocks entered. Per thread, as JAX's mesh context is; a thread-local
    rather than a ContextVar because torch.compile traces (and guards on) a thread-local
    attribute, and cannot read a ContextVar.
    """

    def __init__(self) -> None:
        self.set_mesh: ParallelMesh | None = None
        self.entered: tuple[ParallelMesh, ...] = ()


_current = _CurrentMeshes()
# The meshes of this process not destroyed yet, for destroy_every_mesh().
_live_meshes: weakref.WeakSet[ParallelMesh] = weakref.WeakSet()


def destroy_every_mesh() -> None:
    """Destroy every mesh of this process not destroyed yet, and forget the calling
    thread's current meshes.

    For harnesses that run many tests in one process (``meshstate.testing``
    does between tests): whatever a test left alive, Megatron's façade
    included, is gone before the next.
    """
    for mesh in list(_live_meshes):
        mesh.destroy()
    _current.set_mesh, _current.entered = None, ()


def _inverse(permutation: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``permutation``: ``_inverse((2, 0, 1)) == (1, 2, 0)``."""
    inverse = [0] * len(permutation)
    for index, value in enumerate(permutation):
        inverse[value] = index
    return tuple(inverse)


def _first_caller_outside_meshstate() -> str:
    """``file:line`` of the innermost frame of the calling stack outside meshstate."""
    package = os.path.dirname(os.path.dirname(__file__)) + os.sep  # meshstate/, not core/
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
    return "an unknown place" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def require_parallel_mesh(mesh: object, where: str) -> ParallelMesh:
    """``mesh`` if it is a :class:`ParallelMesh`, else a ``WrongMeshError`` naming ``where``.

    Example: ``require_parallel_mesh(mesh["tp"], "psum(mesh=...)")`` raises
    ``psum(mesh=...) takes a meshstate ParallelMesh, got DeviceMesh; ...``.
    """
    if isinstance(mesh, ParallelMesh):
        return mesh
    raise WrongMeshError(
        f"{where} takes a meshstate ParallelMesh, got {type(mesh).__name__}; pass the mesh "
        "that meshstate.init_mesh returned (its DeviceMeshes, such as mesh[\"tp\"], are for "
        "torch's own APIs)"
    )


def set_mesh(mesh: ParallelMesh | None) -> None:
    """Make ``mesh`` the current mesh outside any ``with mesh:`` block (``None`` clears it).

    Like ``with mesh:``, it holds for the calling thread (a thread-local value,
    which ``torch.compile`` guards on): a new thread starts with no current mesh.

    Example::

        meshstate.set_mesh(meshstate.init_mesh(tp=2))
        meshstate.current_mesh().size("tp")   # 2
    """
    _current.set_mesh = None if mesh is None else require_parallel_mesh(mesh, "set_mesh()")


def current_mesh() -> ParallelMesh:
    """The innermost mesh of a ``with mesh:`` block, else the one :func:`set_mesh` set.

    Both are per thread. Where that mesh was destroyed, the error names the
    line that did it. ``initialize_model_parallel`` sets its mesh too.
    """
    for mesh in reversed((_current.set_mesh, *_current.entered)):
        if mesh is not None:
            mesh._check_alive()
            return mesh
    raise NotInitializedError(
        "there is no current mesh in this thread; call meshstate.set_mesh(mesh) or use "
        "`with mesh:` on the ParallelMesh from meshstate.init_mesh (a torch DeviceMesh's "
        "`with` does not count)"
    )


@overload
def init_mesh(
    order: str = ...,
    *,
    tp: int = ...,
    cp: int = ...,
    ep: int = ...,
    etp: int | None = ...,
    pp: int = ...,
    dp_replicate: int = ...,
    device_type: str | None = ...,
    backend: str | None = ...,
    timeout: timedelta | None = ...,
    joint_groups: Sequence[str] = ...,
    derived: Sequence[DerivedGroup] = ...,
    group_options: Mapping[Key, GroupOptions] | None = ...,
    agree_on: Mapping[str, object] | None = ...,
    group_creation: GroupCreation | None = ...,
    ranks: None = ...,
) -> ParallelMesh: ...


@overload
def init_mesh(
    order: str = ...,
    *,
    tp: int = ...,
    cp: int = ...,
    ep: int = ...,
    etp: int | None = ...,
    pp: int = ...,
    dp_replicate: int = ...,
    device_type: str | None = ...,
    backend: str | None = ...,
    timeout: timedelta | None = ...,
    joint_groups: Sequence[str] = ...,
    derived: Sequence[DerivedGroup] = ...,
    group_options: Mapping[Key, GroupOptions] | None = ...,
    agree_on: Mapping[str, object] | None = ...,
    group_creation: GroupCreation | None = ...,
    ranks: Sequence[int],
) -> ParallelMesh | None: ...


def init_mesh(
    order: str = DEFAULT_ORDER,
    *,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    pp: int = 1,
    dp_replicate: int = 1,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    joint_groups: Sequence[str] = (),
    derived: Sequence[DerivedGroup] = (),
    group_options: Mapping[Key, GroupOptions] | None = None,
    agree_on: Mapping[str, object] | None = None,
    group_creation: GroupCreation | None = None,
    ranks: Sequence[int] | None = None,
) -> ParallelMesh | None:
    """Build the calling rank's :class:`ParallelMesh`; every rank must call it.

    Uses the initialised default process group, or initialises one from the
    torchrun environment (NCCL when CUDA is available, else gloo). ``dp`` is
    inferred from the world size and ``etp`` defaults to ``tp``. ``dp_replicate``
    splits ``dp`` for FSDP2's HSDP into ``dp_replicate`` (outer) x ``dp_shard``
    (inner), torchtitan's layout: with ``dp_replicate > 1`` the mesh has the keys
    ``"dp_replicate"``, ``"dp_shard"`` and ``"dp_shard-cp"`` (``joint_groups``
    declares them, or others such as ``"dp_replicate-cp"``, at any size), and
    ``"dp_replicate-dp_shard"`` is ``"dp"`` in every spelling. ``backend``
    and ``timeout`` reach every group created; ``device_type`` defaults to
    ``"cuda"`` on an NCCL world and ``"cpu"`` otherwise. ``joint_groups``
    declares joint groups beyond Megatron's (e.g. ``"cp-pp"``); ``derived``
    adds groups carved out of them (:class:`~meshstate.core.layout.DerivedGroup`
    values, e.g. the hierarchical levels of ``cp``); ``group_options`` sets
    backend and options per key; ``group_creation`` forces ``"split"`` or
    ``"local"`` group creation (default: split where the backend can, see
    :mod:`meshstate.core.groups`). ``ranks`` (a ``range`` or a list of
    increasing ranks, consecutive or not) builds the mesh over those ranks only,
    local rank ``i`` of the layout on global rank ``ranks[i]``, its groups
    member-local; the other ranks get ``None`` and may build meshes of their
    own beside it, over interleaved ranks too.

    First every rank agrees on these arguments (and ``agree_on``, for callers
    with more to agree on) through the store, within ``timeout`` (torch's
    default when ``None``): a rank with different arguments makes every rank
    raise :class:`~meshstate.core.errors.ConfigMismatchError`, a rank that never
    arrives a :class:`~meshstate.core.errors.MeshTimeoutError` naming it.

    Example (``torchrun --nproc-per-node 8``)::

        mesh = meshstate.init_mesh(tp=2, cp=2, pp=2, ep=2, etp=1)
        mesh["dp-cp"]   # what FSDP2 shards over
        hsdp = meshstate.init_mesh(tp=2, dp_replicate=2)
        hsdp["dp_replicate", "dp_shard"]   # on rank 5: [[1, 3], [5, 7]]
        evens = meshstate.init_mesh(tp=2, ranks=[0, 2, 4, 6])  # None on odd ranks
    """
    backend = check_backend("backend", backend)
    timeout = check_timeout(timeout)
    device_type = check_device_type(device_type)
    joint_groups = check_sequence("joint_groups", joint_groups, str)
    derived = check_sequence("derived", derived, DerivedGroup)
    group_options = check_group_options(group_options)
    agree_on = check_agree_on(agree_on)
    group_creation = check_group_creation(group_creation)
    _init_default_group_from_env(backend, timeout)
    span = check_ranks(ranks, dist.get_world_size())
    world = span or range(dist.get_world_size())
    layout = ParallelLayout(
        MeshConfig(
            len(world), order=order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp,
            dp_replicate=dp_replicate,
        ),
        rank_offset=world.start if isinstance(world, range) else 0,
        ranks=None if isinstance(world, range) else world,
    )
    kinds, declared = _declared_keys(layout, joint_groups, derived)
    options = _options_by_key(layout, kinds + declared, group_options)
    rank = dist.get_rank()
    if span is not None and rank not in span:
        return None
    config = layout.config
    build_id = agree(
        {
            "order": config.order, "tp": config.tp, "cp": config.cp, "ep": config.ep,
            "etp": etp if etp is None else config.etp, "pp": config.pp,
            "dp_replicate": config.dp_replicate, "device_type": device_type, "backend": backend,
            "timeout": None if timeout is None else timeout.total_seconds(),
            "joint_groups": list(joint_groups),
            "derived": [str(spec) for spec in derived],
            "group_options": {
                str(key): [value.backend, value.pg_options is not None, value.separate]
                for key, value in group_options.items()
            },
            "group_creation": group_creation,
            "ranks": None if span is None else (
                [span.start, span.stop] if isinstance(span, range) else list(span)
            ),
            **agree_on,
        },
        timeout=timeout or _compat.default_timeout(str(dist.get_backend())),
        ranks=span,
    )
    members = {key: layout.members(rank, key) for key in kinds + declared}
    specs = [
        GroupSpec(key, ranks, partial(layout.every_group, key), options[key])
        for key, ranks in members.items()
    ]
    process_groups = create_process_groups(
        specs, backend=backend, timeout=timeout, build_id=build_id,
        group_creation="local" if span is not None else group_creation,
    )
    return ParallelMesh(
        layout,
        process_groups,
        members,
        device_type=device_type or ("cuda" if "nccl" in str(dist.get_backend()) else "cpu"),
        kinds=kinds,
        derived=declared,
    )


def _declared_keys(
    layout: ParallelLayout, joint_groups: Sequence[str], derived: Sequence[DerivedGroup]
) -> tuple[tuple[str, ...], tuple[DerivedGroup, ...]]:
    """The kinds with the joint groups, and the derived groups, spelled canonically."""
    joints = dict.fromkeys(map(layout.canonical, joint_groups))
    base_kinds = GROUP_KINDS + (HSDP_KINDS if layout.config.dp_replicate > 1 else ())
    kinds = base_kinds + tuple(key for key in joints if key not in base_kinds)
    declared: list[DerivedGroup] = []
    for spec in derived:
        base = layout.canonical(spec.base) if isinstance(spec.base, str) else spec.base
        canonical = replace(spec, base=base)
        layout.resolve_base(canonical.base)
        if canonical.lookup in {other.lookup for other in declared}:
            raise ConfigError(f"derived group {str(spec)!r} is declared twice")
        declared.append(canonical)
    return kinds, tuple(declared)


def _options_by_key(
    layout: ParallelLayout, keys: tuple[Key, ...], given: Mapping[Key, GroupOptions]
) -> dict[Key, GroupOptions]:
    """Each key's group options: ``given`` (in any spelling) with a derived group's own backend."""
    split_dp = splits_dp(keys)
    canonical = {
        spelling: key for key in keys for spelling in spellings(key, split_dp=split_dp)
    }
    unknown = [str(key) for key in given if key not in canonical]
    if unknown:
        raise ConfigError(
            f"group_options names {unknown}, which are not keys of the mesh: "
            f"{', '.join(map(str, keys))}"
        )
    by_key = {canonical[key]: value for key, value in given.items()}
    options = {}
    for key in keys:
        chosen = by_key.get(key, GroupOptions())
        if isinstance(key, DerivedGroup):
            backend, separate = key.backend or chosen.backend, key.separate or chosen.separate
            chosen = replace(chosen, backend=backend, separate=separate)
        options[key] = chosen
    return options


def _init_default_group_from_env(backend: str | None, timeout: timedelta | None) -> None:
    """Initialise the default group from the torchrun environment unless one exists.

    It stays until exit, or until ``torch.distributed.destroy_process_group()``:
    under torchrun a second ``init_process_group`` meets the first one's keys in
    the agent's store and cannot connect, so a mesh destroyed and built again
    must find this one.
    """
    if dist.is_initialized():
        return
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise MeshStateError(
            "torch.distributed is not initialized and the torchrun environment is missing "
            f"{', '.join(missing)}; call torch.distributed.init_process_group first or "
            "launch with torchrun"
        )
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), timeout=timeout)
    atexit.register(_destroy_default_group, _compat.default_group())


def _destroy_default_group(group: dist.ProcessGroup) -> None:
    """At exit: destroy the default group ``init_mesh`` made, if it is still the default."""
    if dist.is_initialized() and _compat.default_group() is group:
        dist.destroy_process_group()
