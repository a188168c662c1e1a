"""The two type systems behind :mod:`meshstate.jax.typing`, the one module that imports them:
JAX's varying-axes types (:mod:`~meshstate.jax.types.vma`) and the adapter of torchtitan's
spmd_types checker (:mod:`~meshstate.jax.types.spmd_checker`), which types values both ways.
"""
