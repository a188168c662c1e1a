"""The entries through meta-pytorch's torch-checkpointing (``pip install 'meshstate[checkpointing]'``).

Each rank writes, into its own file of the checkpoint's one item (``meshstate``), the
entries it is the first of the replica group for; each entry's :class:`ShardMetadata`
says where its block lies in the whole tensor and which ranks hold the same block
(``equivalent_ranks``: its replica group, writer first), so the metadata torch-checkpointing
gathers at save has one record per block, sent by one rank. :class:`MeshResharder`,
torch-checkpointing's extension point for state that is not a DTensor, reads at load
each piece of a rank's new block from the file of the rank that wrote it. Only
:mod:`meshstate.checkpoint.saving` imports this module, when a call names the backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshstate.checkpoint.entries import (
    Entry,
    GapCheck,
    Transfer,
    holdings,
    refuse_strays_and_gaps,
)
from meshstate.checkpoint.layout import Holding
from meshstate.checkpoint.errors import CheckpointError
from meshstate.core.mesh import ParallelMesh

try:
    from torch_checkpointing.barriers import Barrier, BarrierConfig
    from torch_checkpointing.builder import make_sync_checkpoint_saver
    from torch_checkpointing.checkpoint_base import CheckpointBase, CheckpointItem
    from torch_checkpointing.checkpoint_loader import CheckpointLoader
    from torch_checkpointing.checkpoint_reader import CheckpointReader
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.distributed_metadata import DistributedItemMetadata, ShardingMetadata
    from torch_checkpointing.metadata_manager import DefaultMetadataManager
    from torch_checkpointing.metadata_serialization import (
        TorchDistributedMetadataFormat,
        load_distributed_metadata,
    )
    from torch_checkpointing.resharding import Resharder
    from torch_checkpointing.storage.base_storage import Storage
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from torch_checkpointing.types import NestedPath, RankInfo
except ImportError:
    raise CheckpointError(
        "backend='torch-checkpointing' needs the torch-checkpointing package: "
        "pip install 'meshstate[checkpointing]'"
    ) from None

ITEM = "meshstate"
"""The checkpoint's one item: each rank's file is ``meshstate_<rank>.pt``."""


@dataclass(frozen=True)
class ShardMetadata(ShardingMetadata, type_name="meshstate_shard_v1"):
    """Where one block of a whole tensor lies, and the ranks that hold it (writer first).

    ``shape`` is the whole tensor's shape, ``None`` for a plain value (then ``offsets``
    and ``sizes`` are empty). Example: rows 8-15 of a (16, 8) table replicated over
    ranks 1 and 5: ``ShardMetadata((16, 8), (8, 0), (8, 8), "torch.float32", (1, 5))``.
    """

    shape: tuple[int, ...] | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]

    @property
    def equivalent_ranks(self) -> tuple[int, ...]:
        """The replica group: torch-checkpointing gathers this record from one of them."""
        return self.ranks

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "offsets": self.offsets, "sizes": self.sizes,
                "dtype": self.dtype, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardMetadata:
        shape = d["shape"]
        return cls(None if shape is None else tuple(shape), tuple(d["offsets"]), tuple(d["sizes"]),
                   d["dtype"], tuple(d["ranks"]))

    @classmethod
    def of(cls, entry: Entry, mesh: ParallelMesh) -> ShardMetadata:
        """The record of ``entry``'s block (or value) on this rank."""
        if not entry.is_tensor:
            return cls(None, (), (), "", entry.replicas(mesh))
        return cls(entry.whole_shape(mesh), entry.block_offsets(mesh), tuple(entry.value.shape),
                   str(entry.value.dtype), entry.replicas(mesh))


