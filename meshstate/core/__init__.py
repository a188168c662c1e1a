"""The runtime: agreement between ranks, group creation, the build, the mesh and its views,
torch's private names (``compat.py``) and the seam a simulation plugs into (``world.py``).

Knows ``torch.distributed`` and the layout, never a Megatron, JAX or command-line name.
"""
