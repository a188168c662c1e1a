"""Every ```python block of README.md and docs/*.md runs exactly as printed, and every
```signature block there is the code's own signature.

A block runs on every rank of an 8-rank local gloo world (the README's mesh
needs 8), in a fresh namespace; a line ``expression  # literal`` also checks
that the expression equals the literal, so the values the pages show stay
true. A block that defines a ``@distributed`` test is a test file, so it is
run the way a user runs one: saved as a file and given to pytest. A signature
is ``module.name(parameters)`` as :func:`signature_text` renders it from the code
(keywords a ``**kwargs: Unpack[...]`` takes listed by name), so none is retyped.
"""

import ast
import importlib
import inspect
import io
import linecache
import re
import subprocess
import sys
import tokenize
import typing
from pathlib import Path

import pytest

from meshstate.testing import local_world

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
WORLD_SIZE = 8


def python_blocks(markdown: str, language: str = "python") -> list[tuple[str, int, str]]:
    """``(heading, first line, source)`` of every ```python (or ``language``) block; a
    heading's second is ``#2``."""
    blocks: list[tuple[str, int, str]] = []
    per_heading: dict[str, int] = {}
    heading, fence, lines = "top", None, []
    for number, line in enumerate(markdown.splitlines(), start=1):
        if fence is None and line.startswith("```"):
            fence, lines, first_line = line[3:], [], number + 1
        elif fence is not None and line == "```":
            if fence == language:
                count = per_heading[heading] = per_heading.get(heading, 0) + 1
                name = heading if count == 1 else f"{heading} #{count}"
                blocks.append((name, first_line, "\n".join(lines) + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


BLOCKS = [
    (page, f"{page.relative_to(ROOT)}: {name}", line, source)
    for page in PAGES
    for name, line, source in python_blocks(page.read_text())
]
SIGNATURES = [
    (f"{page.relative_to(ROOT)}: {name}", source.strip())
    for page in PAGES
    for name, _, source in python_blocks(page.read_text(), "signature")
]


def with_checked_comments(source: str, first_line: int, page: str = "README.md") -> ast.Module:
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
    module = ast.parse(source, filename=page)
    for index, statement in enumerate(module.body):
        if isinstance(statement, ast.Expr) and statement.end_lineno in literals:
            expected = literals[statement.end_lineno]
            shown = ast.get_source_segment(source, statement.value)
            check = ast.Assert(
                test=ast.Compare(statement.value, [ast.Eq()], [ast.parse(expected, mode="eval").body]),
                msg=ast.Constant(f"{page} says {shown} is {expected}"),
            )
            module.body[index] = ast.copy_location(check, statement)
    return ast.increment_lineno(ast.fix_missing_locations(module), first_line - 1)


def run_block(source: str, first_line: int = 1, page: Path = README) -> None:
    """Run one block in a fresh namespace (called on every rank).

    Its code is filed under the page's name with the block at its own lines
    (``linecache``), so a traceback shows the page's line and tools that read
    a function's source (torch.compile does) find it.
    """
    filename = f"{page}#L{first_line}"
    lines = ["\n"] * (first_line - 1) + source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    code = compile(with_checked_comments(source, first_line, page.name), filename, "exec")
    exec(code, {"__name__": "readme"})


def defines_distributed_test(source: str) -> bool:
    return re.search(r"^@distributed\(", source, re.MULTILINE) is not None


def test_the_pages_have_python_blocks():
    readme = [source for page, _, _, source in BLOCKS if page == README]
    assert len(readme) >= 5 and any(defines_distributed_test(source) for source in readme)
    assert len(README.read_text().splitlines()) <= 200


@pytest.fixture(scope="module")
def test_file_outcomes(tmp_path_factory):
    """Every block that defines a ``@distributed`` test, saved as a test file, and all of
    them given to one pytest (one start of torch and of the workers, not one per block):
    ``{block's source: (pytest's outcomes of its file, pytest's output)}``."""
    folder = tmp_path_factory.mktemp("blocks")
    files = {}
    for number, (_, _, _, source) in enumerate(BLOCKS):
        if defines_distributed_test(source):
            files[source] = f"test_block_{number}.py"
            (folder / files[source]).write_text(source)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *files.values()],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+?)::", output, re.MULTILINE)
    return {
        source: ([outcome for outcome, path in outcomes if path == name], output)
        for source, name in files.items()
    }


@pytest.mark.parametrize(
    "page, source, first_line",
    [pytest.param(page, source, line, id=name) for page, name, line, source in BLOCKS],
)
def test_readme_block_runs_as_printed(page, source, first_line, request):
    if defines_distributed_test(source):
        outcomes, output = request.getfixturevalue("test_file_outcomes")[source]
        assert outcomes and set(outcomes) == {"PASSED"}, output
        return
    if not needs_a_world(source):
        run_block(source, first_line, page)  # pure layout or import switching: no ranks needed
        return
    local_world(WORLD_SIZE).run(run_block, source, first_line, page)


def signature_text(dotted: str) -> str:
    """``module.name(parameters)`` of the function or class at ``dotted``, keywords that a
    ``**kwargs: Unpack[TypedDict]`` takes listed by name, in the order they are declared."""
    module_name, _, name = dotted.rpartition(".")
    target = getattr(importlib.import_module(module_name), name)
    parameters = []
    for parameter in inspect.signature(target).parameters.values():
        unpacked = typing.get_type_hints(target).get(parameter.name) if parameter.kind is parameter.VAR_KEYWORD else None
        if unpacked is not None and typing.get_origin(unpacked) is typing.Unpack:
            (typed_dict,) = typing.get_args(unpacked)
            declared = [key for base in reversed(typed_dict.__mro__) for key in getattr(base, "__annotations__", {})]
            parameters += list(dict.fromkeys(declared))
            continue
        text = parameter.name if parameter.default is parameter.empty else f"{parameter.name}={parameter.default!r}"
        text = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "") + text
        if parameter.kind is parameter.KEYWORD_ONLY and not any(p.startswith("*") for p in parameters) and "*" not in parameters:
            parameters.append("*")
        parameters.append(text)
    return f"{dotted}({', '.join(parameters)})"


@pytest.mark.parametrize("written", [pytest.param(text, id=name) for name, text in SIGNATURES])
def test_a_signature_on_a_page_is_the_codes(written):
    assert written == signature_text(written.partition("(")[0])


def needs_a_world(source: str) -> bool:
    """Whether a block uses process groups (a mesh, Megatron's state, torch.distributed)."""
    return re.search(r"init_mesh|make_mesh|initialize_model_parallel|ParallelDims|adopt\(|\bdist\.", source) is not None


# The harness itself: a block that breaks, or shows a wrong value, fails.


def test_every_link_between_pages_resolves():
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert broken == []


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
