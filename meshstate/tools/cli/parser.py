"""The ``meshstate`` command's arguments: parsing, help and argument errors, without torch.

``meshstate --help``, every subcommand's ``--help`` and every argument error
are answered from here before torch is imported. A size meshstate infers
(``--dp``, ``--edp``, ``--dp-shard``) is answered with the world size that
gives it::

    $ meshstate plan --world-size 16 --tp 2 --dp 4
    meshstate plan: error: --dp 4: dp is inferred, not given: world size / (tp*cp*pp); with tp*cp*pp = 2*1*1 = 2, --world-size 8 gives dp 4
"""

from __future__ import annotations

import argparse
import math
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from meshstate.layout.config import DEFAULT_ORDER, MAX_WORLD_SIZE, MeshArguments, MeshConfig, sizes_text
from meshstate.errors import ConfigError
from meshstate.tools.bench.settings import (
    CHECKPOINT_RUNS,
    CHECKPOINT_SIZES,
    CHECKPOINT_WORLDS,
    COMPILE_SIZES,
    MAX_SIMULATED_CHECK,
    MAX_FAKE_WORLD,
    PROCESS_SIZES,
    SIMULATED_CHECK_SIZES,
    SIMULATED_CHECK_WORLDS,
    SIMULATED_PIPELINE_SIZES,
    SIMULATED_PIPELINE_WORLD,
)
from meshstate.tools.cli.shared import EXIT_BAD_INPUT

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

# The sizes plan and check default to are init_mesh's; bench times a large-model layout.
_MESH_DEFAULTS: dict[str, int | None] = {"tp": 1, "cp": 1, "ep": 1, "etp": None, "pp": 1}
_BENCH_DEFAULTS: dict[str, int | None] = {"tp": 8, "cp": 2, "ep": 8, "etp": 1, "pp": 8}

_INFERRED = {
    "dp": ("tp", "cp", "pp"),
    "edp": ("etp", "ep", "pp"),
    "dp_shard": ("dp_replicate", "tp", "cp", "pp"),
}
"""Each size meshstate infers, and the sizes the world size is divided by to get it."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default; an option without a value (None) says its default in words."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:  # no value, or a flag
            return action.help
        return super()._get_help_string(action)


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose ``--help`` shows every default (:class:`_HelpFormatter`) and
    whose errors are one line on stderr and status 2."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(formatter_class=_HelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


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


def _world_size_or_none(text: str) -> int:
    """A world size, or ``"0"`` for none (0)."""
    return 0 if text.strip() == "0" else _rank_count(text)


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


def _add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    """The layout of ``plan`` and ``check``: init_mesh's sizes, ``--dp-replicate`` and hints."""
    _add_layout_flags(parser, _MESH_DEFAULTS, "")
    parser.add_argument(
        "--dp-replicate", type=_rank_count, default=1,
        help="split dp for HSDP into dp_replicate (outer) x dp_shard (inner), as init_mesh does",
    )
    for name in _INFERRED:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=_rank_count, dest=f"inferred_{name}",
            default=argparse.SUPPRESS, help=argparse.SUPPRESS,
        )


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


def _add_plan(commands: argparse._SubParsersAction[_OneLineParser]) -> None:
    plan = commands.add_parser(
        "plan", help="print every group of a layout; no processes",
        description="Print every group kind of a layout; starts no processes. Sizes not "
        "given default to init_mesh's: 1, and etp the same as tp; dp is inferred.",
    )
    plan.add_argument("--world-size", type=_rank_count, required=True, help="ranks in the world")
    _add_mesh_flags(plan)
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