class MeshResharder(Resharder):
    """torch-checkpointing's ``Resharder`` for meshstate's entries: the records of
    ``shards`` (by saved key) at save; at load, each piece of a target block read from
    the file of the rank that wrote the saved block it lies in."""

    def __init__(self, shards: Mapping[str, ShardMetadata]) -> None:
        self._shards = shards

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        return {(key,): self._shards[key] for key in item_value}

    def should_reshard(
        self, source_metadata: DistributedItemMetadata | None,
        target_metadata: dict[NestedPath, ShardingMetadata] | None,
    ) -> bool:
        """Always: :meth:`load` maps the files and copies each block's pieces out of them;
        0.1.1's read of an unchanged layout reads each rank's whole file into fresh memory
        first and copies out of that."""
        return True

    def load(
        self, source_path: Path, item_key: str, target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata, target: Any, storage: Storage,
    ) -> list[NestedPath]:
        pieces, unhandled = _pieces_by_writer(target_metadata, source_metadata)
        for writer, wanted in sorted(pieces.items()):
            written = torch.load(source_metadata.get_file_path(writer, source_path, item_key),
                                 map_location="cpu", mmap=True, weights_only=False)
            for key, into, out_of in wanted:
                if into is None:
                    target[key] = written[key]
                else:
                    target[key][into].copy_(written[key][out_of])
        return unhandled


Piece = tuple[str, "tuple[slice, ...] | None", "tuple[slice, ...]"]
"""A saved key, the slices of the wanted block it fills (``None``: a plain value) and those
of the saved block it comes from."""


def _pieces_by_writer(
    target_metadata: Mapping[NestedPath, ShardingMetadata], source_metadata: DistributedItemMetadata,
) -> tuple[dict[int, list[Piece]], list[NestedPath]]:
    """The pieces of each wanted block, by the rank whose file holds them; and the paths
    the checkpoint has no meshstate record of."""
    pieces: dict[int, list[Piece]] = {}
    unhandled: list[NestedPath] = []
    for path, wanted in target_metadata.items():
        groups = source_metadata.nested_path_to_metadata.get(path, [])
        saved = [group.sharding_metadata for group in groups if isinstance(group.sharding_metadata, ShardMetadata)]
        if not saved or not isinstance(wanted, ShardMetadata):
            unhandled.append(path)
            continue
        for block in saved if wanted.shape is not None else saved[:1]:
            piece = overlap(wanted, block)
            if piece is not None:
                pieces.setdefault(block.ranks[0], []).append((str(path[0]), *piece))
    return pieces, unhandled


def overlap(
    wanted: ShardMetadata, saved: ShardMetadata,
) -> tuple[tuple[slice, ...] | None, tuple[slice, ...]] | None:
    """Where the saved block and the wanted one meet: the slices of the wanted block and
    of the saved one (``(None, ())`` for a plain value); ``None`` if they do not meet.

    Example: rows 4-11 wanted, rows 8-15 saved -> ``((slice(4, 8),), (slice(0, 4),))``.
    """
    if wanted.shape is None:
        return None, ()
    into, out_of = [], []
    for start, size, saved_start, saved_size in zip(wanted.offsets, wanted.sizes, saved.offsets, saved.sizes):
        first, last = max(start, saved_start), min(start + size, saved_start + saved_size)
        if first >= last:
            return None
        into.append(slice(first - start, last - start))
        out_of.append(slice(first - saved_start, last - saved_start))
    return tuple(into), tuple(out_of)


def save(entries: list[Entry], path: str, mesh: ParallelMesh) -> Transfer:
    """Write, on this rank, the entries it is the first of the replica group for, once
    every block is known to be held by exactly its replica group."""
    if os.path.isdir(path) and os.listdir(path):
        raise CheckpointError(f"{path} holds files already; torch-checkpointing commits a "
                              "checkpoint onto an absent or empty directory only")
    refuse_strays_and_gaps(holdings(entries, mesh), "nothing was written")
    mine = [entry for entry in entries if entry.is_first_replica(mesh)]
    payload = _Payload({entry.saved_key: entry.value.detach() if entry.is_tensor else entry.value
                        for entry in mine}, {entry.saved_key: ShardMetadata.of(entry, mesh) for entry in mine})
    writer = CheckpointWriterConfig(barrier_config=_WorldBarrierConfig(timeout_barrier_init_sec=0))
    saver = make_sync_checkpoint_saver(SyncCheckpointSaverConfig(writer_config=writer), _rank_info(),
                                       storage_config=_storage(),
                                       checkpoint_metadata_manager=_GatheringMetadataManager(_rank_info()))
    try:
        saver.save(path, payload)
    finally:
        saver.close()
    dist.barrier()  # the first rank renames the finished directory into place
    tensors = [entry.value for entry in mine if entry.is_tensor]
    return Transfer(sum(t.numel() * t.element_size() for t in tensors), len(tensors))


