"""The one place meshstate creates process groups.

Every rank walks the same list of :class:`GroupSpec` in the same order. A rank
creates only the groups it belongs to; a rank set it already has a group for
(with the same backend and options) is not created again (``etp == tp`` gives
one communicator, not two); every size-1 group is the same single-rank group;
a group of the whole world is the default group itself unless other options
are asked for. On torch's fake backend every group is fake, whatever backend
a spec names: the world is simulated.

On an NCCL world bound to a device (``init_process_group(device_id=...)``)
communicators are split from the default one, which every rank of the world
must join, so there each family of the default backend is created with one
``split_group`` call. The strategy is chosen once per build
(``group_creation``): ``"split"`` or ``"local"`` forces one; ``None`` splits
where the default group is bound to a device and falls back to member-local
creation for the whole build if the backend's first split raises (a backend
without comm splitting).

The Megatron façade's ``HyperCommGrid`` creates and destroys its groups as
megatron-core's does, through torch's ``new_subgroups_by_enumeration`` and
``destroy_process_group``: :func:`create_enumerated_groups`, :func:`destroy_groups`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, cast

import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.agreement import leave_barrier, store_barrier
from meshstate.errors import ConfigError, MeshStateError, MeshTimeoutError, SimulationError
from meshstate.layout.layout import Key
from meshstate.layout.ranks import identity, ranks_text
from meshstate.core.world import process_rank, ranks_share_the_process, tiling_mismatch

_builds_of_world: weakref.WeakKeyDictionary[dist.ProcessGroup, Iterator[int]] = (
    weakref.WeakKeyDictionary()
)
"""A count of each rank's builds without an agreed id, by its default group (a thread of a
threaded world is a rank with a default group of its own)."""

GroupCreation = Literal["split", "local"]
"""How groups are created: split from the default group, or member-local ``new_group``."""


@dataclass(frozen=True)
class GroupOptions:
    """How the groups of one family are created.

    ``backend`` and ``pg_options`` override the build's; ``separate`` gives the
    family communicators of its own even where another family has the same
    ranks (e.g. a second data-parallel group used only for all-gathers).
    """

    backend: str | None = None
    pg_options: Any = None
    separate: bool = False


@dataclass(frozen=True)
class GroupSpec:
    """One family of disjoint rank groups, e.g. every data-parallel group.

    ``members`` is the calling rank's group, sorted (``None`` if it is in none;
    a :class:`~meshstate.layout.ranks.Ranks` keeps a large one as strides);
    ``all_groups`` lists every group of the family and is only called where
    groups are split collectively.
    """

    name: Key
    members: Sequence[int] | None
    all_groups: Callable[[], list[list[int]]]
    options: GroupOptions = GroupOptions()


@dataclass
class ProcessGroupSet:
    """The groups of one mesh build: by spec name, and the ones to destroy."""

    by_name: dict[Key, dist.ProcessGroup]
    owned: list[dist.ProcessGroup] = field(default_factory=list)
    creation_calls: int = 0
    build_id: str = ""
    backend: str | None = None
    timeout: timedelta | None = None
    traced_names: dict[dist.ProcessGroup, str] = field(default_factory=dict)
    """The name a traced graph calls each group by where it is not the group's own."""

    def name_for_every_rank(self, group: dist.ProcessGroup, family: Key, backend: str) -> None:
        """Give ``group`` a second name, ``meshstate-{build}-{backend}-{family}``, which the
        caller's group of ``family`` has on every rank: a graph traced on one rank then
        calls each rank's own group (``compile_on_one_rank``). Not where ranks share a
        process (threads, a simulation), whose groups share one table of names, nor for a
        group whose name is every rank's already (the default group's)."""
        if group in self.traced_names or backend == "fake" or ranks_share_the_process():
            return
        if group is _compat.default_group():
            return
        name = f"meshstate-{self.build_id}-{backend}-{family}"
        _compat.name_for_every_rank(group, name)
        self.traced_names[group] = name

    def traced_name(self, group: dist.ProcessGroup) -> str:
        """The name of ``group`` for torch's traceable collectives: every rank's where it has one."""
        return self.traced_names.get(group, group.group_name)

    def destroy(self) -> None:
        """Destroy every group this build created; safe to call twice. Where this set
        holds a group's last reference (a mesh clears its tables first), the teardowns
        run side by side (see :func:`release_side_by_side`)."""
        for name in self.traced_names.values():
            _compat.forget_name(name)
        self.traced_names.clear()
        _unregister(self.owned)
        self.by_name.clear()
        release_side_by_side(self.owned)


