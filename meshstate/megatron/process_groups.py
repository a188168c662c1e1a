"""A typed bundle of process groups for code that passes groups explicitly.

megatron-core's newer modules take a ``ProcessGroupCollection`` instead of
calling ``parallel_state`` getters. This one has the same fields and is filled
from a mesh::

    pgs = ProcessGroupCollection.from_mesh(mesh)          # any ParallelMesh
    pgs = ProcessGroupCollection.use_mpu_process_groups() # the current mesh
    model = TransformerBlock(config, pg_collection=pgs)

As in megatron-core, a field that was never set is absent (``hasattr(pgs,
"cp")`` is False): ``ProcessGroupCollection()`` has none, and the constructors
set exactly the fields asked for. A field that was set is ``None`` where the
calling rank has no such group: ``embd`` off the first and last stages, ``hcp``
without hierarchical context parallelism, ``inter_dist_opt`` and
``intra_dist_opt`` with one distributed-optimizer instance unless the mesh was
built by ``initialize_model_parallel``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch.distributed as dist

from meshstate.megatron import derived as families
from meshstate.core.errors import ConfigError
from meshstate.core.layout import Key
from meshstate.core.mesh import ParallelMesh, current_mesh

ProcessGroup = dist.ProcessGroup

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
    "tp_dp_cp": ("tp-dp-cp",),
    "dp": ("dp",),
    "dp_cp": ("dp-cp",),
    "expt_dp": ("edp",),
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
    tp_dp_cp: ProcessGroup | None
    dp: ProcessGroup | None
    dp_cp: ProcessGroup | None
    expt_dp: ProcessGroup | None
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

    @classmethod
    def from_mesh(
        cls, mesh: ParallelMesh, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The calling rank's groups of ``mesh``: every field, or only ``required_pgs``."""
        wanted = _FIELD_NAMES if required_pgs is None else list(required_pgs)
        _check_names(wanted)
        return cls(**{name: _group_of(mesh, name) for name in wanted})

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The groups of the current mesh, e.g. the one ``initialize_model_parallel`` built."""
        return cls.from_mesh(current_mesh(), required_pgs)

    def __eq__(self, other: object) -> bool:
        """Equal when the same fields are set to the same groups."""
        if not isinstance(other, ProcessGroupCollection):
            return NotImplemented
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        """The fields set, with group sizes, as megatron-core writes them.

        Example: ``ProcessGroupCollection(tp(2), cp(None))``; ``hcp`` shows one
        size per level, ``hcp([2, 2])``.
        """
        present = []
        for name in _FIELD_NAMES:
            if not hasattr(self, name):
                continue
            value = getattr(self, name)
            if isinstance(value, list):
                present.append(f"{name}({[group.size() for group in value]})")
            else:
                present.append(f"{name}({None if value is None else value.size()})")
        return f"ProcessGroupCollection({', '.join(present) or 'empty'})"


_FIELD_NAMES = [f.name for f in fields(ProcessGroupCollection)]


def _check_names(names: Iterable[str]) -> None:
    unknown = [name for name in names if name not in _FIELD_NAMES]
    if unknown:
        raise ConfigError(f"unknown process groups {unknown}; fields are {_FIELD_NAMES}")


def _group_of(mesh: ParallelMesh, name: str) -> ProcessGroup | list[ProcessGroup] | None:
    """The calling rank's group of ``mesh`` for field ``name``; ``None`` if it has none."""
    if name == "hcp":
        levels = families.hierarchical_cp_levels(mesh.keys())
        return [mesh.group(level) for level in levels] or None
    keys = [key for key in _FIELD_KEYS[name] if key in mesh.keys()]
    return mesh.group(keys[0]) if keys and mesh.has_group(keys[0]) else None
