"""Every ```python block of README.md runs exactly as printed.

A block runs on every rank of an 8-rank local gloo world (the README's mesh
needs 8), in a fresh namespace; a line ``expression  # literal`` also checks
that the expression equals the literal, so the values the README shows stay
true. A block that defines a ``@distributed`` test is a test file, so it is
run the way a user runs one: saved as a file and given to pytest.
"""

import ast
import io
import linecache
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from meshstate.testing import local_world

README = Path(__file__).resolve().parent.parent / "README.md"
WORLD_SIZE = 8


def python_blocks(markdown: str) -> list[tuple[str, int, str]]:
    """``(heading, first line, source)`` of every ```python block; a heading's second is ``#2``."""
    blocks: list[tuple[str, int, str]] = []
    per_heading: dict[str, int] = {}
    heading, fence, lines = "top", None, []
    for number, line in enumerate(markdown.splitlines(), start=1):
        if fence is None and line.startswith("```"):
            fence, lines, first_line = line[3:], [], number + 1
        elif fence is not None and line == "```":
            if fence == "python":
                count = per_heading[heading] = per_heading.get(heading, 0) + 1
                name = heading if count == 1 else f"{heading} #{count}"
                blocks.append((name, first_line, "\n".join(lines) + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


BLOCKS = python_blocks(README.read_text())


def with_checked_comments(source: str, first_line: int) -> ast.Module:
    """``source`` parsed, each ``expression  # literal`` statement turned into an assert.

    Line numbers are README.md's, so a traceback points into the README.
    """
    literals: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string[1:].strip()
            try:
                ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue  # prose, not a value
            literals[token.start[0]] = text
    module = ast.parse(source, filename="README.md")
    for index, statement in enumerate(module.body):
        if isinstance(statement, ast.Expr) and statement.end_lineno in literals:
            expected = literals[statement.end_lineno]
            shown = ast.get_source_segment(source, statement.value)
            check = ast.Assert(
                test=ast.Compare(statement.value, [ast.Eq()], [ast.parse(expected, mode="eval").body]),
                msg=ast.Constant(f"README.md says {shown} is {expected}"),
            )
            module.body[index] = ast.copy_location(check, statement)
    return ast.increment_lineno(ast.fix_missing_locations(module), first_line - 1)


def run_block(source: str, first_line: int = 1) -> None:
    """Run one README block in a fresh namespace (called on every rank).

    Its code is filed under the README's name with the block at its own lines
    (``linecache``), so a traceback shows the README's line and tools that read
    a function's source (torch.compile does) find it.
    """
    filename = f"{README}#L{first_line}"
    lines = ["\n"] * (first_line - 1) + source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    code = compile(with_checked_comments(source, first_line), filename, "exec")
    exec(code, {"__name__": "readme"})


def defines_distributed_test(source: str) -> bool:
    return re.search(r"^@distributed\(", source, re.MULTILINE) is not None


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5
    assert any(defines_distributed_test(source) for _, _, source in BLOCKS)


@pytest.mark.parametrize(
    "source, first_line", [pytest.param(source, line, id=name) for name, line, source in BLOCKS]
)
def test_readme_block_runs_as_printed(source, first_line, tmp_path):
    if defines_distributed_test(source):
        test_file = tmp_path / "test_readme_block.py"
        test_file.write_text(source)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return
    if not needs_a_world(source):
        run_block(source, first_line)  # pure layout or import switching: no ranks needed
        return
    local_world(WORLD_SIZE).run(run_block, source, first_line)


def needs_a_world(source: str) -> bool:
    """Whether a block uses process groups (a mesh, Megatron's state, torch.distributed)."""
    return re.search(r"init_mesh|initialize_model_parallel|ParallelDims|adopt\(|\bdist\.", source) is not None


# The harness itself: a block that breaks, or shows a wrong value, fails.


def test_a_block_that_raises_fails():
    with pytest.raises(NameError):
        run_block("undefined_name\n")


def test_a_wrong_value_in_a_comment_fails():
    run_block("sorted([3, 1, 2])   # [1, 2, 3]\n")
    with pytest.raises(AssertionError, match=r"README.md says sorted\(\[3, 1, 2\]\) is \[3, 2, 1\]"):
        run_block("sorted([3, 1, 2])   # [3, 2, 1]\n")


def test_prose_comments_are_not_values():
    run_block("x = 2  # two\nx * 2   # doubled\n")


def test_blocks_are_found_under_their_headings():
    markdown = (
        "# A\n```python\na = 1\n```\n## B\n```bash\n# not a heading\n```\n"
        "```python\nb = 2\n```\n```python\nc = 3\n```\n"
    )
    assert python_blocks(markdown) == [("A", 3, "a = 1\n"), ("B", 10, "b = 2\n"), ("B #2", 13, "c = 3\n")]
