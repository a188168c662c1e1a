"""A fake world: the calling process stands in for one rank of a large world on torch's fake
backend (the layout and its groups, no values; collectives do nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from meshstate.testing import torch_internals


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of a ``world_size``-rank world on torch's fake backend.

    For layout, group-count and timing work in one process; collectives do not
    move data. The default group (and every group made inside) is destroyed on exit.

    Example: ``with fake_world(5, 131072): meshstate.init_mesh(tp=8)``.
    """
    dist.init_process_group("fake", store=torch_internals.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
