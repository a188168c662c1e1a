"""What ``meshstate plan``, ``check`` and ``bench`` do once their arguments are parsed.

Imports torch: :mod:`meshstate.tools.cli` loads this module only for a command
that runs. Each ``run_*`` takes the parsed arguments (for ``plan`` and ``check``
with ``layout``, the :class:`MeshConfig` the entry point checked before importing
torch) and a progress reporter, and returns the exit status and what to print on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshstate.layout.config import MeshConfig
from meshstate.errors import ConfigError, MeshStateError
from meshstate.layout.layout import Grid, ParallelLayout
from meshstate.core.build import init_mesh
from meshstate.testing.launch import default_backend, run_local
from meshstate.tools import bench
from meshstate.tools.bench_settings import MAX_SIMULATED_CHECK
from meshstate.tools.cli_parser import (
    MAX_LISTED_WORLD,
    RANK_MEMORY_BYTES,
    RANKS_PER_CPU,
    layout_arguments,
    under_torchrun,
)
from meshstate.layout.config import sizes_text
from meshstate.layout.ranks import ranks_text
from meshstate.tools.cli_shared import EXIT_MISMATCH, Progress
from meshstate.tools.svg import layout_svg
from meshstate.layout.topology import (
    LocalityReport,
    NodeCrossingWarning,
    locality_report,
    nodes_spanned,
)
from meshstate.tools.verify import (
    PIPELINE_SENDS,
    KindSummary,
    check_every_rank,
    check_layout,
    format_summary,
    merge_stages,
    summarize,
    verify_mesh,
)

_SLOW_LISTING = 2**16
"""From this world size on, listing every group takes seconds: say so."""


@dataclass(frozen=True)
class LocalCapacity:
    """How many local ranks this machine is counted to hold.

    Example: 2 CPUs and 21 GiB available hold ``min(2 * 8, 21 // 0.5) = 16``.
    """

    cpus: int
    available_bytes: int | None

    @property
    def limit(self) -> int:
        """The most local ranks to start without ``--force``."""
        by_cpu = RANKS_PER_CPU * self.cpus
        if self.available_bytes is None:
            return by_cpu
        return max(1, min(by_cpu, self.available_bytes // RANK_MEMORY_BYTES))

    def describe(self) -> str:
        """``"2 CPUs x 8 ranks; 21.3 GiB available / 0.5 GiB per rank"``."""
        cpus = f"{self.cpus} CPU{'s' if self.cpus != 1 else ''} x {RANKS_PER_CPU} ranks"
        if self.available_bytes is None:
            return f"{cpus}; available memory unknown"
        memory = f"{self.available_bytes / 2**30:.1f} GiB available"
        return f"{cpus}; {memory} / {RANK_MEMORY_BYTES / 2**30:g} GiB per rank"


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``; elsewhere the free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def local_capacity() -> LocalCapacity:
    """This machine's :class:`LocalCapacity`, measured now."""
    return LocalCapacity(_cpu_count(), _available_memory_bytes())


def _require_capacity(ranks: int, force: bool, instead: str) -> None:
    """Refuse, before any process starts, to start more local ranks than the machine holds."""
    if force:
        return
    capacity = local_capacity()
    if ranks > capacity.limit:
        raise MeshStateError(
            f"{ranks} local ranks are more than this machine holds: at most {capacity.limit} "
            f"({capacity.describe()}); {instead}, or add --force to start them anyway"
        )


def _require_gpus(backend: str, local_ranks: int) -> None:
    """Refuse NCCL, before any process starts, without a GPU for every local rank."""
    if backend != "nccl":
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < local_ranks:
        raise MeshStateError(
            f"--backend nccl needs a GPU per local rank: {local_ranks} ranks, {gpus} GPUs "
            "visible; use --backend gloo"
        )
    if not dist.is_nccl_available():
        raise MeshStateError("--backend nccl: this torch build has no NCCL; use --backend gloo")


def _describe(config: MeshConfig) -> str:
    return f"order {config.order}, {sizes_text(config.sizes())}"


def _plan_json(
    layout: ParallelLayout, rank: int | None, locality: LocalityReport | None
) -> dict[str, Any]:
    config = layout.config
    kinds = layout.kinds
    plan: dict[str, Any] = {
        "world_size": config.world_size,
        "order": config.order,
        "sizes": config.sizes(),
        "groups": {kind: layout.groups(kind).tolist() for kind in kinds},
    }
    if rank is not None:
        plan["rank"] = {
            "rank": rank,
            "coordinate": layout.coordinate(rank),
            "groups": {
                kind: {"ranks": list(ranks), "index": ranks.index(rank)}
                for kind in kinds
                for ranks in [layout.group_ranks(rank, kind)]
            },
        }
    if locality is not None:
        plan["ranks_per_node"] = locality.ranks_per_node
        plan["locality"] = {
            kind: {"nodes_spanned": nodes, "intra_node": nodes == 1}
            for kind, nodes in locality.nodes_spanned.items()
        }
        plan["advice"] = [] if locality.advice is None else [locality.advice]
    return plan


def _step(grid: Grid, axes: Sequence[str], index: int) -> int:
    """How far the ``index``-th rank of a walk over ``axes`` (last fastest) is from the first."""
    offset = 0
    for axis in reversed(axes):
        index, position = divmod(index, grid.size(axis))
        offset += position * grid.stride(axis)
    return offset


@dataclass(frozen=True)
class _GroupsPreview:
    """A kind's group size, group count and first groups, without listing them all."""

    size: int
    count: int
    first: list[list[int]]


def _preview(layout: ParallelLayout, kind: str, groups: int, members: int) -> _GroupsPreview:
    """Equals ``layout.groups(kind)[:groups, :members]`` with its shape, in O(groups * members)."""
    _, grid, axes = layout.resolve(kind)
    others = [axis for axis in grid.axes_mesh_order if axis not in axes]
    size = math.prod(grid.size(axis) for axis in axes)
    count = grid.world_size // size
    first = [
        [grid.rank_offset + _step(grid, others, row) + _step(grid, axes, i)
         for i in range(min(size, members))]
        for row in range(min(count, groups))
    ]
    return _GroupsPreview(size, count, first)


def _rank_group(
    layout: ParallelLayout, rank: int, kind: str, members: int
) -> tuple[int, int, list[int]]:
    """``rank``'s index in its group of ``kind``, the group's size and its first members."""
    _, grid, axes = layout.resolve(kind)
    group = grid.lattice_of(rank, axes)  # strides: no list of a million members
    return group.index(rank), len(group), [group[i] for i in range(min(len(group), members))]


def _nodes(count: int) -> str:
    return "node" if count == 1 else f"{count} nodes"


def _plan_text(
    layout: ParallelLayout, rank: int | None, locality: LocalityReport | None
) -> str:
    config = layout.config
    lines = [f"world size {config.world_size}, {_describe(config)}"]
    if locality is not None:
        node_count = config.world_size // locality.ranks_per_node
        lines.append(f"nodes: {node_count} of {locality.ranks_per_node} ranks each")
    lines.append("")
    kinds = layout.kinds
    width = max(10, *map(len, kinds))
    locality_header = "" if locality is None else f" {'locality':>9}"
    lines.append(f"{'kind':<{width}} {'size':>6} {'groups':>7}{locality_header}  first groups")
    for kind in kinds:
        preview = _preview(layout, kind, groups=3, members=8)
        first = " ".join(ranks_text(group, preview.size) for group in preview.first)
        more = " …" if preview.count > 3 else ""
        spans = "" if locality is None else f" {_nodes(locality.nodes_spanned[kind]):>9}"
        lines.append(f"{kind:<{width}} {preview.size:>6} {preview.count:>7}{spans}  {first}{more}")
    if locality is not None and locality.advice is not None:
        lines += ["", f"advice: {locality.advice}"]
    if rank is not None:
        coordinate = " ".join(f"{a}={i}" for a, i in layout.coordinate(rank).items())
        lines += ["", f"rank {rank}: {coordinate}", f"{'kind':<{width}} {'index':>6}  group"]
        for kind in kinds:
            index, size, shown = _rank_group(layout, rank, kind, members=16)
            lines.append(f"{kind:<{width}} {index:>6}  {ranks_text(shown, size)}")
    return "\n".join(lines)


def _check_plan_args(args: argparse.Namespace) -> None:
    """The plan's own limits: a rank inside the world, a world small enough to list."""
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise MeshStateError(f"--rank {args.rank} is outside 0..{args.world_size - 1}")
    lists_every_group = [flag for flag, given in (("--json", args.json),
                         ("--gpus-per-node", args.gpus_per_node is not None)) if given]
    if lists_every_group and args.world_size > MAX_LISTED_WORLD:
        raise ConfigError(
            f"{' and '.join(lists_every_group)}: listing every group needs a world of at most "
            f"{MAX_LISTED_WORLD} ranks, got {args.world_size}; without "
            f"{'it' if len(lists_every_group) == 1 else 'them'} the table (and --rank) works "
            "at any world size"
        )


def _locality(layout: ParallelLayout, ranks_per_node: int) -> LocalityReport:
    """:func:`locality_report` without its warning (plan prints the advice), HSDP kinds too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NodeCrossingWarning)
        report = locality_report(layout, ranks_per_node)
    spans = {kind: nodes_spanned(layout.groups(kind), ranks_per_node)
             for kind in layout.kinds if kind not in report.nodes_spanned}
    return replace(report, nodes_spanned={**report.nodes_spanned, **spans})


def _write_svg(layout: ParallelLayout, args: argparse.Namespace, progress: Progress) -> None:
    picture = layout_svg(layout, args.color_by, args.gpus_per_node or args.world_size)
    try:
        with open(args.svg, "w") as file:
            file.write(picture)
    except OSError as error:
        raise ConfigError(f"--svg {args.svg}: {error.strerror}") from error
    progress(f"wrote {args.svg}")


def run_plan(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    """``meshstate plan``: the table (or ``--json``), and ``--svg``'s picture."""
    layout = ParallelLayout(args.layout)
    _check_plan_args(args)
    listed = args.json or args.gpus_per_node is not None
    if listed and args.world_size >= _SLOW_LISTING:
        progress(f"listing every group of {args.world_size} ranks")
    locality = None if args.gpus_per_node is None else _locality(layout, args.gpus_per_node)
    if args.svg is not None:
        _write_svg(layout, args, progress)
    if args.json:
        return 0, json.dumps(_plan_json(layout, args.rank, locality))
    return 0, _plan_text(layout, args.rank, locality)


def _check_launched(
    args: argparse.Namespace, progress: Progress, timeout: timedelta
) -> tuple[MeshConfig, str, list[Any], bool]:
    """``check`` on the ranks torchrun launched: the config, backend, checks and whether to report."""
    config: MeshConfig = args.layout
    world_size = config.world_size
    if args.backend is not None:
        _require_gpus(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    is_reporter = os.environ["RANK"] == "0"
    say = replace(progress, enabled=progress.enabled and is_reporter)
    say(f"building the mesh on the {world_size} ranks torchrun launched")
    mesh = init_mesh(**config.arguments(), backend=args.backend, timeout=timeout)
    say("verifying every group kind with collectives")
    checks = verify_mesh(mesh)
    checks_by_rank: list[Any] = [None] * world_size
    dist.all_gather_object(checks_by_rank, checks)
    backend = str(dist.get_backend())
    mesh.destroy()
    return config, backend, checks_by_rank, is_reporter


def _check_local(
    args: argparse.Namespace, progress: Progress, timeout: timedelta
) -> tuple[MeshConfig, str, list[Any]]:
    """``check`` on local ranks it starts: the config, backend and every rank's checks."""
    config: MeshConfig = args.layout
    world_size = config.world_size
    backend = args.backend or default_backend(world_size)
    _require_gpus(backend, world_size)
    _require_capacity(
        world_size, args.force,
        f"`meshstate plan --world-size {world_size}` shows the groups without processes, "
        "`meshstate bench` simulates large worlds",
    )
    progress(f"starting {world_size} local ranks ({backend})")
    checks_by_rank = run_local(
        check_layout, world_size, config, progress, backend=backend, timeout=timeout
    )
    return config, backend, checks_by_rank


def _check_simulated(args: argparse.Namespace, progress: Progress) -> tuple[MeshConfig, list[KindSummary]]:
    """``check --simulate``: the config and the table's rows, every rank in this process."""
    config: MeshConfig = args.layout
    world_size = config.world_size
    if world_size > MAX_SIMULATED_CHECK:
        raise ConfigError(
            f"--simulate builds at most {MAX_SIMULATED_CHECK} ranks in one process, got "
            f"{world_size}; `meshstate plan --world-size {world_size}` shows the groups"
        )
    stages = args.stages
    progress(f"simulating {world_size} ranks in this process (torch's LocalTensorMode)" if stages == 1
             else f"simulating {world_size} ranks in {stages} stages, a process each (torch's "
             "LocalTensorMode), with real send/recv between them")
    with progress.if_slow("importing torch's simulation"):
        from meshstate.testing.simulated import simulated_world
    world = simulated_world(world_size, stages)
    if stages == 1:
        summaries: list[KindSummary] = world.call(check_every_rank, config, progress)
        return config, summaries
    return config, merge_stages(world.call(check_every_rank, config, progress))


def run_check(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    """``meshstate check``: build the mesh on real ranks and verify every group kind."""
    timeout = timedelta(seconds=args.timeout)
    is_reporter = True
    if args.simulate:
        config, summaries = _check_simulated(args, progress)
        backend = "simulated"
    else:
        if under_torchrun():
            config, backend, checks_by_rank, is_reporter = _check_launched(args, progress, timeout)
        else:
            config, backend, checks_by_rank = _check_local(args, progress, timeout)
        summaries = summarize(checks_by_rank)
    status = EXIT_MISMATCH if any(not row.ok for row in summaries) else 0
    if not is_reporter:
        return status, ""
    failed = [row.key for row in summaries if not row.ok]
    world_size = config.world_size
    kinds = sum(row.key != PIPELINE_SENDS for row in summaries)
    verified = f"all {kinds} group kinds" + (" and the pp send/recv" if kinds < len(summaries) else "")
    last = (f"FAILED kinds: {', '.join(failed)}" if failed else
            f"{verified} verified on {world_size} ranks")
    if args.simulate and args.stages > 1:
        backend = f"simulated in {args.stages} stages"
    header = f"meshstate check: {world_size} ranks ({backend}), {_describe(config)}"
    return status, "\n".join([header, format_summary(summaries), last])


def run_bench(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    """``meshstate bench``: time meshstate beside megatron-core, DeviceMesh and torchtitan."""
    sizes: dict[str, Any] = dict(layout_arguments(args))
    if args.processes:
        _require_capacity(
            max(args.processes), args.force, "pass smaller --processes (0 for none)"
        )
    report = bench.run(
        args.world_sizes, sizes, rank=args.rank, repeats=args.repeat,
        process_world_sizes=args.processes, with_megatron=not args.without_megatron,
        with_titan=not args.without_torchtitan, with_runtime=not args.without_runtime,
        harness_tests=args.harness_tests, simulated_checks=args.simulated_checks,
        simulated_pipeline=args.simulated_pipeline,
        progress=progress,
    )
    return 0, bench.report_json(report) if args.json else bench.format_report(report)
