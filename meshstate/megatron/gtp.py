"""megatron-core 0.19's generalized tensor parallelism (GTP weight remat) getters and
``create_all_gather_groups``, answered by the mesh served.

meshstate builds GTP groups of one rank only (``gtp_remat_size=1``, megatron-core's
default, which it also builds as groups of one rank): ``initialize_model_parallel``
refuses larger sizes, since megatron-core's GTP axis sits between ``tp`` and ``cp``,
an axis meshstate's layout does not have. Example, on rank 5 of 8 after
``initialize_model_parallel(tensor_model_parallel_size=2)``::

    get_gtp_weight_remat_world_size(), get_gtp_weight_remat_global_ranks()   # (1, [5])
    dp_cp_ag, expt_dp_ag = create_all_gather_groups()   # a second dp-cp group of 1, 3, 5, 7; None
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate.core.groups import create_group_family
from meshstate.megatron import getters
from meshstate.megatron.errors import ParallelStateError
from meshstate.megatron.facts import checked_getter
from meshstate.megatron.nccl import get_nccl_options

__all__ = [
    "create_all_gather_groups",
    "get_expert_gtp_weight_remat_global_ranks",
    "get_expert_gtp_weight_remat_group",
    "get_expert_gtp_weight_remat_rank",
    "get_expert_gtp_weight_remat_world_size",
    "get_gtp_weight_remat_global_ranks",
    "get_gtp_weight_remat_group",
    "get_gtp_weight_remat_rank",
    "get_gtp_weight_remat_world_size",
]

ProcessGroup = dist.ProcessGroup


@checked_getter
def get_gtp_weight_remat_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's GTP weight-remat group: itself alone."""
    facts = getters._facts
    return facts.gtp_group if check_initialized else facts.maybe.gtp_group


def get_gtp_weight_remat_world_size() -> int:
    """Size of the caller's GTP weight-remat group: 1, or 0 before init."""
    return getters._facts.maybe.gtp_size or 0


def get_gtp_weight_remat_rank() -> int:
    """The caller's rank in its GTP weight-remat group: 0."""
    return getters._facts.maybe.gtp_rank or 0


@checked_getter
def get_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of the caller's GTP weight-remat group: ``[rank]``."""
    facts = getters._facts
    ranks = facts.gtp_ranks if check_initialized else facts.maybe.gtp_ranks
    return None if ranks is None else list(ranks)


@checked_getter
def get_expert_gtp_weight_remat_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's expert GTP weight-remat group: itself alone."""
    facts = getters._facts
    return facts.egtp_group if check_initialized else facts.maybe.egtp_group


def get_expert_gtp_weight_remat_world_size() -> int:
    """Size of the caller's expert GTP weight-remat group: 1, or 0 before init."""
    return getters._facts.maybe.egtp_size or 0


def get_expert_gtp_weight_remat_rank() -> int:
    """The caller's rank in its expert GTP weight-remat group: 0."""
    return getters._facts.maybe.egtp_rank or 0


@checked_getter
def get_expert_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of the caller's expert GTP weight-remat group: ``[rank]``."""
    facts = getters._facts
    ranks = facts.egtp_ranks if check_initialized else facts.maybe.egtp_ranks
    return None if ranks is None else list(ranks)


def create_all_gather_groups(
    for_expert_parallelism: bool = False,
    timeout: timedelta | None = None,
    nccl_comm_cfgs: dict[str, dict[str, Any]] | None = None,
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """Second communicators of the data+context groups (and of the expert data groups
    if ``for_expert_parallelism`` and ep > 1), for all-gathers beside reduce-scatters;
    the mesh owns them, so ``destroy_model_parallel`` ends them. Every rank calls it.

    Example: on rank 5 of 8 after ``initialize_model_parallel(tensor_model_parallel_size=2)``,
    ``create_all_gather_groups()`` is a new group of ranks 1, 3, 5, 7 and ``None``.
    """
    if not getters.is_initialized():
        raise ParallelStateError(
            "create_all_gather_groups() requires parallel state to be initialized. "
            "Call initialize_model_parallel() first."
        )
    mesh = getters.get_mesh()
    configs = nccl_comm_cfgs or {}
    families = [("dp-cp", "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_AG")]
    if for_expert_parallelism and mesh.size("ep") > 1:
        families.append(("edp", "ep_dp", "EXPERT_DATA_PARALLEL_GROUP_AG"))
    groups = [
        create_group_family(mesh.layout.every_group(key), description=description, timeout=timeout,
                            pg_options=get_nccl_options(options, configs), owner=mesh.process_groups)
        for key, options, description in families
    ]
    return groups[0], groups[1] if len(groups) > 1 else None

