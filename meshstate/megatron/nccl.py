"""NCCL communicator options for Megatron's groups: megatron-core's config files, SHARP, the pp backend.

``initialize_model_parallel`` turns its ``nccl_communicator_config_path``,
``high_priority_stream_groups``, ``use_sharp`` and
``pipeline_model_parallel_comm_backend`` into per-key
:class:`~meshstate.core.groups.GroupOptions` here. Example::

    configs = {}
    overwrite_nccl_comm_cfgs(configs, "tp", ("is_high_priority_stream", True))
    configs        # {"tp": {"is_high_priority_stream": True}}
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.megatron.errors import ParallelStateError
from meshstate.core.groups import GroupOptions
from meshstate.layout.layout import GROUP_KINDS, Chunks, DerivedGroup, Key, Level
from meshstate.megatron import derived as families
from meshstate.megatron.facts import (
    DP_CP, ETP_EP, ETP_EP_PP, TP_CP, TP_DP, TP_DP_CP, TP_PP,
)

__all__ = ["get_nccl_options", "overwrite_nccl_comm_cfgs"]

# megatron-core's process-group names (for NCCL options) -> meshstate keys.
_NCCL_CONFIG_KEYS: dict[str, tuple[Key, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": (TP_PP,),
    "tp_cp": (TP_CP,),
    "tp_dp": (TP_DP,),
    "tp_dp_cp": (TP_DP_CP,),
    "ep": ("ep",),
    "ep_tp": ("etp",),
    "tp_ep_mp": (ETP_EP,),
    "tp_ep_pp": (ETP_EP_PP,),
    "ep_dp": ("edp",),
    "embd": (families.EMBEDDING,),
    "pos_embd": (families.POSITION_EMBEDDING,),
    "intra_dp_cp": (families.INTRA_DP_CP,),
    "intra_ep_dp": (families.INTRA_EDP,),
    "inter_ep_dp": (families.INTER_EDP,),
    "intra_dist_opt_instance": (families.DIST_OPT_INSTANCE,),
}


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


def nccl_configs(path: str | None, high_priority: list[str] | None) -> dict[str, dict[str, Any]]:
    """The communicator config read from ``path``, with ``high_priority`` groups marked."""
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
        return (DP_CP,) + tuple(
            spec for spec in derived
            if spec.base == DP_CP and (spec.separate or isinstance(spec.split, Chunks))
        )
    declared = set(GROUP_KINDS) | {spec.lookup for spec in derived}
    return tuple(key for key in _NCCL_CONFIG_KEYS.get(pg_name, ()) if key in declared)


def group_options(
    derived: Sequence[DerivedGroup], configs: dict[str, dict[str, Any]], pp_backend: str | None
) -> dict[Key, GroupOptions]:
    """Each key's communicator options and backend, from the configs and the pp backend."""
    backend = str(dist.get_backend())
    fake = backend == "fake"
    options: dict[Key, dict[str, Any]] = {}
    if configs and "nccl" not in backend and not fake:
        warnings.warn(
            f"NCCL communicator options {sorted(configs)} have no effect on the {backend} "
            "backend; ignoring them",
            stacklevel=3,
        )
    elif configs and not fake:
        for pg_name in configs:
            for key in _nccl_keys(pg_name, derived):
                options.setdefault(key, {})["pg_options"] = get_nccl_options(pg_name, configs)
    if pp_backend not in (None, "nccl", "ucc"):
        raise ParallelStateError(
            f'"{pp_backend}" backend for PP communication is not supported; use "nccl" or "ucc"'
        )
    if pp_backend is not None and not fake and pp_backend not in backend:
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


def check_sharp(use_sharp: bool, sharp_enabled_group: str | None, instances: int) -> Key | None:
    """The key of the group to initialise with SHARP, or ``None``; refuses what cannot work."""
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
    return DP_CP if group == "dp" else families.INTER_EDP


def enable_sharp(group: dist.ProcessGroup | None) -> None:
    """Initialise ``group``'s communicator first, with NCCL's CollNet (SHARP) on."""
    os.environ["NCCL_COLLNET_ENABLE"] = "1"
    try:
        if group is not None:
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
    finally:
        os.environ.pop("NCCL_COLLNET_ENABLE", None)
