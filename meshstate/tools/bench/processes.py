"""``meshstate bench``'s real processes: init on N local ranks, and a psum over an undeclared tuple.

The approaches of :mod:`meshstate.tools.bench.init` build the same layout on
real local processes (gloo, NCCL with a GPU per rank); each row is the wall
time of init on the slowest rank. Then a psum over an axis tuple the mesh was
not built with: the first call (which makes its group) and later ones, beside a
declared key.

Example: ``measure_processes([8], dict(tp=2, pp=2), [INIT_MESH], print)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshstate.layout.config import MeshConfig
from meshstate.core.build import init_mesh
from meshstate.testing.launch import LocalWorld, default_backend
from meshstate.tools.bench.init import _BUILDERS, _median_seconds


@dataclass(frozen=True)
class ProcessRow:
    """One approach on real local processes: init wall time, the slowest rank."""

    world_size: int
    backend: str
    approach: str
    init_seconds: float


@dataclass(frozen=True)
class AxisSetRow:
    """A psum over an axis tuple the mesh was not built with, beside one over a declared key.

    The first call makes the group (only its members take part); later calls
    look it up. Seconds, the slowest rank.
    """

    world_size: int
    backend: str
    axes: tuple[str, ...]
    first_call_seconds: float
    later_call_seconds: float
    declared: str
    declared_call_seconds: float


UNDECLARED_AXES = ("pp", "cp")
DECLARED_KEY = "tp-cp"
"""The axis tuple timed without declaring it, and a declared key of the same size."""


def time_init_on_rank(approach: str, sizes: dict[str, Any]) -> float:
    """Build ``approach`` on this rank of an initialised world; return the seconds it took."""
    config = MeshConfig(dist.get_world_size(), **sizes)
    dist.barrier()
    started = time.perf_counter()
    built = _BUILDERS[approach](config)
    seconds = time.perf_counter() - started
    dist.barrier()
    built.teardown()
    return seconds


def time_axis_set_psum(sizes: dict[str, Any], repeats: int = 20) -> tuple[float, float, float]:
    """On this rank: the first psum over ``UNDECLARED_AXES``, the median of later ones,
    and the median psum over ``DECLARED_KEY``, in seconds."""
    from meshstate.jax.collectives import psum

    mesh = init_mesh(**sizes)
    value = torch.ones(1024)
    try:
        dist.barrier()
        started = time.perf_counter()
        psum(value, UNDECLARED_AXES, mesh=mesh)
        first = time.perf_counter() - started
        later = _median_seconds(lambda: psum(value, UNDECLARED_AXES, mesh=mesh), repeats)
        declared = _median_seconds(lambda: psum(value, DECLARED_KEY, mesh=mesh), repeats)
        return first, later, declared
    finally:
        dist.barrier()
        mesh.destroy()


def measure_processes(
    world_sizes: Sequence[int],
    sizes: dict[str, Any],
    approaches: Sequence[str],
    progress: Callable[[str], object],
) -> tuple[list[ProcessRow], list[AxisSetRow]]:
    """Each approach's init on each world of local ranks, then the undeclared-tuple psum."""
    process_rows, axis_set_rows = [], []
    for world_size in world_sizes:
        backend = default_backend(world_size)
        progress(f"starting {world_size} local ranks ({backend})")
        with LocalWorld(world_size, backend=backend) as world:
            for approach in approaches:
                progress(f"{world_size} local ranks: {approach}")
                seconds = world.run(time_init_on_rank, approach, sizes)
                process_rows.append(ProcessRow(world_size, backend, approach, max(seconds)))
            progress(f"{world_size} local ranks: psum over {UNDECLARED_AXES}, not declared")
            timings = world.run(time_axis_set_psum, sizes)
            first, later, declared = (max(column) for column in zip(*timings))
            axis_set_rows.append(AxisSetRow(
                world_size, backend, UNDECLARED_AXES, first, later, DECLARED_KEY, declared
            ))
    return process_rows, axis_set_rows
