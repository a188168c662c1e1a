"""The ``meshstate`` command: ``plan`` a layout without processes, ``check`` it on real ones.

``meshstate plan --world-size 16 --tp 2 --pp 2`` prints every group kind;
``--json`` prints them as one object; ``--rank R`` adds that rank's view;
``--gpus-per-node N`` adds how many nodes each group spans and order advice.
``meshstate check`` builds the mesh on local processes (or the ranks torchrun
launched) and verifies every group with real collectives; it refuses to start
more local ranks than the machine holds unless told ``--force``. ``meshstate
bench`` measures meshstate beside megatron-core and plain DeviceMesh.

A mistake in the input exits with status 2 and one line on stderr; Ctrl-C
exits 130, SIGTERM 143, a closed stdout pipe 141, each without a traceback.
Progress goes to stderr when it is a terminal, or always with ``--verbose``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from meshstate.tools import bench
from meshstate.core.config import DEFAULT_ORDER, MeshConfig
from meshstate.core.errors import ConfigError, MeshStateError
from meshstate.testing.launch import RankFailure, RankTimeout, default_backend, run_local
from meshstate.core.layout import GROUP_KINDS, Grid, ParallelLayout
from meshstate.core.mesh import init_mesh
from meshstate.tools.svg import layout_svg
from meshstate.tools.topology import LocalityReport, NodeCrossingWarning, locality_report
from meshstate.tools.verify import KindCheck, format_summary, summarize, verify_mesh

EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a program Ctrl-C ended
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
EXIT_TERMINATED = 143  # 128 + SIGTERM

MAX_WORLD_SIZE = 2**31 - 1
"""The largest world c10d can address: ranks are 32-bit signed integers."""
MAX_LISTED_WORLD = 2**20
"""The largest world whose every group ``plan --json`` or ``--gpus-per-node`` lists
(about 120 MB of JSON, 1.3 GB of memory and 20 s); the table and ``--rank`` work at
any world size."""
MAX_TIMEOUT_SECONDS = 24 * 3600
"""A check that has not finished in a day will not; longer is a typo."""
DEFAULT_CHECK_WORLD = 8

RANK_MEMORY_BYTES = 512 * 2**20
"""Memory one local rank is counted as needing. A gloo worker that has imported
torch 2.13 (CPU) and run ``check`` holds about 300 MB resident, 150 MB of it its
own; 0.5 GiB leaves room for collective buffers and bigger meshes."""
RANKS_PER_CPU = 8
"""Local ranks one CPU core is counted as holding. Gloo ranks mostly wait for each
other, so 8 per core still run the default ``check`` (8 ranks) and ``bench`` (16)
on 2 cores well inside their timeout; starting many more spends minutes importing
torch and ends in timeouts."""

_SLOW_LISTING = 2**16
"""From this world size on, listing every group takes seconds: say so."""


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default; an option without a value (None) says its default in words."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:  # no value, or a flag
            return action.help
        return super()._get_help_string(action)


def _bounded_int(most: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: a positive integer, at most ``most`` (``why`` says why)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive integer, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"expected at most {most} ({why}), got {value}")
        return value

    return parse


_rank_count = _bounded_int(MAX_WORLD_SIZE, "the most ranks c10d can address")
_timeout_seconds = _bounded_int(MAX_TIMEOUT_SECONDS, "one day")
_positive_int = _bounded_int()


def _world_sizes(text: str) -> list[int]:
    """``"1024,16384"`` -> ``[1024, 16384]``."""
    return [_rank_count(part) for part in text.split(",")]


def _process_world_sizes(text: str) -> list[int]:
    """Like :func:`_world_sizes`, and ``"0"`` alone means none."""
    return [] if text.strip() == "0" else _world_sizes(text)


def _add_layout_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, int | None], whose: str
) -> None:
    parser.add_argument("--order", default=DEFAULT_ORDER, help="Megatron order, fastest axis first")
    for name, meaning in (
        ("tp", "tensor parallel size"),
        ("cp", "context parallel size"),
        ("ep", "expert parallel size"),
        ("etp", "expert tensor parallel size"),
        ("pp", "pipeline parallel size"),
    ):
        help_text = f"{meaning}{whose}"
        if defaults[name] is None:
            help_text += " (default: the same as --tp)"
        parser.add_argument(f"--{name}", type=_rank_count, default=defaults[name], help=help_text)


def _add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose", action="store_true",
        help="print progress to stderr even when it is not a terminal",
    )


def _add_force_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force", action="store_true",
        help="start more local ranks than this machine is counted to hold "
        f"({RANKS_PER_CPU} per CPU, {RANK_MEMORY_BYTES / 2**30:g} GiB of available memory each)",
    )


# The sizes plan and check default to are init_mesh's; bench times a large-model layout.
_MESH_DEFAULTS: dict[str, int | None] = {"tp": 1, "cp": 1, "ep": 1, "etp": None, "pp": 1}
_BENCH_DEFAULTS: dict[str, int | None] = {"tp": 8, "cp": 2, "ep": 8, "etp": 1, "pp": 8}


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="meshstate", description=__doc__.splitlines()[0], formatter_class=_HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    plan = commands.add_parser(
        "plan", help="print every group of a layout; no processes",
        description="Print every group kind of a layout; starts no processes. Sizes not "
        "given default to init_mesh's: 1, and etp the same as tp.",
        formatter_class=_HelpFormatter,
    )
    plan.add_argument("--world-size", type=_rank_count, required=True, help="ranks in the world")
    _add_layout_flags(plan, _MESH_DEFAULTS, "")
    plan.add_argument("--rank", type=int, help="also show this rank's groups (default: none)")
    plan.add_argument(
        "--json", action="store_true",
        help=f"print one JSON object with every group (worlds of at most {MAX_LISTED_WORLD} ranks)",
    )
    plan.add_argument(
        "--gpus-per-node", type=_rank_count,
        help="also show which groups cross nodes (default: not shown)",
    )
    plan.add_argument(
        "--svg", metavar="FILE",
        help="also draw the ranks by node (--gpus-per-node, else one node) into an SVG file "
        "(default: none)",
    )
    plan.add_argument("--color-by", default="tp", help="the group key that colours --svg's cells")
    _add_verbose_flag(plan)

    check = commands.add_parser(
        "check", help="build the mesh and verify it with collectives",
        description="Build the mesh on local processes (or the ranks torchrun launched) and "
        "verify every group with real collectives. Sizes not given default to init_mesh's: "
        "1, and etp the same as tp.",
        formatter_class=_HelpFormatter,
    )
    check.add_argument(
        "--world-size", type=_rank_count,
        help=f"local ranks to start (default: {DEFAULT_CHECK_WORLD}; under torchrun, "
        "the ranks it launched)",
    )
    _add_layout_flags(check, _MESH_DEFAULTS, "")
    check.add_argument(
        "--backend", choices=("gloo", "nccl"),
        help="process group backend (default: nccl with a GPU per rank, else gloo)",
    )
    check.add_argument(
        "--timeout", type=_timeout_seconds, default=120,
        help="seconds every rank and collective gets",
    )
    _add_force_flag(check)
    _add_verbose_flag(check)

    bench_parser = commands.add_parser(
        "bench", help="init time, groups, getter cost and memory beside megatron-core",
        description="Simulate one rank of each world on torch's fake backend and time every "
        "approach, then time init on real local processes. The simulated layout defaults to "
        "a large model's, tp=8 cp=2 ep=8 etp=1 pp=8, unlike plan and check, whose sizes "
        "default to 1.",
        formatter_class=_HelpFormatter,
    )
    bench_parser.add_argument(
        "--world-sizes", type=_world_sizes, default="1024,16384,131072",
        help=f"simulated worlds, comma-separated, each at most {bench.MAX_SIMULATED_WORLD}",
    )
    _add_layout_flags(bench_parser, _BENCH_DEFAULTS, " of the simulated layout")
    bench_parser.add_argument(
        "--rank", type=int, help="the simulated rank (default: world/2 + 1, at most world - 1)"
    )
    bench_parser.add_argument(
        "--repeat", type=_positive_int, default=3, help="timed runs; the median is reported"
    )
    bench_parser.add_argument(
        "--processes", type=_process_world_sizes, default="8,16",
        help="real local worlds to time too, with "
        + " ".join(f"{name}={size}" for name, size in bench.PROCESS_SIZES.items())
        + "; 0 for none",
    )
    bench_parser.add_argument(
        "--without-megatron", action="store_true", help="leave megatron-core out"
    )
    bench_parser.add_argument(
        "--without-torchtitan", action="store_true", help="leave torchtitan's ParallelDims out"
    )
    bench_parser.add_argument(
        "--without-runtime", action="store_true",
        help="leave out the runtime table (JAX-layer calls, eager and compiled, beside torch's)",
    )
    bench_parser.add_argument(
        "--harness-tests", type=_process_world_sizes, default="1",
        help="time a fresh pytest running this many 8-rank tests with meshstate's harness and "
        "with torch's MultiProcessTestCase (comma-separated counts; one test is timed too); "
        "0 for none",
    )
    bench_parser.add_argument("--json", action="store_true", help="print one JSON object")
    _add_force_flag(bench_parser)
    _add_verbose_flag(bench_parser)
    return parser


@dataclass(frozen=True)
class Progress:
    """Progress lines on stderr, ``meshstate check: starting 8 local ranks (gloo)``.

    Silent unless ``enabled``; picklable, so a worker rank can report its phases.
    """

    command: str
    enabled: bool

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"meshstate {self.command}: {message}", file=sys.stderr, flush=True)


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


def _config(args: argparse.Namespace, world_size: int) -> MeshConfig:
    return MeshConfig(
        world_size, order=args.order, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, pp=args.pp
    )


def _describe(config: MeshConfig) -> str:
    sizes = " ".join(f"{name}={size}" for name, size in config.sizes().items())
    return f"order {config.order}, {sizes}"


def _plan_json(
    layout: ParallelLayout, rank: int | None, locality: LocalityReport | None
) -> dict[str, Any]:
    config = layout.config
    plan: dict[str, Any] = {
        "world_size": config.world_size,
        "order": config.order,
        "sizes": config.sizes(),
        "groups": {kind: layout.groups(kind).tolist() for kind in GROUP_KINDS},
    }
    if rank is not None:
        plan["rank"] = {
            "rank": rank,
            "coordinate": layout.coordinate(rank),
            "groups": {
                kind: {"ranks": list(ranks), "index": ranks.index(rank)}
                for kind in GROUP_KINDS
                for ranks in [layout.group_of(rank, kind)]
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
    others = [axis for axis in grid.mesh_axes if axis not in axes]
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
    coordinate = grid.coordinate(rank)
    first_rank = rank - sum(coordinate[axis] * grid.stride(axis) for axis in axes)
    size = math.prod(grid.size(axis) for axis in axes)
    shown = [first_rank + _step(grid, axes, i) for i in range(min(size, members))]
    return grid.index_in_group(rank, axes), size, shown


def _short(ranks: Sequence[int], total: int) -> str:
    return f"[{', '.join(map(str, ranks))}{', …' if total > len(ranks) else ''}]"


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
    locality_header = "" if locality is None else f" {'locality':>9}"
    lines.append(f"{'kind':<10} {'size':>6} {'groups':>7}{locality_header}  first groups")
    for kind in GROUP_KINDS:
        preview = _preview(layout, kind, groups=3, members=8)
        first = " ".join(_short(group, preview.size) for group in preview.first)
        more = " …" if preview.count > 3 else ""
        spans = "" if locality is None else f" {_nodes(locality.nodes_spanned[kind]):>9}"
        lines.append(f"{kind:<10} {preview.size:>6} {preview.count:>7}{spans}  {first}{more}")
    if locality is not None and locality.advice is not None:
        lines += ["", f"advice: {locality.advice}"]
    if rank is not None:
        coordinate = " ".join(f"{a}={i}" for a, i in layout.coordinate(rank).items())
        lines += ["", f"rank {rank}: {coordinate}", f"{'kind':<10} {'index':>6}  group"]
        for kind in GROUP_KINDS:
            index, size, shown = _rank_group(layout, rank, kind, members=16)
            lines.append(f"{kind:<10} {index:>6}  {_short(shown, size)}")
    return "\n".join(lines)


def _plan(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    layout = ParallelLayout(_config(args, args.world_size))
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
    if lists_every_group and args.world_size >= _SLOW_LISTING:
        progress(f"listing every group of {args.world_size} ranks")
    locality = None
    if args.gpus_per_node is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NodeCrossingWarning)
            locality = locality_report(layout, args.gpus_per_node)
    if args.svg is not None:
        picture = layout_svg(layout, args.color_by, args.gpus_per_node or args.world_size)
        try:
            with open(args.svg, "w") as file:
                file.write(picture)
        except OSError as error:
            raise ConfigError(f"--svg {args.svg}: {error.strerror}") from error
        progress(f"wrote {args.svg}")
    if args.json:
        return 0, json.dumps(_plan_json(layout, args.rank, locality))
    return 0, _plan_text(layout, args.rank, locality)


def check_layout(
    order: str,
    tp: int,
    cp: int,
    ep: int,
    etp: int | None,
    pp: int,
    progress: Progress | None = None,
) -> list[KindCheck]:
    """Build the mesh on this rank, verify every group kind, destroy it.

    Rank 0 reports each phase to ``progress``.
    """
    say = progress if progress is not None and dist.get_rank() == 0 else None
    if say:
        say(f"{dist.get_world_size()} ranks ready; building the mesh")
    mesh = init_mesh(order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp)
    try:
        if say:
            say("verifying every group kind with collectives")
        return verify_mesh(mesh)
    finally:
        mesh.destroy()


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _check(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    layout_args = (args.order, args.tp, args.cp, args.ep, args.etp, args.pp)
    timeout = timedelta(seconds=args.timeout)
    if _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world_size):
            raise MeshStateError(
                f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE {world_size}"
            )
        config = _config(args, world_size)
        if args.backend is not None:
            _require_gpus(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        is_reporter = os.environ["RANK"] == "0"
        say = replace(progress, enabled=progress.enabled and is_reporter)
        say(f"building the mesh on the {world_size} ranks torchrun launched")
        mesh = init_mesh(args.order, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp,
                         pp=args.pp, backend=args.backend, timeout=timeout)
        say("verifying every group kind with collectives")
        checks = verify_mesh(mesh)
        checks_by_rank: list[Any] = [None] * world_size
        dist.all_gather_object(checks_by_rank, checks)
        backend = str(dist.get_backend())
        mesh.destroy()
    else:
        world_size = args.world_size or DEFAULT_CHECK_WORLD
        config = _config(args, world_size)
        backend = args.backend or default_backend(world_size)
        _require_gpus(backend, world_size)
        _require_capacity(
            world_size, args.force,
            f"`meshstate plan --world-size {world_size}` shows the groups without processes, "
            "`meshstate bench` simulates large worlds",
        )
        progress(f"starting {world_size} local ranks ({backend})")
        checks_by_rank = run_local(
            check_layout, world_size, *layout_args, progress, backend=backend, timeout=timeout
        )
        is_reporter = True
    summaries = summarize(checks_by_rank)
    status = EXIT_MISMATCH if any(not row.ok for row in summaries) else 0
    if not is_reporter:
        return status, ""
    failed = [row.key for row in summaries if not row.ok]
    last = (f"FAILED kinds: {', '.join(failed)}" if failed else
            f"all {len(summaries)} group kinds verified on {world_size} ranks")
    header = f"meshstate check: {world_size} ranks ({backend}), {_describe(config)}"
    return status, "\n".join([header, format_summary(summaries), last])


def _bench(args: argparse.Namespace, progress: Progress) -> tuple[int, str]:
    sizes = dict(order=args.order, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, pp=args.pp)
    if args.processes:
        _require_capacity(
            max(args.processes), args.force, "pass smaller --processes (0 for none)"
        )
    report = bench.run(
        args.world_sizes, sizes, rank=args.rank, repeats=args.repeat,
        process_world_sizes=args.processes, with_megatron=not args.without_megatron,
        with_titan=not args.without_torchtitan, with_runtime=not args.without_runtime,
        harness_tests=args.harness_tests, progress=progress,
    )
    return 0, bench.report_json(report) if args.json else bench.format_report(report)


class _Terminated(BaseException):
    """SIGTERM arrived during :func:`main`: unwind, stopping local ranks on the way."""


_main_running = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """During :func:`main` raise :class:`_Terminated`; otherwise die of SIGTERM as by default."""
    if _main_running:
        raise _Terminated
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM unwind the stack (``finally`` blocks and ``__exit__`` run) while inside."""
    global _main_running
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    installed = previous not in (signal.SIG_IGN, None)
    if installed:
        signal.signal(signal.SIGTERM, _on_sigterm)
    _main_running = True
    try:
        yield
    finally:
        _main_running = False
        if installed and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, previous)


def _print_output(text: str) -> bool:
    """Print ``text`` to stdout; False if the reader has gone (stdout then goes nowhere)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # As Python's docs advise: point stdout at devnull so the flush at exit stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``meshstate`` command; return its exit status."""
    with _sigterm_unwinds():
        args = _build_parser().parse_args(argv)
        progress = Progress(args.command, args.verbose or sys.stderr.isatty())
        commands = {"plan": _plan, "check": _check, "bench": _bench}
        try:
            status, output = commands[args.command](args, progress)
            if output and not _print_output(output):
                return EXIT_BROKEN_PIPE
            return status
        except KeyboardInterrupt:
            print(f"meshstate {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except _Terminated:
            print(f"meshstate {args.command}: terminated", file=sys.stderr)
            return EXIT_TERMINATED
        except (RankFailure, RankTimeout) as failure:
            print(f"meshstate {args.command}: {failure}", file=sys.stderr)
            return EXIT_MISMATCH
        except MeshStateError as error:
            print(f"meshstate {args.command}: error: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
