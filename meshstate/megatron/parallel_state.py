"""megatron-core's ``parallel_state``, served by a meshstate mesh.

Legacy code switches by changing one import::

    from meshstate.megatron import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mpu.get_tensor_model_parallel_rank()
    mpu.get_data_parallel_group(with_context_parallel=True)

Every function has megatron-core 0.16's name, parameters, defaults and values.
``initialize_model_parallel`` builds one :class:`~meshstate.ParallelMesh`
(``get_mesh()``) and the module keeps references to it and its tables only;
every getter asks those tables (``mesh.rank_in["tp"]``), with the
``set_*`` overrides laid over them. Before init, and after
``destroy_model_parallel``, the tables are stand-ins that raise megatron-core's
errors; once the mesh is destroyed, by ``destroy_model_parallel`` or by
``get_mesh().destroy()``, its own tables raise, so no answer outlives its mesh. Only the values megatron-core itself
keeps beside its groups live here: the overrides, the virtual pipeline stage
and the memory buffers. No getter calls into ``torch.distributed``.

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

import logging
import math
import operator
import os
import sys
import warnings
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from datetime import timedelta
from functools import partial, reduce
from typing import Any, Literal, Protocol, TypeVar, cast, overload

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.megatron import derived as families
from meshstate.core.config import DEFAULT_ORDER, MeshConfig, parse_order
from meshstate.core.errors import AxisError, ConfigError, NotInitializedError, ParallelStateError
from meshstate.core.groups import GroupOptions, ProcessGroupSet, create_group_family
from meshstate.core.layout import (
    GROUP_KINDS,
    Chunks,
    DerivedGroup,
    Grid,
    Key,
    Level,
    hierarchical_levels,
)
from meshstate.megatron.derived import default_embedding_ranks, default_position_embedding_ranks
from meshstate.core.mesh import ParallelMesh, init_mesh, set_mesh

ProcessGroup = dist.ProcessGroup
T = TypeVar("T")

logger = logging.getLogger(__name__)

__all__ = [
    "GlobalMemoryBuffer",
    "GlobalSymmetricMemoryBuffer",
    "RankGenerator",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
    "destroy_model_parallel",
    "generate_masked_orthogonal_rank_groups",
    "get_all_ranks",
    "get_amax_reduction_group",
    "get_context_parallel_global_ranks",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_modulo_expert_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_embedding_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_group_gloo",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_src_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
    "get_hierarchical_context_parallel_groups",
    "get_hybrid_data_context_parallel_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group",
    "get_mesh",
    "get_model_parallel_group",
    "get_model_parallel_src_rank",
    "get_nccl_options",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "has_separate_all_gather_group",
    "initialize_model_parallel",
    "is_initialized",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "is_unitialized",
    "logger",
    "model_parallel_is_initialized",
    "overwrite_nccl_comm_cfgs",
    "set_data_parallel_rank",
    "set_expert_model_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
    "update_pg_timeout",
]


# The joint keys, interned: the mesh's tables then find them by identity (a code constant
# with a "-" is not interned, and a lookup by an equal but distinct string is slower).
_TP_PP, _TP_CP, _TP_DP, _TP_DP_CP, _DP_CP, _ETP_EP, _ETP_EP_PP = map(
    sys.intern, ("tp-pp", "tp-cp", "tp-dp", "tp-dp-cp", "dp-cp", "etp-ep", "etp-ep-pp")
)
_INTRA_DP_CP = families.INTRA_DP_CP
_INTRA_EDP = families.INTRA_EDP
_EMBEDDING = families.EMBEDDING
_GLOO = {key: families.gloo(key) for key in families.GLOO_KEYS}
# A key no mesh has: data parallel without context parallel, partial (only an override answers).
_PARTIAL_DP = "dp (partial, without cp)"

# megatron-core's name of each group, for "... is not initialized".
_WHAT: dict[Key, str] = {
    "tp": "tensor model parallel group",
    "pp": "pipeline model parallel group",
    _TP_PP: "model parallel group",
    "dp": "data parallel group",
    _PARTIAL_DP: "data parallel group",
    _DP_CP: "data parallel group with context parallel",
    _INTRA_DP_CP: "intra partial data parallel group with context parallel",
    families.DP_CP_ALL_GATHER: "all-gather data parallel group with context parallel",
    "cp": "context parallel group",
    _TP_CP: "tensor and context parallel group",
    _TP_DP: "tensor and data parallel group",
    _TP_DP_CP: "tensor and data parallel group with context parallel",
    "ep": "expert model parallel group",
    "etp": "expert tensor parallel group",
    _ETP_EP: "expert tensor and model parallel group",
    _ETP_EP_PP: "expert tensor-model-pipeline parallel group",
    "edp": "expert data parallel group",
    _INTRA_EDP: "intra partial expert data parallel group",
    families.INTER_EDP: "inter distributed optimizer instance group "
    "(needs num_distributed_optimizer_instances > 1)",
    families.DIST_OPT_INSTANCE: "intra distributed optimizer instance group",
    _EMBEDDING: "embedding group",
    families.POSITION_EMBEDDING: "position embedding group",
}
_WHAT.update({twin: f"gloo {_WHAT[key]}" for key, twin in _GLOO.items()})

# Sizes and ranks megatron-core answers with 0 before torch.distributed is initialized.
_ZERO_UNLESS_DISTRIBUTED: frozenset[Key] = frozenset(
    {"dp", _PARTIAL_DP, _DP_CP, _INTRA_DP_CP, "cp", _TP_CP, "ep", _ETP_EP, "edp", _INTRA_EDP}
)

# megatron-core's override names -> the table and the keys each answers for.
_OVERRIDDEN: dict[str, tuple[Literal["rank", "size"], tuple[Key, ...]]] = {
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": ("size", ("tp",)),
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": ("rank", ("tp",)),
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": ("size", ("pp",)),
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": ("rank", ("pp",)),
    "_MPU_DATA_PARALLEL_WORLD_SIZE": ("size", ("dp", _PARTIAL_DP, _DP_CP, _INTRA_DP_CP)),
    "_MPU_DATA_PARALLEL_RANK": ("rank", ("dp", _PARTIAL_DP, _DP_CP, _INTRA_DP_CP)),
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": ("size", ("ep",)),
    "_MPU_EXPERT_MODEL_PARALLEL_RANK": ("rank", ("ep",)),
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": ("size", ("etp",)),
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK": ("rank", ("etp",)),
}

# megatron-core's process-group names (for NCCL options) -> meshstate keys.
_NCCL_CONFIG_KEYS: dict[str, tuple[Key, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": (_TP_PP,),
    "tp_cp": (_TP_CP,),
    "tp_dp": (_TP_DP,),
    "tp_dp_cp": (_TP_DP_CP,),
    "ep": ("ep",),
    "ep_tp": ("etp",),
    "tp_ep_mp": (_ETP_EP,),
    "tp_ep_pp": (_ETP_EP_PP,),
    "ep_dp": ("edp",),
    "embd": (_EMBEDDING,),
    "pos_embd": (families.POSITION_EMBEDDING,),
    "intra_dp_cp": (_INTRA_DP_CP,),
    "intra_ep_dp": (_INTRA_EDP,),
    "inter_ep_dp": (families.INTER_EDP,),
    "intra_dist_opt_instance": (families.DIST_OPT_INSTANCE,),
}


class GlobalMemoryBuffer:
    """Named scratch tensors reused between calls to avoid allocations.

    Example: ``buffer.get_tensor((4, 8), torch.float16, "mpu")`` returns a
    view of a buffer of at least 32 elements, grown when a larger one is asked.
    Tensors live on the current CUDA device when CUDA is available, else on CPU.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        """A tensor of ``tensor_shape`` and ``dtype`` backed by the buffer ``name``."""
        required = reduce(operator.mul, tensor_shape, 1)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < required:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
            with mem_alloc_context() if mem_alloc_context else nullcontext():
                current = torch.empty(required, dtype=dtype, device=device, requires_grad=False)
            self.buffer[(name, dtype)] = current
        return current[:required].view(*tensor_shape)


