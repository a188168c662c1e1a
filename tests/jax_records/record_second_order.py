"""Records what JAX gives for the programs of ``tests/test_second_order.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``second_order.json``
beside it.

``init_mesh(tp=4)``'s mesh on 4 devices (Auto axis types); ``x`` = ``linspace(-1, 2, 16)``
split over tp, ``w`` = ``[0.7]``. Per program and mode (``typed``: ``check_vma=True``,
``legacy``: ``False``) it keeps the gradient of (the sum of the gradients of the loss wrt
every input) wrt each input, or the text of JAX's refusal.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)
lax = jax.lax
WEIGHTS = jnp.arange(1.0, 17.0, dtype=jnp.float64)


def gathered_cubes(x_block):
    return (lax.all_gather(x_block ** 3 / 6, "tp", tiled=True, to="invarying") * WEIGHTS).sum()


def scattered_sums(x_block):
    return lax.psum_scatter(jnp.concatenate([x_block ** 2] * 4), "tp", tiled=True) ** 2


# name: (body, out_spec, number of inputs), as in test_second_order.PROGRAMS
PROGRAMS = {
    "psum": (lambda b: lax.psum((b ** 3).sum() / 6, "tp"), P(), 1),
    "pvary of a replicated weight": (
        lambda b, w: lax.psum(((lax.pcast(w, "tp", to="varying") * b) ** 2).sum() / 2, "tp"),
        P(), 2),
    "all_gather_invariant": (gathered_cubes, P(), 1),
    "all_gather": (
        lambda b: ((lax.all_gather(b, "tp", tiled=True) ** 3 * WEIGHTS).sum() / 6).reshape(1),
        P("tp"), 1),
    "ppermute": (lambda b: lax.ppermute(b, "tp", [(i, (i + 1) % 4) for i in range(4)]) ** 3 / 6,
                 P("tp"), 1),
    "psum_scatter": (scattered_sums, P("tp"), 1),
    "all_to_all": (lambda b: lax.all_to_all(b, "tp", 0, 0, tiled=True) ** 3 / 6, P("tp"), 1),
}


def weighted(out):
    return (out * WEIGHTS).sum() if out.size == 16 else out.sum()


def second_order(function, inputs):
    argnums = tuple(range(len(inputs)))

    def first_summed(*xs):
        return sum(g.sum() for g in jax.grad(function, argnums=argnums)(*xs))

    return jax.grad(first_summed, argnums=argnums)(*inputs)


def record(mesh, name, check_vma):
    body, out_spec, count = PROGRAMS[name]
    inputs = (jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float64), jnp.array([0.7]))[:count]
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P())[:count], out_specs=out_spec,
                           check_vma=check_vma)
    try:
        grads = second_order(lambda *xs: weighted(mapped(*xs)), inputs)
    except Exception as error:  # noqa: BLE001 - the refusal is what is recorded
        return {"refused": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {"grads": [np.asarray(g).tolist() for g in grads]}


if __name__ == "__main__":
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    records = {name: {mode: record(mesh, name, check_vma)
                      for mode, check_vma in (("typed", True), ("legacy", False))}
               for name in PROGRAMS}
    records["jax"] = jax.__version__
    Path(__file__).with_name("second_order.json").write_text(json.dumps(records, indent=1) + "\n")
