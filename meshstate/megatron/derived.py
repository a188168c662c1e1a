"""Megatron's derived groups as :class:`~meshstate.layout.layout.DerivedGroup` values.

Pure: no process groups here. Besides the axis kinds, megatron-core's
``initialize_model_parallel`` builds groups carved out of them: embedding and
position-embedding groups (stages of each pipeline), hierarchical
context-parallel levels, the groups of partial distributed-optimizer
instances, hybrid data+context groups, a second data+context group for
all-gathers and gloo twins. :func:`derived_groups` returns the ones asked for,
with megatron-core's rank arithmetic, for the façades to pass to
:func:`meshstate.init_mesh`; the constants below look them up in a mesh.

Example::

    >>> from meshstate.layout.config import MeshConfig
    >>> from meshstate.layout.layout import ParallelLayout
    >>> derived = derived_groups(MeshConfig(8, pp=4))
    >>> derived[0].lookup == EMBEDDING
    True
    >>> ParallelLayout(MeshConfig(8, pp=4)).every_group(derived[0])
    [[0, 6], [1, 7]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from meshstate.layout.config import MeshConfig
from meshstate.megatron.errors import ParallelStateError
from meshstate.layout.layout import Chunks, DerivedGroup, Instances, Key, Level, Pick

EMBEDDING = DerivedGroup("pp", Pick("embedding"))
POSITION_EMBEDDING = DerivedGroup("pp", Pick("position-embedding"))
INTRA_DP_CP = DerivedGroup("dp-cp", Instances())
INTRA_EDP = DerivedGroup("edp", Instances())
INTER_EDP = DerivedGroup("edp", Instances(inter=True))
DIST_OPT_INSTANCE = DerivedGroup(("edp", "pp", "ep", "etp"), Instances())
DP_CP_ALL_GATHER = DerivedGroup("dp-cp", separate=True)
# megatron-core 0.19's GTP weight-remat groups at size 1 (meshstate builds no larger): one rank each.
GTP_REMAT = DerivedGroup("tp", Chunks(1))
EXPERT_GTP_REMAT = DerivedGroup("etp", Chunks(1))
GLOO_KEYS: tuple[Key, ...] = ("dp", "dp-cp", "edp", INTRA_DP_CP, INTRA_EDP)
"""Keys megatron-core gives a gloo twin when ``create_gloo_process_groups``."""

RanksCallback = Callable[..., Sequence[int]]


def hierarchical_cp(level: int) -> DerivedGroup:
    """Hierarchical context-parallel level ``level``, whatever the sizes."""
    return DerivedGroup("cp", Level(level))


def hierarchical_cp_levels(keys: Iterable[Key]) -> list[DerivedGroup]:
    """The hierarchical context-parallel levels among ``keys``, innermost first."""
    declared = {key.lookup if isinstance(key, DerivedGroup) else key for key in keys}
    return list(itertools.takewhile(declared.__contains__, map(hierarchical_cp, itertools.count())))


def hybrid_dp_cp(size: int) -> DerivedGroup:
    """The hybrid data+context groups of ``size`` ranks."""
    return DerivedGroup("dp-cp", Chunks(size))


def hybrid_sizes(dp_cp: int) -> list[int]:
    """Group sizes of the hybrid data+context groups: powers of two from 2, below ``dp_cp``."""
    return [2**power for power in range(1, int(math.log2(dp_cp)))]


def gloo(key: Key) -> DerivedGroup:
    """The gloo twin of ``key``: the same ranks, a gloo communicator."""
    if isinstance(key, DerivedGroup):
        return replace(key, backend="gloo")
    return DerivedGroup(key, backend="gloo")


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


def derived_groups(
    config: MeshConfig,
    *,
    get_embedding_ranks: RanksCallback | None = None,
    get_position_embedding_ranks: RanksCallback | None = None,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    num_distributed_optimizer_instances: int = 1,
    hybrid_context_parallel: bool = False,
    create_all_gather_group: bool = False,
    create_gloo_process_groups: bool = False,
) -> list[DerivedGroup]:
    """The derived groups megatron-core builds for these arguments, in its order.

    Validates them as megatron-core does (with :class:`ParallelStateError`).
    """
    position_embedding = get_position_embedding_ranks or default_position_embedding_ranks
    derived = [
        DerivedGroup("pp", Pick("embedding", get_embedding_ranks or default_embedding_ranks)),
        DerivedGroup("pp", Pick("position-embedding", position_embedding)),
        GTP_REMAT,
        EXPERT_GTP_REMAT,
    ]
    if hierarchical_context_parallel_sizes:
        sizes = tuple(hierarchical_context_parallel_sizes)
        if math.prod(sizes) != config.cp:
            raise ParallelStateError(
                f"hierarchical_context_parallel_sizes {list(sizes)} multiply to {math.prod(sizes)}, "
                f"but context_parallel_size is {config.cp}"
            )
        derived += [DerivedGroup("cp", Level(level, sizes)) for level in range(len(sizes))]
    instances = num_distributed_optimizer_instances
    _check_instances(config, instances)
    dp_cp = config.dp * config.cp
    intra = Instances(instances)
    derived += [replace(INTRA_DP_CP, split=intra), replace(INTRA_EDP, split=intra)]
    derived.append(replace(DIST_OPT_INSTANCE, split=intra))
    if instances > 1:
        derived.append(replace(INTER_EDP, split=Instances(instances, inter=True)))
    if hybrid_context_parallel:
        if dp_cp % 2:
            raise ParallelStateError(
                f"hybrid context parallel needs an even dp*cp, got {config.dp}*{config.cp} = {dp_cp}"
            )
        derived += [hybrid_dp_cp(size) for size in hybrid_sizes(dp_cp)]
    if create_all_gather_group:
        derived.append(DP_CP_ALL_GATHER)
    if create_gloo_process_groups:
        declared: dict[Key, Key] = {spec.lookup: spec for spec in derived}
        derived += [gloo(declared.get(key, key)) for key in GLOO_KEYS]
    return derived


def _check_instances(config: MeshConfig, instances: int) -> None:
    """megatron-core's checks of ``num_distributed_optimizer_instances``, with the numbers."""
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
