"""meshstate: the parallel layout of a training job as one named, typed object.

Build it once from a Megatron order string; slice it like a ``DeviceMesh``;
ask it for Megatron's groups; shard tensors over it with JAX-style specs.

Example (``torchrun --nproc-per-node 8``)::

    import meshstate
    mesh = meshstate.init_mesh("tp-cp-ep-dp-pp", tp=2, cp=2, pp=2, ep=2, etp=1)
    mesh["dp", "cp"]        # 2-D DeviceMesh for FSDP2's HSDP
    mesh.group("tp-cp")     # the joint tensor+context group

Legacy Megatron code: ``from meshstate import parallel_state as mpu``.
"""

from typing import TYPE_CHECKING, Any

from meshstate.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from meshstate.config import DEFAULT_ORDER, MeshConfig
from meshstate.errors import (
    AxisError,
    ConfigError,
    MeshStateError,
    NotInitializedError,
    ParallelStateError,
)
from meshstate.groups import GroupOptions
from meshstate.hyper_comm_grid import HyperCommGrid
from meshstate.layout import (
    GROUP_KINDS,
    Chunks,
    DerivedGroup,
    Grid,
    Instances,
    Level,
    ParallelLayout,
    Pick,
)
from meshstate.mesh import (
    AxisGroup,
    OrderedGroup,
    ParallelMesh,
    current_mesh,
    init_mesh,
    set_mesh,
)
from meshstate.process_groups import ProcessGroupCollection

if TYPE_CHECKING:
    from meshstate.sharding import NamedSharding, P, distribute, to_placements

_SHARDING_NAMES = ("NamedSharding", "P", "distribute", "to_placements")


def __getattr__(name: str) -> Any:
    # DTensor is a heavy import; code that never shards tensors does not pay for it.
    if name in _SHARDING_NAMES:
        from meshstate import sharding

        return getattr(sharding, name)
    raise AttributeError(f"module 'meshstate' has no attribute {name!r}")

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_KINDS",
    "AxisError",
    "AxisGroup",
    "ConfigError",
    "Chunks",
    "DerivedGroup",
    "Grid",
    "GroupOptions",
    "HyperCommGrid",
    "Instances",
    "Level",
    "MeshConfig",
    "MeshStateError",
    "NamedSharding",
    "NotInitializedError",
    "OrderedGroup",
    "P",
    "ParallelLayout",
    "ParallelMesh",
    "ParallelStateError",
    "Pick",
    "ProcessGroupCollection",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "current_mesh",
    "distribute",
    "init_mesh",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "set_mesh",
    "to_placements",
]
