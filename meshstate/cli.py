"""The ``meshstate`` command: ``plan`` a layout without processes, ``check`` it on real ones.

``meshstate plan --world-size 16 --tp 2 --pp 2`` prints every group kind;
``--json`` prints them as one object; ``--rank R`` adds that rank's view;
``--gpus-per-node N`` adds how many nodes each group spans and order advice.
``meshstate check`` builds the mesh on local processes (or the ranks torchrun
launched) and verifies every group with real collectives. ``meshstate bench``
measures meshstate beside megatron-core and plain DeviceMesh.
Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from meshstate import bench
from meshstate.config import DEFAULT_ORDER, MeshConfig
from meshstate.errors import MeshStateError
from meshstate.launch import RankFailure, RankTimeout, default_backend, run_local
from meshstate.layout import GROUP_KINDS, ParallelLayout
from meshstate.mesh import init_mesh
from meshstate.topology import LocalityReport, NodeCrossingWarning, locality_report
from meshstate.verify import KindCheck, format_summary, summarize, verify_mesh

EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_layout_flags(parser: argparse.ArgumentParser, defaults: dict[str, int | None]) -> None:
    parser.add_argument("--order", default=DEFAULT_ORDER, help="Megatron order, fastest axis first")
    for name, meaning in (
        ("tp", "tensor parallel size"),
        ("cp", "context parallel size"),
        ("ep", "expert parallel size"),
        ("etp", "expert tensor parallel size (default: tp)"),
        ("pp", "pipeline parallel size"),
    ):
        parser.add_argument(f"--{name}", type=_positive_int, default=defaults[name], help=meaning)


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="meshstate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    plan = commands.add_parser("plan", help="print every group of a layout; no processes")
    plan.add_argument("--world-size", type=_positive_int, required=True)
    _add_layout_flags(plan, {"tp": 1, "cp": 1, "ep": 1, "etp": None, "pp": 1})
    plan.add_argument("--rank", type=int, help="also show this rank's groups")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--gpus-per-node", type=_positive_int, help="also show which groups cross nodes"
    )

    check = commands.add_parser("check", help="build the mesh and verify it with collectives")
    check.add_argument(
        "--world-size", type=_positive_int, help="local ranks to spawn (default 8; torchrun's)"
    )
    _add_layout_flags(check, {"tp": 2, "cp": 2, "ep": 2, "etp": 1, "pp": 2})
    check.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on GPUs, gloo")
    check.add_argument("--timeout", type=_positive_int, default=120, help="seconds (default 120)")

    bench = commands.add_parser(
        "bench", help="init time, groups, getter cost and memory beside megatron-core"
    )
    bench.add_argument(
        "--world-sizes", type=_positive_ints, default=[1024, 16384, 131072],
        help="simulated worlds (default 1024,16384,131072)",
    )
    _add_layout_flags(bench, {"tp": 8, "cp": 2, "ep": 8, "etp": 1, "pp": 8})
    bench.add_argument("--rank", type=int, help="the simulated rank (default: world/2 + 1)")
    bench.add_argument("--repeat", type=_positive_int, default=3, help="timed runs (median)")
    bench.add_argument(
        "--processes", type=_positive_ints, default=[8, 16],
        help="real local worlds to time too, tp=2 cp=2 pp=2 ep=2 etp=1 (default 8,16; 0: none)",
    )
    bench.add_argument("--without-megatron", action="store_true", help="leave megatron-core out")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _positive_ints(text: str) -> list[int]:
    if text.strip() == "0":
        return []
    return [_positive_int(part) for part in text.split(",")]


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


def _short(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', …' if len(ranks) > limit else ''}]"


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
        groups = layout.groups(kind)
        first = " ".join(_short(g) for g in groups[:3].tolist())
        more = " …" if len(groups) > 3 else ""
        spans = "" if locality is None else f" {_nodes(locality.nodes_spanned[kind]):>9}"
        lines.append(
            f"{kind:<10} {groups.shape[1]:>6} {groups.shape[0]:>7}{spans}  {first}{more}"
        )
    if locality is not None and locality.advice is not None:
        lines += ["", f"advice: {locality.advice}"]
    if rank is not None:
        coordinate = " ".join(f"{a}={i}" for a, i in layout.coordinate(rank).items())
        lines += ["", f"rank {rank}: {coordinate}", f"{'kind':<10} {'index':>6}  group"]
        for kind in GROUP_KINDS:
            ranks = layout.group_of(rank, kind)
            lines.append(f"{kind:<10} {ranks.index(rank):>6}  {_short(ranks, 16)}")
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
    layout = ParallelLayout(_config(args, args.world_size))
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise MeshStateError(f"--rank {args.rank} is outside 0..{args.world_size - 1}")
    locality = None
    if args.gpus_per_node is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NodeCrossingWarning)
            locality = locality_report(layout, args.gpus_per_node)
    if args.json:
        print(json.dumps(_plan_json(layout, args.rank, locality)))
    else:
        print(_plan_text(layout, args.rank, locality))
    return 0


def check_layout(
    order: str, tp: int, cp: int, ep: int, etp: int | None, pp: int
) -> list[KindCheck]:
    """Build the mesh on this rank, verify every group kind, destroy it."""
    mesh = init_mesh(order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp)
    try:
        return verify_mesh(mesh)
    finally:
        mesh.destroy()


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _check(args: argparse.Namespace) -> int:
    layout_args = (args.order, args.tp, args.cp, args.ep, args.etp, args.pp)
    timeout = timedelta(seconds=args.timeout)
    if _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world_size):
            raise MeshStateError(
                f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE {world_size}"
            )
        config = _config(args, world_size)
        mesh = init_mesh(args.order, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp,
                         pp=args.pp, backend=args.backend, timeout=timeout)
        checks = verify_mesh(mesh)
        checks_by_rank: list[Any] = [None] * world_size
        dist.all_gather_object(checks_by_rank, checks)
        backend = str(dist.get_backend())
        is_reporter = mesh.global_rank == 0
        mesh.destroy()
    else:
        world_size = args.world_size or 8
        config = _config(args, world_size)
        backend = args.backend or default_backend(world_size)
        checks_by_rank = run_local(
            check_layout, world_size, *layout_args, backend=backend, timeout=timeout
        )
        is_reporter = True
    summaries = summarize(checks_by_rank)
    if is_reporter:
        print(f"meshstate check: {world_size} ranks ({backend}), {_describe(config)}")
        print(format_summary(summaries))
        failed = [row.key for row in summaries if not row.ok]
        print(f"FAILED kinds: {', '.join(failed)}" if failed else
              f"all {len(summaries)} group kinds verified on {world_size} ranks")
    return EXIT_MISMATCH if any(not row.ok for row in summaries) else 0


def _bench(args: argparse.Namespace) -> int:
    sizes = dict(order=args.order, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, pp=args.pp)
    for world_size in args.world_sizes:
        if args.rank is not None and not 0 <= args.rank < world_size:
            raise MeshStateError(f"--rank {args.rank} is outside 0..{world_size - 1}")
    report = bench.run(
        args.world_sizes, sizes, rank=args.rank, repeats=args.repeat,
        process_world_sizes=args.processes, with_megatron=not args.without_megatron,
    )
    print(bench.report_json(report) if args.json else bench.format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``meshstate`` command; return its exit status."""
    args = _build_parser().parse_args(argv)
    commands = {"plan": _plan, "check": _check, "bench": _bench}
    try:
        return commands[args.command](args)
    except (RankFailure, RankTimeout) as failure:
        print(f"meshstate {args.command}: {failure}", file=sys.stderr)
        return EXIT_MISMATCH
    except MeshStateError as error:
        print(f"meshstate {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
