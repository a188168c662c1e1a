"""A typed bundle of process groups for code that passes groups explicitly.

megatron-core's newer modules take a ``ProcessGroupCollection`` instead of
calling ``parallel_state`` getters. This one has the same fields and is filled
from a mesh::

    pgs = ProcessGroupCollection.from_mesh(mesh)          # any ParallelMesh
    pgs = ProcessGroupCollection.use_mpu_process_groups() # the current mesh
    model = TransformerBlock(config, pg_collection=pgs)

As in megatron-core 0.19, a field that was never set reads ``None`` (in 0.16 it
is absent: :mod:`~meshstate.megatron.surface`), and ``vars(pgs)`` holds the fields
set: ``ProcessGroupCollection()`` sets none, and the constructors set exactly the
fields asked for. A field that was set is ``None`` where the
calling rank has no such group: ``embd`` off the first and last stages, ``hcp``
without hierarchical context parallelism, ``inter_dist_opt`` and
``intra_dist_opt`` with one distributed-optimizer instance unless the mesh was
built by ``initialize_model_parallel``; ``dp_cp_ag`` and ``expt_dp_ag`` (which
``create_all_gather_groups`` makes) always, and the GTP weight-remat fields
off ``initialize_model_parallel``'s meshes.

``setup_process_groups_for_ddp`` and ``setup_process_groups_for_optimizer`` are
megatron-core's helpers that its ``DistributedDataParallel`` and
``get_megatron_optimizer`` call: given no collection they answer with the
current mesh's groups, given one they check it and fill the gaps as
megatron-core does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

from meshstate.megatron import derived as families
from meshstate.errors import ConfigError, NotInitializedError
from meshstate.core.groups import create_group_family
from meshstate.layout.layout import Key
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, mesh_for, require_parallel_mesh
from meshstate.megatron.facts import served_mesh

ProcessGroup = dist.ProcessGroup
GroupsByRole = dict[str, ProcessGroup | None]

logger = logging.getLogger(__name__)

# field -> mesh key, and the key to use when the mesh lacks the first one.
_FIELD_KEYS: dict[str, tuple[Key, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "mp": ("tp-pp",),
    "embd": (families.EMBEDDING,),
    "pos_embd": (families.POSITION_EMBEDDING,),
    "cp": ("cp",),
    "tp_cp": ("tp-cp",),
    "ep": ("ep",),
    "expt_tp": ("etp",),
    "tp_ep": ("etp-ep",),
    "tp_ep_pp": ("etp-ep-pp",),
    "tp_ep_pp_with_egtp_remat": ("etp-ep-pp",),  # the same group: GTP groups hold one rank
    "tp_dp_cp": ("tp-dp-cp",),
    "dp": ("dp",),
    "dp_cp": ("dp-cp",),
    "dp_cp_gtp_remat": ("dp-cp",),
    "dp_cp_ag": (),  # create_all_gather_groups' return, which megatron-core leaves unset too
    "gtp_remat": (families.GTP_REMAT,),
    "expt_gtp_remat": (families.EXPERT_GTP_REMAT,),
    "expt_dp": ("edp",),
    "expt_dp_gtp_remat": ("edp",),
    "expt_dp_ag": (),
    "intra_dp_cp": (families.INTRA_DP_CP, "dp-cp"),
    "intra_expt_dp": (families.INTRA_EDP, "edp"),
    "inter_dist_opt": (families.INTER_EDP,),
    "intra_dist_opt": (families.DIST_OPT_INSTANCE,),
}


@dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection:
    """megatron-core's ``ProcessGroupCollection``: one field per group kind, absent until set.

    Example, on rank 5 of 8 after ``init_mesh(tp=2, pp=2)``::

        pgs = ProcessGroupCollection.from_mesh(mesh)
        dist.get_process_group_ranks(pgs.tp)   # [4, 5]
        dist.get_process_group_ranks(pgs.mp)   # [0, 1, 4, 5]
        hasattr(ProcessGroupCollection(tp=pgs.tp), "pp")   # False
    """

    tp: ProcessGroup | None
    pp: ProcessGroup | None
    mp: ProcessGroup | None
    embd: ProcessGroup | None
    pos_embd: ProcessGroup | None
    cp: ProcessGroup | None
    tp_cp: ProcessGroup | None
    hcp: list[ProcessGroup] | None
    ep: ProcessGroup | None
    expt_tp: ProcessGroup | None
    tp_ep: ProcessGroup | None
    tp_ep_pp: ProcessGroup | None
    tp_ep_pp_with_egtp_remat: ProcessGroup | None
    tp_dp_cp: ProcessGroup | None
    dp: ProcessGroup | None
    dp_cp: ProcessGroup | None
    dp_cp_gtp_remat: ProcessGroup | None
    dp_cp_ag: ProcessGroup | None
    gtp_remat: ProcessGroup | None
    expt_gtp_remat: ProcessGroup | None
    expt_dp: ProcessGroup | None
    expt_dp_gtp_remat: ProcessGroup | None
    expt_dp_ag: ProcessGroup | None
    intra_dp_cp: ProcessGroup | None
    intra_expt_dp: ProcessGroup | None
    inter_dist_opt: ProcessGroup | None
    intra_dist_opt: ProcessGroup | None

    def __init__(self, **groups: ProcessGroup | list[ProcessGroup] | None) -> None:
        """Set the fields named; the others stay absent.

        Example: ``ProcessGroupCollection(tp=tp_group, cp=None)`` has ``tp`` and
        ``cp`` (``None``); ``hasattr`` of any other field is False.
        """
        _check_names(groups)
        for name, group in groups.items():
            setattr(self, name, group)

    def __getattr__(self, name: str) -> None:
        """A field never set: ``None``."""
        if name in _field_names():
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    @classmethod
    def from_mesh(
        cls, mesh: ParallelMesh, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The calling rank's groups of ``mesh``: every field, or only ``required_pgs``."""
        mesh = require_parallel_mesh(mesh, "ProcessGroupCollection.from_mesh(mesh=...)")
        wanted = _field_names() if required_pgs is None else list(required_pgs)
        invalid = [name for name in wanted if name not in _field_names()]
        if invalid:
            raise ConfigError(f"Invalid process groups requested: {invalid}; fields are {_field_names()}")
        return cls(**{name: _group_of(mesh, name) for name in wanted})

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The groups of the mesh megatron-core's getters answer from (see :func:`_mpu_mesh`)."""
        return cls.from_mesh(_mpu_mesh("ProcessGroupCollection.use_mpu_process_groups()"), required_pgs)

    @staticmethod
    def setup_process_groups_for_ddp(
        pg_collection: ProcessGroupCollection | None, config: Any, ddp_config: Any
    ) -> GroupsByRole:
        """The groups megatron-core's ``DistributedDataParallel`` uses, by role.

        Without ``pg_collection``: the current mesh's (``dp_group``, ``dp_cp_group``,
        ``intra_dp_cp_group``, ``expt_dp_group``, ``intra_expt_dp_group``,
        ``tp_group``, ``pp_group``, ``ep_group``, ``gtp_remat_group``,
        ``expt_gtp_remat_group``, and ``inter_dist_opt_group`` /
        ``intra_dist_opt_group`` where ``ddp_config`` asks for several optimizer
        instances / the distributed optimizer, else ``None``). With one: its
        fields, ``dp_cp`` defaulting to ``dp`` when ``config.context_parallel_size``
        is 1, and a missing ``expt_dp`` replaced by the caller's single-rank group.

        Example: on rank 5 of 8 after ``initialize_model_parallel(tensor_model_parallel_size=2)``,
        ``setup_process_groups_for_ddp(None, config, ddp_config)["dp_group"]``
        is the group of ranks 1, 3, 5, 7.
        """
        instances = ddp_config.num_distributed_optimizer_instances
        if pg_collection is None:
            mesh = _mpu_mesh("ProcessGroupCollection.setup_process_groups_for_ddp()")
            groups: GroupsByRole = {f"{name}_group": _required_group(mesh, name) for name in _DDP_FIELDS}
            groups.update(_gtp_groups(mesh))
            groups["inter_dist_opt_group"] = (
                _required_group(mesh, "inter_dist_opt") if instances > 1 else None)
            groups["intra_dist_opt_group"] = (
                _required_group(mesh, "intra_dist_opt")
                if ddp_config.use_distributed_optimizer else None)
            return groups
        groups = {"dp_group": _provided(pg_collection, "dp", "")}
        groups["dp_cp_group"] = _dp_cp_or_dp(pg_collection, config)
        expt_dp = getattr(pg_collection, "expt_dp", None)
        if expt_dp is None:
            logger.warning("No expert data parallel group provided in pg_collection, "
                           "creating a new one with just the current rank")
            expt_dp = _single_rank_group()
        groups["expt_dp_group"] = expt_dp
        if instances == 1:
            groups.update(intra_dp_cp_group=groups["dp_cp_group"], intra_expt_dp_group=expt_dp,
                          inter_dist_opt_group=None)
        else:
            _require_fields(pg_collection, ("intra_dp_cp", "intra_expt_dp", "inter_dist_opt"),
                            " when using multiple optimizer instances (>1)")
            groups.update(intra_dp_cp_group=pg_collection.intra_dp_cp,
                          intra_expt_dp_group=pg_collection.intra_expt_dp,
                          inter_dist_opt_group=pg_collection.inter_dist_opt)
        _require_fields(pg_collection, ("tp", "pp", "ep"), "")
        groups.update(tp_group=pg_collection.tp, pp_group=pg_collection.pp,
                      ep_group=pg_collection.ep, **_gtp_fields(pg_collection))
        return groups

    @staticmethod
    def setup_process_groups_for_optimizer(
        pg_collection: ProcessGroupCollection | None,
        model_chunks: list[Any],
        use_gloo_process_groups: bool = True,
    ) -> GroupsByRole:
        """The groups megatron-core's ``get_megatron_optimizer`` uses, by role.

        Without ``pg_collection``: the current mesh's (``dp_group``, ``dp_cp_group``,
        ``intra_dp_cp_group``, ``expt_dp_group``, ``intra_expt_dp_group``,
        ``mp_group``, ``expt_tp_pp_group`` (and ``expt_tp_pp_with_egtp_remat_group``,
        the same), ``gtp_remat_group``, ``expt_gtp_remat_group``, ``intra_dist_opt_group``, the gloo twins
        ``intra_dp_cp_group_gloo`` and ``intra_expt_dp_group_gloo`` if
        ``use_gloo_process_groups``, and ``inter_dist_opt_group`` where the first
        chunk's ``ddp_config`` has several optimizer instances). With one: its
        fields, checked and defaulted as megatron-core does; gloo twins are refused.

        Example: on rank 5 of 8 after ``initialize_model_parallel(tensor_model_parallel_size=2)``,
        ``setup_process_groups_for_optimizer(None, [model])["mp_group"]`` is the
        group of ranks 4 and 5.
        """
        ddp_config = getattr(model_chunks[0], "ddp_config", None)
        instances = 1 if ddp_config is None else ddp_config.num_distributed_optimizer_instances
        if pg_collection is None:
            mesh = _mpu_mesh("ProcessGroupCollection.setup_process_groups_for_optimizer()")
            groups: GroupsByRole = {
                f"{name}_group": _required_group(mesh, name) for name in _OPTIMIZER_FIELDS}
            groups["expt_tp_pp_group"] = groups.pop("tp_ep_pp_group")
            groups["expt_tp_pp_with_egtp_remat_group"] = groups["expt_tp_pp_group"]
            groups.update(_gtp_groups(mesh))
            groups["inter_dist_opt_group"] = (
                _required_group(mesh, "inter_dist_opt") if instances > 1 else None)
            for name in ("intra_dp_cp", "intra_expt_dp"):
                groups[f"{name}_group_gloo"] = (
                    _required_group(mesh, name, gloo=True) if use_gloo_process_groups else None)
            return groups
        groups = {"dp_group": _provided(pg_collection, "dp", "")}
        groups["dp_cp_group"] = _dp_cp_or_dp(pg_collection, _model_config(model_chunks[0]))
        groups["expt_dp_group"] = _provided(pg_collection, "expt_dp", _SET_NONE)
        if ddp_config is None or instances == 1:
            groups.update(intra_dp_cp_group=groups["dp_cp_group"],
                          intra_expt_dp_group=groups["expt_dp_group"], inter_dist_opt_group=None)
        else:
            _require_fields(
                pg_collection, ("intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt"),
                " when using multiple optimizer instances (>1)")
            groups.update(intra_dp_cp_group=pg_collection.intra_dp_cp,
                          intra_expt_dp_group=pg_collection.intra_expt_dp,
                          inter_dist_opt_group=pg_collection.inter_dist_opt)
        groups["intra_dist_opt_group"] = (
            _provided(pg_collection, "intra_dist_opt", _SET_NONE)
            if ddp_config is not None and ddp_config.use_distributed_optimizer else None)
        groups["mp_group"] = _provided(pg_collection, "mp", _SET_NONE)
        groups["expt_tp_pp_group"] = _provided(pg_collection, "tp_ep_pp", _SET_NONE)
        groups["expt_tp_pp_with_egtp_remat_group"] = vars(pg_collection).get(
            "tp_ep_pp_with_egtp_remat", groups["expt_tp_pp_group"])
        groups.update(_gtp_fields(pg_collection))
        if use_gloo_process_groups:
            raise ConfigError(
                "Gloo process groups are not supported when pg_collection is provided. "
                "Please set use_gloo_process_groups to False.")
        groups.update(intra_dp_cp_group_gloo=None, intra_expt_dp_group_gloo=None)
        return groups

    def __eq__(self, other: object) -> bool:
        """Equal when the same fields are set to the same groups."""
        if not isinstance(other, ProcessGroupCollection):
            return NotImplemented
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        """The fields set to a group, with group sizes, as megatron-core writes them.

        Example: ``ProcessGroupCollection(tp(2))`` where ``cp`` is ``None``; ``hcp``
        shows one size per level, ``hcp([2, 2])``.
        """
        present = [describe_field(name, vars(self)[name]) for name in _field_names() if name in vars(self)]
        return f"ProcessGroupCollection({', '.join(filter(None, present)) or 'empty'})"

    @staticmethod
    def is_gtp_remat_active(process_group_dict: dict[str, Any]) -> bool:
        """Whether the setup helpers' ``gtp_remat_group`` or ``expt_gtp_remat_group``
        holds more than one rank (never, on meshstate's groups)."""
        groups = (process_group_dict.get("gtp_remat_group"), process_group_dict.get("expt_gtp_remat_group"))
        return any(group is not None and group.size() > 1 for group in groups)


