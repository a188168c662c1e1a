"""Records what JAX gives for the programs of ``tests/test_vma.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) to write ``vma.json`` beside it.

The mesh is ``init_mesh(tp=2, cp=2)``'s: axes ``('pp', 'dp', 'cp', 'tp')`` (Auto axis types,
shard_map's plain-array world). It keeps:

- ``types``: ``jax.typeof`` of each value the type tests name, on 8 devices (dp=2), and
  the varying axes it reads as;
- ``refusals``: JAX's text for each collective the types refuse;
- ``inside``/``invariant``: each device's gradient taken inside the body with ``jax.grad``,
  ``check_vma`` True and False, on 4 devices (dp=1), the results laid out over
  ``('dp', 'cp', 'tp')`` as ``out_specs`` says (x = [1..8]; each device's loss weighted by
  its tp index + 1).

JAX 0.12 spells meshstate's ``pvary`` as ``pcast(..., to="varying")`` and
``all_gather_invariant`` as ``all_gather(..., to="invarying")``.
"""

import json
import os
import re
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)
lax = jax.lax
AUTO = jax.sharding.AxisType.Auto
NAMES = ("pp", "dp", "cp", "tp")


def mesh_of(dp):
    return jax.make_mesh((1, dp, 2, 2), NAMES, axis_types=(AUTO,) * 4,
                         devices=jax.devices()[: 4 * dp])


def pvary(x, axes):
    return lax.pcast(x, axes, to="varying")


def all_gather_invariant(x, axes, **options):
    return lax.all_gather(x, axes, to="invarying", **options)


def varying_axes(type_text):
    """``{'cp', 'tp'}`` from ``float32[4]{V:(cp,tp)}`` (an empty list for no ``{V:...}``)."""
    found = re.search(r"\{V:\(?([^)}]*)\)?\}", type_text)
    return sorted(found.group(1).split(",")) if found else []


def typed(calls):
    """Each call's type and varying axes, or the text of JAX's refusal."""
    types = {}
    for name, call in calls.items():
        try:
            text = str(jax.typeof(call()))
        except Exception as error:  # noqa: BLE001 - the refusal is what is recorded
            types[name] = {"refused": f"{type(error).__name__}: {error}"}
        else:
            types[name] = {"type": text, "vma": varying_axes(text)}
    return types


def inside(mesh, body, in_specs, out_specs=P(("dp", "cp", "tp")), **options):
    seen = []

    def record(*blocks):
        seen.append(body(*blocks))
        return blocks[0]

    args = [jnp.zeros(8, jnp.float32) for _ in (in_specs if isinstance(in_specs, tuple) else [0])]
    jax.shard_map(record, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **options)(*args)
    return seen[0]


def arguments_constants_and_ops(x, w):
    closed_over = jnp.ones(4, jnp.float32)
    both = x[:, None] * w
    return typed({
        "x": lambda: x, "w": lambda: w, "constant": lambda: jnp.ones(3, jnp.float32),
        "closed over": lambda: closed_over, "x * 2": lambda: x * 2,
        "x + constant": lambda: x + jnp.ones(4, jnp.float32), "x and w": lambda: both,
        "sum": lambda: both.sum(), "split": lambda: jnp.split(both, 4)[0],
        "max": lambda: x.max(0),
    })


def each_collective(x):
    ring = [(0, 1), (1, 0)]
    invariant = jnp.ones(4, jnp.float32)
    return typed({
        "psum": lambda: lax.psum(x, "tp"),
        "psum of invariant": lambda: lax.psum(invariant, "tp"),
        "psum over cp of tp": lambda: lax.psum(x, "cp"),
        "pmean": lambda: lax.pmean(x, "tp"),
        "pmax mixed": lambda: lax.pmax(x, ("cp", "tp")),
        "all_gather": lambda: lax.all_gather(x, "tp", tiled=True),
        "all_gather over cp": lambda: lax.all_gather(x, "cp"),
        "all_gather_invariant": lambda: all_gather_invariant(x, "tp", tiled=True),
        "all_gather_invariant of invariant": lambda: all_gather_invariant(invariant, "tp"),
        "psum_scatter": lambda: lax.psum_scatter(x, "tp", tiled=True),
        "psum_scatter of invariant": lambda: lax.psum_scatter(invariant, "cp", tiled=True),
        "all_to_all": lambda: lax.all_to_all(x, "tp", 0, 0, tiled=True),
        "ppermute": lambda: lax.ppermute(x, "tp", ring),
        "ppermute of invariant": lambda: lax.ppermute(invariant, "cp", ring),
        "pvary": lambda: pvary(x, "cp"),
        "pvary joint key": lambda: pvary(invariant, ("dp", "cp")),
        "axis_index": lambda: lax.axis_index(("cp", "dp")),
        "axis_index times x": lambda: x * lax.axis_index("cp"),
    })