class GlobalSymmetricMemoryBuffer:
    """Symmetric memory over a group for low-latency NVLink collectives.

    Where symmetric memory is unavailable (no CUDA, or the group is not on one
    NVLink domain) the buffer is absent and ``maybe_get_tensor`` returns
    ``{"tensor": None, "handle": None}``, as in megatron-core.
    """

    def __init__(self, size_in_mb: float, process_group: ProcessGroup) -> None:
        self.symm_buffer, self.symm_mem_hdl = _compat.symmetric_memory(
            int(size_in_mb * 1024 * 1024), process_group
        )

    def maybe_get_tensor(
        self, tensor_shape: Sequence[int], dtype: torch.dtype
    ) -> dict[str, Any]:
        """A tensor backed by symmetric memory and its handle, or ``None``s."""
        numel = reduce(operator.mul, tensor_shape, 1)
        needed = numel * torch.tensor([], dtype=dtype).element_size()
        if self.symm_buffer is None or needed > self.symm_buffer.numel():
            return {"tensor": None, "handle": None}
        tensor = self.symm_buffer[:needed].view(dtype).view(*tensor_shape)
        return {"tensor": tensor, "handle": self.symm_mem_hdl}


class _NotInitialized(dict[Key, Any]):
    """A table before init: empty, and a lookup by ``[]`` is megatron-core's answer.

    That answer is an error naming the group or, for the sizes and ranks that
    megatron-core gives as 0 while torch.distributed is not initialized, 0.
    ``get`` answers ``None``, as for a group the caller is not in.
    """

    def __init__(self, zero_keys: frozenset[Key] = frozenset()) -> None:
        super().__init__()
        self.zero_keys = zero_keys

    def __missing__(self, key: Key) -> Any:
        if key in self.zero_keys and not dist.is_initialized():
            return 0
        raise _not_initialized(_WHAT[key])


def _tables(
    mesh: ParallelMesh | None, overrides: Mapping[str, int | None]
) -> tuple[Mapping[Key, int], Mapping[Key, int], Mapping[Key, ProcessGroup], Mapping[Key, Sequence[int]]]:
    """The rank, size, group and member tables of ``mesh``, under the overrides.

    The tables are the mesh's own (``mesh.rank_in``, ...) or, before init,
    :class:`_NotInitialized` stand-ins; the ``set_*`` overrides are laid over
    the rank and size tables where any is set.
    """
    layers: dict[str, dict[Key, int]] = {"rank": {}, "size": {}}
    for name, value in overrides.items():
        if value is not None:
            table, keys = _OVERRIDDEN[name]
            layers[table].update(dict.fromkeys(keys, value))
    for layer in layers.values():
        if mesh is None and "tp" in layer:  # megatron-core's etp falls back to the tp override
            layer.setdefault("etp", layer["tp"])
    if mesh is None:
        return (
            _layered(layers["rank"], _NotInitialized(_ZERO_UNLESS_DISTRIBUTED)),
            _layered(layers["size"], _NotInitialized(_ZERO_UNLESS_DISTRIBUTED)),
            _NotInitialized(),
            _NotInitialized(),
        )
    return (
        _layered(layers["rank"], mesh.rank_in),
        _layered(layers["size"], mesh.size_of),
        mesh.group_of,
        mesh.ranks_of,
    )


def _layered(overrides: dict[Key, int], table: dict[Key, int]) -> Mapping[Key, int]:
    return ChainMap(overrides, table) if overrides else table


# The `set_*` overrides, by megatron-core's module-level name: plain values, settable before init.
_overrides: dict[str, int | None] = dict.fromkeys(_OVERRIDDEN)
# The mesh served and its tables: references to the mesh's own state, rebound together.
_mesh: ParallelMesh | None = None
_rank_in, _size_of, _group_of, _ranks_of = _tables(None, _overrides)
_vpp_rank: int | None = None
_vpp_size: int | None = None
_memory_buffer: GlobalMemoryBuffer | None = None
_symmetric_buffer: GlobalSymmetricMemoryBuffer | None = None


