"""Wrap process groups that already exist into a :class:`~meshstate.core.mesh.ParallelMesh`.

A framework, torchrun's world or an elastic launcher may have made the groups
already. :func:`adopt` checks them against the layout a config describes with
one collective and creates only the groups it was not given.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Unpack

import torch.distributed as dist

from meshstate.core.agreement import agree
from meshstate.core.arguments import (
    AdoptArguments,
    BuildOptions,
    GroupArguments,
    resolve_device_type,
    split_arguments,
)
from meshstate.layout.config import DEFAULT_ORDER, MeshConfig, sizes_text
from meshstate.errors import AxisError, ConfigError
from meshstate.core.groups import GroupSpec, create_process_groups, require_default_group
from meshstate.layout.layout import Key, ParallelLayout
from meshstate.core.mesh import ParallelMesh
from meshstate.core.world import refuse_simulation


def adopt(
    groups: Mapping[str, dist.ProcessGroup],
    order: str = DEFAULT_ORDER,
    **arguments: Unpack[AdoptArguments],
) -> ParallelMesh:
    """A mesh over existing process groups: ``groups[key]`` is the caller's group of ``key``.

    Takes the sizes :func:`~meshstate.init_mesh` takes (``tp``, ``cp``, ``ep``,
    ``etp``, ``pp``, ``dp_replicate``) and its ``device_type``, ``backend`` and
    ``timeout``, by keyword. Every rank must call it with the same keys. Keys are
    axes or Megatron's joint keys (``"tp"``, ``"dp-cp"``; with ``dp_replicate > 1``
    also ``"dp_replicate"``, ``"dp_shard"`` and ``"dp_shard-cp"``); a group's ranks,
    in group-rank order, must be the layout's group of that key. One
    ``all_gather_object`` tells every rank about every mismatch, so all raise
    :class:`~meshstate.ConfigError` together, naming the axis and the ranks.
    Keys not given get groups of their own, made with ``backend`` and
    ``timeout`` as :func:`~meshstate.init_mesh` makes them (``mesh.destroy()``
    destroys only those).

    Example (4 ranks, the caller made ``tp_group`` of ranks [0, 1] / [2, 3])::

        mesh = meshstate.adopt({"tp": tp_group}, tp=2)
        mesh.group("tp") is tp_group   # True
    """
    refuse_simulation("adopt()")
    sizes, given = split_arguments("adopt()", arguments, GroupArguments)
    options = BuildOptions.check(given)
    require_default_group()
    layout = ParallelLayout(MeshConfig(dist.get_world_size(), order=order, **sizes))
    kinds = layout.kinds
    adopted: dict[str, dist.ProcessGroup] = {}
    for key, group in groups.items():
        canonical = layout.canonical(key)
        if canonical not in kinds:
            raise AxisError(f"adopt cannot take group {key!r}; keys are {', '.join(kinds)}")
        adopted[canonical] = group
    build_id = agree(
        {"adopt": sorted(map(str, adopted)), **layout.config.arguments(), **options.agreed()},
        timeout=options.timeout,
    )
    rank = dist.get_rank()
    members = {key: layout.group_ranks(rank, key) for key in kinds}
    _check_adopted(layout, adopted, members)
    specs = [
        GroupSpec(key, ranks, partial(layout.every_group, key))
        for key, ranks in members.items()
        if key not in adopted
    ]
    process_groups = create_process_groups(
        specs, backend=options.backend, timeout=options.timeout, build_id=build_id
    )
    process_groups.by_name.update(adopted)
    members_by_key: dict[Key, tuple[int, ...] | None] = {key: members[key] for key in kinds}
    return ParallelMesh(
        layout,
        process_groups,
        members_by_key,
        device_type=resolve_device_type(options.device_type),
        kinds=kinds,
    )


def _check_adopted(
    layout: ParallelLayout,
    adopted: Mapping[str, dist.ProcessGroup],
    members: Mapping[str, tuple[int, ...]],
) -> None:
    """Raise the same ConfigError on every rank where an adopted group of any rank holds
    other ranks than the layout's group of its key (one ``all_gather_object``)."""
    rank = dist.get_rank()
    problem = next(
        (
            f"the adopted {key!r} group of rank {rank} holds ranks {given}, but the layout "
            f"({layout.config.order}, {sizes_text(layout.config.sizes())}) puts it with {list(members[key])}"
            for key, group in adopted.items()
            if (given := dist.get_process_group_ranks(group)) != list(members[key])
        ),
        None,
    )
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        more = f" (and {len(found) - 1} more ranks disagree)" if len(found) > 1 else ""
        raise ConfigError(found[0] + more)


