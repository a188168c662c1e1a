"""Records what JAX gives for the partial-manual programs of ``tests/test_partial_manual.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``partial_manual.json``
beside it.

The mesh is ``init_mesh(tp=2, cp=2)``'s on 8 devices: axes ``('pp', 'dp', 'cp', 'tp')``,
Auto axis types. Each program is ``jax.shard_map(body, in_specs=, out_specs=,
axis_names=...)``: manual over ``axis_names`` only, global over the other axes. Per program
and mode (``typed``: ``check_vma=True``, ``legacy``: ``False``) it keeps the global outputs,
the gradient of ``loss_of(outputs)`` with respect to each input and the types the body
noted (``jax.typeof`` of each value it passed to ``note``), or the first line of JAX's
refusal. ``"mlp training"`` keeps the losses and weights of 3 SGD steps of a column- then
row-parallel MLP manual over tp, its weights and batch global over dp (FSDP2's).
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
NOTED = []


def note(x):
    """Keep ``x``'s type as JAX prints it; ``x`` unchanged."""
    NOTED.append(str(jax.typeof(x)))
    return x


def pvary(x, axes):
    return lax.pcast(x, axes, to="varying")


def invariant_gather(x, axes, **options):
    return lax.all_gather(x, axes, to="invarying", **options)


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def mlp(x, up, down):
    """Column- then row-parallel MLP over tp (tanh: JAX 0.12's erf fails inside a typed
    body)."""
    hidden = note(jnp.tanh(note(x @ up)))
    return lax.psum(note(hidden @ down), "tp")


TP = {"tp"}
# name: (body, in_specs, out_specs, axis_names, input shapes), as in test_partial_manual.CASES
CASES = {
    "row-parallel matmul": (lambda x, w: lax.psum(note(note(x) @ w), "tp"),
                            (P(None, "tp"), P("tp", None)), P(), TP, ((8, 6), (6, 3))),
    "column then row parallel mlp": (mlp, (P(), P(None, "tp"), P("tp", None)), P(), TP,
                                     ((8, 4), (4, 8), (8, 4))),
    "identity": (lambda x: note(x), P("tp"), P("tp"), TP, ((8, 2),)),
    "replicated in and out": (lambda v: note(v * 2), P(), P(), TP, ((4, 3),)),
    "replicated in, split out": (lambda v: v, P(), P(None, "tp"), TP, ((4, 3),)),
    "gathered over tp": (lambda x: note(invariant_gather(x, "tp", axis=1, tiled=True)),
                         P(None, "tp"), P(), TP, ((4, 4),)),
    "psum_scatter over tp": (lambda v: note(lax.psum_scatter(v, "tp", scatter_dimension=1,
                                                             tiled=True)),
                             P(), P(None, "tp"), TP, ((4, 4),)),
    "all_to_all over tp": (lambda x: lax.all_to_all(x, "tp", 0, 1, tiled=True), P(None, "tp"),
                           P("tp"), TP, ((4, 4),)),
    "ppermute over cp": (lambda x: lax.ppermute(x, "cp", ring(2)), P(None, "cp"),
                         P(None, "cp"), {"cp"}, ((4, 6),)),
    "manual over cp and tp": (lambda x: note(lax.psum(x, ("cp", "tp"))), P(None, ("cp", "tp")),
                              P(), {"cp", "tp"}, ((4, 8),)),
    "axis_index weights": (lambda x: note(x * (lax.axis_index("tp") + 1)), P(None, "tp"),
                           P(None, "tp"), TP, ((4, 4),)),
    "sum over a global dim": (lambda x: note(note(x).sum(0)), P(None, "tp"), P("tp"), TP,
                              ((8, 4),)),
    "manual over dp only": (lambda x: note(lax.pmean(x, "dp")), P("dp"), P(), {"dp"},
                            ((8, 3),)),
    "two results": (lambda x: (x, lax.psum(x, "tp")), P(None, "tp"), (P(None, "tp"), P()),
                    TP, ((4, 4),)),
    "dict specs": (lambda d: {"y": d["a"] * 3}, ({"a": P(None, "tp")},), {"y": P(None, "tp")},
                   TP, ((4, 4),)),
    "explicit pvary": (lambda v: lax.psum(note(pvary(v, "tp")) * (lax.axis_index("tp") + 1),
                                          "tp"), P(), P(), TP, ((3, 2),)),
    "psum over dp refused": (lambda x: lax.psum(x, "dp"), P(None, "tp"), P(None, "tp"), TP,
                             ((4, 4),)),
    "axis_index of dp refused": (lambda x: x * lax.axis_index("dp"), P(None, "tp"),
                                 P(None, "tp"), TP, ((4, 4),)),
    "all_gather over dp refused": (lambda x: lax.all_gather(x, "dp"), P(None, "tp"),
                                   P(None, "tp"), TP, ((4, 4),)),
    "psum over dp and tp refused": (lambda x: lax.psum(x, ("dp", "tp")), P(None, "tp"), P(), TP,
                                    ((4, 4),)),
    "in_specs naming dp refused": (lambda x: x, P("dp"), P("dp"), TP, ((4, 4),)),
    "out_specs naming dp refused": (lambda x: x, P(None, "tp"), P("dp"), TP, ((4, 4),)),
    "varying result under P() refused": (lambda x: x, P(None, "tp"), P(), TP, ((4, 4),)),
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
    body, in_specs, out_specs, axis_names, shapes = CASES[name]
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=axis_names, check_vma=check_vma)
    args = inputs_of(shapes)
    if name == "dict specs":
        def run(x):
            return flat(mapped({"a": x}))
    else:
        def run(*xs):
            return flat(mapped(*xs))
    NOTED.clear()
    try:
        outputs = run(*args)
        types = list(NOTED)
        grads = jax.grad(lambda *xs: loss_of(run(*xs)), argnums=tuple(range(len(args))))(*args)
    except Exception as error:  # noqa: BLE001 - the refusal is what is recorded
        return {"refused": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {"outputs": [np.asarray(y).tolist() for y in outputs],
            "grads": [np.asarray(g).tolist() for g in grads],
            "types": types if check_vma else []}


def mlp_training(mesh, steps=3, learning_rate=0.1):
    """3 SGD steps of ``mlp`` manual over tp; the batch and weights are global over dp
    (in torch: FSDP2-sharded over dp)."""
    step_mlp = jax.shard_map(mlp, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)),
                             out_specs=P(), axis_names=TP)
    x, up, down = inputs_of(((8, 4), (4, 8), (8, 4)))

    def loss(up, down):
        return (step_mlp(x, up, down) ** 2).mean()

    losses = []
    for _ in range(steps):
        value, (d_up, d_down) = jax.value_and_grad(loss, argnums=(0, 1))(up, down)
        losses.append(float(value))
        up, down = up - learning_rate * d_up, down - learning_rate * d_down
    return {"losses": losses, "up": np.asarray(up).tolist(), "down": np.asarray(down).tolist()}


if __name__ == "__main__":
    mesh = jax.make_mesh((1, 2, 2, 2), ("pp", "dp", "cp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    records = {name: {mode: record(mesh, name, check_vma)
                      for mode, check_vma in (("typed", True), ("legacy", False))}
               for name in CASES}
    records["mlp training"] = mlp_training(mesh)
    records["jax"] = jax.__version__
    Path(__file__).with_name("partial_manual.json").write_text(json.dumps(records, indent=1) + "\n")
