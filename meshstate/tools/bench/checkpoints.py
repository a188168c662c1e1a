"""``meshstate bench``'s checkpoint throughput: meshstate.checkpoint beside DCP's own save and load.

On N local gloo ranks (``CHECKPOINT_SIZES``, dp inferred), each rank holds ``layers``
pairs of float32 blocks split over every axis (rows over ``("dp", "tp")``, and rows
over dp with columns over tp), so no rank holds another's bytes. DCP saves and loads
the DTensors of those blocks (:func:`~meshstate.jax.sharding.to_placements` on the
mesh's DeviceMesh); meshstate.checkpoint saves and loads the plain blocks with their
:class:`~meshstate.checkpoint.Layout`, through DCP and, where it is installed,
through torch-checkpointing: the same bytes each way, into the same tensors in place.
Each figure is the median of ``repeats`` runs after one untimed, the wall time of the slowest rank;
MB/s counts every rank's bytes; a ratio is the median of each run's over DCP's in that run.
A run saves with every writer, each into a folder of its own, then loads with every
writer (the saves back to back, and the loads, in the same order: the runs take the
writers' orders in turn, so each writer comes first, and after each other, as often),
and removes the folders, untimed.

Example: ``format_checkpoints(measure_checkpoints([4], print))``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from meshstate.checkpoint import Layout, load, save
from meshstate.core.build import init_mesh
from meshstate.core.mesh import ParallelMesh
from meshstate.jax.sharding import P, to_placements
from meshstate.layout.config import sizes_text
from meshstate.testing.launch import LocalWorld
from meshstate.tools.bench.settings import CHECKPOINT_BLOCK, CHECKPOINT_LAYERS, CHECKPOINT_SIZES

DCP = "DCP, DTensors"
MESHSTATE_DCP = "meshstate.checkpoint, dcp"
MESHSTATE_CHECKPOINTING = "meshstate.checkpoint, torch-checkpointing"
SPECS = {"*.up": P(("dp", "tp"), None), "*.down": P("dp", "tp")}


@dataclass(frozen=True)
class CheckpointRow:
    """One writer's save and load of the same blocks on ``world_size`` gloo ranks."""

    world_size: int
    writer: str
    megabytes: float
    save_seconds: float
    load_seconds: float
    save_over_dcp: float
    load_over_dcp: float
    """The median over runs of each run's seconds over DCP's own in the same run (the
    two timed back to back, so a busy spell of the machine weighs on both)."""


def blocks(layers: int) -> dict[str, torch.Tensor]:
    """This rank's blocks: ``layers`` pairs of ``CHECKPOINT_BLOCK``-square float32 tensors."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    return {f"layers.{layer}.{name}": torch.randn(CHECKPOINT_BLOCK, CHECKPOINT_BLOCK, generator=generator)
            for layer in range(layers) for name in ("up", "down")}


def dtensors(local: dict[str, torch.Tensor], mesh: ParallelMesh) -> dict[str, DTensor]:
    """The DTensors of ``local``'s blocks, as a DTensor user of the same layout holds them."""
    layout, device_mesh = Layout(SPECS), mesh["dp", "tp"]
    sizes = {axis: mesh.size(axis) for axis in ("dp", "tp")}
    made = {}
    for key, block in local.items():
        spec = layout.spec_of(key)
        shape = [block.shape[dim] * (sizes["dp"] * sizes["tp"] if entry == ("dp", "tp") else sizes[str(entry)])
                 if entry else block.shape[dim] for dim, entry in enumerate(spec.dims)]
        made[f"model.{key}"] = DTensor.from_local(block, device_mesh, to_placements(spec, device_mesh),
                                                  shape=torch.Size(shape), stride=(shape[1], 1), run_check=False)
    return made


