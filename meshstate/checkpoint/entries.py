"""One entry of a checkpoint as every backend sees it: a rank's value, its whole-model key,
where its block lies and which ranks hold the same block.

:mod:`meshstate.checkpoint.saving` makes the entries; the backends
(:mod:`~meshstate.checkpoint.dcp`, :mod:`~meshstate.checkpoint.checkpointing`) write
and read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshstate.checkpoint.errors import CheckpointError, refusal
from meshstate.checkpoint.layout import Holding, first_stray, global_offsets, global_shape
from meshstate.core.mesh import ParallelMesh
from meshstate.jax.sharding import P


GapCheck = Callable[[Mapping[str, "tuple[int, ...] | None"]], list[str]]
"""Given each saved key's whole shape (``None``: a plain value), what this rank's entries
need that a checkpoint lacks, a line each. A backend's ``load`` calls it on every rank
before it reads anything, and raises :func:`~meshstate.checkpoint.errors.refusal` on
every rank if any rank found gaps (in the collective that checks ``held`` too)."""


def holdings(entries: list["Entry"], mesh: ParallelMesh) -> dict[str, Holding]:
    """What this rank holds, for :func:`~meshstate.checkpoint.layout.first_stray`."""
    return {entry.saved_key: (entry.block_offsets(mesh) if entry.is_tensor else (), entry.replicas(mesh))
            for entry in entries}


def refuse_strays_and_gaps(held: Mapping[str, Holding], undone: str, gaps: Sequence[str] = ()) -> None:
    """Raise, on every rank, if some saved key's block is held by other ranks than exactly
    its replica group (the message ends with ``undone``: ``"nothing was written"``), else
    if any rank's ``gaps`` is not empty (:func:`~meshstate.checkpoint.errors.refusal`):
    both gathered on rank 0 together, its verdict broadcast."""
    every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((dict(held), list(gaps)), every, dst=0)
    verdict: list[str | None] = [None]
    if every is not None:
        stray = first_stray([theirs for theirs, _ in every])
        found = {rank: theirs for rank, (_, theirs) in enumerate(every) if theirs}
        verdict = [f"{stray}; {undone}" if stray is not None else str(refusal(found)) if found else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


@dataclass(frozen=True)
class Transfer:
    """What this rank moved: tensor bytes written (save) or read from storage (load),
    and the entries they belong to."""

    bytes: int
    entries: int


@dataclass(frozen=True)
class Entry:
    """One value of a rank's state, as a checkpoint holds it."""

    key: str
    """The key in the caller's state (dotted through nested dicts)."""
    saved_key: str
    """The whole model's key: numbered items moved by the ranks before this one."""
    value: Any
    spec: P
    replica_axes: tuple[str, ...]
    """The axes (of size > 1) along which other ranks hold this same block or value."""

    def whole_shape(self, mesh: ParallelMesh) -> tuple[int, ...]:
        """The whole tensor's shape (the entry is a tensor)."""
        return global_shape(self.value.shape, self.spec,
                            {axis: mesh.size(axis) for axis in self.spec.axes})

    def block_offsets(self, mesh: ParallelMesh) -> tuple[int, ...]:
        """Where this rank's block starts in the whole tensor (the entry is a tensor)."""
        axes = self.spec.axes
        return global_offsets(self.value.shape, self.spec, {axis: mesh.rank(axis) for axis in axes},
                              {axis: mesh.size(axis) for axis in axes})

    def replicas(self, mesh: ParallelMesh) -> tuple[int, ...]:
        """The ranks that hold this same block or value, the one that writes and reads it
        first: ``(0, 4)`` on ranks 0 and 4 for a tensor replicated over a dp of 2 at tp=4."""
        if not self.replica_axes:
            return (dist.get_rank(),)
        return mesh.ordered(self.replica_axes).ranks

    def is_first_replica(self, mesh: ParallelMesh) -> bool:
        """Whether this rank writes the entry and reads it from storage (the others of its
        replica group receive it by broadcast)."""
        return not self.replica_axes or mesh.ordered(self.replica_axes).index == 0

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)

    def block(self) -> torch.Tensor:
        """Where this rank's block is read or received: the state's own tensor where it is
        contiguous (read in place, as DCP reads a model's), else a new contiguous one that
        the load copies into it."""
        if self.value.is_contiguous():
            return self.value.detach()  # type: ignore[no-any-return]
        return torch.empty_like(self.value, memory_format=torch.contiguous_format)
