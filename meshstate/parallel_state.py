"""megatron-core's ``parallel_state``, served by a meshstate mesh.

Legacy code switches by changing one import::

    from meshstate import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mpu.get_tensor_model_parallel_rank()
    mpu.get_data_parallel_group(with_context_parallel=True)

Every function has megatron-core 0.16's name, parameters, defaults and values.
``initialize_model_parallel`` builds one :class:`~meshstate.ParallelMesh`
(``get_mesh()``); the module keeps a single reference, ``_view``: the mesh
plus the few values only Megatron has (the ``set_*`` overrides, the virtual
pipeline stage, the memory buffers), with every getter's answer read from the
mesh once at init. A getter is then one attribute read; none calls into
``torch.distributed``.

Differences from megatron-core, on purpose:

- ``destroy_model_parallel`` destroys the process groups it created and resets
  every module-level name (megatron-core keeps several stale global-rank lists
  and the data-parallel overrides).
- Identical rank sets share one process group (``etp == tp`` gives one).
- On a gloo world the gloo copies of the data-parallel groups *are* the
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
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from functools import partial, reduce
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from meshstate import _compat
from meshstate import megatron_groups as families
from meshstate.config import DEFAULT_ORDER, MeshConfig, parse_order
from meshstate.errors import AxisError, ConfigError, NotInitializedError, ParallelStateError
from meshstate.groups import GroupOptions, GroupSpec, create_process_groups
from meshstate.layout import Grid
from meshstate.megatron_groups import (
    default_embedding_ranks,
    default_position_embedding_ranks,
    hierarchical_levels,
)
from meshstate.mesh import ParallelMesh, init_mesh, set_mesh

ProcessGroup = dist.ProcessGroup

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

# megatron-core's process-group names (for NCCL options) -> meshstate keys.
_NCCL_CONFIG_KEYS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": ("tp-pp",),
    "tp_cp": ("tp-cp",),
    "tp_dp": ("tp-dp",),
    "tp_dp_cp": ("tp-dp-cp",),
    "ep": ("ep",),
    "ep_tp": ("etp",),
    "tp_ep_mp": ("etp-ep",),
    "tp_ep_pp": ("etp-ep-pp",),
    "ep_dp": ("edp",),
    "embd": (families.EMBEDDING,),
    "pos_embd": (families.POSITION_EMBEDDING,),
    "intra_dp_cp": (families.INTRA_DP_CP,),
    "intra_ep_dp": (families.INTRA_EDP,),
    "inter_ep_dp": (families.INTER_EDP,),
    "intra_dist_opt_instance": (families.DIST_OPT_INSTANCE,),
}

# The groups whose global ranks megatron-core keeps in module-level lists.
_GLOBAL_RANK_KEYS = ("tp", "pp", "dp", "cp", "dp-cp", "ep", "tp-pp")

# The `set_*` overrides, by megatron-core's module-level name.
_OVERRIDES = {
    "tp_size": "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "tp_rank": "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "pp_size": "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "pp_rank": "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "dp_size": "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "dp_rank": "_MPU_DATA_PARALLEL_RANK",
    "ep_size": "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
    "ep_rank": "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "etp_size": "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
    "etp_rank": "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
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


class _View:
    """What the getters read: the current mesh's answers and Megatron's extras.

    An int attribute is absent when neither an override nor a mesh gives it,
    so a getter's one attribute read fails over to the not-initialized path.
    """

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    pp_first: bool
    pp_last: bool
    dp_size: int
    dp_rank: int
    dp_cp_size: int
    dp_cp_rank: int
    intra_dp_cp_size: int
    intra_dp_cp_rank: int
    cp_size: int
    cp_rank: int
    tp_cp_size: int
    tp_cp_rank: int
    ep_size: int
    ep_rank: int
    etp_size: int | None
    etp_rank: int | None
    etp_ep_size: int
    etp_ep_rank: int
    edp_size: int
    edp_rank: int
    intra_edp_size: int
    intra_edp_rank: int

    def __init__(self, mesh: ParallelMesh | None = None) -> None:
        self.mesh = mesh
        self.overrides: dict[str, int | None] = dict.fromkeys(_OVERRIDES)
        self.vpp_rank: int | None = None
        self.vpp_size: int | None = None
        self.embedding_ranks: list[int] | None = None
        self.position_embedding_ranks: list[int] | None = None
        self.memory_buffer: GlobalMemoryBuffer | None = None
        self.symmetric_buffer: GlobalSymmetricMemoryBuffer | None = None
        self.standalone_groups: list[ProcessGroup] = []
        self.groups: dict[str, ProcessGroup | None] = {}
        self.global_ranks: dict[str, list[int] | None] = {}
        self.hierarchical_cp: list[ProcessGroup] | None = None
        self.hybrid_dp_cp: dict[int, ProcessGroup] = {}
        if mesh is not None:
            self._read_groups(mesh)
        self.refresh()

    def _read_groups(self, mesh: ParallelMesh) -> None:
        member_keys = [key for key in mesh.keys() if mesh.has_group(key)]
        self.groups = {key: mesh.group(key) for key in member_keys}
        self.global_ranks = {key: list(mesh.ranks(key)) for key in _GLOBAL_RANK_KEYS}
        levels = families.hierarchical_cp_levels(mesh.keys())
        self.hierarchical_cp = [mesh.group(level) for level in levels] or None
        self.hybrid_dp_cp = {
            size: mesh.group(families.hybrid_dp_cp(size))
            for size in families.hybrid_sizes(mesh.size("dp-cp"))
            if families.hybrid_dp_cp(size) in self.groups
        }
        pp_ranks = list(mesh.ranks("pp"))
        for name, attribute in (
            (families.EMBEDDING, "embedding_ranks"),
            (families.POSITION_EMBEDDING, "position_embedding_ranks"),
        ):
            split = mesh.families[name].split
            if name in self.groups and split is not None:
                setattr(self, attribute, list(split(pp_ranks)[0]))

    def refresh(self) -> None:
        """Recompute every getter's answer from the overrides and the mesh."""
        mesh, overrides = self.mesh, self.overrides
        values: dict[str, int | None] = {}

        def size(key: str) -> int | None:
            return mesh.size(key) if mesh is not None and mesh.has_group(key) else None

        def rank(key: str) -> int | None:
            return mesh.rank(key) if mesh is not None and mesh.has_group(key) else None

        def first(*candidates: int | None) -> int | None:
            return next((c for c in candidates if c is not None), None)

        dp_size, dp_rank = overrides["dp_size"], overrides["dp_rank"]
        values.update(
            tp_size=first(overrides["tp_size"], size("tp")),
            tp_rank=first(overrides["tp_rank"], rank("tp")),
            pp_size=first(overrides["pp_size"], size("pp")),
            pp_rank=first(overrides["pp_rank"], rank("pp")),
            dp_size=first(dp_size, size("dp")),
            dp_rank=first(dp_rank, rank("dp")),
            dp_cp_size=first(dp_size, size("dp-cp")),
            dp_cp_rank=first(dp_rank, rank("dp-cp")),
            intra_dp_cp_size=first(dp_size, size(families.INTRA_DP_CP)),
            intra_dp_cp_rank=first(dp_rank, rank(families.INTRA_DP_CP)),
            cp_size=size("cp"),
            cp_rank=rank("cp"),
            tp_cp_size=size("tp-cp"),
            tp_cp_rank=rank("tp-cp"),
            ep_size=first(overrides["ep_size"], size("ep")),
            ep_rank=first(overrides["ep_rank"], rank("ep")),
            etp_ep_size=size("etp-ep"),
            etp_ep_rank=rank("etp-ep"),
            edp_size=size("edp"),
            edp_rank=rank("edp"),
            intra_edp_size=size(families.INTRA_EDP),
            intra_edp_rank=rank(families.INTRA_EDP),
        )
        for name, value in values.items():
            if value is None:
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = value
        # megatron-core falls back to the tp overrides (even None) without an etp group.
        self.etp_size = first(overrides["etp_size"], size("etp") if mesh else overrides["tp_size"])
        self.etp_rank = first(overrides["etp_rank"], rank("etp") if mesh else overrides["tp_rank"])
        pp_rank, pp_size = values["pp_rank"], values["pp_size"]
        for name, value in (
            ("pp_first", None if pp_rank is None else pp_rank == 0),
            ("pp_last", None if pp_rank is None or pp_size is None else pp_rank == pp_size - 1),
        ):
            if value is None:
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = value


