"""Records what JAX gives for the programs of ``tests/test_smap_infer.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``smap_infer.json``
beside it.

The mesh is ``init_mesh(tp=2, cp=2)``'s on 8 devices, axes ``('pp', 'dp', 'cp', 'tp')``,
Explicit axis types (``jax.make_mesh``'s default), current (``jax.set_mesh``). Each
argument is laid out by its ``layouts`` entry (``jax.device_put``). ``infer`` programs are
``jax.shard_map`` with ``in_specs`` omitted (read from the arguments' types) or given;
``smap`` programs are ``jax.smap(body, in_axes=, out_axes=, axis_name=)``. Per program it
keeps the global outputs, their types, and the gradient of ``loss_of(outputs)`` with
respect to each input, or the first line of JAX's refusal.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)
lax = jax.lax
OMITTED = "omitted"
ROWS, COLUMNS, BOTH, NONE = P("dp"), P(None, "tp"), P("dp", "tp"), P()


def infer(body, in_specs, out_specs, axis_names=frozenset()):
    if in_specs == OMITTED:
        return jax.shard_map(body, out_specs=out_specs, axis_names=axis_names)
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names)


# name: (mapped function, argument layouts, input shapes), as in test_smap_infer.CASES
CASES = {
    "infer: rows": (infer(lambda x: x * 2, OMITTED, ROWS), (ROWS,), ((8, 4),)),
    "infer: row-parallel matmul": (infer(lambda x, w: lax.psum(x @ w, "tp"), OMITTED, ROWS),
                                   (BOTH, P("tp", None)), ((8, 4), (4, 3))),
    "infer: replicated": (infer(lambda v: v + 1, OMITTED, NONE), (NONE,), ((4, 3),)),
    "infer: columns summed": (infer(lambda x: lax.psum(x, "tp"), OMITTED, NONE), (COLUMNS,),
                              ((4, 4),)),
    "infer: two layouts": (infer(lambda x, v: x * v.sum(), OMITTED, BOTH), (BOTH, NONE),
                           ((8, 4), (3,))),
    "infer: gathered": (infer(lambda x: lax.all_gather(x, "dp", tiled=True, to="invarying"),
                              OMITTED, NONE), (ROWS,), ((8, 2),)),
    "infer: partial manual over tp": (infer(lambda x, w: lax.psum(x @ w, "tp"), OMITTED, NONE,
                                            {"tp"}), (BOTH, P("tp", None)), ((8, 4), (4, 3))),
    "infer: partial manual, out_specs naming dp refused": (
        infer(lambda x, w: lax.psum(x @ w, "tp"), OMITTED, ROWS, {"tp"}), (BOTH, P("tp", None)),
        ((8, 4), (4, 3))),
    "infer: given and agreeing": (infer(lambda x: x * 3, (BOTH,), BOTH), (BOTH,), ((8, 4),)),
    "infer: given and disagreeing refused": (infer(lambda x: x, (COLUMNS,), COLUMNS), (BOTH,),
                                             ((8, 4),)),
    "infer: P() for a split argument refused": (infer(lambda x: x, (NONE,), NONE), (ROWS,),
                                                ((8, 4),)),
    "smap: rows": (jax.smap(lambda x: x * 2, in_axes=0, out_axes=0, axis_name="dp"), (ROWS,),
                   ((8, 4),)),
    "smap: rows inferred": (jax.smap(lambda x: x * 2, out_axes=0, axis_name="dp"), (ROWS,),
                            ((8, 4),)),
    "smap: columns summed": (jax.smap(lambda x: lax.psum(x, "tp"), in_axes=1, out_axes=None,
                                      axis_name="tp"), (COLUMNS,), ((4, 4),)),
    "smap: columns inferred, summed": (jax.smap(lambda x: lax.psum(x, "tp"), out_axes=None,
                                                axis_name="tp"), (BOTH,), ((8, 4),)),
    "smap: two arguments": (jax.smap(lambda x, w: lax.psum(x @ w, "tp"), in_axes=(1, 0),
                                     out_axes=None, axis_name="tp"),
                            (COLUMNS, P("tp", None)), ((4, 4), (4, 3))),
    "smap: an unmapped argument": (jax.smap(lambda x, v: x * v.sum(), in_axes=(0, None),
                                            out_axes=0, axis_name="dp"), (ROWS, NONE),
                                   ((8, 4), (3,))),
    "smap: out on another dim": (jax.smap(lambda x: x.T, in_axes=0, out_axes=1, axis_name="dp"),
                                 (ROWS,), ((8, 4),)),
    "smap: axis_index": (jax.smap(lambda x: x * (lax.axis_index("cp") + 1), in_axes=0,
                                  out_axes=0, axis_name="cp"), (P("cp"),), ((4, 2),)),
    "smap: ppermute": (jax.smap(lambda x: lax.ppermute(x, "dp", [(0, 1), (1, 0)]), in_axes=0,
                                out_axes=0, axis_name="dp"), (ROWS,), ((4, 2),)),
    "smap: two results": (jax.smap(lambda x: (x, lax.psum(x, "dp")), in_axes=0,
                                   out_axes=(0, None), axis_name="dp"), (ROWS,), ((4, 3),)),
    "smap: psum over another axis refused": (jax.smap(lambda x: lax.psum(x, "tp"), in_axes=0,
                                                      out_axes=0, axis_name="dp"), (ROWS,),
                                             ((4, 4),)),
    "smap: in_axes None for a split argument refused": (
        jax.smap(lambda x: x, in_axes=None, out_axes=None, axis_name="dp"), (ROWS,), ((8, 4),)),
}


def inputs_of(shapes):
    return [jnp.sin(jnp.arange(int(np.prod(shape)), dtype=jnp.float64) * 0.37 + number)
            .reshape(shape) for number, shape in enumerate(shapes)]


def flat(outputs):
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def loss_of(outputs):
    return sum((value * (jnp.arange(value.size, dtype=value.dtype).reshape(value.shape)
                         + number + 1)).sum() for number, value in enumerate(outputs))


def record(mesh, name):
    mapped, layouts, shapes = CASES[name]
    args = [jax.device_put(x, NamedSharding(mesh, layout))
            for x, layout in zip(inputs_of(shapes), layouts)]

    def run(*xs):
        return flat(mapped(*xs))
    try:
        outputs = run(*args)
        grads = jax.grad(lambda *xs: loss_of(run(*xs)), argnums=tuple(range(len(args))))(*args)
    except Exception as error:  # noqa: BLE001 - the refusal is what is recorded
        return {"refused": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {"outputs": [np.asarray(y).tolist() for y in outputs],
            "types": [str(jax.typeof(y)) for y in outputs],
            "grads": [np.asarray(g).tolist() for g in grads]}


if __name__ == "__main__":
    mesh = jax.make_mesh((1, 2, 2, 2), ("pp", "dp", "cp", "tp"))
    with jax.set_mesh(mesh):
        records = {name: record(mesh, name) for name in CASES}
    records["jax"] = jax.__version__
    Path(__file__).with_name("smap_infer.json").write_text(json.dumps(records, indent=1) + "\n")