def _serve(mesh: ParallelMesh | None) -> None:
    global _mesh, _rank_in, _size_of, _group_of, _ranks_of, _facts
    _mesh = mesh
    _rank_in, _size_of, _group_of, _ranks_of = _tables(mesh, _overrides)
    overridden = any(value is not None for value in _overrides.values())
    _facts = cast(_GetterFacts, mesh.facts if mesh is not None and not overridden else _TABLE_FACTS)


class _TableFacts:
    """The tables above read by attribute, as a mesh's ``facts`` are (``tp_rank`` is
    ``_rank_in["tp"]``): what the getters read before init or under a ``set_*`` override.
    """

    def __getattr__(self, name: str) -> Any:
        ident, _, field = name.rpartition("_")
        tables = {"rank": _rank_in, "size": _size_of, "group": _group_of, "ranks": _ranks_of}
        if field not in tables or ident not in _KEY_OF_IDENT:
            raise AttributeError(f"no table answers {name!r}")
        return tables[field][_KEY_OF_IDENT[ident]]


_KEY_OF_IDENT: dict[str, Key] = {
    key.replace("-", "_"): key
    for key in ("tp", "pp", "dp", "cp", "ep", "etp", "edp", _TP_PP, _TP_CP, _TP_DP, _TP_DP_CP,
                _DP_CP, _ETP_EP, _ETP_EP_PP)
}
_TABLE_FACTS = _TableFacts()


class _GetterFacts(Protocol):
    """The attributes of a mesh's ``facts`` the getters read (types for the checker)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int
    tp_cp_rank: int
    tp_cp_size: int
    dp_cp_rank: int
    dp_cp_size: int
    etp_ep_rank: int
    etp_ep_size: int
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    cp_group: ProcessGroup
    ep_group: ProcessGroup
    etp_group: ProcessGroup
    tp_cp_group: ProcessGroup
    dp_cp_group: ProcessGroup
    tp_pp_group: ProcessGroup
    etp_ep_group: ProcessGroup
    etp_ep_pp_group: ProcessGroup
    tp_ranks: Sequence[int]
    pp_ranks: Sequence[int]
    ep_ranks: Sequence[int]
    tp_pp_ranks: Sequence[int]


# What the getters read: the served mesh's own ``facts``, or the tables (overrides, no mesh).
_facts: _GetterFacts = cast(_GetterFacts, _TABLE_FACTS)


def _not_initialized(what: str) -> NotInitializedError:
    if _mesh is not None and _mesh.destroyed_at is not None:
        return NotInitializedError(
            f"{what} is gone: its mesh was destroyed at {_mesh.destroyed_at}; call "
            "initialize_model_parallel() again"
        )
    return NotInitializedError(
        f"{what} is not initialized; call initialize_model_parallel() first"
    )


@overload
def _checked(value: T | None, check_initialized: Literal[True], what: str) -> T: ...
@overload
def _checked(value: T | None, check_initialized: bool, what: str) -> T | None: ...
def _checked(value: T | None, check_initialized: bool, what: str) -> T | None:
    if value is None and check_initialized:
        raise _not_initialized(what)
    return value


@overload
def _group(key: Key, check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def _group(key: Key, check_initialized: bool) -> ProcessGroup | None: ...
def _group(key: Key, check_initialized: bool = True) -> ProcessGroup | None:
    return _checked(_group_of.get(key), check_initialized, _WHAT[key])


def _global_rank_list(key: Key) -> list[int] | None:
    """megatron-core's list of the caller's group's global ranks, or ``None``."""
    ranks = _ranks_of.get(key)
    return None if ranks is None else list(ranks)


def _partial_without_cp(table: Mapping[Key, int]) -> int:
    """Partial data parallel without cp: an override, the answer before init, or an error."""
    try:
        return table[_PARTIAL_DP]
    except KeyError:
        raise ParallelStateError("Partial DP for Optimizer needs to include CP") from None


def _virtual_stage(vp_stage: int | None) -> int:
    if vp_stage is None:
        raise ParallelStateError("vp_stage must be passed if virtual pipeline is enabled")
    return vp_stage


# -- lifecycle -------------------------------------------------------------------------


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
    """Build every Megatron group on the calling rank; every rank must call it.

    Takes megatron-core's parameters (see its docs): e.g. on 16 ranks with
    ``tensor_model_parallel_size=2, pipeline_model_parallel_size=4`` the tensor
    groups are ``[0, 1], [2, 3], ...`` and the pipelines ``[0, 4, 8, 12], ...``.
    ``distributed_timeout_minutes`` reaches every group.
    """
    global _vpp_rank, _vpp_size, _memory_buffer
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    if is_initialized():
        raise ParallelStateError(
            "model parallel state is already initialized; call destroy_model_parallel() first"
        )
    if _mesh is not None:  # its mesh was destroyed behind this module's back: start afresh
        destroy_model_parallel()
    if not dist.is_initialized():
        raise ParallelStateError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group first"
        )
    sharp_group = _check_sharp(use_sharp, sharp_enabled_group, num_distributed_optimizer_instances)
    try:
        config = MeshConfig(
            dist.get_world_size(),
            order=order,
            tp=tensor_model_parallel_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size,
            pp=pipeline_model_parallel_size,
        )
    except ConfigError as error:
        raise ParallelStateError(str(error)) from None
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size <= 1:
        raise ParallelStateError(
            "pipeline-model-parallel size should be greater than 1 with interleaved schedule, "
            f"got pipeline_model_parallel_size={pipeline_model_parallel_size} and "
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}"
        )
    derived = families.derived_groups(
        config,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        hybrid_context_parallel=hybrid_context_parallel,
        create_all_gather_group=bool(create_all_gather_group),
        create_gloo_process_groups=create_gloo_process_groups,
    )
    options = _group_options(
        derived,
        _nccl_configs(nccl_communicator_config_path, high_priority_stream_groups),
        pipeline_model_parallel_comm_backend,
    )
    mesh = init_mesh(
        **config.arguments(),
        timeout=_minutes(distributed_timeout_minutes),
        derived=derived,
        group_options=options,
        agree_on={
            "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
            "pipeline_model_parallel_comm_backend": pipeline_model_parallel_comm_backend,
            "use_sharp": use_sharp,
            "sharp_enabled_group": sharp_enabled_group,
            "hierarchical_context_parallel_sizes": hierarchical_context_parallel_sizes,
            "num_distributed_optimizer_instances": num_distributed_optimizer_instances,
            "get_embedding_ranks": _name_of(get_embedding_ranks),
            "get_position_embedding_ranks": _name_of(get_position_embedding_ranks),
            "create_gloo_process_groups": create_gloo_process_groups,
        },
    )
    if sharp_group is not None:
        _enable_sharp(mesh.group_of.get(sharp_group))
    if virtual_pipeline_model_parallel_size is not None:
        _vpp_rank, _vpp_size = 0, virtual_pipeline_model_parallel_size
    _memory_buffer = GlobalMemoryBuffer()
    _serve(mesh)
    set_mesh(mesh)
    logger.debug("initialized model parallel state: %r", mesh)


