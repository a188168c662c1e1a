"""``ParallelMesh``: a rank's process groups by key, their tables, the DeviceMeshes made
from them on first use, and the calling thread's current mesh.

:func:`~meshstate.core.build.init_mesh` and :func:`~meshstate.core.adopt.adopt`
create the groups of every declared key and hand them to a ``ParallelMesh``,
which keeps them in private tables (answered by ``rank``, ``size``, ``group`` and
``ranks``) and their facts (the same, by attribute). Everything else is made on first request and cached:
the dense, expert and HSDP root DeviceMeshes (O(world) each, which the tables
never need), their slices and flattened joint meshes (local work once the
groups exist), and, by :meth:`ParallelMesh.ordered`, the group of an axis set no
key declared (only its members take part). Which mesh a call uses (``with mesh:``,
``set_mesh``, per thread) is :mod:`meshstate.core.which_mesh`'s.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.layout.config import MeshConfig
from meshstate.errors import AxisError, MeshStateError, NotInitializedError
from meshstate.core.groups import ProcessGroupSet, create_axis_set_group
from meshstate.layout.layout import GROUP_KINDS, DerivedGroup, Grid, Key, MeshLayout, spellings, splits_dp
from meshstate.core.world import outside_simulation, process_rank, simulated_ranks, simulation
from meshstate.core.ordered import OrderedGroup, axis_tuple
from meshstate.core.facts import MeshTables, TableView
from meshstate.core.current import (
    CurrentMeshes, current as _current, first_caller_outside_meshstate, forget_mesh, track_mesh,
)
from meshstate.core.views import DeviceMeshOnly, build_root_mesh, flattened_mesh, sliced_mesh

current: CurrentMeshes[ParallelMesh] = _current
"""The calling thread's current meshes (set_mesh's, then the `with mesh:` blocks')."""


