"""meshstate.megatron.install(): megatron-core's own tensor-parallel code on meshstate's groups.

The oracle is the same run on megatron-core's own ``parallel_state``: outputs and
gradients must be equal. The "before" run gets a fresh 4-rank world (spawned
processes), so it really installs before megatron-core is first imported; the
"after" run follows the reference run in the world that imported megatron-core.
"""

import importlib
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate.megatron import parallel_state as meshstate_parallel_state
from meshstate.testing.launch import LocalWorld
from meshstate.megatron import install, uninstall

WORLD_SIZE = 4
TP_SIZES = (2, 4)
SEQUENCE, BATCH, HIDDEN, FFN, VOCAB = 5, 3, 8, 12, 16


def import_megatron_tensor_parallel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
        from megatron.core import ModelParallelConfig, tensor_parallel
    return ModelParallelConfig, tensor_parallel


def tensor_parallel_step(tp):
    """An MLP and a vocab-parallel loss on megatron-core's layers; every output and gradient.

    The column layer finds its group through ``parallel_state``, the row layer
    through a ``HyperCommGrid``, the head through a ``ProcessGroupCollection``,
    the loss through the getters ``cross_entropy`` imported by name.
    """
    ModelParallelConfig, tensor_parallel = import_megatron_tensor_parallel()
    from megatron.core import parallel_state as mpu
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
    )
    grid = HyperCommGrid([tp, WORLD_SIZE // tp], ["tp", "dp"])
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    torch.manual_seed(0)  # the same full weights on every rank; each keeps its shard
    layers = {
        "column": tensor_parallel.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=torch.nn.init.normal_, gather_output=False),
        "row": tensor_parallel.RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=torch.nn.init.normal_, bias=True,
            input_is_parallel=True, skip_bias_add=False, tp_group=grid.create_pg(["tp"])),
        "head": tensor_parallel.ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
            tp_group=pg_collection.tp),
    }
    torch.manual_seed(1 + mpu.get_data_parallel_rank())  # one batch per data-parallel replica
    inputs = torch.randn(SEQUENCE, BATCH, HIDDEN, requires_grad=True)
    targets = torch.randint(VOCAB, (SEQUENCE, BATCH))

    warnings.filterwarnings("ignore", "When using async grad allreduce")  # a CUDA tuning hint
    hidden, _ = layers["column"](inputs)
    outputs, _ = layers["row"](torch.nn.functional.gelu(hidden))
    logits, _ = layers["head"](outputs)
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    losses.sum().backward()
    return {
        "outputs": outputs.detach(),
        "losses": losses.detach(),
        "inputs.grad": inputs.grad,
        **{f"{name}.tp_group_ranks": torch.tensor(dist.get_process_group_ranks(layer.tp_group))
           for name, layer in layers.items()},
        **{f"{name}.{p}": param for name, layer in layers.items()
           for p, param in layer.named_parameters()},
        **{f"{name}.{p}.grad": param.grad for name, layer in layers.items()
           for p, param in layer.named_parameters()},
    }


def run_megatron_layers(mode):
    """``tensor_parallel_step`` for each tp size, with install() per ``mode``:
    "before" megatron-core is imported, "after" it, or "megatron" (never)."""
    if mode == "before":
        # Workers fork from a copy of pytest, which imported megatron-core (conftest's oracle):
        # forget it, so this worker imports it afresh, after install().
        for name in [name for name in sys.modules if name.split(".")[0] == "megatron"]:
            del sys.modules[name]
        assert "megatron" not in sys.modules
        install()
        assert "megatron" not in sys.modules  # install() itself never imports megatron-core
    import_megatron_tensor_parallel()
    megatron_parallel_state = sys.modules["megatron.core.parallel_state"]
    if mode == "after":
        install()
    from megatron.core import parallel_state as mpu

    results = {}
    for tp in TP_SIZES:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
        if mode != "megatron":
            from megatron.core.hyper_comm_grid import HyperCommGrid
            from megatron.core.process_groups_config import ProcessGroupCollection

            assert mpu is meshstate_parallel_state
            assert mpu.get_tensor_model_parallel_group() is mpu.get_mesh().group("tp")
            assert HyperCommGrid is meshstate.HyperCommGrid
            assert ProcessGroupCollection is meshstate.ProcessGroupCollection
        if mode == "after":
            assert not megatron_parallel_state.model_parallel_is_initialized()
        results[tp] = tensor_parallel_step(tp)
        mpu.destroy_model_parallel()
    return results


def uninstall_restores_megatron_core():
    """After a before-import install(): megatron-core's own parallel_state is loaded
    and every megatron module points at it again."""
    uninstall()
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import cross_entropy, layers

    assert parallel_state is not meshstate_parallel_state
    assert megatron.core.mpu is parallel_state
    assert layers.get_tensor_model_parallel_rank is parallel_state.get_tensor_model_parallel_rank
    assert cross_entropy.get_tensor_model_parallel_group is (
        parallel_state.get_tensor_model_parallel_group)
    assert HyperCommGrid is not meshstate.HyperCommGrid
    assert ProcessGroupCollection is not meshstate.ProcessGroupCollection


def run_in_fresh_world(*bodies):
    with LocalWorld(WORLD_SIZE) as world:
        return [world.run(body, *args) for body, *args in bodies]


