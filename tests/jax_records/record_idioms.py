"""Records JAX's answers to the small questions the tests ask of it by name.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``idioms.json`` beside it.
It keeps, each under the test that reads it:

- ``psum of numbers`` (test_jax_idioms): ``psum``/``pmean`` of Python numbers in a body;
- ``make_mesh`` (test_make_mesh): its parameter names, the default axis types of it and of
  ``AbstractMesh``, what ``all_gather``/``axis_index`` over ``('y', 'x')`` give on a
  ``(2, 1, 2)`` mesh of ``('x', 'one', 'y')``, and the text of an unknown keyword;
- ``tuple order`` (test_collectives): on a ``(2, 2, 2)`` mesh of ``('dp', 'cp', 'tp')``,
  every device's ``ppermute`` of its number round a ring over each axis pair, with
  ``jax_raise_on_ppermute_sort_diff`` on (JAX 0.12's default: refused against mesh order)
  and off; every other collective over the pairs is checked by test_collectives' formula;
- ``current mesh``: whether ``with mesh:`` still sets the mesh (``get_abstract_mesh``) and
  warns, and what ``jax.set_mesh`` sets.
"""

import inspect
import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec as P

lax = jax.lax
AUTO = jax.sharding.AxisType.Auto


def psum_of_numbers():
    mesh = jax.make_mesh((1, 2, 2, 2), ("pp", "dp", "cp", "tp"), axis_types=(AUTO,) * 4)
    seen = {}

    def body(block):
        seen.update({"psum(1, 'tp')": lax.psum(1, "tp"), "psum(1, ('cp', 'dp'))": lax.psum(1, ("cp", "dp")),
                     "psum(2.5, ('dp', 'cp', 'tp'))": lax.psum(2.5, ("dp", "cp", "tp")),
                     "pmean(3, 'tp')": lax.pmean(3, "tp")})
        return block

    jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))(jnp.ones(4))
    return {name: {"value": value, "type": type(value).__name__} for name, value in seen.items()}


def make_mesh():
    mesh = jax.make_mesh((2, 1, 2), ("x", "one", "y"), axis_types=(AUTO,) * 3,
                         devices=jax.devices()[:4])
    every = P(("x", "one", "y"))
    gathered, index = jax.shard_map(
        lambda b: (lax.all_gather(b, ("y", "x"), tiled=True)[None], lax.axis_index(("y", "x"))[None]),
        mesh=mesh, in_specs=every, out_specs=(every, every), check_vma=False)(jnp.arange(4.0))
    try:
        jax.make_mesh(axis_shapes=(2, 4), axis_names=("a", "b"))
        unknown = None
    except TypeError as error:
        unknown = str(error)
    return {
        "parameters": list(inspect.signature(jax.make_mesh).parameters),
        "default axis types": [str(t) for t in jax.make_mesh((2, 4), ("a", "b")).axis_types],
        "AbstractMesh default axis types": [str(t) for t in AbstractMesh((2, 4), ("a", "b")).axis_types],
        "all_gather over ('y', 'x')": np.asarray(gathered).tolist(),
        "axis_index(('y', 'x'))": np.asarray(index).tolist(),
        "axis_shapes=": unknown,
    }


def tuple_order():
    mesh = jax.make_mesh((2, 2, 2), ("dp", "cp", "tp"), axis_types=(AUTO,) * 3)
    every = P(("dp", "cp", "tp"))
    ring = [(i, (i + 1) % 4) for i in range(4)]
    records = {}
    for axes in [("cp", "dp"), ("dp", "cp"), ("tp", "cp"), ("cp", "tp")]:
        mapped = jax.shard_map(lambda b, axes=axes: lax.ppermute(b, axes, ring), mesh=mesh,
                               in_specs=every, out_specs=every)
        record = {}
        for flag in (True, False):
            jax.config.update("jax_raise_on_ppermute_sort_diff", flag)
            try:
                record[f"sort_diff raises={flag}"] = np.asarray(mapped(jnp.arange(8.0))).tolist()
            except RuntimeError as error:
                record[f"sort_diff raises={flag}"] = f"RuntimeError: {error}"
        jax.config.update("jax_raise_on_ppermute_sort_diff", True)
        records["-".join(axes)] = record
    return records


def current_mesh():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mesh:
            inside_with = str(jax.sharding.get_abstract_mesh())
    with jax.set_mesh(mesh):
        inside_set_mesh = str(jax.sharding.get_mesh())
    return {"with mesh: abstract mesh": inside_with,
            "with mesh: warnings": [str(w.message) for w in caught],
            "with jax.set_mesh(mesh): get_mesh()": inside_set_mesh}


if __name__ == "__main__":
    records = {"psum of numbers": psum_of_numbers(), "make_mesh": make_mesh(),
               "tuple order": tuple_order(), "current mesh": current_mesh(), "jax": jax.__version__}
    Path(__file__).with_name("idioms.json").write_text(json.dumps(records, indent=1) + "\n")
