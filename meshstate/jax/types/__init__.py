"""JAX's types over a mesh. Behind :mod:`meshstate.jax.typing`, the one module that imports
them, the two type systems of a collective's value, each a
:class:`~meshstate.jax.types.system.TypeSystem` wrapping the collectives it describes: JAX's
rule in a typed body (:mod:`~meshstate.jax.types.in_body`, over the varying-axes types of
:mod:`~meshstate.jax.types.vma`) and the adapter of torchtitan's spmd_types checker
(:mod:`~meshstate.jax.types.spmd_checker`), which types values both ways. Beside them, JAX's
Explicit axes' types (:mod:`~meshstate.jax.types.explicit`: a value's type read from its
placements, and whether this thread is in the explicit mode), which the explicit mode and
``shard_map`` read.
"""