def _unregister(groups: list[dist.ProcessGroup]) -> None:
    """Tell torch each of ``groups`` is destroyed (its name, its entries), holding none after."""
    for group in groups:
        _compat.destroy_group(group)


def release_side_by_side(groups: list[dist.ProcessGroup]) -> None:
    """Empty ``groups``, dropping each gloo or NCCL group's reference in a thread of its own,
    and wait for them all. A gloo group's teardown joins its transport's event loop, which
    polls every 10 ms (about 20 ms a group, the GIL released): a mesh's 7 groups go in 20 ms,
    not 140. Any other group (the fake backend's) is dropped here, where a thread costs more.

    Example: ``release_side_by_side(owned)`` leaves ``owned == []``; the groups are gone if it
    held their last references.
    """
    boxes = [[group] for group in groups if group.name() in _SLOW_TO_RELEASE]
    groups.clear()
    if len(boxes) < 2:
        return
    releases = [threading.Thread(target=box.clear, name="meshstate: group release")
                for box in boxes]
    del boxes
    for release in releases:
        release.start()
    for release in releases:
        release.join()


_SLOW_TO_RELEASE = frozenset({"gloo", "nccl"})
"""The backends (``ProcessGroup.name()``) whose groups :func:`release_side_by_side` releases
in threads."""


def require_default_group(error: type[MeshStateError] = MeshStateError) -> None:
    """Refuse, with ``error``, where torch.distributed has no default process group yet.

    Example: ``require_default_group(ConfigError)`` before ``init_process_group`` raises
    ``ConfigError("torch.distributed is not initialized; call
    torch.distributed.init_process_group first")``.
    """
    if not dist.is_initialized():
        raise error(
            "torch.distributed is not initialized; call torch.distributed.init_process_group first"
        )


def create_process_groups(
    specs: Sequence[GroupSpec],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    build_id: int | None = None,
    group_creation: GroupCreation | None = None,
) -> ProcessGroupSet:
    """Create the groups of ``specs`` that the calling rank belongs to.

    Every rank must call this with specs naming the same families in the same
    order. ``backend``, ``timeout`` and ``pg_options`` (backend options such as
    ``ProcessGroupNCCL.Options``) reach every group created, unless a spec's
    own options say otherwise. ``build_id`` (the same on every rank, e.g. from
    :func:`meshstate.core.agreement.agree`) names the groups; without it a count of
    this process's builds does. ``group_creation`` forces ``"split"`` or
    ``"local"`` creation (see the module docstring). If a group cannot be
    created, the groups created so far are destroyed.

    Example (4 ranks; rank 1 passes its tp group ``(0, 1)``)::

        specs = [GroupSpec("tp", (0, 1), lambda: [[0, 1], [2, 3]])]
        create_process_groups(specs).by_name["tp"]  # the group of ranks 0 and 1
    """
    require_default_group()
    if group_creation not in (None, "split", "local"):
        raise ConfigError(
            f"group_creation must be 'split', 'local' or None (choose), got {group_creation!r}"
        )
    builder = _Builder(backend, timeout, pg_options, build_id, group_creation)
    try:
        return builder.build(specs)
    except BaseException:
        builder.result.destroy()
        raise