class ParallelMesh:
    """A rank's view of a parallel layout: groups, ranks and DeviceMeshes by axis.

    Build one with :func:`init_mesh`. Keys name one axis (``"tp"``), a
    Megatron joint group (``"dp-cp"``; a set, so ``"cp-dp"`` is the same) or a
    :class:`~meshstate.layout.layout.DerivedGroup` declared at init; ``in``, ``len``
    and iteration follow :meth:`keys`. Every query is one lookup in a private table
    made at init, which maps every spelling of every key whose group holds the
    calling rank to its answer. :meth:`rank` is the one way to ask a position
    (``axis_index`` inside SPMD code).

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)`` (so dp=2)::

        mesh.ranks("dp")        # (5, 7)
        mesh.rank("tp-dp")      # 1
        mesh.rank(("dp", "tp")) # 2: any axis tuple, the first axis major
        mesh.size("cp-dp")      # 2, a dict lookup
        mesh["tp"]              # DeviceMesh([4, 5], mesh_dim_names=("tp",))
        mesh["dp", "tp"]        # 2-D DeviceMesh [[4, 5], [6, 7]]
        mesh.next_rank("pp")    # 1 (the ring wraps around)
        "cp-dp" in mesh         # True
    """

    # What torch's APIs and people reach for on a DeviceMesh, which a ParallelMesh is not
    # (torch's own `device_type` and `size` it has, meaning the same). The public
    # DeviceMesh API, then the private names torch's fully_shard, distribute_tensor,
    # DTensor and parallelize_module read first.
    mesh = DeviceMeshOnly()
    mesh_dim_names = DeviceMeshOnly()
    ndim = DeviceMeshOnly()
    shape = DeviceMeshOnly()
    get_group = DeviceMeshOnly()
    get_all_groups = DeviceMeshOnly()
    get_coordinate = DeviceMeshOnly()
    get_local_rank = DeviceMeshOnly()
    get_rank = DeviceMeshOnly()
    _flatten = DeviceMeshOnly()
    _unflatten = DeviceMeshOnly()
    _get_root_mesh = DeviceMeshOnly()
    _get_mesh_dim_by_name = DeviceMeshOnly()
    _is_current_rank_part_of_mesh = DeviceMeshOnly()
    _sym_get_coordinate = DeviceMeshOnly()

    def __init__(
        self,
        layout: MeshLayout,
        process_groups: ProcessGroupSet,
        members: Mapping[Key, Sequence[int] | None],
        *,
        device_type: str,
        kinds: tuple[str, ...] = GROUP_KINDS,
        derived: tuple[DerivedGroup, ...] = (),
    ) -> None:
        self.destroyed_at: str | None = None
        self.built_at = first_caller_outside_meshstate()
        """``file:line`` of the call that built this mesh, outside meshstate."""
        self.layout = layout
        self.device_type = device_type
        self._rank = process_rank()  # whose groups this process holds (rank 0 when simulating)
        self._process_groups = process_groups
        self.kinds = kinds
        self.derived = derived
        self._ordered_groups: dict[str | tuple[str, ...], OrderedGroup] = {}
        self._rank_free_groups: dict[str | tuple[str, ...], OrderedGroup] = {}
        """Simulated, the process rank's groups: what a graph every rank runs is traced with
        (its rank-dependent values are read when it runs)."""
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
        # The groups this process holds and their members (rank 0's in a simulated world),
        # which groups made on first use start from.
        self._own_group_of: dict[Key, dist.ProcessGroup] = {}
        self._own_ranks_of: dict[Key, Sequence[int]] = {}
        for spelling, key in self._declared.items():
            ranks = members[key]
            if ranks is not None:
                self._own_group_of[spelling] = process_groups.by_name[key]
                self._own_ranks_of[spelling] = ranks
        self.simulated = simulated_ranks()
        """The ranks of the simulated world this mesh answers for, each its own; ``None``
        in a process, which is one rank."""
        self.global_rank, self._rank_in, self._size_of, self._group_of, self._ranks_of = (
            self._process_tables() if self.simulated is None else simulation().tables(
                layout, self.keys(), self._declared, self._own_group_of, self.simulated
            )
        )
        self.tables = MeshTables(
            TableView(self._rank_in, self.check_alive), TableView(self._size_of, self.check_alive),
            TableView(self._group_of, self.check_alive), TableView(self._ranks_of, self.check_alive),
        )
        """The four tables, read-only: each spelling of each key whose group holds the
        calling rank -> its answer (``tables.rank["dp-cp"]`` is ``mesh.rank("dp-cp")``)."""
        self._device_meshes: dict[str | tuple[str, ...], DeviceMesh] = {}
        self._roots: dict[str, DeviceMesh] = {}  # "dense", "expert", "hsdp" -> made on first use
        self.store: dict[Hashable, Any] = {}
        """What the layers above compute from this mesh (shard_map and reshard plans, the
        Megatron façade's facts), by a key of their own; ``destroy()`` calls ``forget``
        on the entries that have one, then empties it."""
        self.traced = SimpleNamespace()
        """The store's entries a traced program reads, each as an attribute named by the
        layer that keeps it: ``torch.compile`` reads an attribute as it is when read, a
        dict as it was when the trace first read it (an entry kept since, missing)."""
        track_mesh(self)

    def _process_tables(
        self,
    ) -> tuple[int, dict[Key, int], dict[Key, int], dict[Key, dist.ProcessGroup],
               dict[Key, Sequence[int]]]:
        """The calling process's rank and its four tables: positions and sizes of the
        groups it holds (plain dicts: a query is one dict lookup)."""
        rank_in: dict[Key, int] = {}
        size_of: dict[Key, int] = {}
        for spelling, ranks in self._own_ranks_of.items():
            rank_in[spelling] = ranks.index(self._rank)
            size_of[spelling] = len(ranks)
        return self._rank, rank_in, size_of, self._own_group_of, self._own_ranks_of

    @property
    def config(self) -> MeshConfig:
        """The Megatron config of an ``init_mesh`` mesh (a ``make_mesh`` mesh has none)."""
        return self.layout.config

    @property
    def process_groups(self) -> ProcessGroupSet:
        """The groups this mesh's build made (``destroy()`` ends them)."""
        self.check_alive()
        return self._process_groups

    @property
    def dense(self) -> DeviceMesh:
        """The dense DeviceMesh (dims pp, dp, cp, tp for the default order), made on first use.

        torch builds a DeviceMesh from a rank grid of the whole world, so this
        costs O(world) once; the groups, getters and tables never need it.
        """
        return self._roots.get("dense") or self._made_root("dense")

    @property
    def expert(self) -> DeviceMesh:
        """The expert DeviceMesh (dims pp, edp, ep, etp for the default order), made on first use."""
        return self._roots.get("expert") or self._made_root("expert")

    @property
    def hsdp(self) -> DeviceMesh:
        """The HSDP DeviceMesh (dims pp, dp_replicate, dp_shard, cp, tp for the default
        order, torchtitan's world mesh), made on first use; ``mesh["dp_replicate",
        "dp_shard"]`` slices it for FSDP2's HSDP.
        """
        return self._roots.get("hsdp") or self._made_root("hsdp")

    def _made_root(self, name: str) -> DeviceMesh:
        """Build the root DeviceMesh of the view ``name``, holding the rank map of a root
        made before it where the maps are equal (one world-sized map, not three).

        Kept in a table made at init: an attribute added to the mesh later would cost
        every query its fast attribute read (CPython's instance layout).
        """
        self.check_alive()
        root = build_root_mesh(self, getattr(self.layout, name))
        for made in self._roots.values():
            _compat.share_rank_map(root, made)
            break
        self._roots[name] = root
        return root

    def root_of(self, grid: Grid) -> DeviceMesh:
        """The root DeviceMesh of one of the layout's views: ``dense``, ``expert`` or ``hsdp``."""
        root: DeviceMesh = getattr(self, self.layout.view_name(grid))
        return root

    def keys(self) -> tuple[Key, ...]:
        """Every group key: the kinds, the declared joint groups, then the derived groups."""
        self.check_alive()
        return self.kinds + self.derived

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is one of :meth:`keys`, in any spelling (``"cp-dp"``)."""
        self.check_alive()
        return isinstance(key, (str, DerivedGroup)) and key in self._declared

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def has_group(self, key: Key) -> bool:
        """Whether the calling rank is in a group of ``key`` (always, for axis keys)."""
        self.check_alive()
        return key in self._group_of

    @property
    def coordinate(self) -> dict[str, int]:
        """The calling rank's position on every axis of the layout."""
        self.check_alive()
        if self.simulated is None:
            return self.layout.coordinate(self.global_rank)
        return simulation().coordinate(self.layout, self.simulated)

    def traced_name(self, group: dist.ProcessGroup) -> str:
        """The name a traced graph calls ``group`` (one of this mesh's) by: the same on
        every rank where the mesh could name its groups alike (not in threads)."""
        return self._process_groups.traced_name(group)

    def ordered(self, axes: str | Sequence[str]) -> OrderedGroup:
        """The caller's group over ``axes`` with its ranks in the caller's axis order.

        ``axes`` is one axis, a joint key (mesh order) or a sequence of axes of
        one view, the first major: ``ordered(("cp", "dp")).index == cp * dp_size + dp``.
        A declared key's group serves; any other axis set gets its group on
        first use (only its members take part, as they do in SPMD code), cached
        and destroyed with the mesh; the same axes in another order share it.
        """
        key = axes if isinstance(axes, str) else axis_tuple(axes)
        # Simulated and traced: one graph every rank runs, traced with the process rank's group.
        every_rank = self.simulated is not None and _compat.tracing()
        found = (self._rank_free_groups if every_rank else self._ordered_groups).get(key)
        if found is not None:
            return found
        self.check_alive()
        grid, major_to_minor = self.layout.resolve_base(key)
        mesh_axes = grid.mesh_order(major_to_minor)
        # Threads asking for one axis set at once make its group once; others go on beside.
        with self._creating:
            creating = self._creating_axes.setdefault(mesh_axes, threading.Lock())
        with creating:
            ranks = grid.group_ranks(self._rank, major_to_minor)
            group = self._axis_set_group(mesh_axes, ranks)
        found = OrderedGroup.of(ranks, self._rank, group, self.traced_name(group))
        if self.simulated is not None:
            self._rank_free_groups[key] = found
            with outside_simulation():
                groups = grid.groups(major_to_minor).tolist()
            found = simulation().ordered("-".join(major_to_minor), found, groups)
        self._ordered_groups[key] = found
        return self._rank_free_groups[key] if every_rank else found

    def _axis_set_group(
        self, mesh_axes: tuple[str, ...], ranks: tuple[int, ...]
    ) -> dist.ProcessGroup:
        """The group of a declared key with these axes or these ranks, else a new one."""
        joint = "-".join(mesh_axes)
        if joint in self._own_group_of:
            return self._own_group_of[joint]
        members = tuple(sorted(ranks))
        for spelling, declared_ranks in self._own_ranks_of.items():
            if isinstance(spelling, str) and len(declared_ranks) == len(members):
                if tuple(sorted(declared_ranks)) == members:
                    return self._own_group_of[spelling]
        return create_axis_set_group(self._process_groups, joint, members)

    def group(self, key: Key) -> dist.ProcessGroup:
        """The process group of ``key`` that the calling rank is in."""
        try:
            return self._group_of[key]
        except KeyError:
            raise self._missing(key) from None

    def rank(self, key: Key | tuple[str, ...]) -> int:
        """The calling rank's position in its group of ``key``, or along a tuple of axes
        of one view, the first major (``rank(("cp", "dp")) == cp * dp_size + dp``)."""
        try:
            return self._rank_in[key]  # type: ignore[index]  # a tuple is never a key: KeyError
        except KeyError:
            if isinstance(key, tuple):
                return self.ordered(key).index
            raise self._missing(key) from None

    def size(self, key: Key) -> int:
        """Number of ranks in a group of ``key``."""
        try:
            return self._size_of[key]
        except KeyError:
            raise self._missing(key) from None

    def ranks(self, key: Key) -> Sequence[int]:
        """Global ranks of the calling rank's group of ``key``, in group order.

        A sequence equal to the tuple of them; a large group's is kept as strides
        (:class:`~meshstate.layout.ranks.Ranks`), so ``[i]``, ``in`` and ``index`` cost no list.
        """
        try:
            return self._ranks_of[key]
        except KeyError:
            raise self._missing(key) from None

    def next_rank(self, key: Key) -> int:
        """Global rank after the caller in its group, wrapping around.

        ``next_rank("pp")`` is the next pipeline stage; ``next_rank("cp")`` is
        where a context-parallel ring sends.
        """
        ranks = self.ranks(key)
        return ranks[(self._rank_in[key] + 1) % len(ranks)]

    def prev_rank(self, key: Key) -> int:
        """Global rank before the caller in its group, wrapping around.

        ``prev_rank("cp")`` is where a context-parallel ring receives from.
        """
        ranks = self.ranks(key)
        return ranks[(self._rank_in[key] - 1) % len(ranks)]

    def first_rank(self, key: Key) -> int:
        """Global rank of the first member of the caller's group."""
        return self.ranks(key)[0]

    def last_rank(self, key: Key) -> int:
        """Global rank of the last member of the caller's group."""
        return self.ranks(key)[-1]

    def is_first(self, key: Key) -> bool:
        """Whether the caller is first in its group (``is_first("pp")``: first stage)."""
        try:
            return self._rank_in[key] == 0
        except KeyError:
            raise self._missing(key) from None

    def is_last(self, key: Key) -> bool:
        """Whether the caller is last in its group (``is_last("pp")``: last stage)."""
        return self.rank(key) == self._size_of[key] - 1

    def __getitem__(self, key: str | tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh by axis name, tuple of axis names, or joint key.

        ``mesh["tp"]`` is 1-D, ``mesh["dp", "cp"]`` is 2-D in mesh order (for
        FSDP2's HSDP), ``mesh["dp-cp"]`` is the flattened 1-D mesh of the joint
        group and ``mesh["dp-cp", "tp"]`` puts it beside a plain axis (any axis
        set flattens, declared or not). Dims follow mesh order: a torch
        DeviceMesh cannot hold them in another, so ``mesh["cp", "dp"]`` raises
        and points to ``P(("cp", "dp"))``. The same request returns the same object.
        """
        try:
            return self._device_meshes[key]  # the request as made: one dict lookup
        except KeyError:
            self.check_alive()
        names = (key,) if isinstance(key, str) else tuple(key)
        if len(names) == 1 and isinstance(names[0], str) and "-" in names[0]:
            mesh = flattened_mesh(self, names[0])
        else:
            mesh = sliced_mesh(self, names)
        self._device_meshes[names] = self._device_meshes[key] = mesh
        return mesh

    def cached_view(self, key: tuple[str, ...]) -> DeviceMesh | None:
        """The DeviceMesh already made for the request ``key``, if any (for the views)."""
        return self._device_meshes.get(key)

    def _tables(
        self,
    ) -> tuple[dict[Key, int], dict[Key, int], dict[Key, dist.ProcessGroup], dict[Key, Sequence[int]]]:
        """The four tables, in the order of :class:`MeshTables`' fields."""
        return self._rank_in, self._size_of, self._group_of, self._ranks_of

    def root_meshes(self) -> list[DeviceMesh]:
        """The root DeviceMeshes (dense, expert, HSDP) made so far."""
        return list(self._roots.values())

    def keep_view(self, key: tuple[str, ...], view: DeviceMesh) -> None:
        """Keep ``view`` as the answer to the request ``key`` until ``destroy()``."""
        self._device_meshes[key] = view

    def destroy(self) -> None:
        """Destroy the process groups this mesh created; safe to call twice.

        Every later use of the mesh, its tables and facts (so every Megatron
        getter served by it) raises :class:`~meshstate.errors.NotInitializedError`
        naming the line that destroyed it, as does ``current_mesh()`` inside its
        ``with`` block; here it stops being what ``set_mesh`` set. A default
        process group that :func:`init_mesh` initialised stays (torch cannot
        form it again under torchrun) until exit or
        ``torch.distributed.destroy_process_group()``.
        """
        if self.destroyed_at is not None:
            return
        self.destroyed_at = first_caller_outside_meshstate()
        if current.set_mesh is self:  # no longer this thread's mesh; a `with` block still names it
            current.set_mesh = None
        if self._device_meshes or self._roots:
            _compat.forget_sharding_decisions()
        self._device_meshes.clear()
        self._ordered_groups.clear()
        self._rank_free_groups.clear()
        destroyed = str(self._destroyed_error())
        for kept in self.store.values():
            forget = getattr(kept, "forget", None)
            if forget is not None:  # what a façade keeps here dies with the mesh, saying where
                forget(destroyed)
        self.store.clear()
        vars(self.traced).clear()
        self._roots.clear()
        for table in (*self._tables(), self._own_group_of, self._own_ranks_of):
            table.clear()
        self._process_groups.destroy()  # last: it holds the groups' last references then
        forget_mesh(self)

    def __enter__(self) -> ParallelMesh:
        """Make this the current mesh inside a ``with`` block (see
        :func:`~meshstate.core.which_mesh.current_mesh`)."""
        self.check_alive()
        current.entered = (*current.entered, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        entered = current.entered
        if entered and entered[-1] is self:
            current.entered = entered[:-1]

    def __repr__(self) -> str:
        if self.simulated is not None:
            return f"ParallelMesh({len(self.simulated)} simulated ranks, {self.layout.describe()})"
        return (
            f"ParallelMesh(rank {self.global_rank} of {self.layout.dense.world_size}, "
            f"{self.layout.describe()})"
        )

    def _destroyed_error(self) -> NotInitializedError:
        return NotInitializedError(
            f"this mesh was destroyed at {self.destroyed_at}; build a new one with "
            "meshstate.init_mesh"
        )

    def check_alive(self) -> None:
        """Raise :class:`~meshstate.errors.NotInitializedError` naming where this mesh was
        destroyed, if it was."""
        if self.destroyed_at is not None:
            raise self._destroyed_error()

    def _missing(self, key: Key) -> MeshStateError:
        """Why the tables lack ``key``: a derived group without the caller, or no such key."""
        if key in self:
            return MeshStateError(f"rank {self.global_rank} is in no {str(key)!r} group")
        valid = ", ".join(map(str, self.keys()))
        return AxisError(f"mesh has no group {str(key)!r}; valid keys are {valid}")
