"""megatron-core's ``get_*`` and ``is_*`` functions, answered by the mesh served.

Each getter reads ``_facts``, the served mesh's
:class:`~meshstate.megatron.facts.ServedFacts`: a getter without arguments is one
attribute read (``_facts.tp_rank``, Python's fastest read, for what the mesh answers;
megatron-core's answer, read from the tables, for the rest; ``_facts.maybe`` answers
``None`` where megatron-core's ``check_initialized=False`` does); one with arguments
(a virtual stage, a rank to place) computes its answer from such reads. Before init they answer as megatron-core
does, under the ``set_*`` overrides; once the mesh is destroyed they raise, so
no answer outlives its mesh. No getter calls into ``torch.distributed``, except
the answers megatron-core gives as 0 before it is initialized
(``torch.distributed.is_initialized()``) and
``is_rank_in_embedding_group(ignore_virtual=False)`` (``get_rank()``).
Inside :func:`state_per_thread` (a threaded world) each thread serves its own
state, and ``_facts`` reads the calling thread's.
While another live mesh of the rank could answer (a second grid), ``_facts``
reads the facts of the mesh picked with ``with mesh:`` and a getter without a
pick raises :class:`~meshstate.errors.AmbiguousMeshError`: no getter answers
for the wrong grid (:class:`~meshstate.megatron.facts.FactsOfThePickedMesh`).

Example, on rank 5 of 8 after ``initialize_model_parallel(tensor_model_parallel_size=2)``::

    get_tensor_model_parallel_rank(), get_data_parallel_world_size()   # (1, 4)
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import cast

import torch.distributed as dist

from meshstate.errors import AxisError, NotInitializedError
from meshstate.megatron.errors import ParallelStateError
from meshstate.layout.layout import Chunks, DerivedGroup, Key
from meshstate.core import world
from meshstate.core.current import watch_live_meshes
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import live_meshes
from meshstate.megatron import derived as families
from meshstate.megatron import facts as served
from meshstate.megatron.facts import (
    DP_CP, GLOO, OVERRIDES, PARTIAL_DP, WHAT, FactsOfTheCallingThread, FactsOfThePickedMesh, ServedFacts,
    ServedStatePerThread, checked_getter, not_initialized, served_facts, served_mesh,
)

__all__ = [
    "get_amax_reduction_group", "get_context_parallel_global_ranks",
    "get_context_parallel_group", "get_context_parallel_rank",
    "get_context_parallel_world_size", "get_data_parallel_group",
    "get_data_parallel_group_gloo", "get_data_parallel_rank", "get_data_parallel_world_size",
    "get_embedding_group", "get_expert_data_parallel_group",
    "get_expert_data_parallel_group_gloo", "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size", "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group", "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "get_hierarchical_context_parallel_groups", "get_hybrid_data_context_parallel_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group", "get_mesh", "get_model_parallel_group",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size", "get_position_embedding_group",
    "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size", "get_tensor_and_data_parallel_group",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size", "is_initialized",
    "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group", "model_parallel_is_initialized",
    "set_virtual_pipeline_model_parallel_rank", "set_virtual_pipeline_model_parallel_world_size",
]

ProcessGroup = dist.ProcessGroup


# The facts every getter reads: the served state's, rebound by serve(); while each thread
# serves its own state, a stand-in that reads the calling thread's.
_facts = served.state.facts


def serve(mesh: ParallelMesh | None) -> None:
    """Answer every getter from ``mesh`` (stand-ins when ``None``), under the overrides."""
    state = served.state
    state.mesh = (lambda: None) if mesh is None else weakref.ref(mesh)
    state.own_facts = served_facts(mesh, state.overrides)
    if mesh is not None:
        mesh.store[ServedFacts] = state.own_facts  # forgotten by the mesh's destroy()
    for other in live_meshes():  # what other meshes answered under the old overrides
        other.store.pop(FactsOfThePickedMesh, None)
    choose_facts()


def choose_facts() -> None:
    """Read the served mesh's facts directly while no other live mesh of this rank could
    answer (the fast read); else through the pick of :class:`FactsOfThePickedMesh`."""
    global _facts
    state = served.state
    alone = all(mesh is state.mesh() for mesh in live_meshes())
    state.facts = state.own_facts if alone else _PICKED
    if type(cast(object, _facts)) is not FactsOfTheCallingThread:  # isinstance reads __class__, a picked fact
        _facts = state.facts


_PICKED = cast(ServedFacts, FactsOfThePickedMesh())
OVERRIDES.changed = lambda: serve(served_mesh())
watch_live_meshes(choose_facts)


@contextmanager
def state_per_thread() -> Iterator[None]:
    """While inside, every thread serves a state of its own, uninitialised at first (a
    threaded world's ranks); the state served before comes back after. The getters then
    read through :class:`FactsOfTheCallingThread` (about 110 ns a call, not 35).
    Example: ``with state_per_thread(): ...`` around threads that each initialise."""
    global _facts
    process_state = served.state
    served.state, _facts = ServedStatePerThread(), cast(ServedFacts, FactsOfTheCallingThread())
    try:
        yield
    finally:
        served.state, _facts = process_state, process_state.facts


world.keep_state_per_thread(state_per_thread)


def get_mesh() -> ParallelMesh:
    """The :class:`~meshstate.ParallelMesh` behind every getter (the one picked with
    ``with mesh:`` while another live mesh could answer)."""
    mesh = _facts.mesh()
    if mesh is None and _facts.destroyed is not None:  # destroyed, and collected since
        raise NotInitializedError(f"model parallel state is gone: {_facts.destroyed}")
    if mesh is None or mesh.destroyed_at is not None:
        raise not_initialized("model parallel state", mesh)
    return mesh


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run and its mesh is not destroyed."""
    mesh = served_mesh()
    return mesh is not None and mesh.destroyed_at is None


def model_parallel_is_initialized() -> bool:
    """Whether the model- and data-parallel groups exist."""
    return is_initialized()


def process_group_list() -> list[ProcessGroup | None] | None:
    """megatron-core's ``_global_process_group_list``: ``None`` (the default group), then ours."""
    mesh = served_mesh()
    if mesh is None or not is_initialized():
        return None
    return [None, *dict.fromkeys([*mesh.tables.group.values(), *mesh.process_groups.owned])]


def _partial_without_cp(table: Mapping[Key, int]) -> int:
    """Partial data parallel without cp: an override, the answer before init, or an error."""
    try:
        return table[PARTIAL_DP]
    except KeyError:
        raise ParallelStateError("Partial DP for Optimizer needs to include CP") from None


def _refuse_partial_without_cp(key: Key) -> None:
    if key in _facts.group_of:
        raise ParallelStateError("Partial DP for Optimizer needs to include CP")


def _virtual_stage(vp_stage: int | None) -> int:
    if vp_stage is None:
        raise ParallelStateError("vp_stage must be passed if virtual pipeline is enabled")
    return vp_stage


# -- groups ----------------------------------------------------------------------------


@checked_getter
def get_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The model-parallel (tensor + pipeline) group of the caller."""
    return _facts.tp_pp_group if check_initialized else _facts.maybe.tp_pp_group


@checked_getter
def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor-model-parallel group of the caller."""
    return _facts.tp_group if check_initialized else _facts.maybe.tp_group


@checked_getter
def get_pipeline_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The pipeline-model-parallel group of the caller."""
    return _facts.pp_group if check_initialized else _facts.maybe.pp_group


def get_data_parallel_group(
    with_context_parallel: bool = False,
    with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
) -> ProcessGroup:
    """The data-parallel group of the caller, with context parallel if asked.

    ``partial_data_parallel`` gives the group inside one distributed-optimizer
    instance. ``with_gtp_remat`` asks for the group across GTP weight-remat peers
    too: the same group, as meshstate builds GTP groups of one rank only.
    """
    if not with_context_parallel:
        if partial_data_parallel:
            _refuse_partial_without_cp("dp")
        return _facts.dp_group
    return _facts.intra_dp_cp_group if partial_data_parallel else _facts.dp_cp_group


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup:
    """The gloo twin of the caller's data-parallel group."""
    if with_context_parallel:
        return _facts.intra_dp_cp_gloo_group if partial_data_parallel else _facts.dp_cp_gloo_group
    if partial_data_parallel:
        _refuse_partial_without_cp(GLOO["dp"])
    return _facts.dp_gloo_group


@checked_getter
def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The context-parallel group of the caller."""
    return _facts.cp_group if check_initialized else _facts.maybe.cp_group


@checked_getter
def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of the caller's context-parallel group."""
    ranks = _facts.maybe.cp_ranks
    if ranks is None and check_initialized:
        raise not_initialized(WHAT["cp"], served_mesh())
    return None if ranks is None else list(ranks)


@checked_getter
def get_hierarchical_context_parallel_groups(
    check_initialized: bool = True,
) -> list[ProcessGroup] | None:
    """The caller's hierarchical context-parallel groups, innermost level first."""
    groups = _facts.group_of
    levels = [groups[level] for level in families.hierarchical_cp_levels(groups)]
    if not levels and check_initialized:
        raise not_initialized("hierarchical context parallel groups", served_mesh())
    return levels or None


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: int | None = None
) -> ProcessGroup | None:
    """The caller's hybrid data+context group of ``group_size`` ranks (dp-cp's own at its size)."""
    initialized = served_mesh() is not None
    if initialized and group_size == get_data_parallel_world_size(True):
        return _facts.dp_cp_group if check_initialized else _facts.maybe.dp_cp_group
    groups = hybrid_dp_cp_groups()
    if group_size not in groups and (check_initialized or initialized):
        raise AxisError(
            f"no hybrid data+context group of {group_size} ranks; sizes are {sorted(groups)} "
            "(initialize with hybrid_context_parallel=True)"
        )
    return groups.get(group_size) if group_size is not None else None