def _minutes(minutes: object) -> timedelta:
    """``distributed_timeout_minutes`` as a timedelta; a ParallelStateError unless a positive number."""
    if isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes > 0:
        try:
            return timedelta(minutes=minutes)
        except OverflowError:
            pass
    raise ParallelStateError(
        f"distributed_timeout_minutes must be a positive number, got {minutes!r}"
    )


def _name_of(function: Callable[..., object] | None) -> str | None:
    if function is None:
        return None
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', repr(function))}"


def destroy_model_parallel() -> None:
    """Destroy the groups and reset every value; safe to call when not initialized."""
    global _vpp_rank, _vpp_size, _memory_buffer, _symmetric_buffer
    mesh = _mesh
    _overrides.update(dict.fromkeys(_overrides))
    _vpp_rank = _vpp_size = _memory_buffer = _symmetric_buffer = None
    _serve(None)
    if mesh is not None:
        mesh.destroy()


def get_mesh() -> ParallelMesh:
    """The :class:`~meshstate.ParallelMesh` behind every getter."""
    return _checked(_mesh if is_initialized() else None, True, "model parallel state")


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run and its mesh is not destroyed."""
    return _mesh is not None and _mesh.destroyed_at is None


def is_unitialized() -> bool:
    """Deprecated: ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2)
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """Whether the model- and data-parallel groups exist."""
    return is_initialized()


def _check_sharp(use_sharp: bool, sharp_enabled_group: str | None, instances: int) -> Key | None:
    if not use_sharp:
        if sharp_enabled_group is not None:
            raise ParallelStateError("sharp_enabled_group is only valid when use_sharp is True")
        return None
    group = sharp_enabled_group or "dp"
    if group not in ("dp", "dp_replica"):
        raise ParallelStateError(
            f"sharp_enabled_group must be 'dp' or 'dp_replica', got {sharp_enabled_group!r}"
        )
    if group == "dp_replica" and instances <= 1:
        raise ParallelStateError(
            "sharp_enabled_group='dp_replica' needs num_distributed_optimizer_instances > 1, "
            f"got {instances}"
        )
    backend = str(dist.get_backend())
    if "nccl" not in backend:
        raise ParallelStateError(f"use_sharp needs the NCCL backend; this world runs {backend}")
    if _compat.bound_device(_compat.default_group()) is not None:
        raise ParallelStateError(
            "use_sharp needs lazily created NCCL communicators; do not pass device_id "
            "to init_process_group"
        )
    return _DP_CP if group == "dp" else families.INTER_EDP


def _enable_sharp(group: ProcessGroup | None) -> None:
    """Initialise ``group``'s communicator first, with NCCL's CollNet (SHARP) on."""
    os.environ["NCCL_COLLNET_ENABLE"] = "1"
    try:
        if group is not None:
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
    finally:
        os.environ.pop("NCCL_COLLNET_ENABLE", None)


def _nccl_configs(path: str | None, high_priority: list[str] | None) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ParallelStateError(
                "nccl_communicator_config_path needs the yaml package (pip install pyyaml)"
            ) from None
        with open(path) as stream:
            configs = yaml.safe_load(stream) or {}
    for name in high_priority or []:
        overwrite_nccl_comm_cfgs(configs, name, ("is_high_priority_stream", True))
    return configs


def _nccl_keys(pg_name: str, derived: Sequence[DerivedGroup]) -> tuple[Key, ...]:
    """The declared keys whose groups megatron-core's communicator config ``pg_name`` reaches."""
    if pg_name == "hcp":
        return tuple(spec for spec in derived if isinstance(spec.split, Level))
    if pg_name == "dp_cp":
        return (_DP_CP,) + tuple(
            spec for spec in derived
            if spec.base == _DP_CP and (spec.separate or isinstance(spec.split, Chunks))
        )
    declared = set(GROUP_KINDS) | {spec.lookup for spec in derived}
    return tuple(key for key in _NCCL_CONFIG_KEYS.get(pg_name, ()) if key in declared)


