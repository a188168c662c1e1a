"""``shard_map`` and ``smap``: JAX's per-shard programming model on a ParallelMesh.

Inside: ``mapped`` (``shard_map`` itself: the spec trees, the blocks in, the body run
typed or in JAX's legacy mode, the results out), ``partial_manual`` (a body manual over
some axes, global over the others), ``infer`` (in-specs read from the arguments,
:data:`Infer`) and ``smap`` (one axis, one block at a time, over ``shard_map``).
"""

from meshstate.jax.shard_map.infer import Infer
from meshstate.jax.shard_map.mapped import shard_map
from meshstate.jax.shard_map.smap import smap

__all__ = ["Infer", "shard_map", "smap"]
