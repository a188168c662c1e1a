"""Save a state dict of plain shards under one layout, load it under another, with DCP.

Each local tensor becomes a DTensor over the axes its spec splits (the view's
sub-mesh of just those axes, so replicas along the other axes are one entry),
under its whole-model key (numbered items moved by the items of the ranks before
them); torch's ``torch.distributed.checkpoint`` (DCP) writes each entry once and
reads, at any other layout, the pieces each rank's new shards cover. On load, one
rank of each replica group reads a replicated entry and broadcasts it over the
group; nothing is copied into the state until every rank has read what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from meshstate.checkpoint.errors import CheckpointError
from meshstate.checkpoint.layout import Layout, Numbering, flatten, global_shape, ranges_text
from meshstate.core.mesh import ParallelMesh, current_mesh
from meshstate.core.world import refuse_simulation
from meshstate.jax.plan import contiguous_strides
from meshstate.jax.sharding import P, to_placements


@dataclass(frozen=True)
class Transfer:
    """What this rank moved: tensor bytes written (save) or read from storage (load),
    and the entries they belong to."""

    bytes: int
    entries: int


@dataclass(frozen=True)
class _Entry:
    key: str
    """The key in the caller's state (dotted through nested dicts)."""
    saved_key: str
    """The whole model's key: numbered items moved by the ranks before this one."""
    value: Any
    spec: P
    replica_axes: tuple[str, ...]
    """The axes (of size > 1) along which other ranks hold this same entry."""


def save(
    state: Mapping[str, Any], path: str | os.PathLike[str], layout: Layout = Layout(),
    mesh: ParallelMesh | None = None,
) -> Transfer:
    """Save ``state`` (nested dicts of tensors and plain values, each rank's own shards)
    at ``path`` so that any layout of the same model can load it.

    Every rank of the mesh calls it. ``layout`` says how each local tensor lies;
    ``mesh`` is the current mesh by default. Returns this rank's tensor bytes
    written: a replicated entry is written by one rank of its replica group.

    Example::

        layout = Layout(specs={"*.up": P(None, "tp"), "*.down": P("tp", None)})
        meshstate.checkpoint.save({"model": model.state_dict()}, "ckpt/step100", layout)
    """
    mesh = _mesh(mesh, "save")
    entries = _entries(state, layout, mesh)
    planner = _CountingSavePlanner()
    dcp_save({entry.saved_key: _saved(entry, mesh) for entry in entries},
             checkpoint_id=os.fspath(path), planner=planner)
    return Transfer(planner.bytes, planner.entries)


def load(
    state: MutableMapping[str, Any], path: str | os.PathLike[str], layout: Layout = Layout(),
    mesh: ParallelMesh | None = None,
) -> Transfer:
    """Load the checkpoint at ``path`` into ``state``, this layout's shards, in place.

    ``state`` has the structure :func:`save` was given (tensors of this layout's
    local shapes, plain values); its tensors are overwritten and its plain values
    replaced. Every rank first checks that the checkpoint covers its entries (a
    missing key or numbered range, a whole shape that differs: a
    :class:`CheckpointError` on every rank, naming them, before anything is read).
    A replicated entry is read by one rank of its replica group and broadcast to
    the others. Returns this rank's tensor bytes read from storage.
    """
    mesh = _mesh(mesh, "load")
    entries = _entries(state, layout, mesh)
    _require_covered(entries, mesh, FileSystemReader(os.fspath(path)).read_metadata())
    readers = {entry.key: _reads(entry, mesh) for entry in entries}
    targets = {entry.saved_key: _target(entry, mesh) for entry in entries if readers[entry.key]}
    planner = _CountingLoadPlanner()
    dcp_load(targets, checkpoint_id=os.fspath(path), planner=planner)
    loaded: dict[str, Any] = {}
    for entry in entries:  # the same order on every rank of a replica group
        value = targets.get(entry.saved_key)
        if isinstance(entry.value, torch.Tensor):
            block = value.to_local() if isinstance(value, DTensor) else value
            if block is None:
                block = torch.empty_like(entry.value)
            if entry.replica_axes:
                group = mesh.ordered(entry.replica_axes)
                dist.broadcast(block, group=group.group, group_src=group.group_rank_at[0])
            loaded[entry.key] = block
        else:
            loaded[entry.key] = value
    _put(state, loaded)
    return Transfer(planner.bytes, planner.entries)


def _mesh(mesh: ParallelMesh | None, what: str) -> ParallelMesh:
    refuse_simulation(f"meshstate.checkpoint.{what} (torch's DCP writes files per process)")
    return current_mesh() if mesh is None else mesh


