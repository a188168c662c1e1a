"""The entries through torch's ``torch.distributed.checkpoint`` (DCP), the default backend.

Each tensor entry is saved under its whole-model key as the block of the whole
tensor its spec says it is (the planners' own write and read items, at the block's
offsets: what DCP makes of a DTensor's local shard, without building one); a
replicated block is one item to DCP, which writes it once. On load, DCP reads, at
any other layout, the pieces each rank's new blocks cover, straight into them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner, DefaultSavePlanner, create_default_local_load_plan, create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from meshstate.checkpoint.entries import Entry, GapCheck, Transfer, holdings
from meshstate.checkpoint.errors import CheckpointError, Gaps, refusal
from meshstate.checkpoint.layout import Holding, first_stray
from meshstate.core.mesh import ParallelMesh


def save(entries: list[Entry], path: str, mesh: ParallelMesh) -> Transfer:
    """Write ``entries`` (every rank's, replicas too: DCP keeps one of each) at ``path``,
    once DCP's planning step has found every block held by exactly its replica group."""
    held = holdings(entries, mesh)
    split = {entry.saved_key: (held[entry.saved_key][0], entry.whole_shape(mesh))
             for entry in entries if entry.is_tensor and entry.spec.axes}
    planner = _CountingSavePlanner(held, split)
    try:
        dcp_save({entry.saved_key: entry.value.detach() if entry.is_tensor else entry.value
                  for entry in entries}, checkpoint_id=path, planner=planner)
    except CheckpointException as error:
        raise _ours(error) from None
    return Transfer(planner.bytes, planner.entries)


def load(
    entries: list[Entry], path: str, mesh: ParallelMesh, gaps: GapCheck, held: Mapping[str, Holding],
) -> tuple[dict[str, Any], Transfer]:
    """Read the blocks and values of ``entries`` (those this rank reads) from ``path``: by
    saved key, each tensor this rank's block of it (where ``held`` says it starts). ``gaps``
    runs, and ``held`` (what this rank holds, read or not) is checked, in DCP's planning
    step, whose gather of every rank's plan (or failure) comes before any read."""
    targets = {entry.saved_key: entry.block() if entry.is_tensor else entry.value for entry in entries}
    split = {entry.saved_key: held[entry.saved_key][0]
             for entry in entries if entry.is_tensor and entry.spec.axes}
    planner = _CountingLoadPlanner(gaps, held, split)
    try:
        dcp_load(targets, checkpoint_id=path, planner=planner)
    except CheckpointException as error:
        raise _ours(error) from None
    return targets, Transfer(planner.bytes, planner.entries)


def saved_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    """Each saved key's whole shape in DCP's ``metadata``; ``None`` for a plain value."""
    return {key: tuple(found.size) if isinstance(found, TensorStorageMetadata) else None
            for key, found in metadata.state_dict_metadata.items()}


def _ours(error: CheckpointException) -> BaseException:
    """The refusal DCP carried to every rank from its planning step (meshstate's
    :class:`CheckpointError`), else DCP's own exception."""
    gaps = {rank: failure[0].problems for rank, failure in error.failures.items()
            if isinstance(failure[0], Gaps)}
    if gaps:
        return refusal(gaps)
    ours = [failure[0] for failure in error.failures.values() if isinstance(failure[0], CheckpointError)]
    return CheckpointError(str(ours[0])) if ours else error


def _unless_stray(plans: list[Any], undone: str) -> list[Any]:
    """The local plans with what each rank holds taken off them (their ``planner_data``
    carries it, beside DCP's own), after checking that every block is held by exactly its
    replica group; else a :class:`CheckpointError` ending in ``undone``, which DCP carries
    to every rank."""
    stray = first_stray([plan.planner_data[1] for plan in plans])
    if stray is not None:
        raise CheckpointError(f"{stray}; {undone}")
    return [dataclasses.replace(plan, planner_data=plan.planner_data[0]) for plan in plans]


class _CountingSavePlanner(DefaultSavePlanner):
    """DCP's planner, writing each block of a tensor its spec splits (``split``: by saved
    key, where the block starts and the whole tensor's shape) as DCP writes a DTensor's
    local shard, carrying what this rank holds to the coordinator's global plan (which
    refuses a block held by other ranks than its replica group) and counting the tensor
    bytes this rank writes once plans are final."""

    bytes = 0
    entries = 0

    def __init__(
        self, held: dict[str, Holding], split: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__()
        self.held, self.split = held, split

    def create_local_plan(self) -> Any:
        items: list[WriteItem] = []
        for key, value in self.state_dict.items():  # in the state's order, as DCP's own
            if key not in self.split:
                items.extend(create_default_local_save_plan({key: value}, self.is_coordinator).items)
                continue
            offsets, shape = self.split[key]
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), value.size()),
                    properties=TensorProperties.create_from_tensor(value), size=torch.Size(shape))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return dataclasses.replace(self.plan, planner_data=(self.mappings, self.held))

    def lookup_object(self, index: MetadataIndex) -> Any:
        """What a write item holds: a split tensor's is the plain block itself."""
        if index.fqn in self.split:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)

    def create_global_plan(self, all_plans: Any) -> Any:
        return super().create_global_plan(_unless_stray(all_plans, "nothing was written"))

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
    """DCP's planner, checking that the checkpoint covers this rank's entries (``gaps``),
    reading each block of a tensor its spec splits (``split``: by saved key, where the
    block starts in the whole tensor) as DCP reads a DTensor's local shard, and counting
    the tensor bytes this rank reads."""

    bytes = 0
    entries = 0

    def __init__(
        self, gaps: GapCheck, held: Mapping[str, Holding], split: Mapping[str, tuple[int, ...]],
    ) -> None:
        super().__init__()
        self.gaps, self.held, self.split = gaps, held, split

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        problems = self.gaps(saved_shapes(metadata) if metadata is not None else {})
        if problems:
            raise Gaps(problems)

    def create_global_plan(self, global_plan: Any) -> Any:
        return super().create_global_plan(_unless_stray(global_plan, "nothing was loaded"))

    def create_local_plan(self) -> Any:
        assert self.metadata is not None  # DCP reads it before it plans
        saved = self.metadata.state_dict_metadata
        plan = LoadPlan([])
        for key, value in self.state_dict.items():  # in the state's order, as DCP's own
            if key not in self.split:
                plan.items.extend(create_default_local_load_plan(
                    {key: value}, self.metadata, not self.allow_partial_load).items)
                continue
            plan.items.extend(create_read_items_for_chunk_list(
                key, cast(TensorStorageMetadata, saved[key]),  # set_up_planner's check: a tensor there
                [ChunkStorageMetadata(torch.Size(self.split[key]), value.size())]))
        keys = set()
        for item in plan.items:
            found = saved[item.storage_index.fqn]
            properties = getattr(found, "properties", None)
            if properties is not None:
                self.bytes += torch.Size(item.lengths).numel() * properties.dtype.itemsize
                keys.add(item.storage_index.fqn)
        self.entries = len(keys)
        return dataclasses.replace(plan, planner_data=(plan.planner_data, self.held))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The block a read item lands in: a split tensor's is the plain block itself (the
        item's ``dest_offsets`` count from where it starts)."""
        if index.fqn in self.split:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)
