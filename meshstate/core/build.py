"""``init_mesh``: from its arguments to the calling rank's :class:`~meshstate.core.mesh.ParallelMesh`.

It checks the arguments (:mod:`meshstate.core.arguments`, :class:`MeshConfig`),
initialises the default group from the torchrun environment where none exists,
resolves the declared keys and each key's group options, agrees with every
rank on all of it (:mod:`meshstate.core.agreement`) and creates the groups the
calling rank belongs to (:mod:`meshstate.core.groups`). The DeviceMeshes are
not made here: the mesh builds them on first use.
"""

from __future__ import annotations

import atexit
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Unpack, cast, overload

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.agreement import agree
from meshstate.core.arguments import (
    BuildArguments,
    BuildOptions,
    GroupArguments,
    check_ranks,
    resolve_device_type,
)
from meshstate.layout.config import DEFAULT_ORDER, MeshConfig, reject_unknown
from meshstate.errors import ConfigError, MeshStateError, SimulationError
from meshstate.core.groups import GroupCreation, GroupOptions, GroupSpec, create_process_groups
from meshstate.layout.layout import (
    DerivedGroup,
    Key,
    MeshLayout,
    ParallelLayout,
    spellings,
    splits_dp,
)
from meshstate.layout.named_layout import NamedLayout, check_axes
from meshstate.core.mesh import ParallelMesh
from meshstate.core.world import process_rank, simulated_ranks


@overload
def init_mesh(
    order: str = ..., *, tp: int = ..., cp: int = ..., ep: int = ..., etp: int | None = ...,
    pp: int = ..., dp_replicate: int = ..., ranks: None = ..., backend: str | None = ...,
    timeout: timedelta | None = ..., device_type: str | None = ...,
    joint_groups: Sequence[str] = ..., derived: Sequence[DerivedGroup] = ...,
    group_options: Mapping[Key, GroupOptions] | None = ...,
    agree_on: Mapping[str, object] | None = ..., group_creation: GroupCreation | None = ...,
) -> ParallelMesh: ...


@overload
def init_mesh(
    order: str = ..., *, tp: int = ..., cp: int = ..., ep: int = ..., etp: int | None = ...,
    pp: int = ..., dp_replicate: int = ..., ranks: Sequence[int], backend: str | None = ...,
    timeout: timedelta | None = ..., device_type: str | None = ...,
    joint_groups: Sequence[str] = ..., derived: Sequence[DerivedGroup] = ...,
    group_options: Mapping[Key, GroupOptions] | None = ...,
    agree_on: Mapping[str, object] | None = ..., group_creation: GroupCreation | None = ...,
) -> ParallelMesh | None: ...


def init_mesh(
    order: str = DEFAULT_ORDER, *, tp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
    pp: int = 1, dp_replicate: int = 1, ranks: Sequence[int] | None = None,
    backend: str | None = None, timeout: timedelta | None = None, device_type: str | None = None,
    joint_groups: Sequence[str] = (), derived: Sequence[DerivedGroup] = (),
    group_options: Mapping[Key, GroupOptions] | None = None,
    agree_on: Mapping[str, object] | None = None, group_creation: GroupCreation | None = None,
) -> ParallelMesh | None:
    """Build the calling rank's :class:`ParallelMesh`; every rank must call it.

    The sizes ``tp``, ``cp``, ``ep``, ``etp`` (``tp`` when left out), ``pp`` and
    ``dp_replicate``; ``dp`` is inferred from the world size. Uses the initialised
    default group, or initialises one from the torchrun environment (NCCL when CUDA
    is available, else gloo). ``dp_replicate`` splits ``dp`` for FSDP2's HSDP into
    ``dp_replicate`` (outer) x ``dp_shard`` (inner), torchtitan's layout, and adds the
    keys ``"dp_replicate"``, ``"dp_shard"`` and ``"dp_shard-cp"``. ``ranks`` (a
    ``range`` or increasing ranks) builds the mesh over those ranks only, local rank
    ``i`` on ``ranks[i]``; the others get ``None``. ``backend`` and ``timeout`` reach
    every group created; ``device_type`` defaults to ``"cuda"`` on an NCCL world and
    ``"cpu"`` otherwise. ``joint_groups`` declares joint groups beyond Megatron's
    (``"cp-pp"``); ``derived`` adds groups carved out of them
    (:class:`~meshstate.layout.layout.DerivedGroup`); ``group_options`` sets backend
    and options per key; ``group_creation`` forces ``"split"`` or ``"local"``
    creation (:mod:`meshstate.core.groups`).

    First every rank agrees on all of it (and ``agree_on``) through the store within
    ``timeout``: a rank with different arguments makes every rank raise
    :class:`~meshstate.errors.ConfigMismatchError`, a rank that never arrives a
    :class:`~meshstate.errors.MeshTimeoutError` naming it.

    Example (``torchrun --nproc-per-node 8``)::

        mesh = meshstate.init_mesh(tp=2, cp=2, pp=2, ep=2, etp=1)
        mesh["dp-cp"]   # what FSDP2 shards over
        evens = meshstate.init_mesh(tp=2, ranks=[0, 2, 4, 6])  # None on odd ranks
    """
    options = BuildOptions.check(BuildArguments(
        backend=backend, timeout=timeout, device_type=device_type, joint_groups=joint_groups,
        derived=derived, group_options=group_options, agree_on=agree_on,
        group_creation=group_creation,
    ))
    _init_default_group_from_env(options.backend, options.timeout)
    span = check_ranks(ranks, dist.get_world_size())
    config = MeshConfig(len(span or range(dist.get_world_size())), order=order, tp=tp, cp=cp,
                        ep=ep, etp=etp, pp=pp, dp_replicate=dp_replicate)
    return build_mesh(config, options, ranks=span)


