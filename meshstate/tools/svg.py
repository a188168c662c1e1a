"""A picture of a layout: ``meshstate plan --svg FILE``, plain SVG text.

One cell per rank, the ranks of a node in one box, the boxes in rows; each cell
is filled with the colour of its group of one key and shows its rank and its
group's number (``g3``); a legend gives every group's colour, number and first
ranks. Node crossings are marked where they tell something: when some groups
of the key span several nodes and others do not, the spanning groups' cells
get a dashed outline; when every group does (dp over many nodes), the title
says so once. Plain hex colours, no CSS and no ``hsl()``, so a browser,
``rsvg-convert`` and cairosvg draw the same picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from meshstate.errors import ConfigError
from meshstate.layout.layout import ParallelLayout
from meshstate.layout.config import sizes_text
from meshstate.layout.ranks import ranks_text
from meshstate.layout.topology import check_ranks_per_node

MAX_DRAWN_WORLD = 4096
"""The largest world drawn: one 30-pixel cell per rank."""
PALETTE = (
    "#1f77b4", "#ffd700", "#be0032", "#31a354", "#fdd0a2", "#e377c2", "#ff7f0e", "#00ced1",
    "#8c564b", "#8db600", "#a6761d", "#c5b0d5", "#7b4173", "#ff9896", "#637939", "#e7298a",
    "#008080", "#848482", "#b3446c", "#98df8a", "#f6a600", "#9467bd", "#9edae5", "#fc8d62",
)
"""Group colours, each picked as far (CIELAB) from those before it as a candidate list
allowed: any two of the first 16 differ by a Delta-E of 30 or more. Beyond 24 groups the
colours repeat; the number in each cell tells the groups apart."""
CROSSING_STROKE = "#222222"
MAX_LEGEND_ENTRIES = 48
"""Groups the legend lists; the cells of the rest still show their number."""
_CELL = 30
_COLUMNS = 16
_PAD = 10
_MAX_WIDTH = 1200
_LEGEND_ENTRY_WIDTH = 230
_LEGEND_CHARS = 36
"""Characters of a legend label that fit its column (about 5.5 pixels each at 9 points)."""
_LINE = 16


@dataclass(frozen=True)
class _Geometry:
    """Where the title, legend and node boxes go."""

    columns: int
    rows_per_node: int
    nodes_per_row: int
    legend_columns: int
    legend_rows: int
    width: int
    legend_top: int
    nodes_top: int

    @property
    def node_width(self) -> int:
        return self.columns * _CELL + 2 * _PAD

    @property
    def node_height(self) -> int:
        return self.rows_per_node * _CELL + 2 * _PAD + 14

    def node_origin(self, node: int) -> tuple[int, int]:
        row, column = divmod(node, self.nodes_per_row)
        return (_PAD + column * (self.node_width + _PAD),
                self.nodes_top + row * (self.node_height + _PAD))

    def cell_origin(self, node: int, local: int) -> tuple[int, int]:
        left, top = self.node_origin(node)
        row, column = divmod(local, self.columns)
        return left + _PAD + column * _CELL, top + 16 + _PAD // 2 + row * _CELL

    def legend_origin(self, entry: int) -> tuple[int, int]:
        column, row = divmod(entry, self.legend_rows)
        return _PAD + column * _LEGEND_ENTRY_WIDTH, self.legend_top + row * _LINE


def _geometry(nodes: int, ranks_per_node: int, legend_entries: int, title: int) -> _Geometry:
    columns = min(ranks_per_node, _COLUMNS)
    rows_per_node = -(-ranks_per_node // columns)
    node_width = columns * _CELL + 2 * _PAD
    nodes_per_row = max(1, min(nodes, (_MAX_WIDTH - _PAD) // (node_width + _PAD)))
    width = max(
        nodes_per_row * (node_width + _PAD) + _PAD, 7 * title + 2 * _PAD, 2 * _LEGEND_ENTRY_WIDTH
    )
    legend_columns = max(1, (width - 2 * _PAD) // _LEGEND_ENTRY_WIDTH)
    legend_rows = -(-legend_entries // legend_columns)
    legend_top = 3 * _LINE + _PAD
    nodes_top = legend_top + legend_rows * _LINE + _PAD
    return _Geometry(columns, rows_per_node, nodes_per_row, legend_columns, legend_rows,
                     width, legend_top, nodes_top)


def text_color(fill: str) -> str:
    """Black on a light fill, white on a dark one: ``text_color("#1f77b4") == "#ffffff"``."""
    red, green, blue = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * red + 0.587 * green + 0.114 * blue > 140 else "#ffffff"


def _check_key(layout: ParallelLayout, color_by: str) -> None:
    """Refuse an HSDP key on a layout that does not split dp."""
    config = layout.config
    hsdp_axes = [name for name in color_by.split("-") if name in ("dp_replicate", "dp_shard")]
    if hsdp_axes and config.dp_replicate == 1:
        raise ConfigError(
            f"--color-by {color_by}: {hsdp_axes[0]} exists only when dp is split for HSDP, "
            f"and this layout has dp_replicate=1; add --dp-replicate N (N dividing dp={config.dp})"
        )


def _legend_label(index: int, key: str, group: Sequence[int]) -> str:
    """``"g3 dp [3, 11, 19, 27]"``, as many first ranks as fit one legend column."""
    for most in range(len(group), 1, -1):
        label = f"g{index} {key} {ranks_text(group[:most], len(group))}"
        if len(label) <= _LEGEND_CHARS:
            return label
    return f"g{index} {key} {ranks_text(group[:1], len(group))}"


def _crossing_note(key: str, spans: list[int], crossing: set[int], nodes: int) -> str:
    """What the picture says about nodes: nothing on one node, else where groups cross."""
    if nodes == 1:
        return ""
    if not crossing:
        return f"every {key} group stays inside one node"
    if len(crossing) == len(spans):
        least, most = min(spans), max(spans)
        reach = f"{least}" if least == most else f"{least} to {most}"
        return f"every {key} group spans {reach} nodes"
    return f"{len(crossing)} of {len(spans)} {key} groups span several nodes (dashed outline)"


def layout_svg(layout: ParallelLayout, color_by: str, ranks_per_node: int) -> str:
    """The SVG document of ``layout``: ranks by node, coloured by their ``color_by`` group.

    Example: ``layout_svg(ParallelLayout(MeshConfig(16, tp=2)), "tp", 8)`` draws
    2 nodes of 8 cells in 8 colours, labelled ``g0`` to ``g7``, with a legend
    of 8 entries and no outline (every tp group stays inside a node).
    """
    world = layout.config.world_size
    if world > MAX_DRAWN_WORLD:
        raise ConfigError(f"--svg draws worlds of at most {MAX_DRAWN_WORLD} ranks, got {world}")
    check_ranks_per_node(world, ranks_per_node)
    _check_key(layout, color_by)
    key = layout.canonical(color_by)
    groups: list[list[int]] = layout.groups(color_by).tolist()
    group_of = [0] * world
    for index, group in enumerate(groups):
        for rank in group:
            group_of[rank] = index
    spans = [len({rank // ranks_per_node for rank in group}) for group in groups]
    crossing = {index for index, span in enumerate(spans) if span > 1}
    nodes = world // ranks_per_node
    outlined = crossing if len(crossing) < len(groups) else set()
    title = f"{world} ranks, order {layout.config.order}, {sizes_text(layout.config.sizes())}"
    subtitle = " · ".join(
        part for part in (
            f"coloured by {key}: {len(groups)} groups of {len(groups[0])}",
            f"{nodes} node{'s' if nodes > 1 else ''} of {ranks_per_node}",
            _crossing_note(key, spans, crossing, nodes),
        ) if part
    )
    entries = min(len(groups), MAX_LEGEND_ENTRIES)
    more = len(groups) > entries
    shape = _geometry(nodes, ranks_per_node, entries + more, max(len(title), len(subtitle)))
    height = shape.node_origin(nodes - 1)[1] + shape.node_height + _PAD
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{shape.width}" height="{height}" '
        f'viewBox="0 0 {shape.width} {height}" font-family="DejaVu Sans Mono, monospace" '
        'font-size="9">',
        f'<rect x="0" y="0" width="{shape.width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{_PAD}" y="{_PAD + 10}" font-size="12" fill="#000000">{escape(title)}</text>',
        f'<text x="{_PAD}" y="{_PAD + 10 + _LINE}" font-size="11" fill="#000000">'
        f"{escape(subtitle)}</text>",
    ]
    parts += _legend(shape, key, groups, entries, outlined)
    for node in range(nodes):
        parts += _node(shape, node, ranks_per_node, key, groups, group_of, outlined)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _legend(
    shape: _Geometry, key: str, groups: list[list[int]], entries: int, outlined: set[int]
) -> list[str]:
    parts = []
    for index in range(entries):
        x, y = shape.legend_origin(index)
        fill = PALETTE[index % len(PALETTE)]
        dashed = (f' stroke="{CROSSING_STROKE}" stroke-width="1.5" stroke-dasharray="3,2"'
                  if index in outlined else "")
        parts.append(
            f'<rect class="swatch" x="{x}" y="{y}" width="12" height="12" fill="{fill}"{dashed}/>'
            f'<text x="{x + 16}" y="{y + 10}" fill="#000000">'
            f"{escape(_legend_label(index, key, groups[index]))}</text>"
        )
    if entries < len(groups):
        x, y = shape.legend_origin(entries)
        parts.append(
            f'<text x="{x}" y="{y + 10}" fill="#000000">… {len(groups) - entries} more: '
            "each cell shows its group</text>"
        )
    return parts


def _node(
    shape: _Geometry, node: int, ranks_per_node: int, key: str, groups: list[list[int]],
    group_of: list[int], outlined: set[int],
) -> list[str]:
    left, top = shape.node_origin(node)
    parts = [
        f'<rect x="{left}" y="{top}" width="{shape.node_width}" height="{shape.node_height}" '
        f'fill="none" stroke="#444444"/>'
        f'<text x="{left + _PAD}" y="{top + 13}" fill="#000000">node {node}</text>'
    ]
    for local in range(ranks_per_node):
        rank = node * ranks_per_node + local
        index = group_of[rank]
        fill = PALETTE[index % len(PALETTE)]
        ink = text_color(fill)
        x, y = shape.cell_origin(node, local)
        outline = (f'stroke="{CROSSING_STROKE}" stroke-width="2" stroke-dasharray="4,2"'
                   if index in outlined else 'stroke="#ffffff"')
        parts.append(
            f"<g><title>rank {rank}: {escape(key)} group {index} "
            f"{ranks_text(groups[index][:16], len(groups[index]))}</title>"
            f'<rect class="cell" x="{x}" y="{y}" width="{_CELL - 2}" height="{_CELL - 2}" '
            f'fill="{fill}" {outline}/>'
            f'<text x="{x + 3}" y="{y + 11}" fill="{ink}">{rank}</text>'
            f'<text x="{x + 3}" y="{y + 23}" fill="{ink}" font-size="8">g{index}</text></g>'
        )
    return parts