def hybrid_dp_cp_groups() -> dict[int, ProcessGroup]:
    """megatron-core's ``_HYBRID_DP_CP_GROUPS``: the caller's hybrid data+context groups by size."""
    return {
        key.split.size: group
        for key, group in _facts.group_of.items()
        if isinstance(key, DerivedGroup) and key.base == DP_CP and isinstance(key.split, Chunks)
    }


@checked_getter
def get_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's embedding group (first and last stages by default)."""
    return _facts.embedding_group if check_initialized else _facts.maybe.embedding_group


@checked_getter
def get_position_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's position-embedding group (the first stage by default)."""
    if check_initialized:
        return _facts.position_embedding_group
    return _facts.maybe.position_embedding_group


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> ProcessGroup:
    """The FP8 amax reduction group: tensor(+context)(+data) parallel."""
    if tp_only_amax_red:
        return _facts.tp_cp_group if with_context_parallel else _facts.tp_group
    return _facts.tp_dp_cp_group if with_context_parallel else _facts.tp_dp_group


@checked_getter
def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> ProcessGroup | None:
    """The tensor+data (and context, if asked) parallel group of the caller."""
    facts = _facts if check_initialized else _facts.maybe
    return facts.tp_dp_cp_group if with_context_parallel else facts.tp_dp_group


