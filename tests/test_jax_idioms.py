"""JAX's spellings work as written: shard_map as a keyword-only decorator, ``axis_name=``,
``psum`` of a Python number, and a type mistake that is a ``TypeError``."""

import json
from pathlib import Path

import pytest
import torch

import meshstate
from meshstate import ArgumentTypeError, MeshStateError, P, shard_map
from meshstate.jax import collectives as lax
from meshstate.testing import fake_world
from conftest import in_both_worlds


@in_both_worlds(4)
def test_shard_map_decorates_with_keywords_only():
    mesh = meshstate.make_mesh((2, 2), ("x", "y"))

    @shard_map(mesh=mesh, in_specs=P("x"), out_specs=P())
    def total(block):
        return lax.psum(block.sum(), axis_name="x")

    assert total(torch.arange(4.0)).to_local().item() == 6.0
    mesh.destroy()


CALLS = {
    "psum": lambda x, **axes: lax.psum(x, **axes),
    "pmean": lambda x, **axes: lax.pmean(x, **axes),
    "pmax": lambda x, **axes: lax.pmax(x, **axes),
    "pmin": lambda x, **axes: lax.pmin(x, **axes),
    "pvary": lambda x, **axes: lax.pvary(x, **axes),
    "all_gather": lambda x, **axes: lax.all_gather(x, **axes, tiled=True),
    "all_gather_invariant": lambda x, **axes: lax.all_gather_invariant(x, **axes),
    "psum_scatter": lambda x, **axes: lax.psum_scatter(x, **axes, tiled=True),
    "all_to_all": lambda x, **axes: lax.all_to_all(x, **axes, split_axis=0, concat_axis=0, tiled=True),
    "ppermute": lambda x, **axes: lax.ppermute(x, **axes, perm=[(0, 1), (1, 0)]),
    "axis_index": lambda x, **axes: torch.tensor(lax.axis_index(**axes)),
    "axis_size": lambda x, **axes: torch.tensor(lax.axis_size(**axes)),
}


@pytest.mark.parametrize("name", CALLS)
def test_axis_name_is_axes(name):
    with fake_world(1, 4), meshstate.init_mesh(tp=2):
        x = torch.arange(4.0)
        assert torch.equal(CALLS[name](x, axis_name="tp"), CALLS[name](x, axes="tp"))
        with pytest.raises(ArgumentTypeError, match=rf"^{name}\(\) got axes='tp' and axis_name='tp'"):
            CALLS[name](x, axes="tp", axis_name="tp")
        with pytest.raises(ArgumentTypeError, match=rf"^{name}\(\) missing its axes"):
            CALLS[name](x)


IDIOMS = json.loads((Path(__file__).parent / "jax_records" / "idioms.json").read_text())


def test_psum_of_a_python_number_is_jaxs():
    """JAX 0.12.0.1's answers (jax_records/record_idioms.py): ints stay ints, pmean is a float."""
    jaxs = IDIOMS["psum of numbers"]
    assert [(v["value"], v["type"]) for v in jaxs.values()] == [
        (2, "int"), (4, "int"), (20.0, "float"), (3.0, "float")]
    with fake_world(0, 8), meshstate.init_mesh(tp=2, cp=2):
        assert lax.psum(1, "tp") == 2 and lax.psum(1, ("cp", "dp")) == 4
        assert lax.psum(2.5, axis_name="dp-cp-tp") == 20.0
        assert lax.pmean(3, "tp") == 3.0 and isinstance(lax.pmean(3, "tp"), float)
        seen = []
        shard_map(lambda b: seen.append(lax.psum(1, "tp")) or b, in_specs=P("tp"),
                  out_specs=P("tp"))(torch.ones(4))
        assert seen == [2]


MISTAKES = [
    (lambda: lax.psum("x", "tp"), r"^psum takes a torch.Tensor, got str$"),
    (lambda: lax.pvary([1.0], "tp"), r"^pvary takes a torch.Tensor, got list$"),
    (lambda: lax.psum(torch.ones(1), 3), r"^axes must be an axis name or a tuple of axis names, got 3$"),
    (lambda: lax.all_to_all(torch.ones(2), "tp", 0), r"^all_to_all\(\) missing its argument 'concat_axis'$"),
    (lambda: lax.ppermute(torch.ones(2), "tp"), r"^ppermute\(\) missing its argument 'perm'$"),
]


@pytest.mark.parametrize("call, message", MISTAKES, ids=[m for _, m in MISTAKES])
def test_a_type_mistake_is_a_type_error(call, message):
    with fake_world(0, 4), meshstate.init_mesh(tp=2):
        with pytest.raises(ArgumentTypeError, match=message) as raised:
            call()
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, MeshStateError)