def _add_check(commands: argparse._SubParsersAction[_OneLineParser]) -> None:
    check = commands.add_parser(
        "check", help="build the mesh and verify it with collectives",
        description="Build the mesh on local processes (or the ranks torchrun launched, or "
        "every rank in this process with --simulate) and verify every group with real "
        "collectives. Sizes not given default to init_mesh's: 1, and etp the same as tp; dp "
        "is inferred.",
    )
    check.add_argument(
        "--world-size", type=_rank_count,
        help=f"local ranks to start, or to simulate with --simulate (default: "
        f"{DEFAULT_CHECK_WORLD}; under torchrun, the ranks it launched)",
    )
    _add_mesh_flags(check)
    where = check.add_mutually_exclusive_group()
    where.add_argument(
        "--backend", choices=("gloo", "nccl"),
        help="process group backend (default: nccl with a GPU per rank, else gloo)",
    )
    where.add_argument(
        "--simulate", action="store_true",
        help="build the mesh for every rank in this one process (torch's LocalTensorMode) and "
        "verify every group with collectives computed for all ranks: no processes, so "
        f"worlds far larger than the machine (up to {MAX_SIMULATED_CHECK} ranks)",
    )
    check.add_argument(
        "--stages", type=_positive_int, default=1,
        help="with --simulate: run the world as this many pipeline stages (pp, the outermost "
        "axis, of this size), each simulated in a process of its own, with real send/recv "
        "between them, and check the pp send/recv too",
    )
    check.add_argument(
        "--timeout", type=_timeout_seconds, default=120,
        help="seconds every rank and collective gets",
    )
    _add_force_flag(check)
    _add_verbose_flag(check)