_view = _View()


def _not_initialized(what: str) -> NotInitializedError:
    return NotInitializedError(
        f"{what} is not initialized; call initialize_model_parallel() first"
    )


def _zero_unless_distributed(what: str) -> int:
    """megatron-core answers 0 when torch.distributed is not initialized."""
    if not dist.is_initialized():
        return 0
    raise _not_initialized(what)


def _group(key: str, check_initialized: bool, what: str) -> ProcessGroup | None:
    group = _view.groups.get(key)
    if group is None and check_initialized:
        raise _not_initialized(what)
    return group


def _required_group(key: str, what: str) -> ProcessGroup:
    group = _view.groups.get(key)
    if group is None:
        raise _not_initialized(what)
    return group


def _global_ranks(key: str, what: str) -> list[int]:
    ranks = _view.global_ranks.get(key)
    if ranks is None:
        raise _not_initialized(what)
    return ranks


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
    global _view
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    if _view.mesh is not None:
        raise ParallelStateError(
            "model parallel state is already initialized; call destroy_model_parallel() first"
        )
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
    derived = families.megatron_families(
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
        [family.name for family in derived],
        _nccl_configs(nccl_communicator_config_path, high_priority_stream_groups),
        pipeline_model_parallel_comm_backend,
    )
    mesh = init_mesh(
        order,
        tp=tensor_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
        pp=pipeline_model_parallel_size,
        timeout=timedelta(minutes=distributed_timeout_minutes),
        families=derived,
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
        _enable_sharp(mesh.group(sharp_group) if mesh.has_group(sharp_group) else None)
    view = _View(mesh)
    if virtual_pipeline_model_parallel_size is not None:
        view.vpp_rank, view.vpp_size = 0, virtual_pipeline_model_parallel_size
    view.memory_buffer = GlobalMemoryBuffer()
    _view = view
    set_mesh(mesh)
    logger.debug("initialized model parallel state: %r", mesh)


def _name_of(function: Callable[..., object] | None) -> str | None:
    if function is None:
        return None
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', repr(function))}"


def destroy_model_parallel() -> None:
    """Destroy the groups and reset every value; safe to call when not initialized."""
    global _view
    old, _view = _view, _View()
    for group in old.standalone_groups:
        _compat.destroy_group(group)
    if old.mesh is not None:
        old.mesh.destroy()


def get_mesh() -> ParallelMesh:
    """The :class:`~meshstate.ParallelMesh` behind every getter."""
    if _view.mesh is None:
        raise _not_initialized("model parallel state")
    return _view.mesh


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run (and no destroy since)."""
    return _view.mesh is not None


def is_unitialized() -> bool:
    """Deprecated: ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2)
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """Whether the model- and data-parallel groups exist."""
    return _view.mesh is not None


