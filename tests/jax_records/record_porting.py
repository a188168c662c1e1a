"""Records what JAX gives for the programs of ``tests/test_porting.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write
``porting.json`` beside it. Each program uses the axis names JAX's documentation
uses; inputs are ``arange``-based so that both sides build them alike. Per program
it keeps the global result, the gradient of ``sum(result ** 2)`` with respect to
each input, and the type (``jax.typeof``) of the values the body names.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)


def inputs(*shapes):
    return [jnp.arange(1, 1 + n, dtype=jnp.float64).reshape(shape) / n
            for shape in shapes for n in [int(jnp.prod(jnp.array(shape)))]]


def ring(types):
    def body(x):
        n = jax.lax.psum(1, "i")
        y = jax.lax.ppermute(x, "i", [(j, (j + 1) % 4) for j in range(4)])
        z = y * (jax.lax.axis_index("i") + 1)
        mean = jax.lax.psum(z, "i") / n
        types.extend([str(jax.typeof(v)) for v in (y, z, mean)] + [str(n)])
        return z + mean
    return (4,), ("i",), body, (P("i"),), P("i"), inputs((8,))


def matmul(types):
    def body(a, b):
        partial_product = a @ b
        total = jax.lax.psum(partial_product, "y")
        types.extend([str(jax.typeof(v)) for v in (a, b, partial_product, total)])
        return total
    return (2, 2), ("x", "y"), body, (P("x", "y"), P("y", None)), P("x", None), inputs((4, 4), (4, 3))


def mlp(types):
    def body(x, w1, w2):
        hidden = jnp.tanh(x @ w1)
        y = jax.lax.psum(hidden @ w2, "feats")
        loss = jax.lax.psum(jnp.sum(y ** 2), "batch")
        types.extend([str(jax.typeof(v)) for v in (hidden, y, loss)])
        return loss
    return ((2, 2), ("batch", "feats"), body, (P("batch", None), P(None, "feats"), P("feats", None)),
            P(), inputs((4, 3), (3, 4), (4, 2)))


STAGES, MICROBATCHES, BATCH, FEATURES = 4, 4, 2, 3


def pipeline(types):
    def layer(w, x):
        return jnp.tanh(x @ w)

    def body(w, xs):
        stage = jax.lax.axis_index("stages")
        state = jnp.zeros((1, BATCH, FEATURES))
        outs = []
        for i in range(MICROBATCHES + STAGES - 1):
            if i < MICROBATCHES:
                state = jnp.where(stage == 0, xs[i][None], state)
            state = jax.vmap(layer)(w, state)
            if i == 0:
                types.append(str(jax.typeof(state)))
            outs.append(state[0])
            state = jax.lax.ppermute(state, "stages", [(j, (j + 1) % STAGES) for j in range(STAGES)])
        ys = jnp.stack(outs[STAGES - 1:])
        ys = jnp.where(stage == STAGES - 1, ys, jnp.zeros_like(ys))
        total = jax.lax.psum(ys, "stages")
        types.append(str(jax.typeof(total)))
        return total
    return ((4,), ("stages",), body, (P("stages"), P()), P(),
            inputs((STAGES, FEATURES, FEATURES), (MICROBATCHES, BATCH, FEATURES)))


def halves(types):
    def body(x):
        first, second = jnp.split(x, 2)
        swapped = jnp.concatenate([second * 2, first])
        types.extend([str(jax.typeof(v)) for v in (first, swapped)])
        return swapped
    return (2, 2), ("x", "y"), body, (P("x"),), P("x"), inputs((8, 2))


def remat(types):
    def body(a, b):
        summed = jax.checkpoint(lambda p, q: jax.lax.psum(jnp.tanh(p @ q), "y"))(a, b)
        scattered = jax.checkpoint(
            lambda p, q: jax.lax.psum_scatter(jnp.tanh(p @ q), "y", scatter_dimension=0, tiled=True)
        )(a, b)
        types.extend([str(jax.typeof(v)) for v in (summed, scattered)])
        return summed + jax.lax.all_gather(scattered, "y", axis=0, tiled=True, to="invarying")
    return (2, 2), ("x", "y"), body, (P(None, "y"), P("y", None)), P(), inputs((4, 4), (4, 4))


def collective_matmul(types):
    """The scaling book's collective matmul: the contracting dimension's blocks go round
    the ring with ppermute while each meets its rows of the right operand."""
    def body(lhs, rhs):
        n, index, chunk = jax.lax.axis_size("tp"), jax.lax.axis_index("tp"), lhs.shape[1]

        def rows_of(i):
            return jax.lax.dynamic_slice_in_dim(rhs, (index + i) % n * chunk, chunk, axis=0)

        accum = lhs @ rows_of(0)
        for i in range(1, n):
            lhs = jax.lax.ppermute(lhs, "tp", [(j, (j - 1) % n) for j in range(n)])
            accum = accum + lhs @ rows_of(i)
        mean = jax.lax.pmean(accum[:1], ("dp", "tp"))
        types.extend([str(jax.typeof(v)) for v in (accum, mean)])
        return accum + mean
    return ((2, 2), ("dp", "tp"), body, (P("dp", "tp"), P(None, "tp")), P("dp", "tp"),
            inputs((4, 8), (8, 6)))


PROGRAMS = {"ring": ring, "matmul": matmul, "mlp": mlp, "pipeline": pipeline,
            "halves": halves, "remat": remat, "collective_matmul": collective_matmul}


def record(name, program):
    types = []
    shape, names, body, in_specs, out_specs, args = program(types)
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    result = mapped(*args)
    traced = list(types)  # the grad below traces the body again
    grads = jax.grad(lambda *xs: jnp.sum(mapped(*xs) ** 2), argnums=tuple(range(len(args))))(*args)
    return {"result": result.tolist(), "grads": [g.tolist() for g in grads], "types": traced}


if __name__ == "__main__":
    records = {name: record(name, program) for name, program in PROGRAMS.items()}
    records["jax"] = jax.__version__
    Path(__file__).with_name("porting.json").write_text(json.dumps(records, indent=1) + "\n")
