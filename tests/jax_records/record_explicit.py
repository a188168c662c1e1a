"""Records what JAX gives for the programs of ``explicit_programs.py``.

Not a test: run it in a virtual environment of its own with ``jax==0.12.0.1`` (Python 3.12)
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set below) to write
``explicit.json`` beside it. Each program runs under ``jax.jit`` on a mesh of
Explicit axes, device ``i`` at the ``i``-th row-major coordinate. Per program it
keeps the type (``jax.typeof``), shape and dtype of ``out``, and either its global
value and each device's shard index, or, for a result with unreduced axes, the
data each device holds; or the class and message of the error JAX raised.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from explicit_programs import INPUTS, MESH_AXES, MESH_SHAPE, PROGRAMS, input_values, int_values  # noqa: E402


def with_out(f):
    return lambda *args, out=None: f(*args, **({} if out is None else {"out_sharding": out}))


NAMESPACE = {
    "S": lambda *dims, unreduced=(): PartitionSpec(*dims, unreduced=set(unreduced)),
    "put": jax.sharding.reshard,
    "reshard": jax.sharding.reshard,
    "matmul": with_out(jnp.matmul),
    "einsum": with_out(jnp.einsum),
    "sum": lambda a, dims, keepdim=False: jnp.sum(a, axis=dims, keepdims=keepdim),
    "mean": lambda a, dims, keepdim=False: jnp.mean(a, axis=dims, keepdims=keepdim),
    "amax": lambda a, dims, keepdim=False: jnp.max(a, axis=dims, keepdims=keepdim),
    "sin": jnp.sin,
    "exp": jnp.exp,
    "tanh": jnp.tanh,
    "gelu": lambda a: jax.nn.gelu(a, approximate=True),
    "maximum": jnp.maximum,
    "permute": jnp.transpose,
    "unsqueeze": jnp.expand_dims,
    "cat": jnp.concatenate,
    "cast": lambda a, name: a.astype(name),
    "auto": lambda f, out: jax.sharding.auto_axes(f, out_sharding=out),
    "explicit": lambda f, into: jax.sharding.explicit_axes(f, in_sharding=into),
}


def inputs():
    values = {}
    for number, (name, (shape, dtype)) in enumerate(INPUTS.items()):
        size = int(np.prod(shape))
        flat = int_values(number, size) if dtype == "int32" else input_values(number, size)
        values[name] = jax.device_put(np.array(flat, dtype=dtype).reshape(shape), PartitionSpec())
    return values


def as_list(data):
    data = np.asarray(data)
    if data.dtype.kind in "iub":
        return data.tolist()
    data = data.astype(np.float32)
    return np.vectorize(lambda v: float(str(v)), otypes=[object])(data).tolist() if data.ndim else float(str(data))


def run(source, args):
    def body(args):
        namespace = dict(NAMESPACE, **args)
        exec(source, namespace)
        return namespace["out"]
    return jax.jit(body)(args)


def record(source, args):
    try:
        out = run(source, args)
        jax.block_until_ready(out)
    except Exception as e:  # noqa: BLE001 - the error is what gets recorded
        return {"error": type(e).__name__, "message": str(e)}
    entry = {"type": str(jax.typeof(out)), "shape": list(out.shape), "dtype": out.dtype.name}
    if out.aval.sharding.spec.unreduced:
        entry["locals"] = {str(s.device.id): as_list(s.data) for s in out.addressable_shards}
    else:
        entry["value"] = as_list(out)
        indices = out.sharding.devices_indices_map(out.shape)
        entry["index"] = {str(d.id): [list(sl.indices(n)[:2]) for sl, n in zip(index, out.shape)]
                          for d, index in indices.items()}
    return entry


if __name__ == "__main__":
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), MESH_AXES,
                             axis_types=(AxisType.Explicit,) * len(MESH_AXES))
    records = {"_jax_version": jax.__version__}
    with jax.set_mesh(mesh):
        args = inputs()
        for name, source in PROGRAMS.items():
            records[name] = entry = record(source, args)
            said = entry.get("type") or f"{entry['error']}: {entry['message'][:100]!r}"
            print(f"{name}: {said}")
    Path(__file__).with_name("explicit.json").write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