def _entries(state: Mapping[str, Any], layout: Layout, mesh: ParallelMesh) -> list[_Entry]:
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
        replicas: tuple[str, ...] = ()  # plain values: every rank reads its own (bytes)
        if isinstance(value, torch.Tensor):
            # Ranks that differ along other axes of the view hold the same entry.
            axes = frozenset(spec.axes) | layout.numbering_axes(key)
            view = mesh.layout.view_of(axes or ("dp",), f"the checkpoint entry {key!r}")
            replicas = tuple(axis for axis in reversed(view.axes_fastest_first)
                             if axis not in axes and mesh.size(axis) > 1)
        entries.append(_Entry(key, layout.global_key(key, offsets), value, spec, replicas))
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


def _dtensor(entry: _Entry, mesh: ParallelMesh, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the DTensor over the axes its spec splits (itself if it splits none)."""
    split = entry.spec.axes
    if not split:
        return local
    device_mesh = mesh[_split_axes(entry, mesh)]
    shape = global_shape(local.shape, entry.spec, {axis: mesh.size(axis) for axis in split})
    return DTensor.from_local(
        local, device_mesh, to_placements(entry.spec, device_mesh), shape=torch.Size(shape),
        stride=contiguous_strides(shape), run_check=False,
    )


def _split_axes(entry: _Entry, mesh: ParallelMesh) -> tuple[str, ...]:
    """The axes ``entry``'s spec splits, in its view's order (a DeviceMesh's dims)."""
    view = mesh.root_of(mesh.layout.view_of(entry.spec.axes, f"the checkpoint entry {entry.key!r}"))
    return tuple(axis for axis in view.mesh_dim_names or () if axis in entry.spec.axes)


def _saved(entry: _Entry, mesh: ParallelMesh) -> Any:
    if not isinstance(entry.value, torch.Tensor):
        return entry.value
    return _dtensor(entry, mesh, entry.value.detach())


def _target(entry: _Entry, mesh: ParallelMesh) -> Any:
    if not isinstance(entry.value, torch.Tensor):
        return entry.value
    return _dtensor(entry, mesh, torch.empty_like(entry.value, memory_format=torch.contiguous_format))


def _reads(entry: _Entry, mesh: ParallelMesh) -> bool:
    """Whether this rank reads ``entry`` from storage: the first of its replica group."""
    return not entry.replica_axes or mesh.ordered(entry.replica_axes).index == 0


def _require_covered(entries: list[_Entry], mesh: ParallelMesh, metadata: Any) -> None:
    """Refuse, on every rank, a checkpoint that lacks an entry some rank needs."""
    saved = metadata.state_dict_metadata
    problems = []
    for entry in entries:
        found = saved.get(entry.saved_key)
        if found is None:
            problems.append(f"{entry.saved_key} (this rank's {entry.key}) is not in the checkpoint"
                            + _numbered_hint(entry.saved_key, saved))
        elif isinstance(entry.value, torch.Tensor):
            shape = global_shape(entry.value.shape, entry.spec,
                                 {axis: mesh.size(axis) for axis in entry.spec.axes})
            size = getattr(found, "size", None)
            if size is None:
                problems.append(f"{entry.saved_key} is a plain value in the checkpoint, not a tensor")
            elif tuple(size) != tuple(shape):
                problems.append(f"{entry.saved_key}: the checkpoint's whole shape is "
                                f"{tuple(size)}, this layout's is {tuple(shape)}")
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else []))
    found_on = [(rank, listed) for rank, listed in enumerate(every) if listed]
    if found_on:
        rank, listed = found_on[0]
        raise CheckpointError(
            f"the checkpoint does not cover this layout (rank {rank} of {len(found_on)} ranks "
            f"that found gaps): " + "; ".join(listed) + "; nothing was loaded"
        )


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
            with torch.no_grad():
                node[name].copy_(value)
        else:
            node[name] = value


class _CountingSavePlanner(DefaultSavePlanner):
    """DCP's planner, counting the tensor bytes this rank writes once plans are final."""

    bytes = 0
    entries = 0

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        keys = set()
        for item in plan.items:
            if item.tensor_data is not None:
                self.bytes += item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize
                keys.add(item.index.fqn)
        self.entries = len(keys)
        return plan


class _CountingLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, counting the tensor bytes this rank reads."""

    bytes = 0
    entries = 0

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        keys = set()
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        for item in plan.items:
            found = saved[item.storage_index.fqn]
            properties = getattr(found, "properties", None)
            if properties is not None:
                self.bytes += torch.Size(item.lengths).numel() * properties.dtype.itemsize
                keys.add(item.storage_index.fqn)
        self.entries = len(keys)
        return plan