@checked_getter
def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor+context parallel group of the caller."""
    return _facts.tp_cp_group if check_initialized else _facts.maybe.tp_cp_group


@checked_getter
def get_expert_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-model-parallel group of the caller."""
    return _facts.ep_group if check_initialized else _facts.maybe.ep_group


@checked_getter
def get_expert_tensor_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-tensor-parallel group of the caller."""
    return _facts.etp_group if check_initialized else _facts.maybe.etp_group


@checked_getter
def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """The expert tensor+model parallel group of the caller."""
    return _facts.etp_ep_group if check_initialized else _facts.maybe.etp_ep_group


@checked_getter
def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True, with_egtp_remat: bool = False
) -> ProcessGroup | None:
    """The expert tensor+model+pipeline parallel group of the caller (the same group
    ``with_egtp_remat``: meshstate's expert GTP groups hold one rank)."""
    return _facts.etp_ep_pp_group if check_initialized else _facts.maybe.etp_ep_pp_group


@checked_getter
def get_expert_data_parallel_group(
    check_initialized: bool = True, with_gtp_remat: bool = True,
    partial_expert_data_parallel: bool = False,
) -> ProcessGroup | None:
    """The expert data-parallel group of the caller (one optimizer instance's if partial;
    the same group ``with_gtp_remat``, as meshstate's GTP groups hold one rank)."""
    facts = _facts if check_initialized else _facts.maybe
    return facts.intra_edp_group if partial_expert_data_parallel else facts.edp_group


def get_expert_data_parallel_group_gloo(
    partial_expert_data_parallel: bool = False,
) -> ProcessGroup:
    """The gloo twin of the caller's expert data-parallel group."""
    return _facts.intra_edp_gloo_group if partial_expert_data_parallel else _facts.edp_gloo_group


@checked_getter
def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """All ranks of the caller's distributed-optimizer instance."""
    return _facts.dist_opt_instance_group if check_initialized else _facts.maybe.dist_opt_instance_group


@checked_getter
def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """The caller's peers in the other distributed-optimizer instances."""
    return _facts.inter_edp_group if check_initialized else _facts.maybe.inter_edp_group


# -- sizes and ranks (the hot path: one global, one attribute) ---------------------------


def get_tensor_model_parallel_world_size() -> int:
    """Size of the caller's tensor-model-parallel group."""
    return _facts.tp_size


def get_tensor_model_parallel_rank() -> int:
    """The caller's rank in its tensor-model-parallel group."""
    return _facts.tp_rank


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return _facts.pp_size


def get_pipeline_model_parallel_rank() -> int:
    """The caller's pipeline stage."""
    return _facts.pp_rank


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller is the first pipeline stage (and virtual stage 0 if asked)."""
    if ignore_virtual or served.state.vpp_size is None or _virtual_stage(vp_stage) == 0:
        return _facts.pp_rank == 0  # not `not`, which would ask a simulated world to branch
    return False


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller is the last pipeline stage (and last virtual stage if asked)."""
    vpp_size = served.state.vpp_size
    if ignore_virtual or vpp_size is None or _virtual_stage(vp_stage) == vpp_size - 1:
        return _facts.pp_rank == _facts.pp_size - 1
    return False


def get_data_parallel_world_size(
    with_context_parallel: bool = False, with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
) -> int:
    """Size of the caller's data-parallel group (0 without torch.distributed; GTP peers
    add none, ``with_gtp_remat`` or not)."""
    if with_context_parallel:
        return _facts.intra_dp_cp_size if partial_data_parallel else _facts.dp_cp_size
    return _partial_without_cp(_facts.size_of) if partial_data_parallel else _facts.dp_size


def get_data_parallel_rank(
    with_context_parallel: bool = False, with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
) -> int:
    """The caller's rank in its data-parallel group (0 without torch.distributed; the
    same ``with_gtp_remat`` or not)."""
    if with_context_parallel:
        return _facts.intra_dp_cp_rank if partial_data_parallel else _facts.dp_cp_rank
    return _partial_without_cp(_facts.rank_in) if partial_data_parallel else _facts.dp_rank


def get_context_parallel_world_size() -> int:
    """Size of the caller's context-parallel group (0 without torch.distributed)."""
    return _facts.cp_size


def get_context_parallel_rank() -> int:
    """The caller's rank in its context-parallel group (0 without torch.distributed)."""
    return _facts.cp_rank


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the caller's tensor+context group (0 without torch.distributed)."""
    return _facts.tp_cp_size


def get_tensor_and_context_parallel_rank() -> int:
    """The caller's rank in its tensor+context group (0 without torch.distributed)."""
    return _facts.tp_cp_rank


def get_expert_model_parallel_world_size() -> int:
    """Size of the caller's expert-model-parallel group (0 without torch.distributed)."""
    return _facts.ep_size


def get_expert_model_parallel_rank() -> int:
    """The caller's rank in its expert-model-parallel group (0 without torch.distributed)."""
    return _facts.ep_rank


def get_expert_tensor_parallel_world_size() -> int | None:
    """Size of the caller's expert-tensor group; before init, the tp override (maybe None)."""
    return _facts.maybe.etp_size


def get_expert_tensor_parallel_rank() -> int | None:
    """The caller's expert-tensor rank; before init, the tp rank override (maybe None)."""
    return _facts.maybe.etp_rank


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the caller's expert tensor+model group (0 without torch.distributed)."""
    return _facts.etp_ep_size


def get_expert_tensor_and_model_parallel_rank() -> int:
    """The caller's rank in its expert tensor+model group (0 without torch.distributed)."""
    return _facts.etp_ep_rank


def get_expert_data_parallel_world_size(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    """Size of the caller's expert data-parallel group (0 without torch.distributed)."""
    return _facts.intra_edp_size if partial_expert_data_parallel else _facts.edp_size


def get_expert_data_parallel_rank(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    """The caller's rank in its expert data-parallel group (0 without torch.distributed)."""
    return _facts.intra_edp_rank if partial_expert_data_parallel else _facts.edp_rank


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual pipeline stage, or ``None`` without interleaving."""
    return served.state.vpp_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual pipeline stages per rank, or ``None`` without interleaving."""
    return served.state.vpp_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual pipeline stages per rank."""
    served.state.vpp_size = world_size


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated: pass ``vp_stage`` to the stage queries instead."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
    served.state.vpp_rank = rank


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller holds word embeddings (at ``vp_stage`` if not ignoring virtual)."""
    ranks = _facts.maybe.embedding_ranks
    if ranks is None or ignore_virtual or ranks[0] != dist.get_rank() != ranks[-1]:
        return ranks is not None
    if dist.get_rank() == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    """Whether the caller holds position embeddings."""
    return _facts.maybe.position_embedding_ranks is not None
