"""meshstate plan --svg: one cell per rank, by node, coloured by a key's group, with a legend.

The picture is also drawn by real renderers (rsvg-convert, cairosvg) where installed,
and the pixels of every cell and legend swatch are checked against the group's colour.
"""

import itertools
import math
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ElementTree
import zlib

import pytest

from meshstate.layout.config import MeshConfig
from meshstate.layout.layout import ParallelLayout
from meshstate.tools.cli import main
from meshstate.tools.svg import PALETTE, layout_svg

SVG = "{http://www.w3.org/2000/svg}"


def _cells(svg):
    """(title, fill, dashed, label) of every rank cell; label is the text drawn on the cell."""
    cells = []
    for group in ElementTree.fromstring(svg).iter(f"{SVG}g"):
        rect = group.find(f"{SVG}rect")
        label = " ".join(text.text for text in group.findall(f"{SVG}text"))
        cells.append((group.find(f"{SVG}title").text, rect.get("fill"),
                      rect.get("stroke-dasharray") is not None, label))
    return cells


def _rects(svg, kind):
    """(x, y, fill) of every ``<rect class=kind>``."""
    return [(float(rect.get("x")), float(rect.get("y")), rect.get("fill"))
            for rect in ElementTree.fromstring(svg).iter(f"{SVG}rect") if rect.get("class") == kind]


def _subtitle(svg):
    return [text.text for text in ElementTree.fromstring(svg).iter(f"{SVG}text")][1]


def test_cells_coloured_and_labelled_by_group_with_a_legend():
    # 16 ranks, 4 per node, order tp-dp-pp with tp=2 pp=2: dp groups [0, 2, 4, 6], [1, 3, 5, 7], ...
    layout = ParallelLayout(MeshConfig(16, order="tp-dp-pp", tp=2, pp=2))
    svg = layout_svg(layout, "dp", 4)
    cells = _cells(svg)
    assert [title.split(":")[0] for title, *_ in cells] == [f"rank {r}" for r in range(16)]
    assert cells[0][0] == "rank 0: dp group 0 [0, 2, 4, 6]"
    assert [label for *_, label in cells[:4]] == ["0 g0", "1 g1", "2 g0", "3 g1"]
    fills = [fill for _, fill, _, _ in cells]
    assert fills[0] == fills[2] == fills[4] == fills[6] == PALETTE[0] != fills[1] == PALETTE[1]
    assert [fill for *_, fill in _rects(svg, "swatch")] == list(PALETTE[:4])
    legend = [t.text for t in ElementTree.fromstring(svg).iter(f"{SVG}text") if t.text.startswith("g")]
    assert legend[:4] == ["g0 dp [0, 2, 4, 6]", "g1 dp [1, 3, 5, 7]", "g2 dp [8, 10, 12, 14]",
                          "g3 dp [9, 11, 13, 15]"]
    assert "hsl(" not in svg and set(re.findall(r'fill="([^"]*)"', svg)) <= {
        *PALETTE, "#ffffff", "#000000", "none"}


@pytest.mark.parametrize(
    "config, key, ranks_per_node, dashed_groups, note",
    [
        # every dp group spans 4 nodes: said once, no cell outlined
        (MeshConfig(64, tp=8, pp=2), "dp", 8, set(), "every dp group spans 4 nodes"),
        (MeshConfig(64, tp=8, pp=2), "tp", 8, set(), "every tp group stays inside one node"),
        # tp=3 on nodes of 8: only the groups [6, 7, 8] and [15, 16, 17] cross
        (MeshConfig(24, tp=3), "tp", 8, {2, 5},
         "2 of 8 tp groups span several nodes (dashed outline)"),
        (MeshConfig(16, tp=2), "dp", 16, set(), None),  # one node: nothing to say
    ],
    ids=["all-cross", "none-cross", "some-cross", "one-node"],
)
def test_node_crossings_are_marked_only_where_they_tell_something(
    config, key, ranks_per_node, dashed_groups, note
):
    svg = layout_svg(ParallelLayout(config), key, ranks_per_node)
    dashed = {title.split(" group ")[1].split()[0] for title, _, d, _ in _cells(svg) if d}
    assert dashed == {str(index) for index in dashed_groups}
    assert _subtitle(svg).split(" · ")[2:] == ([note] if note else [])


def test_a_large_world_stays_readable():
    svg = layout_svg(ParallelLayout(MeshConfig(512, tp=8, pp=4)), "tp", 8)
    root = ElementTree.fromstring(svg)
    assert int(root.get("width")) <= 1200  # 4 node boxes a row, 16 rows
    cells = _rects(svg, "cell")
    assert len(cells) == 512 and len({fill for *_, fill in cells}) == len(PALETTE)
    assert len(_rects(svg, "swatch")) == 48
    assert "… 16 more: each cell shows its group" in svg
    legend = [t.text for t in root.iter(f"{SVG}text") if re.match(r"g\d+ tp", t.text)]
    assert legend[1] == "g1 tp [8, 9, 10, 11, 12, 13, 14, 15]"
    assert max(map(len, legend)) <= 36  # one legend column's width


