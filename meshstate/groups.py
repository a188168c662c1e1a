"""The one place meshstate creates process groups.

Every rank walks the same list of :class:`GroupSpec` in the same order. A rank
creates only the groups it belongs to; a rank set it already has a group for
is not created again (``etp == tp`` gives one communicator, not two); every
size-1 group is the same single-rank group; a group of the whole world is the
default group itself unless a backend or timeout is asked for.

On an NCCL world bound to a device (``init_process_group(device_id=...)``)
communicators are split from the default one, which every rank of the world
must join, so there each family is created with one ``split_group`` call.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate import _compat
from meshstate.errors import MeshStateError

_build_counter = itertools.count()


@dataclass(frozen=True)
class GroupSpec:
    """One family of disjoint rank groups, e.g. every data-parallel group.

    ``members`` is the calling rank's group (``None`` if it is in none);
    ``all_groups`` lists every group of the family and is only called where
    groups are split collectively.
    """

    name: str
    members: tuple[int, ...] | None
    all_groups: Callable[[], list[list[int]]]


@dataclass
class ProcessGroupSet:
    """The groups of one mesh build: by spec name, and the ones to destroy."""

    by_name: dict[str, dist.ProcessGroup]
    owned: list[dist.ProcessGroup] = field(default_factory=list)
    creation_calls: int = 0

    def destroy(self) -> None:
        """Destroy every group this build created; safe to call twice."""
        for group in self.owned:
            if _compat.is_registered(group):
                dist.destroy_process_group(group)
        self.owned.clear()
        self.by_name.clear()


def create_process_groups(
    specs: Sequence[GroupSpec],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
) -> ProcessGroupSet:
    """Create the groups of ``specs`` that the calling rank belongs to.

    Every rank must call this with specs naming the same families in the same
    order. ``backend``, ``timeout`` and ``pg_options`` (backend options such as
    ``ProcessGroupNCCL.Options``) reach every group created.

    Example (4 ranks; rank 1 passes its tp group ``(0, 1)``)::

        specs = [GroupSpec("tp", (0, 1), lambda: [[0, 1], [2, 3]])]
        create_process_groups(specs).by_name["tp"]  # the group of ranks 0 and 1
    """
    if not dist.is_initialized():
        raise MeshStateError(
            "torch.distributed is not initialized; call init_process_group first"
        )
    default_group = _compat.default_group()
    reuse_world = backend is None and timeout is None and pg_options is None
    split = _compat.bound_device(default_group) is not None and backend in (
        None,
        dist.get_backend(default_group),
    )
    create = _split_groups if split else _member_groups
    return create(specs, default_group, reuse_world, backend, timeout, pg_options)


def _member_groups(
    specs: Sequence[GroupSpec],
    default_group: dist.ProcessGroup,
    reuse_world: bool,
    backend: str | None,
    timeout: timedelta | None,
    pg_options: Any,
) -> ProcessGroupSet:
    build = next(_build_counter)
    result = ProcessGroupSet(by_name={})
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for spec in specs:
        members = spec.members
        if members is None:
            continue
        if members not in by_ranks:
            if reuse_world and len(members) == default_group.size():
                by_ranks[members] = default_group
            else:
                group = _compat.new_member_group(
                    list(members),
                    _group_name(build, members),
                    backend=backend,
                    timeout=timeout,
                    pg_options=pg_options,
                    description=f"meshstate:{spec.name}",
                )
                result.creation_calls += 1
                result.owned.append(group)
                by_ranks[members] = group
        result.by_name[spec.name] = by_ranks[members]
    return result


def _split_groups(
    specs: Sequence[GroupSpec],
    default_group: dist.ProcessGroup,
    reuse_world: bool,
    backend: str | None,
    timeout: timedelta | None,
    pg_options: Any,
) -> ProcessGroupSet:
    result = ProcessGroupSet(by_name={})
    whole_world = (tuple(range(default_group.size())),)
    by_family: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup | None] = {}
    for spec in specs:
        family = tuple(tuple(group) for group in spec.all_groups())
        if family not in by_family:
            if reuse_world and family == whole_world:
                by_family[family] = default_group
            else:
                group = dist.split_group(
                    split_ranks=[list(ranks) for ranks in family],
                    timeout=timeout,
                    pg_options=pg_options,
                    group_desc=f"meshstate:{spec.name}",
                    backend=backend,
                )
                result.creation_calls += 1
                if group is not None:
                    result.owned.append(group)
                by_family[family] = group
        group = by_family[family]
        if spec.members is not None and group is not None:
            result.by_name[spec.name] = group
    return result


def _group_name(build: int, members: tuple[int, ...]) -> str:
    digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False)
    return f"meshstate-{build}-{digest.hexdigest()[:20]}"
