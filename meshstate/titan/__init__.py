"""torchtitan's API over a meshstate mesh: ``from meshstate.titan import ParallelDims``."""

from meshstate.titan.parallel_dims import ParallelDims, ParallelDimsError

__all__ = ["ParallelDims", "ParallelDimsError"]