def _group_options(
    derived: Sequence[DerivedGroup], configs: dict[str, dict[str, Any]], pp_backend: str | None
) -> dict[Key, GroupOptions]:
    backend = str(dist.get_backend())
    simulated = backend == "fake"
    options: dict[Key, dict[str, Any]] = {}
    if configs and "nccl" not in backend and not simulated:
        warnings.warn(
            f"NCCL communicator options {sorted(configs)} have no effect on the {backend} "
            "backend; ignoring them",
            stacklevel=3,
        )
    elif configs and not simulated:
        for pg_name in configs:
            for key in _nccl_keys(pg_name, derived):
                options.setdefault(key, {})["pg_options"] = get_nccl_options(pg_name, configs)
    if pp_backend not in (None, "nccl", "ucc"):
        raise ParallelStateError(
            f'"{pp_backend}" backend for PP communication is not supported; use "nccl" or "ucc"'
        )
    if pp_backend is not None and not simulated and pp_backend not in backend:
        available = dist.is_nccl_available() if pp_backend == "nccl" else dist.is_ucc_available()
        if not available or not torch.cuda.is_available():
            raise ParallelStateError(
                f"pipeline_model_parallel_comm_backend={pp_backend!r} is not available here; "
                f"this world runs {backend}"
            )
        options.setdefault("pp", {})["backend"] = pp_backend
        if pp_backend == "ucc":
            options["pp"].pop("pg_options", None)
    return {key: GroupOptions(**values) for key, values in options.items()}


# -- groups ----------------------------------------------------------------------------


@overload
def get_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The model-parallel (tensor + pipeline) group of the caller."""
    return _facts.tp_pp_group if check_initialized else _group_of.get(_TP_PP)


@overload
def get_tensor_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_tensor_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor-model-parallel group of the caller."""
    return _facts.tp_group if check_initialized else _group_of.get("tp")


@overload
def get_pipeline_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_pipeline_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_pipeline_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The pipeline-model-parallel group of the caller."""
    return _facts.pp_group if check_initialized else _group_of.get("pp")


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> ProcessGroup:
    """The data-parallel group of the caller, with context parallel if asked.

    ``partial_data_parallel`` gives the group inside one distributed-optimizer
    instance; ``independent_all_gather`` the separate all-gather communicator.
    """
    if not with_context_parallel:
        return _partial_dp_group("dp") if partial_data_parallel else _facts.dp_group
    if independent_all_gather and not partial_data_parallel:
        return _group(families.DP_CP_ALL_GATHER)
    return _group_of[_INTRA_DP_CP] if partial_data_parallel else _facts.dp_cp_group


def _partial_dp_group(key: Key) -> ProcessGroup:
    if key in _group_of:
        raise ParallelStateError("Partial DP for Optimizer needs to include CP")
    return _group(key)


def has_separate_all_gather_group() -> bool:
    """Whether a separate data+context all-gather group was created."""
    return families.DP_CP_ALL_GATHER in _group_of


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup:
    """The gloo twin of the caller's data-parallel group."""
    if not with_context_parallel:
        return _partial_dp_group(_GLOO["dp"]) if partial_data_parallel else _group(_GLOO["dp"])
    return _group(_GLOO[_INTRA_DP_CP if partial_data_parallel else _DP_CP])


@overload
def get_context_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_context_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The context-parallel group of the caller."""
    return _facts.cp_group if check_initialized else _group_of.get("cp")


@overload
def get_context_parallel_global_ranks(check_initialized: Literal[True] = True) -> list[int]: ...
@overload
def get_context_parallel_global_ranks(check_initialized: bool) -> list[int] | None: ...
def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of the caller's context-parallel group."""
    return _checked(_global_rank_list("cp"), check_initialized, _WHAT["cp"])


@overload
def get_hierarchical_context_parallel_groups(
    check_initialized: Literal[True] = True,
) -> list[ProcessGroup]: ...
@overload
def get_hierarchical_context_parallel_groups(
    check_initialized: bool,
) -> list[ProcessGroup] | None: ...
def get_hierarchical_context_parallel_groups(
    check_initialized: bool = True,
) -> list[ProcessGroup] | None:
    """The caller's hierarchical context-parallel groups, innermost level first."""
    levels = families.hierarchical_cp_levels(_group_of)
    return _checked(
        [_group_of[level] for level in levels] or None,
        check_initialized,
        "hierarchical context parallel groups",
    )


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: int | None = None
) -> ProcessGroup | None:
    """The caller's hybrid data+context group of ``group_size`` ranks (dp-cp's own at its size)."""
    return _hybrid_group(group_size, check_initialized)


def _hybrid_dp_cp_groups() -> dict[int, ProcessGroup]:
    """megatron-core's ``_HYBRID_DP_CP_GROUPS``: the caller's hybrid data+context groups by size."""
    return {
        key.split.size: group
        for key, group in _group_of.items()
        if isinstance(key, DerivedGroup) and key.base == _DP_CP and isinstance(key.split, Chunks)
    }


def _hybrid_group(size: int | None, check_initialized: bool) -> ProcessGroup | None:
    if _mesh is not None and size == get_data_parallel_world_size(True):
        return _group(_DP_CP, check_initialized)
    groups = _hybrid_dp_cp_groups()
    if size not in groups and (check_initialized or _mesh is not None):
        raise AxisError(
            f"no hybrid data+context group of {size} ranks; sizes are {sorted(groups)} "
            "(initialize with hybrid_context_parallel=True)"
        )
    return groups.get(size) if size is not None else None


@overload
def get_embedding_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_embedding_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's embedding group (first and last stages by default)."""
    return _group(_EMBEDDING, check_initialized)


@overload
def get_position_embedding_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_position_embedding_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_position_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's position-embedding group (the first stage by default)."""
    return _group(families.POSITION_EMBEDDING, check_initialized)


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> ProcessGroup:
    """The FP8 amax reduction group: tensor(+context)(+data) parallel."""
    with_data = _TP_DP_CP if with_context_parallel else _TP_DP
    return _group((_TP_CP if with_context_parallel else "tp") if tp_only_amax_red else with_data)


@overload
def get_tensor_and_data_parallel_group(
    check_initialized: Literal[True] = True, with_context_parallel: bool = False
) -> ProcessGroup: ...
@overload
def get_tensor_and_data_parallel_group(
    check_initialized: bool, with_context_parallel: bool = False
) -> ProcessGroup | None: ...
def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> ProcessGroup | None:
    """The tensor+data (and context, if asked) parallel group of the caller."""
    key = _TP_DP_CP if with_context_parallel else _TP_DP
    return _group_of[key] if check_initialized else _group_of.get(key)