def build_mesh(
    config: MeshConfig, options: BuildOptions, *, ranks: range | tuple[int, ...] | None = None
) -> ParallelMesh | None:
    """:func:`init_mesh` of a config and options already checked (a façade's, say):
    ``config.world_size`` ranks, all of the world's or ``ranks``' (a checked span)."""
    world = ranks or range(dist.get_world_size())
    layout = ParallelLayout(
        config,
        rank_offset=world.start if isinstance(world, range) else 0,
        ranks=None if isinstance(world, range) else world,
    )
    return _build(layout, options, ranks, layout.arguments(), "init_mesh(ranks=...)")


def make_mesh(
    axis_sizes: Sequence[int],
    axis_names: Sequence[str],
    *,
    ranks: Sequence[int] | None = None,
    **arguments: Unpack[GroupArguments],
) -> ParallelMesh | None:
    """A mesh with the caller's axis names: JAX's ``jax.make_mesh``; every rank calls it.

    ``axis_sizes`` and ``axis_names`` run in mesh order, outer first; the last axis
    varies fastest, as JAX numbers devices. The mesh covers the first
    ``prod(axis_sizes)`` ranks of the world (JAX's first devices), or ``ranks``;
    a rank outside it gets ``None``. On it ``P``, every collective (one axis, a
    joint key ``"x-y"``, an axis tuple), ``shard_map``, ``reshard``, ``vma`` and the
    harness work as on :func:`init_mesh`'s mesh; its one DeviceMesh is
    ``mesh.dense`` (dims in mesh order). A size-1 axis is a group of one rank.
    ``backend``, ``timeout`` and ``device_type`` are :func:`init_mesh`'s. The
    Megatron and torchtitan façades take ``init_mesh``'s meshes only.

    Example (8 ranks)::

        mesh = meshstate.make_mesh((2, 4), ("batch", "feats"))
        mesh.ranks("feats"), mesh.rank(("feats", "batch"))   # on rank 5: (4, 5, 6, 7), 2
        ring = meshstate.make_mesh((4,), ("i",))               # None on ranks 4..7
    """
    reject_unknown("make_mesh()", arguments, GroupArguments.__annotations__)
    options = BuildOptions.check(cast(BuildArguments, arguments))
    names, shapes = check_axes(axis_sizes, axis_names)
    _init_default_group_from_env(options.backend, options.timeout)
    world_size = dist.get_world_size()
    span = check_ranks(ranks, world_size)
    size = math.prod(shapes)
    if span is None and size != world_size:
        if size > world_size:
            raise ConfigError(
                f"axis_sizes {shapes} hold {size} ranks, more than the world's {world_size}"
            )
        span = range(size)
    if span is not None and len(span) != size:
        raise ConfigError(f"axis_sizes {shapes} hold {size} ranks, but ranks lists {len(span)}")
    layout = NamedLayout(
        names, shapes,
        rank_offset=span.start if isinstance(span, range) else 0,
        ranks=span if isinstance(span, tuple) else None,
    )
    where = "make_mesh(ranks=...)" if ranks is not None else f"make_mesh({shapes}, ...)"
    return _build(layout, options, span, layout.arguments(), where)


