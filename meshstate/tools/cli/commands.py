"""What ``meshstate check`` and ``bench`` do once their arguments are parsed.

Imports torch and the mesh: :mod:`meshstate.tools.cli` loads this module only for a
command that runs (``plan`` has :mod:`meshstate.tools.cli.plan`; the bench's own
modules load when it runs). Each ``run_*`` takes the parsed arguments (for ``check``
with ``layout``, the :class:`MeshConfig` the entry point checked before importing
torch) and a progress reporter, and returns the exit status and what to print on stdout.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshstate.layout.config import MeshConfig
from meshstate.errors import ConfigError, MeshStateError
from meshstate.core.build import init_mesh
from meshstate.testing.launch import default_backend, run_local
from meshstate.tools.bench.settings import MAX_SIMULATED_CHECK
from meshstate.tools.cli.parser import (
    RANK_MEMORY_BYTES,
    RANKS_PER_CPU,
    layout_arguments,
    under_torchrun,
)
from meshstate.tools.cli.shared import EXIT_MISMATCH, Progress, layout_text
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
    header = f"meshstate check: {world_size} ranks ({backend}), {layout_text(config)}"
    return status, "\n".join([header, format_summary(summaries), last])


def run_bench(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    """``meshstate bench``: time meshstate beside megatron-core, DeviceMesh and torchtitan."""
    from meshstate.tools.bench import report  # the JAX layer and the peers' modules: for bench alone

    sizes: dict[str, Any] = dict(layout_arguments(args))
    if args.processes:
        _require_capacity(
            max(args.processes), args.force, "pass smaller --processes (0 for none)"
        )
    measured = report.run(
        args.world_sizes, sizes, rank=args.rank, repeats=args.repeat,
        process_world_sizes=args.processes, with_megatron=not args.without_megatron,
        with_titan=not args.without_torchtitan, with_runtime=not args.without_runtime,
        harness_tests=args.harness_tests, simulated_checks=args.simulated_checks,
        simulated_pipeline=args.simulated_pipeline, compile_world_sizes=args.compile_ranks,
        checkpoint_world_sizes=args.checkpoint_ranks, progress=progress,
    )
    return 0, report.report_json(measured) if args.json else report.format_report(measured)
