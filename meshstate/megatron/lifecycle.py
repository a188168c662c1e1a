"""megatron-core's ``initialize_model_parallel`` and ``destroy_model_parallel``: the served mesh's life.

``initialize_model_parallel`` builds one :class:`~meshstate.ParallelMesh` with
megatron-core's groups and serves it to every getter; ``destroy_model_parallel``
destroys it and resets every value. Example, on every rank of 8::

    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    get_mesh()                # ParallelMesh(rank 5 of 8, order='tp-cp-ep-dp-pp', tp=2 pp=2 ...)
    destroy_model_parallel()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshstate.layout.config import DEFAULT_ORDER, MeshConfig
from meshstate.errors import ConfigError
from meshstate.megatron.errors import ParallelStateError
from meshstate.core.groups import GroupOptions, require_default_group
from meshstate.layout.layout import DerivedGroup, Key
from meshstate.core.arguments import BuildOptions
from meshstate.core.build import build_mesh
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import set_mesh
from meshstate.megatron import buffers, getters, nccl
from meshstate.megatron import derived as families
from meshstate.megatron import facts as served
from meshstate.megatron.facts import OVERRIDES

logger = logging.getLogger("meshstate.megatron.parallel_state")

__all__ = ["destroy_model_parallel", "initialize_model_parallel"]


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
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
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
    rank_offset: int = 0,
    local_world_size: int | None = None,
) -> None:
    """Build every Megatron group on the calling rank; every rank must call it.

    Takes megatron-core's parameters (see its docs): on 16 ranks with ``(2, 4)`` the
    tensor groups are ``[0, 1], [2, 3], ...`` and the pipelines ``[0, 4, 8, 12], ...``;
    ``distributed_timeout_minutes`` reaches every group. ``rank_offset`` and
    ``local_world_size`` place the groups on ranks ``rank_offset ..
    rank_offset + local_world_size - 1`` (the others stay uninitialized);
    ``gtp_remat_size`` and ``expert_gtp_remat_size`` must be 1 (see
    :mod:`~meshstate.megatron.gtp`).
    """
    build_model_parallel(ModelParallelArguments(**locals()))


@dataclass(frozen=True)
class ModelParallelArguments:
    """The arguments of ``initialize_model_parallel`` in every megatron-core version
    served (:mod:`~meshstate.megatron.surface`), with megatron-core's defaults."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_model_parallel_comm_backend: str | None = None
    use_sharp: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: list[int] | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    gtp_remat_size: int = 1
    expert_gtp_remat_size: int = 1
    num_distributed_optimizer_instances: int = 1
    expert_tensor_parallel_size: int | None = None
    nccl_communicator_config_path: str | None = None
    distributed_timeout_minutes: int = 30
    order: str = DEFAULT_ORDER
    get_embedding_ranks: Callable[..., list[int]] | None = None
    get_position_embedding_ranks: Callable[..., list[int]] | None = None
    create_gloo_process_groups: bool = True
    high_priority_stream_groups: list[str] | None = None
    sharp_enabled_group: str | None = None
    rank_offset: int = 0
    local_world_size: int | None = None
    create_all_gather_group: bool | None = False


def build_model_parallel(arguments: ModelParallelArguments) -> None:
    """``initialize_model_parallel`` of ``arguments``, whichever version's signature took them."""
    args = arguments
    _start_afresh()
    _refuse_gtp(args.gtp_remat_size, args.expert_gtp_remat_size)
    sharp_group = nccl.check_sharp(
        args.use_sharp, args.sharp_enabled_group, args.num_distributed_optimizer_instances)
    span = _span(args.rank_offset, args.local_world_size)
    config = _config(
        len(span), args.tensor_model_parallel_size, args.context_parallel_size,
        args.expert_model_parallel_size, args.expert_tensor_parallel_size,
        args.pipeline_model_parallel_size, args.order, args.virtual_pipeline_model_parallel_size)
    derived = families.derived_groups(
        config, get_embedding_ranks=args.get_embedding_ranks,
        get_position_embedding_ranks=args.get_position_embedding_ranks,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        hybrid_context_parallel=args.hybrid_context_parallel,
        create_all_gather_group=bool(args.create_all_gather_group),
        create_gloo_process_groups=args.create_gloo_process_groups,
    )
    configs = nccl.nccl_configs(args.nccl_communicator_config_path, args.high_priority_stream_groups)
    options = nccl.group_options(derived, configs, args.pipeline_model_parallel_comm_backend)
    mesh = _build_mesh(config, span, args.distributed_timeout_minutes, derived, options, {
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "pipeline_model_parallel_comm_backend": args.pipeline_model_parallel_comm_backend,
        "use_sharp": args.use_sharp, "sharp_enabled_group": args.sharp_enabled_group,
        "hierarchical_context_parallel_sizes": args.hierarchical_context_parallel_sizes,
        "num_distributed_optimizer_instances": args.num_distributed_optimizer_instances,
        "get_embedding_ranks": _name_of(args.get_embedding_ranks),
        "get_position_embedding_ranks": _name_of(args.get_position_embedding_ranks),
        "create_gloo_process_groups": args.create_gloo_process_groups,
    })
    if mesh is None:  # a rank outside rank_offset .. rank_offset + local_world_size - 1
        return
    if sharp_group is not None:
        nccl.enable_sharp(mesh.tables.group.get(sharp_group))
    _serve(mesh, args.virtual_pipeline_model_parallel_size)
    logger.debug("initialized model parallel state: %r", mesh)