def _lab(color):
    """CIELAB (D65) of ``#rrggbb``."""
    linear = [(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
              for c in (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))]
    matrix = [(0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505)]
    x, y, z = (sum(m * c for m, c in zip(row, linear)) / white
               for row, white in zip(matrix, (0.95047, 1.0, 1.08883)))
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_sixteen_groups_get_clearly_different_colours():
    closest = min(math.dist(_lab(a), _lab(b)) for a, b in itertools.combinations(PALETTE[:16], 2))
    assert closest >= 25  # Delta-E 76; about 2.3 is the smallest difference people notice
    assert len(set(PALETTE)) == len(PALETTE) == 24


def test_cli_writes_the_file_and_refuses_bad_keys(tmp_path, capsys):
    path = tmp_path / "plan.svg"
    assert main(["plan", "--world-size", "16", "--tp", "2", "--pp", "2", "--gpus-per-node", "8",
                 "--svg", str(path), "--color-by", "dp-cp"]) == 0
    text = path.read_text()
    assert text.startswith("<svg") and len(re.findall("<title>", text)) == 16
    assert _subtitle(text) == ("coloured by dp-cp: 4 groups of 4 · 2 nodes of 8 · "
                               "every dp-cp group stays inside one node")
    capsys.readouterr()
    assert main(["plan", "--world-size", "16", "--svg", str(path), "--color-by", "xp"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate plan: error: unknown axis 'xp' in key 'xp'; valid axes are tp, cp, dp, pp, etp, ep, edp"]
    assert main(["plan", "--world-size", "16", "--svg", str(path),
                 "--color-by", "dp_replicate"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate plan: error: --color-by dp_replicate: dp_replicate exists only when dp is "
        "split for HSDP, and this layout has dp_replicate=1; add --dp-replicate N (N dividing dp=16)"]
    assert main(["plan", "--world-size", "16", "--dp-replicate", "2", "--svg", str(path),
                 "--color-by", "dp_replicate"]) == 0
    assert _cells(path.read_text())[8][0] == "rank 8: dp_replicate group 0 [0, 8]"


# --- drawn by real renderers -------------------------------------------------------------


def _png_pixels(data):
    """(width, height, rows of (r, g, b, a)) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset:offset + 4]), data[offset + 4:offset + 8]
        chunks.setdefault(kind, []).append(data[offset + 8:offset + 8 + length])
        offset += 12 + length
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and color_type in (2, 6) and interlace == 0
    channels = 4 if color_type == 6 else 3
    raw, stride = zlib.decompress(b"".join(chunks[b"IDAT"])), width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                nearest = min((abs(guess - left), 0, left), (abs(guess - up), 1, up),
                              (abs(guess - corner), 2, corner))[2]
                line[i] = (line[i] + nearest) & 255
        rows.append([tuple(line[i:i + channels]) + (255,) * (4 - channels)
                     for i in range(0, stride, channels)])
        previous = line
    return width, height, rows


def _render_rsvg(svg_path, png_path):
    if shutil.which("rsvg-convert") is None:
        pytest.skip("rsvg-convert is not installed (apt-get install librsvg2-bin)")
    subprocess.run(["rsvg-convert", str(svg_path), "-o", str(png_path)], check=True, timeout=60)


def _render_cairosvg(svg_path, png_path):
    try:
        import cairosvg
    except (ImportError, OSError):  # OSError: the package is there, the cairo library is not
        pytest.skip("cairosvg is not installed (pip install cairosvg, needs libcairo2)")
    cairosvg.svg2png(url=str(svg_path), write_to=str(png_path))


def _hex(pixel):
    return "#{:02x}{:02x}{:02x}".format(*pixel[:3])


@pytest.mark.parametrize("render", [_render_rsvg, _render_cairosvg], ids=["rsvg-convert", "cairosvg"])
def test_renderers_draw_every_cell_in_its_legend_colour(tmp_path, render):
    # 64 ranks coloured by dp: 16 groups of 4, each spanning 4 of the 8 nodes.
    svg = layout_svg(ParallelLayout(MeshConfig(64, tp=8, pp=2)), "dp", 8)
    (tmp_path / "plan.svg").write_text(svg)
    render(tmp_path / "plan.svg", tmp_path / "plan.png")
    width, height, rows = _png_pixels((tmp_path / "plan.png").read_bytes())
    root = ElementTree.fromstring(svg)
    assert (width, height) == (int(root.get("width")), int(root.get("height")))
    swatches = _rects(svg, "swatch")
    legend = {fill: _hex(rows[int(y) + 6][int(x) + 6]) for x, y, fill in swatches}
    assert legend == {fill: fill for fill in PALETTE[:16]}  # drawn in the colour it names
    for x, y, fill in _rects(svg, "cell"):
        corner = rows[int(y) + 4][int(x) + 24]  # clear of the cell's labels and outline
        assert _hex(corner) == fill != "#000000"
    drawn = {_hex(rows[int(y) + 4][int(x) + 24]) for x, y, _ in _rects(svg, "cell")}
    assert len(drawn) == 16
    dark = sum(1 for row in rows for pixel in row if max(pixel[:3]) < 40) / (width * height)
    assert dark < 0.05  # text and outlines only: nothing rendered as a black block
