"""JAX's Explicit axes for DTensor code: the sharding is part of the type.

Inside :func:`explicit`, a DTensor on a view of the mesh is typed as JAX types
an array on Explicit axes (:func:`typeof`), and plain torch ops on such values
follow JAX 0.10's rules (:mod:`~meshstate.jax.explicit.rules`): each gives JAX's
result sharding, or raises :class:`ShardingTypeError` with JAX's message before
anything is sent. Nothing communicates unless the program asked:
``out_sharding``, :func:`~meshstate.reshard`, or a reduction over a split dim
(which JAX reduces at once). Values are DTensor's; gradients reaching a leaf
carry its type, as JAX's cotangents do.

Example (8 ranks, ``init_mesh(tp=4)``)::

    with meshstate.explicit():
        x = meshstate.device_put(torch.randn(8, 16), P("dp", "tp"))
        str(meshstate.typeof(x))                            # 'float32[8@dp,16@tp]'
        w = meshstate.device_put(torch.randn(16, 4), P("tp", None))
        u = meshstate.matmul(x, w, out_sharding=P("dp", None, unreduced={"tp"}))
        meshstate.reshard(u, P("dp", None))                 # the pending sum, reduced

Inside: ``rules`` (the typing rules, pure arithmetic), ``plans`` (an op on its operands'
layouts), ``runs`` (a planned op on DTensors), ``ops`` (each op's handler), ``mode``; the
types themselves, and whether this thread is in the mode, are
:mod:`meshstate.jax.types.explicit`'s (``shard_map`` reads them too).
"""

from meshstate.jax.explicit.mode import auto_axes, device_put, explicit, explicit_axes
from meshstate.jax.explicit.ops import einsum, matmul
from meshstate.jax.types.explicit import ExplicitType, ShardingTypeError, typeof

__all__ = [
    "ExplicitType", "ShardingTypeError", "auto_axes", "device_put", "einsum", "explicit",
    "explicit_axes", "matmul", "typeof",
]
