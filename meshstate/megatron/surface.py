"""Which megatron-core the Megatron façade follows, and all that differs between the two served.

The façade has the names, parameters, defaults and values of the installed
megatron-core (its version read once from the package metadata; megatron-core is
not imported), or of the newest served where none is installed:

========  ==========================================================================
follows   when megatron-core is
========  ==========================================================================
0.19      0.19 or newer, or not installed (0.19.2 is the reference)
0.16      older than 0.19 (0.16.1 is the reference; 0.17 and 0.18 are not tested)
========  ==========================================================================

The modules of the façade are written to 0.19. This module is the one place
that knows 0.16: the names 0.19 added and dropped (tables below) and, as 0.16
wrote them, the functions and methods whose parameters or values changed, each
a line or two that calls 0.19's. :func:`parallel_state_names` gives
``parallel_state`` its names; importing this module gives the two classes
0.16's methods and fields where 0.16 is followed. Example::

    FOLLOWS                     # (0, 19) with megatron-core 0.19.2 or none installed
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch.distributed as dist

from meshstate.layout.config import DEFAULT_ORDER
from meshstate.megatron import getters, global_ranks, gtp, lifecycle
from meshstate.megatron.rank_groups import RankGenerator
from meshstate.megatron.facts import checked_getter
from meshstate.megatron.hyper_comm_grid import HyperCommGrid
from meshstate.megatron.process_groups import GroupsByRole, ProcessGroupCollection, describe_field

ProcessGroup = dist.ProcessGroup


def _installed() -> tuple[int, int] | None:
    """(major, minor) of the installed megatron-core, or ``None``."""
    try:
        major, minor = metadata.version("megatron-core").split(".")[:2]
    except metadata.PackageNotFoundError:
        return None
    return int(major), int(minor)


INSTALLED = _installed()
FOLLOWS: tuple[int, int] = (0, 16) if INSTALLED is not None and INSTALLED < (0, 19) else (0, 19)

ADDED_IN_0_19 = frozenset(gtp.__all__)
"""``parallel_state`` names 0.19 added (0.17's are parameters: ``rank_offset``, ``local_world_size``)."""
DROPPED_IN_0_19 = frozenset({
    "is_unitialized", "get_data_modulo_expert_parallel_group", "has_separate_all_gather_group",
    "GlobalSymmetricMemoryBuffer", "get_global_symmetric_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
    "_set_global_symmetric_memory_buffer", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",
})
"""``parallel_state`` names 0.19 dropped."""
STATE_NAMES_ADDED_IN_0_19 = frozenset({
    "_GTP_WEIGHT_REMAT_GROUP", "_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP", "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
})
"""``parallel_state``'s module-level state names 0.19 added."""
FIELDS_ADDED_IN_0_19 = (
    "tp_ep_pp_with_egtp_remat", "dp_cp_gtp_remat", "dp_cp_ag", "gtp_remat", "expt_gtp_remat",
    "expt_dp_gtp_remat", "expt_dp_ag",
)
"""``ProcessGroupCollection`` fields 0.19 added."""
DDP_KEYS_ADDED_IN_0_19 = ("gtp_remat_group", "expt_gtp_remat_group")
OPTIMIZER_KEYS_ADDED_IN_0_19 = (*DDP_KEYS_ADDED_IN_0_19, "expt_tp_pp_with_egtp_remat_group")
"""Roles 0.19's ``setup_process_groups_for_ddp`` and ``_for_optimizer`` added."""
GRID_METHODS_ADDED_IN_0_19 = ("register_view", "destroy", "is_current_rank_in_grid")


# -- parallel_state as 0.16 wrote it ------------------------------------------------------


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: Callable[..., list[int]] | None = None,
    get_position_embedding_ranks: Callable[..., list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
) -> None:
    """0.16's: no GTP, rank offset or local world; ``create_all_gather_group`` builds a
    second data+context group (``get_data_parallel_group(True, independent_all_gather=True)``)."""
    lifecycle.build_model_parallel(lifecycle.ModelParallelArguments(**locals()))


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> ProcessGroup:
    """0.16's: ``independent_all_gather`` gives the separate data+context all-gather group.
    The plain questions read the facts here: a second call would cost twice megatron-core's."""
    if partial_data_parallel:
        return getters.get_data_parallel_group(with_context_parallel, partial_data_parallel=True)
    if not with_context_parallel:
        return getters._facts.dp_group
    return getters._facts.dp_cp_all_gather_group if independent_all_gather else getters._facts.dp_cp_group


def has_separate_all_gather_group() -> bool:
    """0.16's: whether a separate data+context all-gather group was created."""
    return getters._facts.maybe.dp_cp_all_gather_group is not None


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """0.16's: size of the caller's data-parallel group (0 without torch.distributed)."""
    if partial_data_parallel:
        return getters.get_data_parallel_world_size(with_context_parallel, partial_data_parallel=True)
    return getters._facts.dp_cp_size if with_context_parallel else getters._facts.dp_size


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """0.16's: the caller's rank in its data-parallel group (0 without torch.distributed)."""
    if partial_data_parallel:
        return getters.get_data_parallel_rank(with_context_parallel, partial_data_parallel=True)
    return getters._facts.dp_cp_rank if with_context_parallel else getters._facts.dp_rank


@checked_getter
def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> ProcessGroup | None:
    """0.16's: the expert data-parallel group of the caller (one optimizer instance's if partial)."""
    return getters.get_expert_data_parallel_group(
        check_initialized, partial_expert_data_parallel=partial_expert_data_parallel)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> ProcessGroup:
    """0.16's, deprecated: ``get_expert_data_parallel_group``."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use "
                  "get_expert_data_parallel_group instead.", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """0.16's: size of the caller's expert data-parallel group (0 without torch.distributed)."""
    return getters.get_expert_data_parallel_world_size(
        partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """0.16's: the caller's rank in its expert data-parallel group (0 without torch.distributed)."""
    return getters.get_expert_data_parallel_rank(partial_expert_data_parallel=partial_expert_data_parallel)


@checked_getter
def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """0.16's: the expert tensor+model+pipeline parallel group of the caller."""
    return getters.get_expert_tensor_model_pipeline_parallel_group(check_initialized)


def is_unitialized() -> bool:
    """0.16's, deprecated: ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning,
                  stacklevel=2)
    return not getters.is_initialized()


def get_all_ranks() -> str:
    """0.16's: the caller's tp, dp, cp, pp and ep ranks as ``"tp_dp_cp_pp_ep"``."""
    return "_".join(part for index, part in enumerate(global_ranks.get_all_ranks().split("_")) if index != 1)


_NAMES_OF_0_16 = (
    "initialize_model_parallel", "get_data_parallel_group", "has_separate_all_gather_group",
    "get_data_parallel_world_size", "get_data_parallel_rank", "get_expert_data_parallel_group",
    "get_data_modulo_expert_parallel_group", "get_expert_data_parallel_world_size",
    "get_expert_data_parallel_rank", "get_expert_tensor_model_pipeline_parallel_group",
    "is_unitialized", "get_all_ranks",
)
"""The functions above: 0.16's, where its names or parameters differ from 0.19's."""


def parallel_state_names(newest: dict[str, Any]) -> dict[str, Any]:
    """``parallel_state``'s names in the version followed, from ``newest`` (0.19's and
    the names 0.19 dropped)."""
    if FOLLOWS >= (0, 19):
        return {name: value for name, value in newest.items() if name not in DROPPED_IN_0_19}
    names = {name: value for name, value in newest.items() if name not in ADDED_IN_0_19}
    return names | {name: globals()[name] for name in _NAMES_OF_0_16}


def state_names(newest: Sequence[str]) -> frozenset[str]:
    """The module-level state names of ``newest`` (0.19's and 0.16's) in the version followed."""
    dropped = DROPPED_IN_0_19 if FOLLOWS >= (0, 19) else STATE_NAMES_ADDED_IN_0_19
    return frozenset(newest) - dropped


# -- HyperCommGrid and ProcessGroupCollection as 0.16 wrote them ----------------------------


def _follow_0_16() -> None:
    """Give the two classes 0.16's methods, fields and unset-field reads."""
    newest_create_pg, newest_get_pg, newest_enum = (
        HyperCommGrid.create_pg, HyperCommGrid.get_pg, HyperCommGrid.get_rank_enum)

    def create_pg(self: HyperCommGrid, dims: str | Sequence[str], *, timeout: timedelta | None = None,
                  pg_options: Any = None, group_desc: str | None = None) -> ProcessGroup | None:
        return newest_create_pg(self, dims, timeout=timeout, pg_options=pg_options, group_desc=group_desc)

    def get_pg(self: HyperCommGrid, dims: str | Sequence[str]) -> ProcessGroup | None:
        return newest_get_pg(self, dims)

    def get_rank_enum(self: HyperCommGrid, dims: str | Sequence[str]) -> list[list[int]]:
        return newest_enum(self, dims)

    def _order_dims(self: HyperCommGrid, dims: str | Sequence[str]) -> tuple[list[str], str]:
        """0.16's: ``dims`` in reversed ``dim_names`` order, and their key (0.19's
        ``_order_dims_for(dim_names, dims)``, which the grid keeps)."""
        return self._order_dims_for(self.dim_names, dims)

    for method in (create_pg, get_pg, get_rank_enum):
        method.__doc__ = getattr(HyperCommGrid, method.__name__).__doc__
        setattr(HyperCommGrid, method.__name__, method)
    HyperCommGrid._order_dims = _order_dims  # type: ignore[attr-defined]
    for name in GRID_METHODS_ADDED_IN_0_19:
        delattr(HyperCommGrid, name)
    _follow_0_16_collection()
    _follow_0_16_rank_generator()