def describe_field(name: str, value: ProcessGroup | list[ProcessGroup] | None) -> str | None:
    """``name(size)`` of a field set to a group, ``name([sizes])`` of a list; ``None`` if unset."""
    if isinstance(value, list):
        return f"{name}({[group.size() for group in value]})"
    return None if value is None else f"{name}({value.size()})"


def _field_names() -> list[str]:
    return [f.name for f in fields(ProcessGroupCollection)]


def _check_names(names: Iterable[str]) -> None:
    unknown = [name for name in names if name not in _field_names()]
    if unknown:
        raise ConfigError(f"unknown process groups {unknown}; fields are {_field_names()}")


# megatron-core's advice where a collection lacks a field that may be None.
_SET_NONE = ". Please explicitly set it to None if you don't need it."

# The fields whose groups the two setup helpers read from the mesh for every rank.
_DDP_FIELDS = ("dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "tp", "pp", "ep")
_OPTIMIZER_FIELDS = (
    "dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "mp", "tp_ep_pp", "intra_dist_opt")


def _required_group(mesh: ParallelMesh, name: str, gloo: bool = False) -> ProcessGroup:
    """The caller's group of field ``name`` (its gloo twin if ``gloo``), which must exist."""
    if gloo:
        keys = [key for key in _FIELD_KEYS[name] if key in mesh]
        twin = families.gloo(keys[0]) if keys else None
        group = mesh.group(twin) if twin is not None and mesh.has_group(twin) else None
    else:
        single = _group_of(mesh, name)
        group = single if isinstance(single, ProcessGroup) else None
    if group is None:
        what = f"gloo twin of {name!r}" if gloo else repr(name)
        raise NotInitializedError(
            f"process group {what} is not on rank {mesh.global_rank}'s mesh; initialize_model_parallel "
            "builds every group megatron-core's DDP and optimizer ask for")
    return group


def _mpu_mesh(asking: str) -> ParallelMesh:
    """The mesh megatron-core's getters answer ``asking`` from: the one
    ``initialize_model_parallel`` built, or the one picked with ``with mesh:`` while
    another live mesh could answer (:func:`~meshstate.core.which_mesh.mesh_for`); without
    either, the current mesh."""
    mesh = mesh_for(asking, served_mesh(), "the mesh initialize_model_parallel built")
    return current_mesh() if mesh is None else mesh


def _gtp_groups(mesh: ParallelMesh) -> GroupsByRole:
    """The setup helpers' GTP weight-remat groups of ``mesh``: ``None`` where it has none."""
    return {"gtp_remat_group": _group_or_none(mesh, "gtp_remat"),
            "expt_gtp_remat_group": _group_or_none(mesh, "expt_gtp_remat")}


def _gtp_fields(pg_collection: ProcessGroupCollection) -> GroupsByRole:
    """The setup helpers' GTP weight-remat groups of ``pg_collection``: ``None`` where unset."""
    return {"gtp_remat_group": vars(pg_collection).get("gtp_remat"),
            "expt_gtp_remat_group": vars(pg_collection).get("expt_gtp_remat")}


def _group_or_none(mesh: ParallelMesh, name: str) -> ProcessGroup | None:
    group = _group_of(mesh, name)
    return group if isinstance(group, ProcessGroup) else None


def _provided(pg_collection: ProcessGroupCollection, name: str, advice: str) -> ProcessGroup | None:
    """Field ``name`` of ``pg_collection``, which must be set (``None`` counts as set)."""
    if name not in vars(pg_collection):
        raise ConfigError(
            f"{name} process group is required but not provided in pg_collection{advice}")
    group: ProcessGroup | None = getattr(pg_collection, name)
    return group


def _require_fields(pg_collection: ProcessGroupCollection, names: tuple[str, ...], when: str) -> None:
    missing = [name for name in names if name not in vars(pg_collection)]
    if missing:
        raise ConfigError(
            f"{', '.join(names[:-1])}, and {names[-1]} process groups are required{when} but not provided in "
            f"pg_collection (missing: {missing})")


def _dp_cp_or_dp(pg_collection: ProcessGroupCollection, config: Any) -> ProcessGroup | None:
    """``pg_collection.dp_cp``, or its ``dp`` where ``config`` has no context parallelism."""
    if "dp_cp" in vars(pg_collection):
        return pg_collection.dp_cp
    cp_size = getattr(config, "context_parallel_size", 1)
    if cp_size != 1:
        raise ConfigError(
            f"dp_cp process group is required when context_parallel_size > 1 (it is {cp_size}) "
            "but not provided in pg_collection")
    return pg_collection.dp


def _model_config(model: Any) -> Any:
    """megatron-core's ``get_model_config``: the first non-None ``config`` down ``.module``s."""
    while getattr(model, "config", None) is None:
        if not hasattr(model, "module"):
            raise ConfigError(f"no config found on {type(model).__name__} or its wrapped modules")
        model = model.module
    return model.config


def _single_rank_group() -> ProcessGroup:
    """The caller's group of itself alone (every rank calls it)."""
    group = create_group_family([[rank] for rank in range(dist.get_world_size())],
                                description="single rank")
    assert group is not None
    return group


def _group_of(mesh: ParallelMesh, name: str) -> ProcessGroup | list[ProcessGroup] | None:
    """The calling rank's group of ``mesh`` for field ``name``; ``None`` if it has none."""
    if name == "hcp":
        levels = families.hierarchical_cp_levels(mesh.keys())
        return [mesh.group(level) for level in levels] or None
    keys = [key for key in _FIELD_KEYS[name] if key in mesh]
    return mesh.group(keys[0]) if keys and mesh.has_group(keys[0]) else None
