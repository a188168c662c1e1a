"""A picture of a layout: ``meshstate plan --svg FILE``, plain SVG text.

One cell per rank, the ranks of a node in one box, each cell coloured by its
group of one key; the cells of groups that span several nodes get a dashed
red outline.
"""

from __future__ import annotations

from html import escape

from meshstate.core.errors import ConfigError
from meshstate.core.layout import ParallelLayout
from meshstate.tools.topology import check_ranks_per_node

MAX_DRAWN_WORLD = 4096
"""The largest world drawn: one 28-pixel cell per rank."""
_CELL = 28
_COLUMNS = 16
_PAD = 10


def layout_svg(layout: ParallelLayout, color_by: str, ranks_per_node: int) -> str:
    """The SVG document of ``layout``: ranks by node, coloured by their ``color_by`` group.

    Example: ``layout_svg(ParallelLayout(MeshConfig(16, tp=2)), "tp", 8)`` draws
    2 nodes of 8 cells, 8 colours, no outlined group.
    """
    world = layout.config.world_size
    if world > MAX_DRAWN_WORLD:
        raise ConfigError(f"--svg draws worlds of at most {MAX_DRAWN_WORLD} ranks, got {world}")
    check_ranks_per_node(world, ranks_per_node)
    groups = layout.groups(color_by).tolist()
    group_index = {rank: index for index, group in enumerate(groups) for rank in group}
    crossing = {
        index for index, group in enumerate(groups) if len({r // ranks_per_node for r in group}) > 1
    }
    columns = min(ranks_per_node, _COLUMNS)
    rows_per_node = -(-ranks_per_node // columns)
    node_width, node_height = columns * _CELL + 2 * _PAD, rows_per_node * _CELL + 2 * _PAD + 14
    nodes = world // ranks_per_node
    key = layout.canonical(color_by)
    sizes = " ".join(f"{name}={size}" for name, size in layout.config.sizes().items())
    title = (
        f"{layout.config.order} {sizes}: coloured by {key}; "
        f"{len(crossing)} of {len(groups)} groups cross nodes (dashed)"
    )
    width = max(node_width, 7 * len(title)) + 2 * _PAD
    height = nodes * (node_height + _PAD) + 3 * _PAD + 20
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="9">',
        f'<text x="{_PAD}" y="{_PAD + 10}" font-size="11">{escape(title)}</text>',
    ]
    for node in range(nodes):
        top = 2 * _PAD + 20 + node * (node_height + _PAD)
        parts.append(
            f'<rect x="{_PAD}" y="{top}" width="{node_width}" height="{node_height}" '
            f'fill="none" stroke="#444"/>'
            f'<text x="{2 * _PAD}" y="{top + 12}">node {node}</text>'
        )
        for local in range(ranks_per_node):
            rank = node * ranks_per_node + local
            index = group_index[rank]
            x = 2 * _PAD + (local % columns) * _CELL
            y = top + 16 + (local // columns) * _CELL
            hue = (index * 137.508) % 360
            outline = (
                'stroke="#d00" stroke-width="2" stroke-dasharray="3,2"'
                if index in crossing
                else 'stroke="#fff"'
            )
            members = ", ".join(map(str, groups[index][:16])) + (", ..." if len(groups[index]) > 16 else "")
            parts.append(
                f'<g><title>rank {rank}: {escape(key)} group {index} [{members}]</title>'
                f'<rect x="{x}" y="{y}" width="{_CELL - 2}" height="{_CELL - 2}" '
                f'fill="hsl({hue:.0f},60%,70%)" {outline}/>'
                f'<text x="{x + 3}" y="{y + 16}">{rank}</text></g>'
            )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