def _follow_0_16_rank_generator() -> None:
    newest_init = RankGenerator.__init__

    def __init__(self: RankGenerator, tp: int, ep: int, dp: int, pp: int, cp: int, order: str,
                 rank_offset: int = 0) -> None:
        newest_init(self, tp, ep, dp, pp, cp, order, rank_offset)

    RankGenerator.__init__ = __init__  # type: ignore[method-assign, assignment]
    RankGenerator.gtp_axis = ()  # no GTP axis in 0.16's orders
    del RankGenerator.get_gtp_ranks


def _follow_0_16_collection() -> None:
    newest_ddp = ProcessGroupCollection.setup_process_groups_for_ddp
    newest_optimizer = ProcessGroupCollection.setup_process_groups_for_optimizer

    def setup_process_groups_for_ddp(
        pg_collection: ProcessGroupCollection | None, config: Any, ddp_config: Any
    ) -> GroupsByRole:
        return _without(newest_ddp(pg_collection, config, ddp_config), DDP_KEYS_ADDED_IN_0_19)

    def setup_process_groups_for_optimizer(
        pg_collection: ProcessGroupCollection | None, model_chunks: list[Any],
        use_gloo_process_groups: bool = True,
    ) -> GroupsByRole:
        groups = newest_optimizer(pg_collection, model_chunks, use_gloo_process_groups)
        return _without(groups, OPTIMIZER_KEYS_ADDED_IN_0_19)

    def __repr__(self: ProcessGroupCollection) -> str:
        present = [describe_field(field.name, vars(self)[field.name]) or f"{field.name}(None)"
                   for field in dataclasses.fields(self) if field.name in vars(self)]
        return f"ProcessGroupCollection({', '.join(present) or 'empty'})"

    for setup in (setup_process_groups_for_ddp, setup_process_groups_for_optimizer):
        setup.__doc__ = getattr(ProcessGroupCollection, setup.__name__).__doc__
        setattr(ProcessGroupCollection, setup.__name__, staticmethod(setup))
    ProcessGroupCollection.__repr__ = __repr__  # type: ignore[method-assign]
    del ProcessGroupCollection.__getattr__, ProcessGroupCollection.is_gtp_remat_active
    for name in FIELDS_ADDED_IN_0_19:
        del ProcessGroupCollection.__dataclass_fields__[name]  # dataclasses.fields() reads these


def _without(groups: GroupsByRole, roles: Sequence[str]) -> GroupsByRole:
    return {role: group for role, group in groups.items() if role not in roles}


if FOLLOWS < (0, 19):
    _follow_0_16()
