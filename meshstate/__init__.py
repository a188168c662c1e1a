"""meshstate: the parallel layout of a training job as one named, typed object.

Build it once from a Megatron order string; slice it like a ``DeviceMesh``;
ask it for Megatron's groups.

Example (``torchrun --nproc-per-node 8``)::

    import meshstate
    mesh = meshstate.init_mesh("tp-cp-ep-dp-pp", tp=2, cp=2, pp=2, ep=2, etp=1)
    mesh["dp", "cp"]        # 2-D DeviceMesh for FSDP2's HSDP
    mesh.group("tp-cp")     # the joint tensor+context group
"""

from meshstate.config import DEFAULT_ORDER, MeshConfig
from meshstate.errors import AxisError, ConfigError, MeshStateError
from meshstate.layout import GROUP_KINDS, Grid, ParallelLayout
from meshstate.mesh import AxisGroup, ParallelMesh, init_mesh

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_KINDS",
    "AxisError",
    "AxisGroup",
    "ConfigError",
    "Grid",
    "MeshConfig",
    "MeshStateError",
    "ParallelLayout",
    "ParallelMesh",
    "init_mesh",
]