def _build(
    layout: MeshLayout,
    options: BuildOptions,
    span: range | tuple[int, ...] | None,
    agreed: dict[str, object],
    where: str,
) -> ParallelMesh | None:
    """The calling rank's mesh of ``layout`` over the world or ``span``, after every rank
    of it agreed on ``agreed`` and the options (``None`` outside ``span``); ``where``
    names the call that asked for ``span`` in a refusal."""
    kinds, declared = _declared_keys(layout, options.joint_groups, options.derived)
    options_of_key = _options_by_key(layout, kinds + declared, options.group_options)
    simulated = simulated_ranks()
    if simulated is not None:
        _check_simulated(simulated, span, where, layout)
    elif span is not None and dist.get_rank() not in span:
        return None
    build_id = _agree(agreed, options, span)
    return _create_mesh(layout, kinds, declared, options_of_key, options, build_id, span)


def _check_simulated(
    simulated: frozenset[int], span: range | tuple[int, ...] | None, where: str, layout: MeshLayout
) -> None:
    """Refuse what a simulated world cannot build: a mesh over some ranks, or a simulation
    of only some ranks of the world other than one stage of a world simulated stage by
    stage, whose pp groups must then hold one rank of each stage."""
    world_size = dist.get_world_size()
    if span is not None:
        raise SimulationError(
            f"{where} over {len(span)} of {world_size} ranks in a simulated world: "
            "the other ranks would take part in its collectives; run it in processes with "
            "meshstate.testing.local_world"
        )
    if len(simulated) == world_size:
        return
    stage_size, first = len(simulated), min(simulated)
    if world_size % stage_size or first % stage_size or simulated != frozenset(range(first, first + stage_size)):
        raise SimulationError(
            f"torch's LocalTensorMode simulates {len(simulated)} of the world's {world_size} "
            "ranks; init_mesh simulates the whole world, or one stage of it "
            "(meshstate.testing.simulated_world(world_size, stages=...))"
        )
    stages = world_size // stage_size
    one_of_each = tuple(range(0, world_size, stage_size))
    try:
        members = layout.members(0, "pp")
    except MeshStateError:
        members = None
    pp_group = None if members is None else tuple(members)
    if pp_group != one_of_each:
        found = "has no 'pp' axis" if pp_group is None else f"has pp groups like {list(pp_group)}"
        raise SimulationError(
            f"a world simulated in {stages} stages of {stage_size} ranks needs pp={stages} as "
            f"the mesh's outermost axis, so that a pp group holds one rank of each stage "
            f"({', '.join(map(str, one_of_each[:4]))}{', …' if stages > 4 else ''}), as "
            f"Megatron's default order tp-cp-ep-dp-pp has it; this mesh {found}"
        )


def _agree(
    agreed: dict[str, object],
    options: BuildOptions,
    span: range | tuple[int, ...] | None,
) -> int | None:
    """Agree with every rank of the build on its layout's fields and options; the build id."""
    listed = None if span is None else (
        [span.start, span.stop] if isinstance(span, range) else list(span)
    )
    fields = {**agreed, "ranks": listed, **options.agreed()}  # agree_on last, as given
    return agree(fields, timeout=options.timeout, ranks=span)


def _create_mesh(
    layout: MeshLayout,
    kinds: tuple[str, ...],
    declared: tuple[DerivedGroup, ...],
    options_of_key: Mapping[Key, GroupOptions],
    options: BuildOptions,
    build_id: int | None,
    span: range | tuple[int, ...] | None,
) -> ParallelMesh:
    """Create the calling rank's groups of every key and the mesh holding them (which
    answers for every simulated rank in a simulated world)."""
    rank = process_rank()
    members = {key: layout.members(rank, key) for key in kinds + declared}
    specs = [
        GroupSpec(key, ranks, partial(layout.every_group, key), options_of_key[key])
        for key, ranks in members.items()
    ]
    process_groups = create_process_groups(
        specs, backend=options.backend, timeout=options.timeout, build_id=build_id,
        group_creation="local" if span is not None else options.group_creation,
    )
    device_type = resolve_device_type(options.device_type)
    return ParallelMesh(
        layout, process_groups, members, device_type=device_type, kinds=kinds, derived=declared
    )


def _declared_keys(
    layout: MeshLayout, joint_groups: Sequence[str], derived: Sequence[DerivedGroup]
) -> tuple[tuple[str, ...], tuple[DerivedGroup, ...]]:
    """The kinds with the joint groups, and the derived groups, spelled canonically."""
    joints = dict.fromkeys(map(layout.canonical, joint_groups))
    base_kinds = layout.kinds
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
    layout: MeshLayout, keys: tuple[Key, ...], given: Mapping[Key, GroupOptions]
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
