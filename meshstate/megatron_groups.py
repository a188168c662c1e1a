"""Megatron's derived groups as :class:`~meshstate.layout.GroupFamily` values.

Pure: no process groups here. Besides the axis kinds, megatron-core's
``initialize_model_parallel`` builds groups carved out of them: embedding and
position-embedding groups (stages of each pipeline), hierarchical
context-parallel levels, the groups of partial distributed-optimizer
instances, hybrid data+context groups and a second data+context group for
all-gathers. :func:`megatron_families` returns them, with megatron-core's rank
arithmetic, for the façades to pass to :func:`meshstate.init_mesh`.

Example::

    >>> from meshstate.config import MeshConfig
    >>> from meshstate.layout import ParallelLayout
    >>> families = megatron_families(MeshConfig(8, pp=4))
    >>> ParallelLayout(MeshConfig(8, pp=4)).family_groups(families[0])
    [[0, 6], [1, 7]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import einops
import torch

from meshstate.config import MeshConfig
from meshstate.errors import ParallelStateError
from meshstate.layout import GroupFamily

EMBEDDING = "embedding"
POSITION_EMBEDDING = "position-embedding"
INTRA_DP_CP = "dp-cp:intra-instance"
INTRA_EDP = "edp:intra-instance"
INTER_EDP = "edp:inter-instance"
DIST_OPT_INSTANCE = "dist-opt-instance"
DP_CP_ALL_GATHER = "dp-cp:all-gather"
GLOO_KEYS = ("dp", "dp-cp", "edp", INTRA_DP_CP, INTRA_EDP)
"""Keys megatron-core gives a gloo copy when ``create_gloo_process_groups``."""

RanksCallback = Callable[..., Sequence[int]]


def hierarchical_cp(level: int) -> str:
    """Family name of hierarchical context-parallel level ``level``."""
    return f"hcp-{level}"


def hierarchical_cp_levels(keys: Sequence[str]) -> list[str]:
    """The hierarchical context-parallel family names among ``keys``, innermost first."""
    levels: list[str] = []
    while hierarchical_cp(len(levels)) in keys:
        levels.append(hierarchical_cp(len(levels)))
    return levels


def hybrid_dp_cp(size: int) -> str:
    """Family name of the hybrid data+context groups of ``size`` ranks."""
    return f"dp-cp:hybrid-{size}"


def gloo(key: str) -> str:
    """Family name of the gloo copy of ``key``'s groups."""
    return f"{key}:gloo"


def default_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The stages holding word embeddings: the first and the last.

    Example: ``default_embedding_ranks([1, 5, 9]) == [1, 9]``.
    """
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The stage holding position embeddings: the first.

    Example: ``default_position_embedding_ranks([1, 5, 9]) == [1]``.
    """
    return [pp_ranks[0]]


