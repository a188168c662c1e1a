"""What ``meshstate plan`` does once its arguments are parsed: the layout's groups as a
table or JSON, a rank's view, node locality and the SVG picture, without processes.

Loaded by :mod:`meshstate.tools.cli` for ``plan`` alone: it imports the layout (torch's
tensors) and nothing that builds meshes, so a plan answers in about a second.
``run_plan`` takes the parsed arguments (with ``layout``, the :class:`MeshConfig` the
entry point checked) and a progress reporter, and returns the exit status and the output.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshstate.errors import ConfigError, MeshStateError
from meshstate.layout.layout import Grid, ParallelLayout
from meshstate.layout.ranks import ranks_text
from meshstate.layout.topology import (
    LocalityReport,
    NodeCrossingWarning,
    locality_report,
    nodes_spanned,
)
from meshstate.tools.cli.parser import MAX_LISTED_WORLD
from meshstate.tools.cli.shared import Progress, layout_text
from meshstate.tools.svg import layout_svg

_SLOW_LISTING = 2**16
"""From this world size on, listing every group takes seconds: say so."""


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
    lines = [f"world size {config.world_size}, {layout_text(config)}"]
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


