"""meshstate: the parallel layout of a training job as one named, typed object.

Build it once from a Megatron order string; slice it like a ``DeviceMesh``;
ask it for Megatron's groups; shard tensors over it with JAX-style specs.

Example (``torchrun --nproc-per-node 8``)::

    import meshstate
    mesh = meshstate.init_mesh("tp-cp-ep-dp-pp", tp=2, cp=2, pp=2, ep=2, etp=1)
    mesh["dp", "cp"]        # 2-D DeviceMesh for FSDP2's HSDP
    mesh.group("tp-cp")     # the joint tensor+context group

Legacy Megatron code: ``from meshstate.megatron import parallel_state as mpu``.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshstate.jax.collectives import all_gather, all_gather_invariant, all_to_all, axis_index, axis_size, pmax, pmean, pmin, ppermute, psum, psum_scatter, pvary, raise_on_ppermute_sort_diff
    from meshstate.jax.typing import UnboundAxisError, VaryingAxesError, vma
    from meshstate.core.adopt import adopt
    from meshstate.core.one_rank import compile_on_one_rank
    from meshstate.layout.config import DEFAULT_ORDER, MeshConfig
    from meshstate.errors import ArgumentTypeError, AxisError, ConfigError, MeshStateError, NotInitializedError, SimulationError, WrongMeshError
    from meshstate.megatron.errors import ParallelStateError
    from meshstate.core.groups import GroupOptions
    from meshstate.megatron.hyper_comm_grid import HyperCommGrid
    from meshstate.layout.layout import GROUP_KINDS, Chunks, DerivedGroup, Grid, Instances, Level, ParallelLayout, Pick
    from meshstate.core.build import init_mesh, make_mesh
    from meshstate.core.mesh import ParallelMesh
    from meshstate.core.which_mesh import current_mesh, get_mesh, set_mesh
    from meshstate.core.ordered import OrderedGroup
    from meshstate.layout.hybrid_grid import HybridGrid
    from meshstate.core.hybrid_mesh import HybridMesh, init_hybrid_mesh
    from meshstate.megatron.process_groups import ProcessGroupCollection
    from meshstate.jax.sharding import NamedSharding, P, distribute, to_placements
    from meshstate.jax.reshard import reshard
    from meshstate.jax.shard_map import Infer, shard_map, smap
    from meshstate.jax.explicit import ExplicitType, ShardingTypeError, auto_axes, device_put, einsum, explicit, explicit_axes, matmul, typeof

# Every public name and the module that defines it. Nothing is imported until a name is
# first used (PEP 562), so `import meshstate` costs no torch import; tools that pull heavy
# optional packages (the benchmark imports megatron-core) are never loaded by it.
_HOME: dict[str, str] = {
    **dict.fromkeys(('all_gather', 'all_gather_invariant', 'all_to_all', 'axis_index', 'axis_size', 'pmax', 'pmean', 'pmin', 'ppermute', 'psum', 'psum_scatter', 'pvary', 'raise_on_ppermute_sort_diff'), "meshstate.jax.collectives"),
    **dict.fromkeys(('UnboundAxisError', 'VaryingAxesError', 'vma'), "meshstate.jax.typing"),
    **dict.fromkeys(('adopt',), "meshstate.core.adopt"),
    **dict.fromkeys(('compile_on_one_rank',), "meshstate.core.one_rank"),
    **dict.fromkeys(('DEFAULT_ORDER', 'MeshConfig'), "meshstate.layout.config"),
    **dict.fromkeys(('ArgumentTypeError', 'AxisError', 'ConfigError', 'MeshStateError', 'NotInitializedError', 'SimulationError', 'WrongMeshError'), "meshstate.errors"),
    **dict.fromkeys(('ParallelStateError',), "meshstate.megatron.errors"),
    **dict.fromkeys(('GroupOptions',), "meshstate.core.groups"),
    **dict.fromkeys(('HyperCommGrid',), "meshstate.megatron.hyper_comm_grid"),
    **dict.fromkeys(('GROUP_KINDS', 'Chunks', 'DerivedGroup', 'Grid', 'Instances', 'Level', 'ParallelLayout', 'Pick'), "meshstate.layout.layout"),
    **dict.fromkeys(('init_mesh', 'make_mesh'), "meshstate.core.build"),
    **dict.fromkeys(('ParallelMesh',), "meshstate.core.mesh"),
    **dict.fromkeys(('current_mesh', 'get_mesh', 'set_mesh'), "meshstate.core.which_mesh"),
    **dict.fromkeys(('OrderedGroup',), "meshstate.core.ordered"),
    **dict.fromkeys(('HybridGrid',), "meshstate.layout.hybrid_grid"),
    **dict.fromkeys(('HybridMesh', 'init_hybrid_mesh'), "meshstate.core.hybrid_mesh"),
    **dict.fromkeys(('ProcessGroupCollection',), "meshstate.megatron.process_groups"),
    **dict.fromkeys(('NamedSharding', 'P', 'distribute', 'to_placements'), "meshstate.jax.sharding"),
    **dict.fromkeys(("reshard",), "meshstate.jax.reshard"),
    **dict.fromkeys(('Infer', 'shard_map', 'smap'), "meshstate.jax.shard_map"),
    **dict.fromkeys(('ExplicitType', 'ShardingTypeError', 'auto_axes', 'device_put', 'einsum', 'explicit', 'explicit_axes', 'matmul', 'typeof'), "meshstate.jax.explicit"),
}
_SUBMODULES = frozenset(
    {"checkpoint", "core", "jax", "layout", "megatron", "simulation", "testing", "titan", "tools", "parallel_state"}
)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"meshstate.{name}")
    else:
        raise AttributeError(f"module 'meshstate' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME) | _SUBMODULES)


__all__ = ['ArgumentTypeError', 'AxisError', 'Chunks', 'ConfigError', 'DEFAULT_ORDER', 'DerivedGroup', 'GROUP_KINDS', 'Grid', 'GroupOptions', 'HybridGrid', 'HybridMesh', 'HyperCommGrid', 'Infer', 'Instances', 'Level', 'MeshConfig', 'MeshStateError', 'NamedSharding', 'NotInitializedError', 'OrderedGroup', 'P', 'ParallelLayout', 'ParallelMesh', 'ParallelStateError', 'Pick', 'ProcessGroupCollection', 'SimulationError', 'UnboundAxisError', 'VaryingAxesError', 'WrongMeshError', 'adopt', 'all_gather', 'all_gather_invariant', 'all_to_all', 'axis_index', 'axis_size', 'compile_on_one_rank', 'current_mesh', 'distribute', 'get_mesh', 'init_hybrid_mesh', 'init_mesh', 'make_mesh', 'pmax', 'pmean', 'pmin', 'ppermute', 'psum', 'psum_scatter', 'pvary', 'raise_on_ppermute_sort_diff', 'reshard', 'set_mesh', 'shard_map', 'smap', 'to_placements', 'vma']