@overload
def get_tensor_and_context_parallel_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_tensor_and_context_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor+context parallel group of the caller."""
    return _facts.tp_cp_group if check_initialized else _group_of.get(_TP_CP)


@overload
def get_expert_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_expert_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_expert_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-model-parallel group of the caller."""
    return _facts.ep_group if check_initialized else _group_of.get("ep")


@overload
def get_expert_tensor_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_expert_tensor_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_expert_tensor_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-tensor-parallel group of the caller."""
    return _facts.etp_group if check_initialized else _group_of.get("etp")


@overload
def get_expert_tensor_and_model_parallel_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool,
) -> ProcessGroup | None: ...
def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """The expert tensor+model parallel group of the caller."""
    return _facts.etp_ep_group if check_initialized else _group_of.get(_ETP_EP)


@overload
def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool,
) -> ProcessGroup | None: ...
def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """The expert tensor+model+pipeline parallel group of the caller."""
    return _facts.etp_ep_pp_group if check_initialized else _group_of.get(_ETP_EP_PP)


@overload
def get_expert_data_parallel_group(
    check_initialized: Literal[True] = True, partial_expert_data_parallel: bool = False
) -> ProcessGroup: ...
@overload
def get_expert_data_parallel_group(
    check_initialized: bool, partial_expert_data_parallel: bool = False
) -> ProcessGroup | None: ...
def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> ProcessGroup | None:
    """The expert data-parallel group of the caller (one optimizer instance's if partial)."""
    key = _INTRA_EDP if partial_expert_data_parallel else "edp"
    return _group_of[key] if check_initialized else _group_of.get(key)


def get_data_modulo_expert_parallel_group(
    partial_expert_data_parallel: bool = False,
) -> ProcessGroup:
    """Deprecated: ``get_expert_data_parallel_group``."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use "
        "get_expert_data_parallel_group instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return get_expert_data_parallel_group(
        partial_expert_data_parallel=partial_expert_data_parallel
    )


def get_expert_data_parallel_group_gloo(
    partial_expert_data_parallel: bool = False,
) -> ProcessGroup:
    """The gloo twin of the caller's expert data-parallel group."""
    return _group(_GLOO[_INTRA_EDP if partial_expert_data_parallel else "edp"])


@overload
def get_intra_distributed_optimizer_instance_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool,
) -> ProcessGroup | None: ...
def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """All ranks of the caller's distributed-optimizer instance."""
    key = families.DIST_OPT_INSTANCE
    return _group_of[key] if check_initialized else _group_of.get(key)


@overload
def get_inter_distributed_optimizer_instance_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool,
) -> ProcessGroup | None: ...
def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> ProcessGroup | None:
    """The caller's peers in the other distributed-optimizer instances."""
    return _group(families.INTER_EDP, check_initialized)


# -- sizes and ranks (the hot path: one global, one attribute, one subscript) ------------


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
    if ignore_virtual or _vpp_size is None or _virtual_stage(vp_stage) == 0:
        return not _facts.pp_rank
    return False


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller is the last pipeline stage (and last virtual stage if asked)."""
    if ignore_virtual or _vpp_size is None or _virtual_stage(vp_stage) == _vpp_size - 1:
        return _facts.pp_rank == _facts.pp_size - 1
    return False


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Size of the caller's data-parallel group (0 without torch.distributed)."""
    if with_context_parallel:
        return _size_of[_INTRA_DP_CP] if partial_data_parallel else _facts.dp_cp_size
    return _partial_without_cp(_size_of) if partial_data_parallel else _facts.dp_size


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """The caller's rank in its data-parallel group (0 without torch.distributed)."""
    if with_context_parallel:
        return _rank_in[_INTRA_DP_CP] if partial_data_parallel else _facts.dp_cp_rank
    return _partial_without_cp(_rank_in) if partial_data_parallel else _facts.dp_rank


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
    return _size_of.get("etp")


def get_expert_tensor_parallel_rank() -> int | None:
    """The caller's expert-tensor rank; before init, the tp rank override (maybe None)."""
    return _rank_in.get("etp")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the caller's expert tensor+model group (0 without torch.distributed)."""
    return _facts.etp_ep_size