@pytest.fixture(scope="module")
def reference_then_after_import():
    """megatron-core's own run, then install() in the same (megatron-importing) world."""
    return run_in_fresh_world((run_megatron_layers, "megatron"), (run_megatron_layers, "after"))


def assert_same_results(got, want):
    for rank, (got_by_tp, want_by_tp) in enumerate(zip(got, want, strict=True)):
        for tp in TP_SIZES:
            assert got_by_tp[tp].keys() == want_by_tp[tp].keys()
            for name, expected in want_by_tp[tp].items():
                assert torch.equal(got_by_tp[tp][name], expected), (rank, tp, name)


def test_install_before_megatron_is_imported_matches_megatron(reference_then_after_import):
    reference, _ = reference_then_after_import
    results, _ = run_in_fresh_world(
        (run_megatron_layers, "before"), (uninstall_restores_megatron_core,))
    assert_same_results(results, reference)


def test_install_after_megatron_is_imported_matches_megatron(reference_then_after_import):
    reference, results = reference_then_after_import
    assert_same_results(results, reference)


def test_the_reference_is_tensor_parallel(reference_then_after_import):
    megatron_reference, _ = reference_then_after_import
    tp = TP_SIZES[0]
    for layer in ("column", "row", "head"):
        assert [r[tp][f"{layer}.tp_group_ranks"].tolist() for r in megatron_reference] == [
            [0, 1], [0, 1], [2, 3], [2, 3]]
    assert megatron_reference[0][tp]["column.weight"].shape == (FFN // tp, HIDDEN)
    assert not torch.equal(megatron_reference[0][tp]["column.weight"],
                           megatron_reference[1][tp]["column.weight"])


def test_install_after_import_rebinds_every_holder_and_uninstall_restores():
    _, tensor_parallel = import_megatron_tensor_parallel()
    import megatron.core
    from megatron.core import hyper_comm_grid, process_groups_config
    from megatron.core.pipeline_parallel import bridge_communicator
    from megatron.core.tensor_parallel import layers

    megatron_parallel_state = sys.modules["megatron.core.parallel_state"]
    megatron_grid = hyper_comm_grid.HyperCommGrid
    megatron_collection = process_groups_config.ProcessGroupCollection
    install()
    try:
        install()  # a second call changes nothing
        assert sum(type(f).__name__ == "_MegatronHook" for f in sys.meta_path) == 1
        assert importlib.import_module("megatron.core.parallel_state") is meshstate_parallel_state
        assert megatron.core.parallel_state is meshstate_parallel_state
        assert megatron.core.mpu is meshstate_parallel_state
        assert process_groups_config.parallel_state is meshstate_parallel_state
        assert layers.get_tensor_model_parallel_rank is (
            meshstate_parallel_state.get_tensor_model_parallel_rank)
        assert tensor_parallel.vocab_parallel_cross_entropy.__globals__[
            "get_tensor_model_parallel_group"] is (
            meshstate_parallel_state.get_tensor_model_parallel_group)
        assert bridge_communicator.HyperCommGrid is meshstate.HyperCommGrid
        assert hyper_comm_grid.HyperCommGrid is meshstate.HyperCommGrid
        assert process_groups_config.ProcessGroupCollection is meshstate.ProcessGroupCollection
        from megatron.core.parallel_state import get_mesh

        assert get_mesh is meshstate_parallel_state.get_mesh
    finally:
        uninstall()
    uninstall()  # a second call changes nothing
    assert not any(type(f).__name__ == "_MegatronHook" for f in sys.meta_path)
    assert sys.modules["megatron.core.parallel_state"] is megatron_parallel_state
    assert megatron.core.parallel_state is megatron_parallel_state
    assert megatron.core.mpu is megatron_parallel_state
    assert layers.get_tensor_model_parallel_rank is (
        megatron_parallel_state.get_tensor_model_parallel_rank)
    assert bridge_communicator.HyperCommGrid is megatron_grid
    assert hyper_comm_grid.HyperCommGrid is megatron_grid
    assert process_groups_config.ProcessGroupCollection is megatron_collection


def test_install_rebinds_user_modules_not_meshstate_and_uninstall_restores_only_that():
    import_megatron_tensor_parallel()
    megatron_parallel_state = sys.modules["megatron.core.parallel_state"]
    user_module = type(sys)("training_script")       # `from megatron.core import parallel_state`
    user_module.mpu = megatron_parallel_state
    user_module.get_rank = megatron_parallel_state.get_tensor_model_parallel_rank
    user_module.chosen = meshstate_parallel_state     # `from meshstate.megatron import parallel_state`
    own_module = type(sys)("meshstate.probe")          # meshstate keeps megatron-core's as is
    own_module.mpu = megatron_parallel_state
    sys.modules.update({"training_script": user_module, "meshstate.probe": own_module})
    try:
        install()
        assert user_module.mpu is meshstate_parallel_state
        assert user_module.get_rank is meshstate_parallel_state.get_tensor_model_parallel_rank
        assert own_module.mpu is megatron_parallel_state
        uninstall()
        assert user_module.mpu is megatron_parallel_state
        assert user_module.get_rank is megatron_parallel_state.get_tensor_model_parallel_rank
        assert user_module.chosen is meshstate_parallel_state
    finally:
        uninstall()
        del sys.modules["training_script"], sys.modules["meshstate.probe"]