def time_checkpoints_on_rank(
    layers: int, repeats: int, writers: list[str],
) -> dict[str, list[tuple[float, float]]]:
    """On this rank: each writer's save and load seconds (between barriers), run by run."""
    mesh = init_mesh(**CHECKPOINT_SIZES)
    folder = [tempfile.mkdtemp(prefix="meshstate-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, group_src=0)
    state = {"model": blocks(layers)}
    calls = _calls(state, dtensors(state["model"], mesh), mesh)
    timings: dict[str, list[tuple[float, float]]] = {writer: [] for writer in writers}
    orders = list(itertools.permutations(writers))  # each writer after each other as often
    try:
        for repeat in range(-1, repeats):  # run -1 warms each writer up, untimed
            order = orders[repeat % len(orders)]
            paths = {writer: os.path.join(str(folder[0]), f"{repeat}-{writer}") for writer in order}
            saves = {writer: _timed(calls[writer][0], paths[writer]) for writer in order}
            loads = {writer: _timed(calls[writer][1], paths[writer]) for writer in order}
            if repeat >= 0:
                for writer in writers:
                    timings[writer].append((saves[writer], loads[writer]))
            if dist.get_rank() == 0:  # every rank has loaded (_timed's barrier); the next run waits
                for path in paths.values():
                    shutil.rmtree(path)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(folder[0]), ignore_errors=True)
        mesh.destroy()
    return timings


def _calls(
    state: dict[str, Any], made: dict[str, DTensor], mesh: ParallelMesh,
) -> dict[str, tuple[Callable[[str], object], Callable[[str], object]]]:
    """Each writer's save and load of the same blocks at a path."""
    layout = Layout(SPECS)
    return {
        DCP: (lambda path: dcp_save(made, checkpoint_id=path), lambda path: dcp_load(made, checkpoint_id=path)),
        MESHSTATE_DCP: (lambda path: save(state, path, layout, mesh), lambda path: load(state, path, layout, mesh)),
        MESHSTATE_CHECKPOINTING: (
            lambda path: save(state, path, layout, mesh, "torch-checkpointing"),
            lambda path: load(state, path, layout, mesh, "torch-checkpointing")),
    }


def _timed(call: Callable[[str], object], path: str) -> float:
    dist.barrier()
    started = time.perf_counter()
    call(path)
    dist.barrier()
    return time.perf_counter() - started


def measure_checkpoints(
    world_sizes: Sequence[int], progress: Callable[[str], object],
    layers: int = CHECKPOINT_LAYERS, repeats: int = 3,
) -> list[CheckpointRow]:
    """A row per writer and world of local gloo ranks (torch-checkpointing's where installed)."""
    writers = [DCP, MESHSTATE_DCP]
    if importlib.util.find_spec("torch_checkpointing") is not None:
        writers.append(MESHSTATE_CHECKPOINTING)
    rows = []
    for world_size in world_sizes:
        progress(f"{world_size} local ranks: checkpoint save and load, DCP and meshstate.checkpoint")
        with LocalWorld(world_size, backend="gloo") as world:
            timings = world.run(time_checkpoints_on_rank, layers, repeats, writers)
        megabytes = world_size * layers * 2 * CHECKPOINT_BLOCK**2 * 4 / 1e6
        runs = {writer: [tuple(max(column) for column in zip(*ranks))  # the slowest rank, run by run
                         for ranks in zip(*(timing[writer] for timing in timings))] for writer in writers}
        for writer in writers:
            saves, loads = zip(*runs[writer])
            dcp_saves, dcp_loads = zip(*runs[DCP])
            rows.append(CheckpointRow(
                world_size, writer, megabytes, statistics.median(saves), statistics.median(loads),
                statistics.median(mine / theirs for mine, theirs in zip(saves, dcp_saves)),
                statistics.median(mine / theirs for mine, theirs in zip(loads, dcp_loads))))
    return rows


def format_checkpoints(rows: Sequence[CheckpointRow]) -> str:
    """The checkpoint table: MB/s each way, and each writer's time over DCP's own."""
    lines = [
        f"checkpoint save and load ({sizes_text(CHECKPOINT_SIZES)}, dp inferred; float32 blocks of "
        f"{CHECKPOINT_BLOCK}x{CHECKPOINT_BLOCK} split over every axis): MB/s of every rank's bytes, "
        "the slowest rank, median of the runs; x: the median of each run's seconds over DCP's own "
        "on the same DTensors (goal <= 1.1x)",
        f"  {'ranks':>5} {'writer':<42} {'MB':>6} {'save MB/s':>10} {'load MB/s':>10} {'save':>6} {'load':>6}",
    ]
    for row in rows:
        lines.append(
            f"  {row.world_size:>5} {row.writer:<42} {row.megabytes:>6.1f} "
            f"{row.megabytes / row.save_seconds:>10.0f} {row.megabytes / row.load_seconds:>10.0f} "
            f"{row.save_over_dcp:>5.2f}x {row.load_over_dcp:>5.2f}x"
        )
    return "\n".join(lines)