def _check_sharp(use_sharp: bool, sharp_enabled_group: str | None, instances: int) -> str | None:
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
    return "dp-cp" if group == "dp" else families.INTER_EDP


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


def _group_options(
    family_names: list[str], configs: dict[str, dict[str, Any]], pp_backend: str | None
) -> dict[str, GroupOptions]:
    backend = str(dist.get_backend())
    simulated = backend == "fake"
    options: dict[str, dict[str, Any]] = {}
    if configs and "nccl" not in backend and not simulated:
        warnings.warn(
            f"NCCL communicator options {sorted(configs)} have no effect on the {backend} "
            "backend; ignoring them",
            stacklevel=3,
        )
    elif configs and not simulated:
        for pg_name in configs:
            keys: tuple[str, ...] = _NCCL_CONFIG_KEYS.get(pg_name, ())
            if pg_name == "dp_cp":
                keys = ("dp-cp", families.DP_CP_ALL_GATHER) + tuple(
                    name for name in family_names if name.startswith("dp-cp:hybrid-")
                )
            if pg_name == "hcp":
                keys = tuple(name for name in family_names if name.startswith("hcp-"))
            for key in keys:
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
    for name in family_names:
        if name.endswith(":gloo"):
            options.setdefault(name, {})["backend"] = "gloo"
        if name == families.DP_CP_ALL_GATHER:
            options.setdefault(name, {})["separate"] = True
    return {key: GroupOptions(**values) for key, values in options.items()}


# -- groups ----------------------------------------------------------------------------


