"""The error the Megatron façade raises where megatron-core raises ``RuntimeError`` or
``AssertionError``.

Example: ``initialize_model_parallel(tensor_model_parallel_size=3)`` on 8 ranks raises
``ParallelStateError`` (catchable as ``RuntimeError``, ``AssertionError`` and ``ValueError``).
"""

from __future__ import annotations

from meshstate.errors import ConfigError


class ParallelStateError(ConfigError, RuntimeError, AssertionError):
    """A Megatron-style call that megatron-core rejects with ``RuntimeError`` or
    ``AssertionError``: catchable as either of those, and as ``ValueError``.
    """
