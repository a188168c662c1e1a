"""A typed bundle of process groups for code that passes groups explicitly.

megatron-core's newer modules take a ``ProcessGroupCollection`` instead of
calling ``parallel_state`` getters. This one has the same fields and is filled
from a mesh::

    pgs = ProcessGroupCollection.from_mesh(mesh)          # any ParallelMesh
    pgs = ProcessGroupCollection.use_mpu_process_groups() # the current mesh
    model = TransformerBlock(config, pg_collection=pgs)

A field is ``None`` where the calling rank has no such group: ``embd`` off the
first and last stages, ``hcp`` without hierarchical context parallelism,
``inter_dist_opt`` and ``intra_dist_opt`` with one distributed-optimizer
instance unless the mesh was built by ``initialize_model_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist

from meshstate import megatron_groups as families
from meshstate.errors import ConfigError
from meshstate.mesh import ParallelMesh, current_mesh

ProcessGroup = dist.ProcessGroup

# field -> mesh key, and the key to use when the mesh lacks the first one.
_FIELD_KEYS: dict[str, tuple[str, ...]] = {
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


@dataclass(kw_only=True)
class ProcessGroupCollection:
    """megatron-core's ``ProcessGroupCollection``: one field per group kind.

    Example, on rank 5 of 8 after ``init_mesh(tp=2, pp=2)``::

        pgs = ProcessGroupCollection.from_mesh(mesh)
        dist.get_process_group_ranks(pgs.tp)   # [4, 5]
        dist.get_process_group_ranks(pgs.mp)   # [0, 1, 4, 5]
    """

    tp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    mp: ProcessGroup | None = None
    embd: ProcessGroup | None = None
    pos_embd: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    tp_cp: ProcessGroup | None = None
    hcp: list[ProcessGroup] | None = None
    ep: ProcessGroup | None = None
    expt_tp: ProcessGroup | None = None
    tp_ep: ProcessGroup | None = None
    tp_ep_pp: ProcessGroup | None = None
    tp_dp_cp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    dp_cp: ProcessGroup | None = None
    expt_dp: ProcessGroup | None = None
    intra_dp_cp: ProcessGroup | None = None
    intra_expt_dp: ProcessGroup | None = None
    inter_dist_opt: ProcessGroup | None = None
    intra_dist_opt: ProcessGroup | None = None

    @classmethod
    def from_mesh(
        cls, mesh: ParallelMesh, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The calling rank's groups of ``mesh`` (only ``required_pgs`` if given)."""
        names = [f.name for f in fields(cls)]
        wanted = names if required_pgs is None else list(required_pgs)
        unknown = [name for name in wanted if name not in names]
        if unknown:
            raise ConfigError(f"unknown process groups {unknown}; fields are {names}")
        collection = cls()
        for name in wanted:
            if name == "hcp":
                levels = families.hierarchical_cp_levels(mesh.keys)
                collection.hcp = [mesh.group(level) for level in levels] or None
                continue
            keys = [key for key in _FIELD_KEYS[name] if key in mesh.keys]
            setattr(collection, name, mesh.group(keys[0]) if keys and mesh.has_group(keys[0]) else None)
        return collection

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: list[str] | None = None
    ) -> ProcessGroupCollection:
        """The groups of the current mesh, e.g. the one ``initialize_model_parallel`` built."""
        return cls.from_mesh(current_mesh(), required_pgs)

    def __repr__(self) -> str:
        present = []
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                present.append(f"{field.name}({[group.size() for group in value]})")
            elif value is not None:
                present.append(f"{field.name}({value.size()})")
        return f"ProcessGroupCollection({', '.join(present) or 'empty'})"