@overload
def get_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The model-parallel (tensor + pipeline) group of the caller."""
    return _group("tp-pp", check_initialized, "model parallel group")


@overload
def get_tensor_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_tensor_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor-model-parallel group of the caller."""
    return _group("tp", check_initialized, "tensor model parallel group")


@overload
def get_pipeline_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_pipeline_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_pipeline_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The pipeline-model-parallel group of the caller."""
    return _group("pp", check_initialized, "pipeline model parallel group")


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> ProcessGroup:
    """The data-parallel group of the caller, with context parallel if asked.

    ``partial_data_parallel`` gives the group inside one distributed-optimizer
    instance; ``independent_all_gather`` the separate all-gather communicator.
    """
    if with_context_parallel:
        if partial_data_parallel:
            key = families.INTRA_DP_CP
        elif independent_all_gather:
            key = families.DP_CP_ALL_GATHER
        else:
            key = "dp-cp"
    else:
        if _view.groups.get("dp") is not None and partial_data_parallel:
            raise ParallelStateError("Partial DP for Optimizer needs to include CP")
        key = "dp"
    return _required_group(key, f"data parallel group ({key})")


def has_separate_all_gather_group() -> bool:
    """Whether a separate data+context all-gather group was created."""
    return _view.groups.get(families.DP_CP_ALL_GATHER) is not None


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup:
    """The gloo copy of the caller's data-parallel group."""
    if with_context_parallel:
        key = families.INTRA_DP_CP if partial_data_parallel else "dp-cp"
    else:
        if _view.groups.get(families.gloo("dp")) is not None and partial_data_parallel:
            raise ParallelStateError("Partial DP for Optimizer needs to include CP")
        key = "dp"
    return _required_group(families.gloo(key), f"gloo data parallel group ({key})")


@overload
def get_context_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_context_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The context-parallel group of the caller."""
    return _group("cp", check_initialized, "context parallel group")


@overload
def get_context_parallel_global_ranks(check_initialized: Literal[True] = True) -> list[int]: ...
@overload
def get_context_parallel_global_ranks(check_initialized: bool) -> list[int] | None: ...
def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of the caller's context-parallel group."""
    ranks = _view.global_ranks.get("cp")
    if ranks is None and check_initialized:
        raise _not_initialized("context parallel group")
    return ranks


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
    if _view.hierarchical_cp is None and check_initialized:
        raise _not_initialized("hierarchical context parallel groups")
    return _view.hierarchical_cp


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: int | None = None
) -> ProcessGroup | None:
    """The caller's hybrid data+context group of ``group_size`` ranks."""
    if _view.mesh is not None and group_size == _view.dp_cp_size:
        return _group("dp-cp", check_initialized, "data parallel group with context parallel")
    if group_size not in _view.hybrid_dp_cp:
        if not check_initialized and _view.mesh is None:
            return None
        raise AxisError(
            f"no hybrid data+context group of {group_size} ranks; sizes are "
            f"{sorted(_view.hybrid_dp_cp)} (initialize with hybrid_context_parallel=True)"
        )
    return _view.hybrid_dp_cp[group_size]


@overload
def get_embedding_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_embedding_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's embedding group (first and last stages by default)."""
    return _group(families.EMBEDDING, check_initialized, "embedding group")


@overload
def get_position_embedding_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_position_embedding_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_position_embedding_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The caller's position-embedding group (the first stage by default)."""
    return _group(families.POSITION_EMBEDDING, check_initialized, "position embedding group")


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> ProcessGroup:
    """The FP8 amax reduction group: tensor(+context)(+data) parallel."""
    key = {
        (False, False): "tp-dp",
        (False, True): "tp",
        (True, False): "tp-dp-cp",
        (True, True): "tp-cp",
    }[(bool(with_context_parallel), bool(tp_only_amax_red))]
    return _required_group(key, "FP8 amax reduction group")


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
    key = "tp-dp-cp" if with_context_parallel else "tp-dp"
    return _group(key, check_initialized, "tensor and data parallel group")


@overload
def get_tensor_and_context_parallel_group(
    check_initialized: Literal[True] = True,
) -> ProcessGroup: ...
@overload
def get_tensor_and_context_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The tensor+context parallel group of the caller."""
    return _group("tp-cp", check_initialized, "tensor and context parallel group")


@overload
def get_expert_model_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_expert_model_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_expert_model_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-model-parallel group of the caller."""
    return _group("ep", check_initialized, "expert model parallel group")


