"""The JAX layer and the getters in one process for every rank: the same answers as processes.

``simulated_world(8).run(body)`` must equal ``local_world(8).run(body)`` rank by rank
for a body that calls every collective over one axis, a joint key and a tuple no key
declares, ``shard_map`` on plain and DTensor arguments (both modes), ``reshard``, and
the Megatron getters; each rank-dependent value (``axis_index``, ``ppermute``'s
exchange, each rank's block of ``shard_map`` and ``reshard``, the first copies of an
uneven ``shard_map``) is among them.
"""

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import P, SimulationError, reshard, shard_map
from meshstate.jax import collectives as lax
from meshstate.megatron import parallel_state as mpu
from meshstate.testing import local_world, simulated_world

AXES = {"one axis": "tp", "joint key": "dp-cp", "undeclared tuple": ("pp", "cp")}
"""init_mesh(tp=2, cp=2, pp=2) on 8 ranks (dp=1): pp-cp is no key of the mesh."""


def every_collective(axes):
    """Each collective over ``axes`` on a value that differs by rank, with its gradient."""
    rank = torch.full((), dist.get_rank(), dtype=torch.float64)
    n = lax.axis_size(axes)
    x = (torch.arange(2.0 * n, dtype=torch.float64) + 10 * rank).requires_grad_()
    weights = torch.arange(1.0, 2 * n + 1, dtype=torch.float64) * (rank + 1)
    results = {
        "axis_index": torch.full((), lax.axis_index(axes)),
        "psum": lax.psum(x, axes),
        "pmean": lax.pmean(x, axes),
        "pmax": lax.pmax(x.detach(), axes),
        "pvary": lax.pvary(x, axes),
        "all_gather": lax.all_gather(x, axes, tiled=True)[: 2 * n],
        "all_gather_invariant": lax.all_gather_invariant(x, axes, tiled=True)[: 2 * n],
        "psum_scatter": lax.psum_scatter(x, axes, tiled=True).repeat(n),
        "all_to_all": lax.all_to_all(x, axes, 0, 0, tiled=True),
        "ppermute ring": lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)]),
        "ppermute one way": lax.ppermute(x, axes, [(0, n - 1)]),
    }
    loss = sum((value * weights).sum() for name, value in results.items()
               if name not in ("axis_index", "pmax"))
    loss.backward()
    return {**{name: value.detach() for name, value in results.items()}, "grad": x.grad}


def jax_layer_and_getters():
    mesh = meshstate.init_mesh(tp=2, cp=2, pp=2)
    answers = {}
    with mesh:
        for label, axes in AXES.items():
            answers.update({f"{label}: {name}": value
                            for name, value in every_collective(axes).items()})
        table = torch.arange(32.0, dtype=torch.float64).view(8, 4)
        for check_vma in (True, False):
            row_parallel = shard_map(lambda x, w: lax.psum(x @ w, "tp"),
                                     in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(),
                                     check_vma=check_vma)
            x, w = table.clone().requires_grad_(), table.T.clone().requires_grad_()
            y = row_parallel(x, w).to_local()
            y.sum().backward()
            blocks = shard_map(lambda b: b * (lax.axis_index(("cp", "tp")) + 1),
                               in_specs=P(("cp", "tp")), out_specs=P(("cp", "tp")),
                               check_vma=check_vma)
            answers[f"shard_map {check_vma}"] = (y, x.grad, w.grad, blocks(table).to_local())
            dtensors = row_parallel(reshard(table, P(None, "tp")), reshard(table.T, P("tp", None)))
            answers[f"shard_map DTensors {check_vma}"] = dtensors.to_local()
        uneven = shard_map(lambda s: s + 1, in_specs=P(("pp", "cp")), out_specs=P(("pp", "cp")))
        answers["uneven shard_map"] = uneven(torch.arange(10.0).view(5, 2)).to_local()
        rows = reshard(table, P(("cp", "pp"), "tp"))
        answers["reshard"] = (rows.to_local(), reshard(rows, P(None, ("tp", "pp"))).to_local())
    mesh.destroy()
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    answers["getters"] = tuple(torch.full((), getter()) for getter in (
        mpu.get_tensor_model_parallel_rank, mpu.get_pipeline_model_parallel_rank,
        mpu.get_data_parallel_rank, mpu.get_tensor_model_parallel_src_rank,
        mpu.get_pipeline_model_parallel_next_rank, mpu.get_pipeline_model_parallel_prev_rank,
        lambda: mpu.get_data_parallel_src_rank(with_context_parallel=True),
    ))
    mpu.destroy_model_parallel()
    return {key: [value.detach() for value in flat(answer)] for key, answer in answers.items()}


def flat(value):
    if isinstance(value, dict):
        return [item for key in sorted(value) for item in flat(value[key])]
    if isinstance(value, (tuple, list)):
        return [item for part in value for item in flat(part)]
    return [value]


def test_every_rank_in_one_process_answers_as_processes_do():
    simulated = simulated_world(8).run(jax_layer_and_getters)
    processes = local_world(8).run(jax_layer_and_getters)
    keys = sorted(processes[0])
    for rank, (mine, theirs) in enumerate(zip(simulated, processes)):
        assert sorted(mine) == keys
        for key in keys:
            assert len(mine[key]) == len(theirs[key]), (rank, key)
            for got, want in zip(mine[key], theirs[key]):
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), (rank, key)


def test_a_tensor_made_before_the_world_is_refused_by_a_collective():
    made_outside = torch.ones(2)

    def body():
        mesh = meshstate.init_mesh(tp=2)
        with mesh:
            return lax.psum(made_outside, "tp")

    with pytest.raises(SimulationError, match="made outside the simulated world"):
        simulated_world(4).run(body)