def get_expert_tensor_and_model_parallel_rank() -> int:
    """The caller's rank in its expert tensor+model group (0 without torch.distributed)."""
    return _facts.etp_ep_rank


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the caller's expert data-parallel group (0 without torch.distributed)."""
    return _size_of[_INTRA_EDP if partial_expert_data_parallel else "edp"]


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """The caller's rank in its expert data-parallel group (0 without torch.distributed)."""
    return _rank_in[_INTRA_EDP if partial_expert_data_parallel else "edp"]


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual pipeline stage, or ``None`` without interleaving."""
    return _vpp_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual pipeline stages per rank, or ``None`` without interleaving."""
    return _vpp_size


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller holds word embeddings (at ``vp_stage`` if not ignoring virtual)."""
    ranks = _ranks_of.get(_EMBEDDING)
    if ranks is None or ignore_virtual or ranks[0] != dist.get_rank() != ranks[-1]:
        return ranks is not None
    if dist.get_rank() == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    """Whether the caller holds position embeddings."""
    return families.POSITION_EMBEDDING in _ranks_of


# -- global ranks ----------------------------------------------------------------------


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's tensor-parallel group."""
    return _facts.tp_ranks[0]


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's model-parallel group."""
    return _facts.tp_pp_ranks[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of the caller's data-parallel group."""
    return _ranks_of[_DP_CP if with_context_parallel else "dp"][0]


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's expert-parallel group."""
    return _facts.ep_ranks[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of the caller's pipeline."""
    return _facts.pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of the caller's pipeline."""
    return _facts.pp_ranks[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage of the caller's pipeline (wrapping around)."""
    stages = _facts.pp_ranks
    return stages[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage of the caller's pipeline (wrapping around)."""
    stages = _facts.pp_ranks
    return stages[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_all_ranks() -> str:
    """The caller's tp, dp, cp, pp and ep ranks as ``"tp_dp_cp_pp_ep"``."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(rank or 0) for rank in ranks)


# -- overrides -------------------------------------------------------------------------


def _override(name: str, value: int | None) -> None:
    _overrides[name] = value
    _serve(_mesh)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-model-parallel size the getters report."""
    _override("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline-model-parallel size the getters report."""
    _override("_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-model-parallel rank the getters report."""
    _override("_MPU_TENSOR_MODEL_PARALLEL_RANK", rank)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline-model-parallel rank the getters report."""
    _override("_MPU_PIPELINE_MODEL_PARALLEL_RANK", rank)


def set_data_parallel_rank(rank: int | None) -> None:
    """Override the data-parallel rank the getters report."""
    _override("_MPU_DATA_PARALLEL_RANK", rank)


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-model-parallel size the getters report."""
    _override("_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert-model-parallel rank the getters report."""
    _override("_MPU_EXPERT_MODEL_PARALLEL_RANK", rank)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-tensor-parallel size the getters report."""
    _override("_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", world_size)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert-tensor-parallel rank the getters report."""
    _override("_MPU_EXPERT_TENSOR_PARALLEL_RANK", rank)


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual pipeline stages per rank."""
    global _vpp_size
    _vpp_size = world_size


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated: pass ``vp_stage`` to the stage queries instead."""
    global _vpp_rank
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
    _vpp_rank = rank


# -- memory buffers --------------------------------------------------------------------


def _set_global_memory_buffer() -> None:
    """Create the global memory buffer (``initialize_model_parallel`` does)."""
    global _memory_buffer
    if _memory_buffer is not None:
        raise ParallelStateError("global memory buffer is already initialized")
    _memory_buffer = GlobalMemoryBuffer()


def _set_global_symmetric_memory_buffer() -> None:
    """Create the symmetric memory buffer over the tensor-parallel group."""
    global _symmetric_buffer
    if _symmetric_buffer is not None:
        raise ParallelStateError("global symmetric memory buffer is already initialized")
    _symmetric_buffer = GlobalSymmetricMemoryBuffer(
        size_in_mb=256, process_group=get_tensor_model_parallel_group()
    )


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The global memory buffer."""
    return _checked(_memory_buffer, True, "global memory buffer")


def get_global_symmetric_memory_buffer() -> GlobalSymmetricMemoryBuffer:
    """The global symmetric memory buffer."""
    return _checked(_symmetric_buffer, True, "global symmetric memory buffer")


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer."""
    global _memory_buffer
    _memory_buffer = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer."""
    global _symmetric_buffer
    _symmetric_buffer = None


# -- group creation and rank arithmetic, as megatron-core exposes them ------------------


def _owner() -> ProcessGroupSet | None:
    """Where groups made outside the mesh go so that destroy ends them: the mesh's set."""
    return _mesh.process_groups if _mesh is not None and is_initialized() else None


def create_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup | None:
    """Create one process group of ``ranks`` (every rank of the world by default).

    Every rank calls it with the same ``ranks``; ranks outside get ``None``.
    Once initialised, the group is destroyed by ``destroy_model_parallel``.
    """
    return create_group_family(
        [range(dist.get_world_size()) if ranks is None else ranks],
        description=group_desc or "group",
        backend=backend,
        timeout=timeout,
        pg_options=pg_options,
        owner=_owner(),
    )


def create_hierarchical_groups(
    rank: int,
    ranks: list[int],
    hierarchical_group_sizes: list[int],
    create_gloo_process_groups: bool = False,
    pg_options: Any = None,
    timeout: timedelta | None = None,
    group_desc: str | None = None,
) -> tuple[list[ProcessGroup], list[ProcessGroup | None]]:
    """Create the hierarchical levels of ``ranks``; return ``rank``'s group per level.

    Level ``i`` groups ranks ``prod(sizes[:i])`` apart. Every rank calls it.
    """
    try:
        levels = hierarchical_levels(ranks, hierarchical_group_sizes)
    except ConfigError as error:
        raise ParallelStateError(str(error)) from None
    per_level = pg_options if isinstance(pg_options, list) else [pg_options] * len(levels)
    groups: list[ProcessGroup] = []
    gloo_groups: list[ProcessGroup | None] = []
    for level, parts in enumerate(levels):
        name = f"HIERARCHICAL_{group_desc}_L{level}"
        group = create_group_family(
            parts, description=name, timeout=timeout, pg_options=per_level[level], owner=_owner()
        )
        gloo_group = create_group_family(
            parts, description=f"{name}_GLOO", backend="gloo", timeout=timeout, owner=_owner()
        ) if create_gloo_process_groups else None
        if group is not None:
            groups.append(group)
            gloo_groups.append(gloo_group)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(
    rank: int, ranks: list[int], pg_options: Any
) -> dict[int, ProcessGroup]:
    """Create hybrid data+context groups of every power-of-two size below ``len(ranks)``."""
    created = {
        size: create_group_family(
            Chunks(size).parts(ranks),
            description=f"HYBRID_DP_CP_GROUP_{size}",
            pg_options=pg_options,
            owner=_owner(),
        )
        for size in families.hybrid_sizes(len(ranks))
    }
    return {size: group for size, group in created.items() if group is not None}


def update_pg_timeout(timeout: timedelta, pg: ProcessGroup | None = None) -> None:
    """Set the timeout of ``pg``, or of every group of the caller, after a barrier."""
    dist.barrier(pg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    targets = [pg] if pg is not None else _process_group_list() or [None]
    for group in targets:
        _compat.set_group_timeout(timeout, group)


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict[str, dict[str, Any]]) -> Any:
    """NCCL options for ``pg_name`` from a communicator config, or ``None``."""
    config = nccl_comm_cfgs.get(pg_name)
    if config is None:
        return None
    options_type = getattr(dist, "ProcessGroupNCCL", None)
    if options_type is None:
        raise ParallelStateError(
            f"NCCL options for {pg_name!r} need a torch build with NCCL; this one has none"
        )
    options = options_type.Options(is_high_priority_stream=config.get("is_high_priority_stream", False))
    for field in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if field in config:
            setattr(options.config, field, config[field])
    if "net_name" in config and str(config["net_name"]).lower() not in ("ib", "socket"):
        raise ParallelStateError(
            f"net_name ({config['net_name']}) is not supported. Accepted values: 'IB' or 'socket'."
        )
    return options


def overwrite_nccl_comm_cfgs(
    nccl_comm_cfgs: dict[str, dict[str, Any]], pg_name: str, key_value_pair: tuple[str, Any]
) -> None:
    """Set one option of ``pg_name`` in a communicator config."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """Groups of the masked axes of a grid, first axis fastest, as megatron-core.

    Example: ``generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, True, False])``
    is ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
    """
    if math.prod(parallel_size) != world_size:
        raise ParallelStateError(
            f"parallel sizes {list(parallel_size)} multiply to {math.prod(parallel_size)}, "
            f"not to world size {world_size}"
        )
    if len(mask) != len(parallel_size):
        raise ParallelStateError(
            f"mask {list(mask)} has {len(mask)} entries for {len(parallel_size)} sizes"
        )
    names = tuple(f"axis{i}" for i in range(len(parallel_size)))
    masked = [name for name, keep in zip(names, mask) if keep]
    if not masked:
        return [[rank] for rank in range(world_size)]
    grid = Grid(names, tuple(parallel_size))
    groups: list[list[int]] = grid.groups(grid.mesh_order(masked)).tolist()
    return groups


class RankGenerator:
    """megatron-core's rank generator: groups of any token set of an order string.

    Example: ``RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp").get_ranks("dp")``
    is ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        if ep != 1 and cp != 1:
            raise ParallelStateError(
                f"ep={ep} and cp={cp} are both > 1: one rank generator takes CP (dense layers) "
                "or EP (expert layers), not both"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        try:
            axes = parse_order(order)
        except ConfigError as error:
            raise AxisError(str(error)) from None
        named = order.lower().split("-")
        for name, size in self.name_to_size.items():
            if name not in named and size != 1:
                raise ParallelStateError(
                    f"The size of ({name}) is ({size}), but you haven't specified the order ({order})."
                )
        self.order = "-".join(axes)
        self.ordered_size = [self.name_to_size[name] for name in axes]
        self._grid = Grid(axes, tuple(self.ordered_size), rank_offset)

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Which axes of ``order`` the hyphenated ``token`` names."""
        ordered = order.split("-")
        tokens = token.split("-")
        unknown = [t for t in tokens if t not in ordered]
        if unknown:
            raise AxisError(f"token {token!r} names {unknown}, not in order {order!r}")
        return [name in tokens for name in ordered]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group of the axes in ``token`` (e.g. ``_TP_DP``), megatron-core's order."""
        mask = self.get_mask(self.order, token)
        names = [name for name, keep in zip(self._grid.axes, mask) if keep]
        groups: list[list[int]] = self._grid.groups(self._grid.mesh_order(names)).tolist()
        return groups


# -- megatron-core's module-level names ------------------------------------------------


def _process_group_list() -> list[ProcessGroup | None] | None:
    """megatron-core's ``_global_process_group_list``: ``None`` (the default group), then ours."""
    mesh = _mesh
    if mesh is None or not is_initialized():
        return None
    return [None, *dict.fromkeys([*mesh.group_of.values(), *mesh.process_groups.owned])]


# Module-level names -> the key of the group they hold, or of the global ranks.
_GROUP_NAMES: dict[str, Key] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": _TP_PP,
    "_EMBEDDING_GROUP": _EMBEDDING,
    "_POSITION_EMBEDDING_GROUP": families.POSITION_EMBEDDING,
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": _GLOO["dp"],
    "_TENSOR_AND_DATA_PARALLEL_GROUP": _TP_DP,
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": _ETP_EP,
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": _ETP_EP_PP,
    "_EXPERT_DATA_PARALLEL_GROUP": "edp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": _GLOO["edp"],
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": _INTRA_EDP,
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": _GLOO[_INTRA_EDP],
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": families.INTER_EDP,
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_DATA_PARALLEL_GROUP_WITH_CP": _DP_CP,
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": families.DP_CP_ALL_GATHER,
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": _GLOO[_DP_CP],
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": _INTRA_DP_CP,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": _GLOO[_INTRA_DP_CP],
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": _TP_CP,
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": _TP_DP_CP,
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": families.DIST_OPT_INSTANCE,
}
_RANKS_NAMES: dict[str, Key] = {
    "_EMBEDDING_GLOBAL_RANKS": _EMBEDDING,
    "_POSITION_EMBEDDING_GLOBAL_RANKS": families.POSITION_EMBEDDING,
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_MODEL_PARALLEL_GLOBAL_RANKS": _TP_PP,
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": _DP_CP,
}
_VALUE_NAMES: dict[str, Callable[[], Any]] = {
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": partial(get_hierarchical_context_parallel_groups, False),
    "_HYBRID_DP_CP_GROUPS": _hybrid_dp_cp_groups,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": lambda: _vpp_rank,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": lambda: _vpp_size,
    "_GLOBAL_MEMORY_BUFFER": lambda: _memory_buffer,
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": lambda: _symmetric_buffer,
    "_global_process_group_list": _process_group_list,
}


def __getattr__(name: str) -> Any:
    """megatron-core's module-level state names, read from the mesh served."""
    if name in _GROUP_NAMES:
        return _group_of.get(_GROUP_NAMES[name])
    if name in _RANKS_NAMES:
        return _global_rank_list(_RANKS_NAMES[name])
    if name in _overrides:
        return _overrides[name]
    if name in _VALUE_NAMES:
        return _VALUE_NAMES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
