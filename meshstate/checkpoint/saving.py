"""Save a state dict of plain shards under one layout, load it under another.

Each local tensor is an :class:`~meshstate.checkpoint.entries.Entry` under its
whole-model key (numbered items moved by the items of the ranks before them),
its block's place in the whole tensor known from its spec. A backend writes and
reads the entries: torch's DCP (``backend="dcp"``, :mod:`meshstate.checkpoint.dcp`)
or meta-pytorch's torch-checkpointing (``backend="torch-checkpointing"``, the
``meshstate[checkpointing]`` extra, :mod:`meshstate.checkpoint.checkpointing`).
Each replicated entry is written once; on load, one rank of each replica group
reads it and broadcasts it over the group. Every rank checks first that the
checkpoint covers its entries; then the blocks are read, and received, straight
into the state's contiguous tensors, as DCP reads a model's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshstate.checkpoint import dcp
from meshstate.checkpoint.entries import Entry, Transfer, holdings
from meshstate.checkpoint.errors import CheckpointError
from meshstate.checkpoint.layout import Layout, Numbering, flatten, ranges_text
from meshstate.core.compat import broadcast_coalesced
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh
from meshstate.core.world import refuse_simulation
from meshstate.jax.sharding import P

BACKENDS = ("dcp", "torch-checkpointing")
"""What writes the files: torch's DCP, or meta-pytorch's torch-checkpointing (an extra)."""
BROADCAST_BUCKET_BYTES = 64 * 2**20
"""The most bytes of a replica group's tensors one broadcast of a load carries (a larger
tensor goes alone, in place)."""


def save(
    state: Mapping[str, Any], path: str | os.PathLike[str], layout: Layout = Layout(),
    mesh: ParallelMesh | None = None, backend: str = "dcp",
) -> Transfer:
    """Save ``state`` (nested dicts of tensors and plain values, each rank's own shards)
    at ``path`` so that any layout of the same model can load it.

    Every rank of the mesh calls it. ``layout`` says how each local tensor lies;
    ``mesh`` is the current mesh by default; ``backend`` is ``"dcp"`` or
    ``"torch-checkpointing"``. Returns this rank's tensor bytes written: a
    replicated entry is written by one rank of its replica group.

    Example::

        layout = Layout(specs={"*.up": P(None, "tp"), "*.down": P("tp", None)})
        meshstate.checkpoint.save({"model": model.state_dict()}, "ckpt/step100", layout)
    """
    files = _backend(backend)
    mesh = _mesh(mesh, "save")
    entries = _entries(state, layout, mesh)
    return files.save(entries, os.fspath(path), mesh)  # type: ignore[no-any-return]


def load(
    state: MutableMapping[str, Any], path: str | os.PathLike[str], layout: Layout = Layout(),
    mesh: ParallelMesh | None = None, backend: str = "dcp",
) -> Transfer:
    """Load the checkpoint at ``path`` into ``state``, this layout's shards, in place.

    ``state`` has the structure :func:`save` was given (tensors of this layout's
    local shapes, plain values); its tensors are overwritten and its plain values
    replaced. ``backend`` must be the one that saved. Every rank first checks that
    the checkpoint covers its entries (a missing key or numbered range, a whole
    shape that differs: a :class:`CheckpointError` on every rank, naming them,
    before anything is read; through DCP, in its own planning step), and that each
    block is held by exactly its replica group, as :func:`save` does. A replicated entry is read by one rank of its
    replica group and broadcast to the others. Returns this rank's tensor bytes
    read from storage.
    """
    files = _backend(backend)
    mesh = _mesh(mesh, "load")
    entries = _entries(state, layout, mesh)
    read, transfer = files.load([entry for entry in entries if entry.is_first_replica(mesh)],
                                os.fspath(path), mesh, lambda saved: _gaps(entries, mesh, saved),
                                holdings(entries, mesh))
    _put(state, _shared(entries, read, mesh))
    return transfer  # type: ignore[no-any-return]


def _backend(name: str) -> ModuleType:
    """The module that writes and reads the files of backend ``name``."""
    if name == "dcp":
        return dcp
    if name == "torch-checkpointing":
        from meshstate.checkpoint import checkpointing

        return checkpointing
    raise CheckpointError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")


def _shared(entries: list[Entry], read: Mapping[str, Any], mesh: ParallelMesh) -> dict[str, Any]:
    """Each entry's value on this rank, by key: as read (by saved key), or, for a replicated
    entry, as the first of its replica group read it, broadcast over the group: per group
    (in the order of their axes), its tensors coalesced into buckets of
    ``BROADCAST_BUCKET_BYTES`` and its plain values in one list, in the entries' order."""
    shared = {entry.key: read.get(entry.saved_key) for entry in entries if not entry.replica_axes}
    groups: dict[tuple[str, ...], list[Entry]] = {}
    for entry in entries:
        if entry.replica_axes:
            groups.setdefault(entry.replica_axes, []).append(entry)
    for axes in sorted(groups):
        group = mesh.ordered(axes)
        src = group.group_rank_at[0]
        tensors = [entry for entry in groups[axes] if entry.is_tensor]
        values = [entry for entry in groups[axes] if not entry.is_tensor]
        blocks = [read[entry.saved_key] if entry.saved_key in read else entry.block() for entry in tensors]
        if blocks:
            broadcast_coalesced(blocks, group.group, src, BROADCAST_BUCKET_BYTES)
        carried = [read.get(entry.saved_key) for entry in values]
        if carried:
            dist.broadcast_object_list(carried, group=group.group, group_src=src)
        shared.update({entry.key: block for entry, block in zip(tensors, blocks)})
        shared.update({entry.key: value for entry, value in zip(values, carried)})
    return shared


def _mesh(mesh: ParallelMesh | None, what: str) -> ParallelMesh:
    refuse_simulation(f"meshstate.checkpoint.{what} (its backends write files per process)")
    return current_mesh() if mesh is None else mesh


def _entries(state: Mapping[str, Any], layout: Layout, mesh: ParallelMesh) -> list[Entry]:
    flat = flatten(state)
    offsets = _offsets(layout.counts(flat), mesh)
    entries = []
    for key, value in flat.items():
        spec = layout.spec_of(key) if isinstance(value, torch.Tensor) and value.dim() else P()
        if spec.unreduced:
            raise CheckpointError(f"{key}: {spec!r} is a pending sum, not a shard; reduce it first")
        if isinstance(value, DTensor):
            raise CheckpointError(
                f"{key} is a DTensor, which knows its layout: save it with "
                "torch.distributed.checkpoint, or its local shard (to_local()) with a spec"
            )
        # Ranks that differ along other axes of the view hold the same entry.
        axes = frozenset(spec.axes) | layout.numbering_axes(key)
        view = mesh.layout.view_of(axes or ("dp",), f"the checkpoint entry {key!r}")
        replicas = tuple(axis for axis in reversed(view.axes_fastest_first)
                         if axis not in axes and mesh.size(axis) > 1)
        entries.append(Entry(key, layout.global_key(key, offsets), value, spec, replicas))
    return entries


def _offsets(counts: Mapping[Numbering, int], mesh: ParallelMesh) -> dict[Numbering, int]:
    """Each numbering's offset on this rank: the items of the ranks before it along its axis."""
    offsets = {}
    for axis in sorted({axis for _, axis in counts}):
        group = mesh.ordered(axis)
        mine = {numbering: n for numbering, n in counts.items() if numbering[1] == axis}
        every: list[Any] = [None] * len(group.ranks)
        dist.all_gather_object(every, mine, group=group.group)
        before = [every[group.group_rank_at[index]] for index in range(group.index)]
        for numbering in mine:
            offsets[numbering] = sum(theirs.get(numbering, 0) for theirs in before)
    return offsets


def _gaps(
    entries: list[Entry], mesh: ParallelMesh, saved: Mapping[str, tuple[int, ...] | None],
) -> list[str]:
    """What this rank's entries need that the checkpoint lacks, a line each; ``saved``
    holds each saved key's whole shape (``None``: a plain value)."""
    problems = []
    for entry in entries:
        if entry.saved_key not in saved:
            problems.append(f"{entry.saved_key} (this rank's {entry.key}) is not in the checkpoint"
                            + _numbered_hint(entry.saved_key, saved))
        elif entry.is_tensor:
            size, shape = saved[entry.saved_key], entry.whole_shape(mesh)
            if size is None:
                problems.append(f"{entry.saved_key} is a plain value in the checkpoint, not a tensor")
            elif tuple(size) != tuple(shape):
                problems.append(f"{entry.saved_key}: the checkpoint's whole shape is "
                                f"{tuple(size)}, this layout's is {tuple(shape)}")
    return problems


def _numbered_hint(key: str, saved: Mapping[str, Any]) -> str:
    """``; it has 0-7 there`` for a key whose numbered item the checkpoint lacks."""
    segments = key.split(".")
    for position, segment in enumerate(segments):
        if not segment.isdigit():
            continue
        numbers = set()
        for other in saved:
            parts = other.split(".")
            if (len(parts) == len(segments) and parts[:position] == segments[:position]
                    and parts[position + 1:] == segments[position + 1:] and parts[position].isdigit()):
                numbers.add(int(parts[position]))
        if numbers:
            return f" (it has {'.'.join(segments[:position])} {ranges_text(numbers)})"
    return ""


def _put(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Write ``loaded`` (dotted keys, as :func:`flatten` gave them) into the nested
    ``state``: tensors in place, plain values replaced."""
    for key, value in loaded.items():
        node: Any = state
        parts = key.split(".")
        while True:
            name = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                         if ".".join(parts[:n]) in node), None)
            if name is None:
                raise CheckpointError(f"{key} is not in the state given to load")
            parts = parts[len(name.split(".")):]
            if not parts:
                break
            node = node[name]
        if isinstance(node[name], torch.Tensor):
            if not _same_view(node[name], value):  # a block read or received in place is there
                with torch.no_grad():
                    node[name].copy_(value)
        else:
            node[name] = value


def _same_view(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``other`` is ``tensor``'s own memory, seen the same way."""
    return (tensor.data_ptr() == other.data_ptr() and tensor.shape == other.shape
            and tensor.stride() == other.stride() and tensor.dtype == other.dtype)