def _add_bench(commands: argparse._SubParsersAction[_OneLineParser]) -> None:
    bench = commands.add_parser(
        "bench", help="init time, groups, getter cost and memory beside megatron-core",
        description="Stand one rank in for each world on torch's fake backend (a fake world) "
        "and time every approach, then time init on real local processes and what each "
        "JAX-layer call costs, eager and compiled, beside torch's own (and a typed op of "
        "JAX's Explicit axes beside the same DTensor op), what check "
        "--simulate costs at whole worlds and a 1F1B step simulated stage by stage, and "
        "meshstate.checkpoint's save and load beside DCP's own. The "
        "layout defaults to a large model's, tp=8 cp=2 ep=8 etp=1 pp=8, unlike plan and "
        "check, whose sizes default to 1.",
    )
    bench.add_argument(
        "--world-sizes", type=_world_sizes, default="1024,16384,131072",
        help=f"fake worlds, comma-separated, each at most {MAX_FAKE_WORLD}",
    )
    _add_layout_flags(bench, _BENCH_DEFAULTS, " of the simulated layout")
    bench.add_argument(
        "--rank", type=int, help="the rank that stands in (default: world/2 + 1, at most world - 1)"
    )
    bench.add_argument(
        "--repeat", type=_positive_int, default=3, help="timed runs; the median is reported"
    )
    bench.add_argument(
        "--processes", type=_process_world_sizes, default="8,16",
        help="real local worlds to time too, with "
        + sizes_text(PROCESS_SIZES)
        + "; 0 for none",
    )
    bench.add_argument("--without-megatron", action="store_true", help="leave megatron-core out")
    bench.add_argument(
        "--without-torchtitan", action="store_true", help="leave torchtitan's ParallelDims out"
    )
    bench.add_argument(
        "--without-runtime", action="store_true", help="leave the JAX-layer runtime and explicit-axes tables out"
    )
    bench.add_argument(
        "--harness-tests", type=_process_world_sizes, default="1",
        help="time a fresh pytest running this many 8-rank tests with meshstate's harness and "
        "with torch's MultiProcessTestCase (comma-separated counts; one test is timed too); "
        "0 for none",
    )
    bench.add_argument(
        "--simulated-checks", type=_process_world_sizes, default=SIMULATED_CHECK_WORLDS,
        help="worlds to time check --simulate at (every rank in one process, "
        + sizes_text(SIMULATED_CHECK_SIZES)
        + "), each in a fresh process, with its peak memory; 0 for none",
    )
    bench.add_argument(
        "--simulated-pipeline", type=_world_size_or_none, default=SIMULATED_PIPELINE_WORLD,
        help="the world to time one 1F1B training step at, simulated stage by stage (a process "
        "per stage, " + sizes_text(SIMULATED_PIPELINE_SIZES) + ", dp inferred) in a fresh "
        "process, beside the simulated checks; 0 for none",
    )
    bench.add_argument(
        "--compile-ranks", type=_process_world_sizes, default="8",
        help="local worlds to compile a training step on (" + sizes_text(COMPILE_SIZES)
        + "), every rank compiling and one rank for all (compile_on_one_rank); 0 for none",
    )
    bench.add_argument(
        "--checkpoint-ranks", type=_process_world_sizes, default=CHECKPOINT_WORLDS,
        help="local worlds to save and load a checkpoint on (" + sizes_text(CHECKPOINT_SIZES)
        + ", dp inferred) with meshstate.checkpoint and with DCP's own save and load of the "
        f"same DTensors, each timed --repeat times but at least {CHECKPOINT_RUNS}; 0 for none",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    _add_force_flag(bench)
    _add_verbose_flag(bench)


def build_parser() -> argparse.ArgumentParser:
    """The ``meshstate`` parser: ``plan``, ``check`` and ``bench``."""
    parser = _OneLineParser(
        prog="meshstate",
        description="The parallel layout of a training job: plan it without processes, "
        "check it on real ones, bench it.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    for add in (_add_plan, _add_check, _add_bench):
        add(commands)
    return parser


def inferred_size_hint(args: argparse.Namespace) -> str | None:
    """What to say to ``--dp 4`` (a size meshstate infers), or None if none was given.

    Example: for ``--tp 2 --dp 4`` it is ``"--dp 4: dp is inferred, not given: world
    size / (tp*cp*pp); with tp*cp*pp = 2*1*1 = 2, --world-size 8 gives dp 4"``.
    """
    for name, divisors in _INFERRED.items():
        wanted = getattr(args, f"inferred_{name}", None)
        if wanted is None:
            continue
        sizes = {**vars(args), "etp": args.tp if args.etp is None else args.etp}
        values = [sizes[divisor] for divisor in divisors]
        product = math.prod(values)
        names = "*".join(divisors)
        return (
            f"--{name.replace('_', '-')} {wanted}: {name} is inferred, not given: world size / "
            f"({names}); with {names} = {'*'.join(map(str, values))} = {product}, "
            f"--world-size {wanted * product} gives {name} {wanted}"
        )
    return None


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun launched (its environment says so)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def layout_arguments(args: argparse.Namespace) -> MeshArguments:
    """The layout the command line gives: every init_mesh layout argument its parser has."""
    given = vars(args)
    return cast(MeshArguments, {name: given[name] for name in MeshArguments.__annotations__ if name in given})


def layout_config(args: argparse.Namespace) -> MeshConfig:
    """The layout ``plan`` or ``check`` lays out, checked without torch (a
    :class:`ConfigError` names a mistake): over ``--world-size``; for ``check`` without
    it, the ranks torchrun launched, else :data:`DEFAULT_CHECK_WORLD` local ones.

    Example: ``meshstate check --world-size 1001 --tp 8`` gives "world size 1001 is
    not divisible by tp*cp*pp = 8*1*1 = 8" before torch is imported.
    """
    world_size = args.world_size
    if args.command == "check" and not args.simulate and under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if world_size not in (None, launched):
            raise ConfigError(f"--world-size {world_size} differs from torchrun's WORLD_SIZE {launched}")
        world_size = launched
    return MeshConfig(world_size or DEFAULT_CHECK_WORLD, **layout_arguments(args))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``meshstate``'s arguments; a user's mistake exits 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check" and args.stages > 1 and not args.simulate:
        parser.exit(EXIT_BAD_INPUT, "meshstate check: error: argument --stages: needs --simulate\n")
    hint = inferred_size_hint(args)
    if hint is not None:
        parser.exit(EXIT_BAD_INPUT, f"meshstate {args.command}: error: {hint}\n")
    return args
