"""The layout: pure rank arithmetic (configs, grids, groups by key, derived groups, topology).

Knows integers, tensors and einops; never ``torch.distributed``, nor a Megatron,
JAX or command-line API above it.
"""