@overload
def get_expert_tensor_parallel_group(check_initialized: Literal[True] = True) -> ProcessGroup: ...
@overload
def get_expert_tensor_parallel_group(check_initialized: bool) -> ProcessGroup | None: ...
def get_expert_tensor_parallel_group(check_initialized: bool = True) -> ProcessGroup | None:
    """The expert-tensor-parallel group of the caller."""
    return _group("etp", check_initialized, "expert tensor parallel group")


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
    return _group("etp-ep", check_initialized, "expert tensor and model parallel group")


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
    return _group(
        "etp-ep-pp", check_initialized, "expert tensor-model-pipeline parallel group"
    )


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
    key = families.INTRA_EDP if partial_expert_data_parallel else "edp"
    return _group(key, check_initialized, "expert data parallel group")


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
    """The gloo copy of the caller's expert data-parallel group."""
    key = families.INTRA_EDP if partial_expert_data_parallel else "edp"
    return _required_group(families.gloo(key), f"gloo expert data parallel group ({key})")


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
    return _group(
        families.DIST_OPT_INSTANCE, check_initialized, "intra distributed optimizer instance group"
    )


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
    return _group(
        families.INTER_EDP,
        check_initialized,
        "inter distributed optimizer instance group (needs num_distributed_optimizer_instances > 1)",
    )


# -- sizes and ranks (the hot path: one attribute read each) ----------------------------


def get_tensor_model_parallel_world_size() -> int:
    """Size of the caller's tensor-model-parallel group."""
    try:
        return _view.tp_size
    except AttributeError:
        raise _not_initialized("tensor model parallel group") from None


def get_tensor_model_parallel_rank() -> int:
    """The caller's rank in its tensor-model-parallel group."""
    try:
        return _view.tp_rank
    except AttributeError:
        raise _not_initialized("tensor model parallel group") from None


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    try:
        return _view.pp_size
    except AttributeError:
        raise _not_initialized("pipeline model parallel group") from None


def get_pipeline_model_parallel_rank() -> int:
    """The caller's pipeline stage."""
    try:
        return _view.pp_rank
    except AttributeError:
        raise _not_initialized("pipeline model parallel group") from None


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller is the first pipeline stage (and virtual stage 0 if asked)."""
    try:
        if ignore_virtual or _view.vpp_size is None:
            return _view.pp_first
        if vp_stage is None:
            raise ParallelStateError("vp_stage must be passed if virtual pipeline is enabled")
        return vp_stage == 0 and _view.pp_first
    except AttributeError:
        raise _not_initialized("pipeline model parallel group") from None


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller is the last pipeline stage (and last virtual stage if asked)."""
    try:
        if ignore_virtual or _view.vpp_size is None:
            return _view.pp_last
        if vp_stage is None:
            raise ParallelStateError("vp_stage must be passed if virtual pipeline is enabled")
        return vp_stage == _view.vpp_size - 1 and _view.pp_last
    except AttributeError:
        raise _not_initialized("pipeline model parallel group") from None


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Size of the caller's data-parallel group (0 without torch.distributed)."""
    try:
        if with_context_parallel:
            return _view.intra_dp_cp_size if partial_data_parallel else _view.dp_cp_size
        if partial_data_parallel and _view.overrides["dp_size"] is None and _view.mesh:
            raise ParallelStateError("Partial DP for Optimizer needs to include CP")
        return _view.dp_size
    except AttributeError:
        return _zero_unless_distributed("data parallel group")


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """The caller's rank in its data-parallel group (0 without torch.distributed)."""
    try:
        if with_context_parallel:
            return _view.intra_dp_cp_rank if partial_data_parallel else _view.dp_cp_rank
        if partial_data_parallel and _view.overrides["dp_rank"] is None and _view.mesh:
            raise ParallelStateError("Partial DP for Optimizer needs to include CP")
        return _view.dp_rank
    except AttributeError:
        return _zero_unless_distributed("data parallel group")


def get_context_parallel_world_size() -> int:
    """Size of the caller's context-parallel group (0 without torch.distributed)."""
    try:
        return _view.cp_size
    except AttributeError:
        return _zero_unless_distributed("context parallel group")


