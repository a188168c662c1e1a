"""megatron-core's ``parallel_state`` module, served by a meshstate mesh: every name, re-exported.

Legacy code switches by changing one import::

    from meshstate.megatron import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mpu.get_tensor_model_parallel_rank()
    mpu.get_data_parallel_group(with_context_parallel=True)

Every function has the installed megatron-core's name, parameters, defaults and
values, 0.19's where none is installed (:mod:`~meshstate.megatron.surface`).
This module re-exports them from the pieces that own them, and serves
megatron-core's module-level state names (``_TENSOR_MODEL_PARALLEL_GROUP``, ...)
by a module ``__getattr__`` that asks the mesh:

- :mod:`~meshstate.megatron.getters`: the getters, ``get_mesh`` and ``is_initialized``;
- :mod:`~meshstate.megatron.global_ranks`: source ranks, pipeline stages and neighbours;
- :mod:`~meshstate.megatron.gtp`: 0.19's GTP weight-remat getters and ``create_all_gather_groups``;
- :mod:`~meshstate.megatron.lifecycle`: ``initialize_model_parallel`` and
  ``destroy_model_parallel``;
- :mod:`~meshstate.megatron.facts`: what the getters read, and the ``set_*`` overrides;
- :mod:`~meshstate.megatron.rank_groups`: ``RankGenerator`` and the ``create_*group*`` helpers;
- :mod:`~meshstate.megatron.nccl`: NCCL communicator options;
- :mod:`~meshstate.megatron.buffers`: the global memory buffers.

``initialize_model_parallel`` builds one :class:`~meshstate.ParallelMesh`
(``get_mesh()``, held weakly) and the getters read its facts only, with the
``set_*`` overrides laid over them. Before init, and after
``destroy_model_parallel``, the facts give megatron-core's answers and errors;
the mesh keeps the facts served from it, so once it is destroyed, by
``destroy_model_parallel`` or by ``get_mesh().destroy()``, they raise, and no
answer outlives its mesh.
Only the values megatron-core itself keeps beside its groups live in the façade:
the overrides, the virtual pipeline stage and the memory buffers.

Differences from megatron-core, on purpose:

- ``destroy_model_parallel`` destroys the process groups it created (those of
  ``create_group`` and friends too, once initialised) and resets every
  module-level name (megatron-core keeps several stale global-rank lists and
  the data-parallel overrides).
- Identical rank sets share one process group (``etp == tp`` gives one).
- On a gloo world the gloo twins of the data-parallel groups *are* the
  data-parallel groups; NCCL communicator options (``nccl_communicator_config_path``,
  ``high_priority_stream_groups``) do not apply and are ignored with a warning;
  ``use_sharp`` and an NCCL/UCC ``pipeline_model_parallel_comm_backend`` are
  refused. On torch's fake backend every group is fake.
- ``create_group`` returns ``None`` on ranks outside the group.
- Errors are meshstate exceptions that are also ``RuntimeError`` and
  ``AssertionError`` (what megatron-core raises), with the numbers in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from meshstate.layout.layout import Key
from meshstate.megatron import buffers, facts, getters, global_ranks, gtp, lifecycle, rank_groups, surface
from meshstate.megatron import derived as families
from meshstate.megatron.buffers import *  # noqa: F403
from meshstate.megatron.buffers import _set_global_memory_buffer, _set_global_symmetric_memory_buffer
from meshstate.megatron.derived import default_embedding_ranks, default_position_embedding_ranks
from meshstate.megatron.getters import *  # noqa: F403
from meshstate.megatron.global_ranks import *  # noqa: F403
from meshstate.megatron.gtp import *  # noqa: F403
from meshstate.megatron.lifecycle import destroy_model_parallel, initialize_model_parallel, logger
from meshstate.megatron.nccl import get_nccl_options, overwrite_nccl_comm_cfgs
from meshstate.megatron.rank_groups import *  # noqa: F403
from meshstate.megatron.facts import *  # noqa: F403
from meshstate.megatron.facts import (
    DP_CP, ETP_EP, ETP_EP_PP, GLOO, OVERRIDES, TP_CP, TP_DP, TP_DP_CP, TP_PP,
)

_NEWEST = [
    *buffers.__all__, *getters.__all__, *global_ranks.__all__, *gtp.__all__, *lifecycle.__all__,
    *rank_groups.__all__, *facts.__all__, "default_embedding_ranks", "default_position_embedding_ranks",
    "get_nccl_options", "logger", "overwrite_nccl_comm_cfgs", "_set_global_memory_buffer",
    "_set_global_symmetric_memory_buffer",
]
# The names of the megatron-core version followed, for every importer (the star imports
# above are 0.19's and 0.16's, for type checkers).
_FOLLOWED = surface.parallel_state_names({name: globals()[name] for name in _NEWEST})
for _name in set(_NEWEST) - _FOLLOWED.keys():
    del globals()[_name]
globals().update(_FOLLOWED)
__all__ = sorted(name for name in _FOLLOWED if not name.startswith("_"))


# Module-level names -> the key of the group they hold, or of the global ranks.
_GROUP_NAMES: dict[str, Key] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": TP_PP,
    "_EMBEDDING_GROUP": families.EMBEDDING,
    "_POSITION_EMBEDDING_GROUP": families.POSITION_EMBEDDING,
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": GLOO["dp"],
    "_TENSOR_AND_DATA_PARALLEL_GROUP": TP_DP,
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ETP_EP,
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ETP_EP_PP,
    "_EXPERT_DATA_PARALLEL_GROUP": "edp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": GLOO["edp"],
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": families.INTRA_EDP,
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": GLOO[families.INTRA_EDP],
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": families.INTER_EDP,
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_DATA_PARALLEL_GROUP_WITH_CP": DP_CP,
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": families.DP_CP_ALL_GATHER,
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": GLOO[DP_CP],
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": families.INTRA_DP_CP,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": GLOO[families.INTRA_DP_CP],
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": TP_CP,
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": TP_DP_CP,
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": families.DIST_OPT_INSTANCE,
    "_GTP_WEIGHT_REMAT_GROUP": families.GTP_REMAT,
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": families.EXPERT_GTP_REMAT,
    # megatron-core 0.19's groups across GTP peers: the groups without, as GTP groups hold one rank
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": DP_CP,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": families.INTRA_DP_CP,
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": ETP_EP_PP,
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "edp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": families.INTRA_EDP,
}
_RANKS_NAMES: dict[str, Key] = {
    "_EMBEDDING_GLOBAL_RANKS": families.EMBEDDING,
    "_POSITION_EMBEDDING_GLOBAL_RANKS": families.POSITION_EMBEDDING,
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_MODEL_PARALLEL_GLOBAL_RANKS": TP_PP,
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": DP_CP,
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": families.GTP_REMAT,
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": families.EXPERT_GTP_REMAT,
}
_VALUE_NAMES: dict[str, Callable[[], Any]] = {
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": partial(getters.get_hierarchical_context_parallel_groups, False),
    "_HYBRID_DP_CP_GROUPS": getters.hybrid_dp_cp_groups,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": lambda: facts.state.vpp_rank,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": lambda: facts.state.vpp_size,
    "_GLOBAL_MEMORY_BUFFER": lambda: facts.state.memory_buffer,
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": lambda: facts.state.symmetric_buffer,
    "_global_process_group_list": getters.process_group_list,
}
_STATE_NAMES = surface.state_names([*_GROUP_NAMES, *_RANKS_NAMES, *_VALUE_NAMES])


def __getattr__(name: str) -> Any:
    """megatron-core's module-level state names, read from the mesh served."""
    facts = getters._facts
    if name in OVERRIDES.values:
        return OVERRIDES.values[name]
    if name not in _STATE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _GROUP_NAMES:
        return None if facts.destroyed else facts.group_of.get(_GROUP_NAMES[name])
    if name in _RANKS_NAMES:
        ranks = None if facts.destroyed else facts.ranks_of.get(_RANKS_NAMES[name])
        return None if ranks is None else list(ranks)
    return _VALUE_NAMES[name]()
