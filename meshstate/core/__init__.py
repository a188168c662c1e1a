"""The state: config, pure layout, agreement, group creation and the mesh.

Knows ``torch.distributed``, never a Megatron, JAX or command-line name.
"""