def saved_shapes(path: str) -> dict[str, tuple[int, ...] | None]:
    """Each saved key's whole shape; ``None`` for a plain value."""
    metadata = load_distributed_metadata(path, _storage().create_storage(),
                                         formats=(TorchDistributedMetadataFormat,))
    item = None if metadata is None else metadata.metadata.get(ITEM)
    if item is None:
        raise CheckpointError(f"{path} holds no checkpoint that meshstate saved through "
                              f"torch-checkpointing (no {ITEM!r} item in its metadata)")
    return {str(path[0]): getattr(groups[0].sharding_metadata, "shape", None)
            for path, groups in item.nested_path_to_metadata.items()}


def load(
    entries: list[Entry], path: str, mesh: ParallelMesh, gaps: GapCheck, held: Mapping[str, Holding],
) -> tuple[dict[str, Any], Transfer]:
    """Read the blocks and values of ``entries`` (those this rank reads) from ``path``,
    once every rank has found no ``gaps`` and every block is ``held`` by exactly its
    replica group."""
    refuse_strays_and_gaps(held, "nothing was loaded", gaps(saved_shapes(path)))
    targets = _Payload({entry.saved_key: entry.block() if entry.is_tensor else entry.value
                        for entry in entries},
                       {entry.saved_key: ShardMetadata.of(entry, mesh) for entry in entries})
    reader = CheckpointReader(_rank_info(), _storage())
    loader = CheckpointLoader(reader, _GatheringMetadataManager(_rank_info()))
    try:
        loader.load(path, targets, strict=True)
    finally:
        loader.close()
    tensors = [entry.value for entry in entries if entry.is_tensor]
    return targets.loaded, Transfer(sum(t.numel() * t.element_size() for t in tensors), len(tensors))


class _Payload(CheckpointBase):
    """The one item ``meshstate``: values by saved key, and their records; after a load,
    what was read."""

    def __init__(self, values: dict[str, Any], shards: Mapping[str, ShardMetadata]) -> None:
        self.item = CheckpointItem(value=values, requires_copy=False, resharder=MeshResharder(shards))
        self.loaded: dict[str, Any] = {}

    def get_items(self) -> dict[str, CheckpointItem]:
        return {ITEM: self.item}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loaded = dict(state_dict[ITEM])


class _GatheringMetadataManager(DefaultMetadataManager):
    """torch-checkpointing's metadata manager, gathering on any backend: 0.1.1 gathers
    through CUDA tensors (``_all_gather_pickled_data``), which a gloo job has not."""

    def _all_gather_pickled_data(self, data: Any, process_group: Any = None) -> dict[int, Any]:
        every: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(every, data, group=process_group)
        return dict(enumerate(every))


def _storage() -> LocalFileSystemStorageConfig:
    """Local files, written without ``O_DIRECT``: 0.1.1 opens them so on ext4 and then
    writes unaligned buffers through them, which fails when the file closes (EINVAL)."""
    return LocalFileSystemStorageConfig(use_direct_io=False)


def _rank_info() -> RankInfo:
    rank, size = dist.get_rank(), dist.get_world_size()
    return RankInfo(global_world_size=size, global_rank=rank, role_rank=rank, role_world_size=size)


@dataclass
class _WorldBarrierConfig(BarrierConfig):
    """A barrier over the default process group (torch-checkpointing's own counts the
    barriers of a process, which the threads of a threaded world would share)."""

    def create_barrier(self, rank_info: RankInfo) -> Barrier:
        return _WorldBarrier(self)


class _WorldBarrier(Barrier):
    def __init__(self, config: BarrierConfig) -> None:
        self.config = config

    def execute_barrier(self, timeout_secs: int) -> None:
        dist.barrier()
