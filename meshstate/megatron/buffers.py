"""megatron-core's global memory buffers: scratch tensors reused between calls.

``initialize_model_parallel`` creates the global memory buffer and
``destroy_model_parallel`` drops both buffers; they live in the served state
(:data:`meshstate.megatron.facts.state`, a rank's own). Example::

    get_global_memory_buffer().get_tensor((4, 8), torch.float16, "mpu")   # a (4, 8) view
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import reduce
from typing import Any, cast

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.megatron.errors import ParallelStateError
from meshstate.megatron import facts as served
from meshstate.megatron.facts import served_mesh
from meshstate.megatron.getters import get_tensor_model_parallel_group
from meshstate.megatron.facts import not_initialized

__all__ = [
    "GlobalMemoryBuffer",
    "GlobalSymmetricMemoryBuffer",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
]


class GlobalMemoryBuffer:
    """Named scratch tensors reused between calls to avoid allocations.

    Example: ``buffer.get_tensor((4, 8), torch.float16, "mpu")`` returns a
    view of a buffer of at least 32 elements, grown when a larger one is asked.
    Tensors live on the current CUDA device when CUDA is available, else on CPU.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        """A tensor of ``tensor_shape`` and ``dtype`` backed by the buffer ``name``."""
        required = reduce(operator.mul, tensor_shape, 1)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < required:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
            with mem_alloc_context() if mem_alloc_context else nullcontext():
                current = torch.empty(required, dtype=dtype, device=device, requires_grad=False)
            self.buffer[(name, dtype)] = current
        return current[:required].view(*tensor_shape)


class GlobalSymmetricMemoryBuffer:
    """Symmetric memory over a group for low-latency NVLink collectives.

    Where symmetric memory is unavailable (no CUDA, or the group is not on one
    NVLink domain) the buffer is absent and ``maybe_get_tensor`` returns
    ``{"tensor": None, "handle": None}``, as in megatron-core.
    """

    def __init__(self, size_in_mb: float, process_group: dist.ProcessGroup) -> None:
        self.symm_buffer, self.symm_mem_hdl = _compat.symmetric_memory(
            int(size_in_mb * 1024 * 1024), process_group
        )

    def maybe_get_tensor(
        self, tensor_shape: Sequence[int], dtype: torch.dtype
    ) -> dict[str, Any]:
        """A tensor backed by symmetric memory and its handle, or ``None``s."""
        numel = reduce(operator.mul, tensor_shape, 1)
        needed = numel * torch.tensor([], dtype=dtype).element_size()
        if self.symm_buffer is None or needed > self.symm_buffer.numel():
            return {"tensor": None, "handle": None}
        tensor = self.symm_buffer[:needed].view(dtype).view(*tensor_shape)
        return {"tensor": tensor, "handle": self.symm_mem_hdl}


def _set_global_memory_buffer() -> None:
    """Create the global memory buffer (``initialize_model_parallel`` does)."""
    if served.state.memory_buffer is not None:
        raise ParallelStateError("global memory buffer is already initialized")
    served.state.memory_buffer = GlobalMemoryBuffer()


def _set_global_symmetric_memory_buffer() -> None:
    """Create the symmetric memory buffer over the tensor-parallel group."""
    if served.state.symmetric_buffer is not None:
        raise ParallelStateError("global symmetric memory buffer is already initialized")
    served.state.symmetric_buffer = GlobalSymmetricMemoryBuffer(
        size_in_mb=256, process_group=get_tensor_model_parallel_group()
    )


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The global memory buffer."""
    buffer = served.state.memory_buffer
    if buffer is None:
        raise not_initialized("global memory buffer", served_mesh())
    return cast(GlobalMemoryBuffer, buffer)


def get_global_symmetric_memory_buffer() -> GlobalSymmetricMemoryBuffer:
    """The global symmetric memory buffer."""
    buffer = served.state.symmetric_buffer
    if buffer is None:
        raise not_initialized("global symmetric memory buffer", served_mesh())
    return cast(GlobalSymmetricMemoryBuffer, buffer)


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer."""
    served.state.memory_buffer = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer."""
    served.state.symmetric_buffer = None
