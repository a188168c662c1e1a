"""meshstate plan --svg: one cell per rank, by node, coloured by a key's group, crossings dashed."""

import re
import xml.etree.ElementTree as ElementTree

from meshstate.core.config import MeshConfig
from meshstate.core.layout import ParallelLayout
from meshstate.tools.cli import main
from meshstate.tools.svg import layout_svg

SVG = "{http://www.w3.org/2000/svg}"


def _cells(svg: str) -> list[tuple[str, str, bool]]:
    """(title, fill, dashed) of every rank cell."""
    root = ElementTree.fromstring(svg)
    cells = []
    for group in root.iter(f"{SVG}g"):
        rect = group.find(f"{SVG}rect")
        cells.append((group.find(f"{SVG}title").text, rect.get("fill"), rect.get("stroke-dasharray") is not None))
    return cells


def test_cells_coloured_by_group_and_node_crossing_groups_dashed():
    # 16 ranks, 4 per node, order tp-dp-pp with tp=2 pp=2: dp groups [0, 2, 4, 6] span 2 nodes.
    layout = ParallelLayout(MeshConfig(16, order="tp-dp-pp", tp=2, pp=2))
    cells = _cells(layout_svg(layout, "dp", 4))
    assert [title.split(":")[0] for title, _, _ in cells] == [f"rank {r}" for r in range(16)]
    assert cells[0][0] == "rank 0: dp group 0 [0, 2, 4, 6]"
    fills = [fill for _, fill, _ in cells]
    assert fills[0] == fills[2] == fills[4] == fills[6] != fills[1]
    assert all(dashed for _, _, dashed in cells)
    tp_cells = _cells(layout_svg(layout, "tp", 4))
    assert not any(dashed for _, _, dashed in tp_cells)  # tp pairs stay inside a node
    assert len(set(fill for _, fill, _ in tp_cells)) == 8


def test_cli_writes_the_file_and_refuses_bad_keys(tmp_path, capsys):
    path = tmp_path / "plan.svg"
    assert main(["plan", "--world-size", "16", "--tp", "2", "--pp", "2", "--gpus-per-node", "8",
                 "--svg", str(path), "--color-by", "dp-cp"]) == 0
    text = path.read_text()
    assert text.startswith("<svg") and len(re.findall("<title>", text)) == 16
    assert "coloured by dp-cp; 0 of 4 groups cross nodes" in text
    capsys.readouterr()
    assert main(["plan", "--world-size", "16", "--svg", str(path), "--color-by", "xp"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate plan: error: unknown axis 'xp' in key 'xp'; valid axes are tp, cp, dp, pp, etp, ep, edp"]