class _Builder:
    def __init__(
        self,
        backend: str | None,
        timeout: timedelta | None,
        pg_options: Any,
        build_id: int | str | None,
        group_creation: GroupCreation | None,
    ) -> None:
        self.default_group = _compat.default_group()
        self.default_backend = str(dist.get_backend(self.default_group))
        self.world_size = self.default_group.size()
        self.backend = backend
        self.timeout = timeout
        self.pg_options = pg_options
        bound = _compat.bound_device(self.default_group) is not None
        self.splits = group_creation == "split" or (group_creation is None and bound)
        self.may_fall_back = group_creation is None
        if build_id is None:
            builds = _builds_of_world.setdefault(self.default_group, itertools.count())
            build_id = f"local{next(builds)}"
        self.build_id = f"{build_id}"
        self.result = ProcessGroupSet(
            by_name={}, build_id=self.build_id, backend=backend, timeout=timeout
        )
        self.by_key: dict[tuple[Any, ...], dist.ProcessGroup | None] = {}

    def build(self, specs: Sequence[GroupSpec]) -> ProcessGroupSet:
        for spec in specs:
            group = self._group(spec)
            if spec.members is not None and group is not None:
                self.result.by_name[spec.name] = group
                self.result.name_for_every_rank(group, spec.name, self._backend(spec))
        return self.result

    def _group(self, spec: GroupSpec) -> dist.ProcessGroup | None:
        """The calling rank's group of ``spec``'s family, created unless an equal one exists."""
        backend = self._backend(spec)
        pg_options = self.pg_options if spec.options.pg_options is None else spec.options.pg_options
        split = self.splits and backend == self.default_backend
        members = spec.members
        if split:
            ranks_key: Any = tuple(tuple(group) for group in spec.all_groups())
            whole_world = len(ranks_key) == 1 and len(ranks_key[0]) == self.world_size
        elif members is None:
            return None
        else:
            ranks_key = identity(members)
            whole_world = len(members) == self.world_size  # distinct ranks: all of them
        key = (
            split,
            ranks_key,
            backend,
            id(pg_options) if pg_options is not None else None,
            spec.name if spec.options.separate else None,
        )
        if key in self.by_key:
            return self.by_key[key]
        reuse_world = (
            whole_world
            and backend == self.default_backend
            and pg_options is None
            and self.timeout is None
            and not spec.options.separate
        )
        group: dist.ProcessGroup | None
        if reuse_world:
            group = self.default_group
        elif split:
            try:
                group = self._split(ranks_key, spec.name, pg_options)
            except _CannotSplit:
                self.splits = False
                return self._group(spec)
        elif members is not None:
            group = self._member_group(members, spec.name, backend, pg_options)
        else:
            return None
        self.by_key[key] = group
        return group

    def _backend(self, spec: GroupSpec) -> str:
        if self.default_backend == "fake":
            return "fake"
        return spec.options.backend or self.backend or self.default_backend

    def _member_group(
        self, members: Sequence[int], name: Key, backend: str, pg_options: Any
    ) -> dist.ProcessGroup:
        # A family's groups are disjoint, so its name and the group's first rank name the group.
        group_name = f"meshstate-{self.build_id}-{backend}-{name}-{members[0]}"
        try:
            group = _compat.new_member_group(
                members,
                group_name,
                backend=backend,
                timeout=self.timeout,
                pg_options=pg_options,
                description=f"meshstate:{name}",
            )
            if backend != "fake":  # a fake or simulated world has no connections to wait for
                self._wait_for_members(group_name, len(members), backend)
        except RuntimeError as error:
            what = f"the {str(name)!r} group of ranks {ranks_text(members)} did not form"
            if isinstance(error, dist.DistStoreError) or "timed out" in str(error).lower():
                raise MeshTimeoutError(f"{what} within the timeout: {error}") from error
            raise MeshStateError(f"{what}: {error}") from error
        self.result.creation_calls += 1
        self.result.owned.append(group)
        return group

    def _wait_for_members(self, group_name: str, size: int, backend: str) -> None:
        """Return once every member has its group: a member whose constructor returned
        first (gloo's) must not destroy the group while another is still connecting.
        The last member to leave removes the keys, torch's rendezvous keys too."""
        store = _compat.thread_store()
        formed = f"{group_name}/formed"
        store_barrier(store, formed, size, self.timeout or _compat.default_timeout(backend))
        leave_barrier(store, formed, size, _compat.rendezvous_keys(group_name, backend, size))

    def _split(
        self, family: tuple[tuple[int, ...], ...], name: Key, pg_options: Any
    ) -> dist.ProcessGroup | None:
        """Split one family. If the build's first split fails and splitting was not
        forced, raise :class:`_CannotSplit`: the build goes member-local."""
        try:
            group = dist.split_group(
                split_ranks=[list(ranks) for ranks in family],
                timeout=self.timeout,
                pg_options=pg_options,
                group_desc=f"meshstate:{name}",
            )
        except (RuntimeError, NotImplementedError, ValueError) as error:
            if self.may_fall_back:
                raise _CannotSplit from error
            raise MeshStateError(
                f"the {str(name)!r} groups could not be split from the default "
                f"{self.default_backend} group: {error}; pass group_creation='local'"
            ) from error
        self.may_fall_back = False
        self.result.creation_calls += 1
        if not isinstance(group, dist.ProcessGroup):  # None, or torch 2.14's typed -100
            return None
        self.result.owned.append(group)
        return group


class _CannotSplit(Exception):
    """The backend's first split failed; create this build's groups member-local."""