REFUSED = {
    "psum": lambda x: lax.psum(x, ("cp", "tp")),
    "pmean": lambda x: lax.pmean(x, ("dp", "tp")),
    "psum_scatter": lambda x: lax.psum_scatter(x, ("tp", "cp"), tiled=True),
    "pvary": lambda x: pvary(x, ("cp", "tp")),
}


def refusal(mesh, call):
    def body(x):
        try:
            call(x)
        except Exception as error:  # noqa: BLE001 - the text is what is recorded
            return f"{type(error).__name__}: {error}"
        return None
    return inside(mesh, body, P("tp"))


def out_spec_refusal(mesh):
    try:
        jax.shard_map(lambda x: {"a": (x, lax.all_gather(x, "tp", tiled=True))}, mesh=mesh,
                      in_specs=P("tp"), out_specs={"a": (P("tp"), P())})(jnp.arange(8.0))
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return None


RING = [(0, 1)]
INSIDE = {
    "psum weighted after": lambda v, w: lax.psum(v, "tp") * w,
    "psum weighted before": lambda v, w: lax.psum(v * w, "tp"),
    "pmean weighted after": lambda v, w: lax.pmean(v, "tp") * w,
    "pmean weighted before": lambda v, w: lax.pmean(v * w, "tp"),
    "psum over cp of a tp block": lambda v, w: lax.psum(v * w, "cp"),
    "all_gather": lambda v, w: lax.all_gather(v, "tp", tiled=True) * w,
    "all_gather over cp": lambda v, w: lax.all_gather(v * w, "cp", tiled=True),
    "all_gather_invariant": lambda v, w: all_gather_invariant(v, "tp", tiled=True) * w,
    "psum_scatter": lambda v, w: lax.psum_scatter(v, "tp", tiled=True) * w,
    "ppermute": lambda v, w: lax.ppermute(v, "tp", RING) * w,
    "all_to_all": lambda v, w: lax.all_to_all(v, "tp", 0, 0, tiled=True) * w,
}
INVARIANT = {
    "pvary": lambda v, w: pvary(v, "tp") * w,
    "cast up by the product": lambda v, w: v * w,
}


def gradient_inside(mesh, op, check_vma, in_spec):
    def body(v):
        weight = jnp.ones((), jnp.float64) * (lax.axis_index("tp") + 1)
        return jax.grad(lambda u: op(u, weight).sum())(v)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=P(("dp", "cp", "tp")),
                           check_vma=check_vma)
    return np.asarray(mapped(jnp.arange(1.0, 9.0, dtype=jnp.float64))).tolist()


def gradients(mesh, programs, in_spec):
    return {name: {mode: gradient_inside(mesh, op, check_vma, in_spec)
                   for mode, check_vma in (("typed", True), ("legacy", False))}
            for name, op in programs.items()}


if __name__ == "__main__":
    eight, four = mesh_of(2), mesh_of(1)
    records = {
        "types": {
            "arguments, constants and ops": inside(eight, arguments_constants_and_ops,
                                                   (P("tp"), P("cp"))),
            "each collective": inside(eight, each_collective, P("tp")),
        },
        "refusals": {name: refusal(eight, call) for name, call in REFUSED.items()},
        "out_specs refusal": out_spec_refusal(eight),
        "inside": gradients(four, INSIDE, P("tp")),
        "invariant": gradients(four, INVARIANT, P()),
        "jax": jax.__version__,
    }
    Path(__file__).with_name("vma.json").write_text(json.dumps(records, indent=1) + "\n")