def hierarchical_levels(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """Split ``ranks`` into hierarchical levels of the given sizes.

    Level ``i`` groups ranks ``prod(sizes[:i])`` apart, ``sizes[i]`` at a time.

    Example: 8 ranks in levels ``[2, 4]`` give ``[[0, 1], [2, 3], ...]`` and
    ``[[0, 2, 4, 6], [1, 3, 5, 7]]``.
    """
    if math.prod(sizes) != len(ranks):
        raise ParallelStateError(
            f"hierarchical sizes {list(sizes)} multiply to {math.prod(sizes)}, "
            f"not to the {len(ranks)} ranks they split"
        )
    levels = []
    for level, size in enumerate(sizes):
        grouped = einops.rearrange(
            torch.tensor(list(ranks)),
            "(outer size inner) -> (outer inner) size",
            inner=math.prod(sizes[:level]),
            size=size,
            outer=math.prod(sizes[level + 1 :]),
        )
        levels.append(grouped.tolist())
    return levels


def megatron_families(
    config: MeshConfig,
    *,
    get_embedding_ranks: RanksCallback | None = None,
    get_position_embedding_ranks: RanksCallback | None = None,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    num_distributed_optimizer_instances: int = 1,
    hybrid_context_parallel: bool = False,
    create_all_gather_group: bool = False,
    create_gloo_process_groups: bool = False,
) -> list[GroupFamily]:
    """The derived group families megatron-core builds for these arguments.

    Validates them as megatron-core does (with :class:`ParallelStateError`).
    """
    embedding = get_embedding_ranks or default_embedding_ranks
    position_embedding = get_position_embedding_ranks or default_position_embedding_ranks
    families = [
        GroupFamily(EMBEDDING, "pp", lambda pp: [list(embedding(pp))]),
        GroupFamily(POSITION_EMBEDDING, "pp", lambda pp: [list(position_embedding(pp))]),
    ]
    if hierarchical_context_parallel_sizes:
        sizes = list(hierarchical_context_parallel_sizes)
        if math.prod(sizes) != config.cp:
            raise ParallelStateError(
                f"hierarchical_context_parallel_sizes {sizes} multiply to {math.prod(sizes)}, "
                f"but context_parallel_size is {config.cp}"
            )
        for level in range(len(sizes)):
            families.append(
                GroupFamily(hierarchical_cp(level), "cp", partial(_level, sizes, level))
            )
    instances = num_distributed_optimizer_instances
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ParallelStateError(
            f"num_distributed_optimizer_instances must be a positive integer, got {instances!r}"
        )
    dp_cp = config.dp * config.cp
    if dp_cp % instances:
        raise ParallelStateError(
            f"data parallel size with context parallel, dp*cp = {config.dp}*{config.cp} = "
            f"{dp_cp}, is not divisible by num_distributed_optimizer_instances = {instances}"
        )
    if config.edp % instances:
        raise ParallelStateError(
            f"expert data parallel size edp = {config.edp} is not divisible by "
            f"num_distributed_optimizer_instances = {instances}"
        )
    intra_edp = config.edp // instances
    families += [
        GroupFamily(INTRA_DP_CP, "dp-cp", lambda ranks: _chunks(ranks, dp_cp // instances)),
        GroupFamily(INTRA_EDP, "edp", lambda ranks: _chunks(ranks, intra_edp)),
        GroupFamily(
            DIST_OPT_INSTANCE,
            ("edp", "pp", "ep", "etp"),
            lambda world: _chunks(world, len(world) // instances),
        ),
    ]
    if instances > 1:
        families.append(
            GroupFamily(INTER_EDP, "edp", lambda ranks: [list(ranks[i::intra_edp]) for i in range(intra_edp)])
        )
    if hybrid_context_parallel:
        if dp_cp % 2:
            raise ParallelStateError(
                f"hybrid context parallel needs an even dp*cp, got {config.dp}*{config.cp} = {dp_cp}"
            )
        for size in hybrid_sizes(dp_cp):
            families.append(
                GroupFamily(hybrid_dp_cp(size), "dp-cp", partial(_chunks, size=size))
            )
    if create_all_gather_group:
        families.append(GroupFamily(DP_CP_ALL_GATHER, "dp-cp"))
    if create_gloo_process_groups:
        by_name = {family.name: family for family in families}
        for key in GLOO_KEYS:
            source = by_name.get(key)
            if source is None:
                families.append(GroupFamily(gloo(key), key))
            else:
                families.append(GroupFamily(gloo(key), source.base, source.split))
    return families


def hybrid_sizes(dp_cp: int) -> list[int]:
    """Group sizes of the hybrid data+context groups: powers of two from 2, below ``dp_cp``."""
    return [2**power for power in range(1, int(math.log2(dp_cp)))]


def _level(sizes: Sequence[int], level: int, ranks: Sequence[int]) -> list[list[int]]:
    return hierarchical_levels(ranks, sizes)[level]


def _chunks(ranks: Sequence[int], size: int) -> list[list[int]]:
    return [list(ranks[start : start + size]) for start in range(0, len(ranks), size)]