def create_axis_set_group(
    owner: ProcessGroupSet, axes: str, members: Sequence[int]
) -> dist.ProcessGroup:
    """The calling rank's group over an undeclared axis set, made on first use.

    Only ``members`` (sorted, the caller among them) take part: in SPMD code
    each of them reaches the same collective, so no other rank waits. The name
    is the axis set (mesh order, e.g. ``"dp-cp"``) and ``owner``'s build id, so
    every member agrees on it; the group is kept in ``owner.by_name[axes]``
    (a second call returns it) and destroyed with ``owner``. The whole world
    is the default group itself.

    Example (8 ranks, the caller is rank 5 of a mesh without a ``"cp-pp"`` key)::

        create_axis_set_group(mesh.process_groups, "cp-pp", (1, 3, 5, 7))
    """
    default_group = _compat.default_group()
    if axes not in owner.by_name:
        if len(members) == default_group.size() and owner.timeout is None:  # distinct: all
            owner.by_name[axes] = default_group
        else:
            fake = str(dist.get_backend(default_group)) == "fake"
            builder = _Builder(
                "fake" if fake else owner.backend, owner.timeout, None, owner.build_id, "local"
            )
            builder.result = owner
            backend = builder.backend or builder.default_backend
            owner.by_name[axes] = builder._member_group(members, f"axes:{axes}", backend, None)
            owner.name_for_every_rank(owner.by_name[axes], f"axes:{axes}", backend)
    return owner.by_name[axes]


def create_group_family(
    rank_lists: Sequence[Sequence[int]],
    *,
    description: str,
    backend: str | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    owner: ProcessGroupSet | None = None,
) -> dist.ProcessGroup | None:
    """Create one process group per rank list; return the calling rank's.

    Every rank of the world calls it with the same disjoint ``rank_lists``,
    the way megatron-core loops over an enumeration; a rank in none of them
    gets ``None``. Groups are made as :func:`create_process_groups` makes them:
    each with its ranks sorted, a list of the whole world without options as
    the default group itself. ``owner`` receives the groups
    this call created, so ``owner.destroy()`` ends them, and keeps the caller's
    under ``description``; without it they live until ``destroy_process_group()``.

    Example (4 ranks)::

        tp_group = create_group_family([[0, 1], [2, 3]], description="tp")
        # on rank 2: the group of ranks 2 and 3
    """
    require_default_group()
    rank = process_rank()
    family = [sorted(ranks) for ranks in rank_lists]
    members = next((tuple(ranks) for ranks in family if rank in ranks), None)
    created = create_process_groups(
        [GroupSpec(description, members, lambda: family)],
        backend=backend,
        timeout=timeout,
        pg_options=pg_options,
    )
    group = created.by_name.get(description)
    mismatch = tiling_mismatch(description, group, family)  # simulated: over rank 0's group
    if mismatch is not None:
        created.destroy()
        raise SimulationError(mismatch)
    if owner is not None:
        owner.owned.extend(created.owned)
        owner.creation_calls += created.creation_calls
        if group is not None:
            owner.by_name[description] = group
    return group


def create_enumerated_groups(
    rank_lists: list[list[int]],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> dist.ProcessGroup | None:
    """Create one process group per rank list, as megatron-core's ``HyperCommGrid`` does:
    with ``torch.distributed.new_subgroups_by_enumeration``, looked up when called (a
    patch of it, or a simulation's, is what runs); return the calling rank's group.

    Every rank of the world calls it with the same disjoint ``rank_lists`` and takes
    part in creating every group (torch's ``new_group``); a rank in none gets ``None``.
    On torch's fake backend every group is fake, whatever ``backend`` says. Without a
    default group torch's refusal is raised as ``ConfigError``; the groups live until
    :func:`destroy_groups` (or ``destroy_process_group()``) ends them.

    Example (4 ranks)::

        tp_group = create_enumerated_groups([[0, 1], [2, 3]], group_desc="tp")
        # on rank 2: the group of ranks 2 and 3
    """
    if dist.is_initialized() and str(dist.get_backend()) == "fake":
        backend = "fake"
    try:
        group, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call, unused-ignore]
            rank_lists, timeout=timeout, backend=backend, pg_options=pg_options,
            group_desc=group_desc,
        )
    except ValueError as error:
        if dist.is_initialized():
            raise
        raise ConfigError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group first"
        ) from error
    return cast(dist.ProcessGroup | None, group)


def destroy_groups(groups: Iterable[dist.ProcessGroup | None]) -> None:
    """Destroy each of ``groups`` the calling rank is a member of, once, with
    ``torch.distributed.destroy_process_group`` (looked up when called), as megatron-core's
    ``HyperCommGrid.destroy`` does; what is not a group (``None``, torch's non-member
    marker) is skipped.

    Example: ``destroy_groups([tp_group, dp_group, tp_group])`` destroys two groups.
    """
    destroyed: set[int] = set()
    for group in groups:
        if not isinstance(group, dist.ProcessGroup) or id(group) in destroyed:
            continue
        destroyed.add(id(group))
        dist.destroy_process_group(group)