def get_context_parallel_rank() -> int:
    """The caller's rank in its context-parallel group (0 without torch.distributed)."""
    try:
        return _view.cp_rank
    except AttributeError:
        return _zero_unless_distributed("context parallel group")


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the caller's tensor+context group (0 without torch.distributed)."""
    try:
        return _view.tp_cp_size
    except AttributeError:
        return _zero_unless_distributed("tensor and context parallel group")


def get_tensor_and_context_parallel_rank() -> int:
    """The caller's rank in its tensor+context group (0 without torch.distributed)."""
    try:
        return _view.tp_cp_rank
    except AttributeError:
        return _zero_unless_distributed("tensor and context parallel group")


def get_expert_model_parallel_world_size() -> int:
    """Size of the caller's expert-model-parallel group (0 without torch.distributed)."""
    try:
        return _view.ep_size
    except AttributeError:
        return _zero_unless_distributed("expert model parallel group")


def get_expert_model_parallel_rank() -> int:
    """The caller's rank in its expert-model-parallel group (0 without torch.distributed)."""
    try:
        return _view.ep_rank
    except AttributeError:
        return _zero_unless_distributed("expert model parallel group")


def get_expert_tensor_parallel_world_size() -> int | None:
    """Size of the caller's expert-tensor group; before init, the tp override (maybe None)."""
    return _view.etp_size


def get_expert_tensor_parallel_rank() -> int | None:
    """The caller's expert-tensor rank; before init, the tp rank override (maybe None)."""
    return _view.etp_rank


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the caller's expert tensor+model group (0 without torch.distributed)."""
    try:
        return _view.etp_ep_size
    except AttributeError:
        return _zero_unless_distributed("expert tensor and model parallel group")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """The caller's rank in its expert tensor+model group (0 without torch.distributed)."""
    try:
        return _view.etp_ep_rank
    except AttributeError:
        return _zero_unless_distributed("expert tensor and model parallel group")


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the caller's expert data-parallel group (0 without torch.distributed)."""
    try:
        return _view.intra_edp_size if partial_expert_data_parallel else _view.edp_size
    except AttributeError:
        return _zero_unless_distributed("expert data parallel group")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """The caller's rank in its expert data-parallel group (0 without torch.distributed)."""
    try:
        return _view.intra_edp_rank if partial_expert_data_parallel else _view.edp_rank
    except AttributeError:
        return _zero_unless_distributed("expert data parallel group")


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual pipeline stage, or ``None`` without interleaving."""
    return _view.vpp_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual pipeline stages per rank, or ``None`` without interleaving."""
    return _view.vpp_size


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether the caller holds word embeddings (at ``vp_stage`` if not ignoring virtual)."""
    ranks = _view.embedding_ranks
    rank = dist.get_rank() if ranks is not None else -1
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether the caller holds position embeddings."""
    ranks = _view.position_embedding_ranks
    return ranks is not None and dist.get_rank() in ranks