def _refuse_gtp(gtp_remat_size: int, expert_gtp_remat_size: int) -> None:
    """meshstate builds GTP weight-remat groups of one rank only (megatron-core's default)."""
    if gtp_remat_size != 1 or expert_gtp_remat_size != 1:
        raise ParallelStateError(
            f"gtp_remat_size={gtp_remat_size}, expert_gtp_remat_size={expert_gtp_remat_size}: "
            "meshstate builds GTP weight-remat groups of one rank only (sizes 1); megatron-core "
            "0.19 puts the GTP axis between tp and cp, an axis meshstate's layout does not have"
        )


def _span(rank_offset: int, local_world_size: int | None) -> range:
    """The ranks the groups are built on: megatron-core's ``rank_offset`` and
    ``local_world_size`` (the world's size when ``None``)."""
    world_size = dist.get_world_size()
    size = world_size if local_world_size is None else local_world_size
    if rank_offset < 0 or size < 1 or rank_offset + size > world_size:
        raise ParallelStateError(
            f"rank_offset {rank_offset} + local_world_size {size} = {rank_offset + size} ranks "
            f"do not fit the world of {world_size} ranks"
        )
    return range(rank_offset, rank_offset + size)


def _serve(mesh: ParallelMesh, vpp: int | None) -> None:
    """Serve ``mesh`` to every getter, with a fresh memory buffer and the virtual stages."""
    if vpp is not None:
        served.set_virtual_pipeline_stages(0, vpp)
    buffers.destroy_global_memory_buffer()
    buffers._set_global_memory_buffer()
    getters.serve(mesh)
    set_mesh(mesh)


def _start_afresh() -> None:
    """Refuse a second init; forget a mesh destroyed behind this module's back."""
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    if getters.is_initialized():
        raise ParallelStateError(
            "model parallel state is already initialized; call destroy_model_parallel() first"
        )
    if served.served_mesh() is not None:
        destroy_model_parallel()
    require_default_group(ParallelStateError)


def _config(
    world_size: int, tp: int, cp: int, ep: int, etp: int | None, pp: int, order: str,
    vpp: int | None,
) -> MeshConfig:
    """The layout of megatron-core's sizes, validated with its errors."""
    try:
        config = MeshConfig(world_size, order=order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp)
    except ConfigError as error:
        raise ParallelStateError(str(error)) from None
    if vpp is not None and pp <= 1:
        raise ParallelStateError(
            "pipeline-model-parallel size should be greater than 1 with interleaved schedule, "
            f"got pipeline_model_parallel_size={pp} and "
            f"virtual_pipeline_model_parallel_size={vpp}"
        )
    return config


def _build_mesh(
    config: MeshConfig,
    span: range,
    timeout_minutes: object,
    derived: list[DerivedGroup],
    options: dict[Key, GroupOptions],
    agree_on: dict[str, Any],
) -> ParallelMesh | None:
    """The mesh of megatron-core's layout (``config``, checked already) over ``span``, with
    its timeout and derived groups; every rank of ``span`` agrees; ``None`` outside it."""
    whole_world = span == range(dist.get_world_size())
    return build_mesh(config, BuildOptions.check({
        "timeout": _minutes(timeout_minutes),
        "derived": derived,
        "group_options": options,
        "agree_on": agree_on,
    }), ranks=None if whole_world else span)


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
    mesh = served.served_mesh()
    OVERRIDES.clear()
    served.set_virtual_pipeline_stages(None, None)
    buffers.destroy_global_memory_buffer()
    buffers.destroy_global_symmetric_memory_buffer()
    getters.serve(None)
    if mesh is not None:
        mesh.destroy()
