"""meshstate for Megatron code: one call makes megatron-core's names serve meshstate.

Example::

    import meshstate.megatron
    meshstate.megatron.install()    # before or after megatron-core is imported
    from megatron.core import parallel_state   # now meshstate.megatron.parallel_state
"""

from meshstate.megatron.install import install, uninstall

__all__ = ["install", "uninstall"]