# -- global ranks ----------------------------------------------------------------------


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's tensor-parallel group."""
    return _global_ranks("tp", "tensor model parallel group")[0]


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's model-parallel group."""
    return _global_ranks("tp-pp", "model parallel group")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of the caller's data-parallel group."""
    key = "dp-cp" if with_context_parallel else "dp"
    return _global_ranks(key, "data parallel group")[0]


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's expert-parallel group."""
    return _global_ranks("ep", "expert model parallel group")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of the caller's pipeline."""
    return _global_ranks("pp", "pipeline parallel group")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of the caller's pipeline."""
    ranks = _global_ranks("pp", "pipeline parallel group")
    return ranks[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage of the caller's pipeline (wrapping around)."""
    ranks = _global_ranks("pp", "pipeline parallel group")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage of the caller's pipeline (wrapping around)."""
    ranks = _global_ranks("pp", "pipeline parallel group")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


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


def _set_override(name: str, value: int | None) -> None:
    _view.overrides[name] = value
    _view.refresh()


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-model-parallel size the getters report."""
    _set_override("tp_size", world_size)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline-model-parallel size the getters report."""
    _set_override("pp_size", world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-model-parallel rank the getters report."""
    _set_override("tp_rank", rank)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline-model-parallel rank the getters report."""
    _set_override("pp_rank", rank)


def set_data_parallel_rank(rank: int | None) -> None:
    """Override the data-parallel rank the getters report."""
    _set_override("dp_rank", rank)


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-model-parallel size the getters report."""
    _set_override("ep_size", world_size)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert-model-parallel rank the getters report."""
    _set_override("ep_rank", rank)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-tensor-parallel size the getters report."""
    _set_override("etp_size", world_size)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert-tensor-parallel rank the getters report."""
    _set_override("etp_rank", rank)


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual pipeline stages per rank."""
    _view.vpp_size = world_size


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated: pass ``vp_stage`` to the stage queries instead."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
    _view.vpp_rank = rank


# -- memory buffers --------------------------------------------------------------------


def _set_global_memory_buffer() -> None:
    """Create the global memory buffer (``initialize_model_parallel`` does)."""
    if _view.memory_buffer is not None:
        raise ParallelStateError("global memory buffer is already initialized")
    _view.memory_buffer = GlobalMemoryBuffer()


def _set_global_symmetric_memory_buffer() -> None:
    """Create the symmetric memory buffer over the tensor-parallel group."""
    if _view.symmetric_buffer is not None:
        raise ParallelStateError("global symmetric memory buffer is already initialized")
    _view.symmetric_buffer = GlobalSymmetricMemoryBuffer(
        size_in_mb=256, process_group=get_tensor_model_parallel_group()
    )


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The global memory buffer."""
    if _view.memory_buffer is None:
        raise _not_initialized("global memory buffer")
    return _view.memory_buffer


def get_global_symmetric_memory_buffer() -> GlobalSymmetricMemoryBuffer:
    """The global symmetric memory buffer."""
    if _view.symmetric_buffer is None:
        raise _not_initialized("global symmetric memory buffer")
    return _view.symmetric_buffer


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer."""
    _view.memory_buffer = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer."""
    _view.symmetric_buffer = None


# -- group creation and rank arithmetic, as megatron-core exposes them ------------------


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
    The group is destroyed by ``destroy_model_parallel``.
    """
    members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
    mine = tuple(members) if dist.get_rank() in members else None
    created = create_process_groups(
        [GroupSpec(group_desc or "group", mine, lambda: [members])],
        backend=backend,
        timeout=timeout,
        pg_options=pg_options,
    )
    _view.standalone_groups.extend(created.owned)
    return created.by_name.get(group_desc or "group")


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
    levels = hierarchical_levels(ranks, hierarchical_group_sizes)
    per_level = pg_options if isinstance(pg_options, list) else [pg_options] * len(levels)
    groups: list[ProcessGroup] = []
    gloo_groups: list[ProcessGroup | None] = []
    for level, parts in enumerate(levels):
        mine = next((tuple(part) for part in parts if rank in part), None)
        name = f"HIERARCHICAL_{group_desc}_L{level}"
        every_part: Callable[[], list[list[int]]] = partial(list, parts)
        specs = [GroupSpec(name, mine, every_part, GroupOptions(pg_options=per_level[level]))]
        if create_gloo_process_groups:
            specs.append(GroupSpec(f"{name}:gloo", mine, every_part, GroupOptions(backend="gloo")))
        created = create_process_groups(specs, timeout=timeout)
        _view.standalone_groups.extend(created.owned)
        if mine is not None:
            groups.append(created.by_name[name])
            gloo_groups.append(created.by_name.get(f"{name}:gloo"))
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(
    rank: int, ranks: list[int], pg_options: Any
) -> dict[int, ProcessGroup]:
    """Create hybrid data+context groups of every power-of-two size below ``len(ranks)``."""
    result: dict[int, ProcessGroup] = {}
    for size in families.hybrid_sizes(len(ranks)):
        parts = [ranks[start : start + size] for start in range(0, len(ranks), size)]
        mine = next((tuple(sorted(part)) for part in parts if rank in part), None)
        created = create_process_groups(
            [GroupSpec(f"HYBRID_DP_CP_GROUP_{size}", mine, partial(list, parts))],
            pg_options=pg_options,
        )
        _view.standalone_groups.extend(created.owned)
        if mine is not None:
            result[size] = created.by_name[f"HYBRID_DP_CP_GROUP_{size}"]
    return result


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
        """Every group of the axes in ``token`` (e.g. ``"tp-dp"``), megatron-core's order."""
        mask = self.get_mask(self.order, token)
        names = [name for name, keep in zip(self._grid.axes, mask) if keep]
        groups: list[list[int]] = self._grid.groups(self._grid.mesh_order(names)).tolist()
        return groups


# -- megatron-core's module-level names ------------------------------------------------


def _process_group_list() -> list[ProcessGroup | None] | None:
    if _view.mesh is None:
        return None
    distinct: list[ProcessGroup | None] = [None]
    for group in list(_view.groups.values()) + _view.standalone_groups:
        if group is not None and all(group is not seen for seen in distinct):
            distinct.append(group)
    return distinct


def _override(name: str) -> int | None:
    return _view.overrides[name]


def _gloo_group(key: str) -> ProcessGroup | None:
    return _view.groups.get(families.gloo(key))


_MODULE_NAMES: dict[str, Callable[[], Any]] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": lambda: _view.groups.get("tp"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": lambda: _view.groups.get("pp"),
    "_MODEL_PARALLEL_GROUP": lambda: _view.groups.get("tp-pp"),
    "_EMBEDDING_GROUP": lambda: _view.groups.get(families.EMBEDDING),
    "_POSITION_EMBEDDING_GROUP": lambda: _view.groups.get(families.POSITION_EMBEDDING),
    "_DATA_PARALLEL_GROUP": lambda: _view.groups.get("dp"),
    "_DATA_PARALLEL_GROUP_GLOO": lambda: _gloo_group("dp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": lambda: _view.groups.get("tp-dp"),
    "_EXPERT_MODEL_PARALLEL_GROUP": lambda: _view.groups.get("ep"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": lambda: _view.groups.get("etp"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": lambda: _view.groups.get("etp-ep"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": lambda: _view.groups.get("etp-ep-pp"),
    "_EXPERT_DATA_PARALLEL_GROUP": lambda: _view.groups.get("edp"),
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": lambda: _gloo_group("edp"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": lambda: _view.groups.get(families.INTRA_EDP),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": lambda: _gloo_group(families.INTRA_EDP),
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": lambda: _view.groups.get(families.INTER_EDP),
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": lambda: _view.vpp_rank,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": lambda: _view.vpp_size,
    "_EMBEDDING_GLOBAL_RANKS": lambda: _view.embedding_ranks,
    "_POSITION_EMBEDDING_GLOBAL_RANKS": lambda: _view.position_embedding_ranks,
    "_PIPELINE_GLOBAL_RANKS": lambda: _view.global_ranks.get("pp"),
    "_DATA_PARALLEL_GLOBAL_RANKS": lambda: _view.global_ranks.get("dp"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": lambda: _view.global_ranks.get("tp"),
    "_EXPERT_MODEL_PARALLEL_RANKS": lambda: _view.global_ranks.get("ep"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": lambda: _view.global_ranks.get("tp-pp"),
    "_CONTEXT_PARALLEL_GROUP": lambda: _view.groups.get("cp"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": lambda: _view.global_ranks.get("cp"),
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": lambda: _view.hierarchical_cp,
    "_HYBRID_DP_CP_GROUPS": lambda: _view.hybrid_dp_cp,
    "_DATA_PARALLEL_GROUP_WITH_CP": lambda: _view.groups.get("dp-cp"),
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": lambda: _view.groups.get(families.DP_CP_ALL_GATHER),
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": lambda: _gloo_group("dp-cp"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": lambda: _view.global_ranks.get("dp-cp"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": lambda: _view.groups.get(families.INTRA_DP_CP),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": lambda: _gloo_group(families.INTRA_DP_CP),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": lambda: _view.groups.get("tp-cp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": lambda: _view.groups.get("tp-dp-cp"),
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": lambda: _view.groups.get(families.DIST_OPT_INSTANCE),
    "_GLOBAL_MEMORY_BUFFER": lambda: _view.memory_buffer,
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": lambda: _view.symmetric_buffer,
    "_global_process_group_list": _process_group_list,
    **{
        module_name: partial(_override, name) for name, module_name in _OVERRIDES.items()
    },
}


def __getattr__(name: str) -> Any:
    """megatron-core's module-level state names, read from the current mesh."""
    if name in _MODULE_NAMES:
        return _MODULE_NAMES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
