"""Records what JAX gives for the programs of ``tests/test_shard_map_modes.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``shard_map_modes.json``
beside it.

The mesh is ``init_mesh(tp=2, cp=2)``'s on 8 devices: axes ``('pp', 'dp', 'cp', 'tp')``
(Auto axis types); the expert view's ``edp`` is ``('dp', 'cp')``. A program on DTensors is
the same program on arrays (JAX has one kind). Per program and mode (``typed``:
``check_vma=True``, ``legacy``: ``False``) it keeps the global outputs (a dict's by sorted
key) and the gradient of ``loss_of(outputs)`` with respect to each input, or the text of
JAX's refusal.
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


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


CONSTANT = jnp.arange(4.0, dtype=jnp.float64)


def invariant_gather(x, axes, **options):
    return lax.all_gather(x, axes, to="invarying", **options)


def pvary(x, axes):
    return lax.pcast(x, axes, to="varying")


@jax.custom_jvp
def erf(x):
    return lax.erf(x)


@erf.defjvp
def erf_jvp(primals, tangents):
    """erf's derivative written out: JAX 0.12's own fails inside a typed body ('Primitive
    polynomial requires varying manual axes to match ... Please open an issue')."""
    (x,), (dx,) = primals, tangents
    return erf(x), 2 / np.sqrt(np.pi) * jnp.exp(-x * x) * dx


def gelu(x):
    """torch's default gelu, the exact one."""
    return x * (1 + erf(x / np.sqrt(2))) / 2


# name: (body, in_specs, out_specs, input shapes), as in test_shard_map_modes.CASES
CASES = {
    "row-parallel matmul": (lambda x, w: lax.psum(x @ w, "tp"), (P(None, "tp"), P("tp", None)),
                            P(), ((4, 6), (6, 3))),
    "column then row parallel mlp": (
        lambda x, up, down: lax.psum(gelu(x @ up) @ down, "tp"),
        (P(("dp", "cp")), P(None, "tp"), P("tp", None)), P(("dp", "cp")),
        ((8, 4), (4, 6), (6, 4))),
    "identity": (lambda x: x, P("tp"), P("tp"), ((8, 2),)),
    "replicated in and out": (lambda v: v * 2, P(), P(), ((3,),)),
    "replicated in, split out": (lambda v: v, P(), P("tp"), ((3,),)),
    "closed-over constant": (lambda x: x * CONSTANT, P("tp"), P("tp"), ((8, 4),)),
    "sequence gathered invariant": (lambda s: invariant_gather(s, ("cp", "dp"), tiled=True),
                                    P(("cp", "dp")), P(), ((8, 2),)),
    "gathered, still split": (lambda x: lax.all_gather(x, "tp", tiled=True), P("tp"), P("tp"),
                              ((4,),)),
    "psum_scatter of a replicated value": (lambda v: lax.psum_scatter(v, "tp", tiled=True), P(),
                                           P("tp"), ((4, 2),)),
    "psum_scatter of blocks": (lambda x: lax.psum_scatter(x, "tp", tiled=True), P("tp"),
                               P("tp"), ((8,),)),
    "all_to_all columns to rows": (lambda x: lax.all_to_all(x, "tp", 1, 0, tiled=True), P("tp"),
                                   P(None, "tp"), ((4, 4),)),
    "ppermute ring": (lambda x: lax.ppermute(x, "cp", ring(2)), P("cp"), P("cp"), ((4, 3),)),
    "pmean over dp": (lambda x: lax.pmean(x, "dp"), P("dp"), P(), ((4, 3),)),
    "psum over a tuple": (lambda x: lax.psum(x, ("cp", "dp")), P(("cp", "dp")), P(), ((8,),)),
    "axis_index weights": (lambda x: x * (lax.axis_index("tp") + 1), P("tp"), P("tp"),
                           ((4, 2),)),
    "expert view": (lambda x: lax.psum(x * 2, ("dp", "cp")), P(("dp", "cp")), P(), ((8,),)),
    "dict specs": (lambda d: {"y": d["a"] * 3}, ({"a": P("tp")},), {"y": P(("dp", "tp"))},
                   ((4,),)),
    "uneven rows": (lambda s: s + 1, P(("dp", "cp")), P(("dp", "cp")), ((5, 2),)),
    "DTensor arguments": (lambda x, w: lax.psum(x @ w, "tp"), (P(None, "tp"), P("tp", None)),
                          P(), ((4, 6), (6, 3))),
    "DTensor on a slice": (lambda x: x * 2, P("tp"), P("tp"), ((4, 3),)),
    "two results": (lambda x: (x, lax.psum(x, "tp")), P("tp"), (P("tp"), P()), ((4,),)),
    "explicit pvary": (lambda v: lax.psum(pvary(v, "tp") * (lax.axis_index("tp") + 1), "tp"),
                       P(), P(), ((3,),)),
    "megatron gather along the last dim": (
        lambda x: invariant_gather(x, "tp", axis=1, tiled=True), P(None, "tp"), P(), ((3, 4),)),
    "stacked gather, invariant": (lambda x: invariant_gather(x, "cp"), P("cp"), P(), ((4,),)),
    "all_gather under P()": (lambda s: lax.all_gather(s, ("cp", "dp"), tiled=True),
                             P(("cp", "dp")), P(), ((8, 2),)),
    "unsummed row-parallel": (lambda x, w: x @ w, (P(None, "tp"), P("tp", None)),
                              P(("dp", "cp", "tp")), ((4, 6), (6, 3))),
}


def inputs_of(shapes):
    return [jnp.sin(jnp.arange(int(np.prod(shape)), dtype=jnp.float64) * 0.37 + number)
            .reshape(shape) for number, shape in enumerate(shapes)]


def flat(outputs):
    if isinstance(outputs, dict):
        return [outputs[key] for key in sorted(outputs)]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def loss_of(outputs):
    return sum((value * (jnp.arange(value.size, dtype=value.dtype).reshape(value.shape)
                         + number + 1)).sum() for number, value in enumerate(outputs))


def record(mesh, name, check_vma):
    body, in_specs, out_specs, shapes = CASES[name]
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=check_vma)
    args = inputs_of(shapes)
    if name == "dict specs":
        def run(x):
            return flat(mapped({"a": x}))
    else:
        def run(*xs):
            return flat(mapped(*xs))
    try:
        outputs = run(*args)
        grads = jax.grad(lambda *xs: loss_of(run(*xs)), argnums=tuple(range(len(args))))(*args)
    except Exception as error:  # noqa: BLE001 - the refusal is what is recorded
        return {"refused": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {"outputs": [np.asarray(y).tolist() for y in outputs],
            "grads": [np.asarray(g).tolist() for g in grads]}


if __name__ == "__main__":
    mesh = jax.make_mesh((1, 2, 2, 2), ("pp", "dp", "cp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    records = {name: {mode: record(mesh, name, check_vma)
                      for mode, check_vma in (("typed", True), ("legacy", False))}
               for name in CASES}
    records["jax"] = jax.__version__
    Path(__file__).with_name("shard_map_modes.json").write_text(json.dumps(records, indent=1) + "\n")
