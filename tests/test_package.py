"""``import meshstate``: every public submodule loads on first use, none at import."""

import subprocess
import sys

FIRST_USE = """
import sys
import meshstate
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("meshstate.")))
HEAVY = ("meshstate.core.build", "meshstate.tools.bench.report", "torch.distributed.tensor")
import meshstate.tools.cli.plan  # what `meshstate plan` loads: the layout, no mesh
print("plan:", [name for name in HEAVY if name in sys.modules])
import meshstate.tools.cli.commands  # what `meshstate check` loads: the mesh, neither bench nor DTensor
print("check:", [name for name in HEAVY if name in sys.modules])
for name in ("core", "jax", "megatron", "testing", "titan", "tools"):
    module = getattr(meshstate, name)
    assert module is sys.modules["meshstate." + name] and name in dir(meshstate), name
print(meshstate.titan.ParallelDims.__module__)
"""


def test_submodules_load_on_first_use():
    result = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[]", "plan: []", "check: ['meshstate.core.build']", "meshstate.titan.parallel_dims"]


def test_a_facade_error_lives_with_its_facade_alone():
    import meshstate
    import meshstate.errors as errors
    from meshstate.megatron.errors import ParallelStateError

    assert meshstate.ParallelStateError is ParallelStateError
    assert not hasattr(errors, "ParallelStateError") and not hasattr(errors, "DimNameError")


def test_the_type_systems_sit_behind_one_seam():
    """In ``jax/``, spmd_types is named by its adapter (and the folder's map) alone, and
    only the seam, ``jax/typing.py``, imports either type system."""
    import re
    from pathlib import Path

    import meshstate.jax

    jax = Path(meshstate.jax.__file__).parent
    sources = {path.relative_to(jax).as_posix(): path.read_text() for path in jax.rglob("*.py")}
    assert sorted(name for name, text in sources.items() if "spmd_types" in text) == [
        "types/__init__.py", "types/spmd_checker.py"]
    importing = re.compile(r"^from meshstate\.jax\.types(\.vma)? import .*(vma|spmd_checker)|"
                           r"^from meshstate\.jax\.types\.(vma|spmd_checker) import", re.M)
    assert sorted(name for name, text in sources.items()
                  if importing.search(text) and not name.startswith("types/")) == ["typing.py"]
