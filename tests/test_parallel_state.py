"""meshstate.megatron.parallel_state against megatron-core's, getter by getter, rank by rank.

Both run in this process on torch's fake backend; group objects compare by
their ranks. megatron-core is the oracle.
"""

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist

from meshstate.megatron import parallel_state as ours
from meshstate.errors import NotInitializedError
from meshstate.megatron.errors import ParallelStateError
from meshstate.testing import fake_world

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as megatron

# megatron-core 0.19's surface: GTP weight remat, no separate all-gather group in init.
NEWER = hasattr(megatron, "get_gtp_weight_remat_group")
GTP_OPTIONS = [dict(with_gtp_remat=False), dict(with_gtp_remat=True)] if NEWER else [{}]

# Public names megatron-core's module has that ours leaves out, and why.
NOT_API = {
    "Callable": "typing import",
    "List": "typing import",
    "Optional": "typing import",
    "einops": "module import",
    "logging": "module import",
    "np": "module import",
    "os": "module import",
    "torch": "module import",
    "warnings": "module import",
    "log2": "math import",
    "timedelta": "datetime import",
    "is_torch_min_version": "megatron.core.utils helper imported into the module",
    "HAVE_EINOPS": "import flag; einops is a meshstate dependency",
    "SymmetricMemoryManager": "megatron.core.inference class imported into the module (0.19)",
}
# Public names only ours has.
OURS_ONLY = {"get_mesh": "the ParallelMesh behind every getter"}


def test_every_public_name_of_megatron_exists_in_ours():
    megatron_names = {n for n in dir(megatron) if not n.startswith("_")}
    our_names = {n for n in dir(ours) if not n.startswith("_")} | set(ours.__all__)
    missing = megatron_names - our_names - set(NOT_API)
    assert not missing, missing
    extra = set(ours.__all__) - megatron_names
    assert extra == set(OURS_ONLY), extra


def test_functions_keep_megatron_parameters_and_defaults():
    for name in ours.__all__:
        theirs = getattr(megatron, name, None)
        if not inspect.isfunction(theirs):
            continue
        expected = [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]
        got = [(p.name, p.default) for p in inspect.signature(getattr(ours, name)).parameters.values()]
        assert got == expected, name


MODULE_NAMES = [
    n for n in dir(megatron)
    if n.startswith("_") and n.upper() == n and n.strip("_")
    and n not in ("_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER")
]


def ranks_of(value):
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)), dist.get_rank(value))
    if isinstance(value, (list, tuple)):
        return [ranks_of(item) for item in value]
    if isinstance(value, dict):
        return {key: ranks_of(item) for key, item in value.items()}
    return value


def calls(vpp, hybrid_sizes):
    yield "get_model_parallel_group", {}
    yield "get_tensor_model_parallel_group", {}
    yield "get_pipeline_model_parallel_group", {}
    for wcp in (False, True):
        for partial in (False, True):
            for gtp in GTP_OPTIONS:
                options = dict(with_context_parallel=wcp, partial_data_parallel=partial, **gtp)
                yield "get_data_parallel_group", options
                yield "get_data_parallel_world_size", options
                yield "get_data_parallel_rank", options
        yield "get_data_parallel_src_rank", dict(with_context_parallel=wcp)
        yield "get_tensor_and_data_parallel_group", dict(with_context_parallel=wcp)
        for tp_only in (False, True):
            yield "get_amax_reduction_group", dict(with_context_parallel=wcp, tp_only_amax_red=tp_only)
    if NEWER:
        yield "get_expert_tensor_model_pipeline_parallel_group", dict(with_egtp_remat=True)
        for name in ("get_gtp_weight_remat_group", "get_gtp_weight_remat_global_ranks",
                     "get_expert_gtp_weight_remat_group", "get_expert_gtp_weight_remat_global_ranks"):
            yield name, {}
            yield name, dict(check_initialized=False)
        for name in ("get_gtp_weight_remat_world_size", "get_gtp_weight_remat_rank",
                     "get_expert_gtp_weight_remat_world_size", "get_expert_gtp_weight_remat_rank"):
            yield name, {}
    else:
        yield "get_data_parallel_group", dict(with_context_parallel=True, independent_all_gather=True)
        yield "has_separate_all_gather_group", {}
    for name in (
        "get_context_parallel_group", "get_context_parallel_global_ranks",
        "get_tensor_and_context_parallel_group", "get_expert_model_parallel_group",
        "get_expert_tensor_parallel_group", "get_expert_tensor_and_model_parallel_group",
        "get_expert_tensor_model_pipeline_parallel_group", "get_expert_data_parallel_group",
        "get_intra_distributed_optimizer_instance_group",
    ):
        yield name, {}
    for name in (
        "get_hierarchical_context_parallel_groups", "get_embedding_group",
        "get_position_embedding_group", "get_inter_distributed_optimizer_instance_group",
    ):
        yield name, dict(check_initialized=False)
    for partial in (False, True):
        for gtp in GTP_OPTIONS:
            yield "get_expert_data_parallel_group", dict(partial_expert_data_parallel=partial, **gtp)
            yield "get_expert_data_parallel_rank", dict(partial_expert_data_parallel=partial, **gtp)
            yield "get_expert_data_parallel_world_size", dict(partial_expert_data_parallel=partial, **gtp)
    for name in (
        "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
        "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank",
        "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
        "is_rank_in_position_embedding_group", "get_virtual_pipeline_model_parallel_rank",
        "get_virtual_pipeline_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
        "get_model_parallel_src_rank", "get_pipeline_model_parallel_first_rank",
        "get_pipeline_model_parallel_last_rank", "get_pipeline_model_parallel_next_rank",
        "get_pipeline_model_parallel_prev_rank", "get_context_parallel_world_size",
        "get_context_parallel_rank", "get_tensor_and_context_parallel_world_size",
        "get_tensor_and_context_parallel_rank", "get_expert_model_parallel_src_rank",
        "get_expert_model_parallel_world_size", "get_expert_model_parallel_rank",
        "get_expert_tensor_parallel_world_size", "get_expert_tensor_parallel_rank",
        "get_expert_tensor_and_model_parallel_world_size",
        "get_expert_tensor_and_model_parallel_rank", "get_all_ranks",
    ):
        yield name, {}
    if vpp:
        for stage in range(vpp):
            for name in ("is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group"):
                yield name, dict(ignore_virtual=False, vp_stage=stage)
    for size in hybrid_sizes:
        yield "get_hybrid_data_context_parallel_groups", dict(group_size=size)


def snapshot(module, vpp=None, hybrid_sizes=()):
    values = {}
    for name, kwargs in calls(vpp, hybrid_sizes):
        key = (name, tuple(sorted(kwargs.items())))
        try:
            values[key] = ranks_of(getattr(module, name)(**kwargs))
        except (AssertionError, RuntimeError):
            values[key] = "raises"
    for name in MODULE_NAMES:
        values[name] = ranks_of(getattr(module, name))
    return values


def reset_megatron():
    """megatron-core's destroy leaves some names stale; start each run clean."""
    megatron.destroy_model_parallel()
    for name in MODULE_NAMES:
        setattr(megatron, name, {} if name == "_HYBRID_DP_CP_GROUPS" else None)


def both_snapshots(rank, world_size, kwargs):
    vpp = kwargs.get("virtual_pipeline_model_parallel_size")
    with fake_world(rank, world_size):
        reset_megatron()
        megatron.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        hybrid = []
        if kwargs.get("hybrid_context_parallel"):
            hybrid = sorted(megatron._HYBRID_DP_CP_GROUPS) + [megatron.get_data_parallel_world_size(True)]
        expected = snapshot(megatron, vpp, hybrid)
        reset_megatron()
        ours.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        got = snapshot(ours, vpp, hybrid)
        ours.destroy_model_parallel()
    return expected, got


def all_stages(pp_ranks):
    return list(pp_ranks)


def last_stage(pp_ranks):
    return [pp_ranks[-1]]


CONFIGS = [
    (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    (16, dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
              expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
    (16, dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)),
    (16, dict(tensor_model_parallel_size=2, context_parallel_size=4,
              hierarchical_context_parallel_sizes=[2, 2])),
    (16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp")),
    (16, dict(context_parallel_size=2, hybrid_context_parallel=True,
              **({} if NEWER else dict(create_all_gather_group=True)))),
    (16, dict(pipeline_model_parallel_size=4, get_embedding_ranks=all_stages,
              get_position_embedding_ranks=last_stage)),
    (32, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
              expert_model_parallel_size=4, expert_tensor_parallel_size=1,
              num_distributed_optimizer_instances=2)),
    (32, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
              expert_tensor_parallel_size=1, order="tp-cp-ep-pp-dp")),
    (64, dict(tensor_model_parallel_size=4, context_parallel_size=2, pipeline_model_parallel_size=2,
              expert_model_parallel_size=2, expert_tensor_parallel_size=2,
              num_distributed_optimizer_instances=2, virtual_pipeline_model_parallel_size=3)),
    (64, dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=8,
              expert_tensor_parallel_size=1, order="tp-ep-cp-dp-pp")),
    (512, dict(tensor_model_parallel_size=8, context_parallel_size=2, pipeline_model_parallel_size=4,
               expert_model_parallel_size=8, expert_tensor_parallel_size=1,
               num_distributed_optimizer_instances=2)),
]


def sampled_ranks(world_size):
    return range(world_size) if world_size <= 64 else sorted({0, 1, 77, world_size // 2 + 3, world_size - 1})


CASES = [(w, kw, r) for w, kw in CONFIGS for r in sampled_ranks(w)]


@pytest.mark.parametrize(
    "world_size, kwargs, rank", CASES,
    ids=[f"w{w}-r{r}-" + "-".join(f"{k[:12]}={v}" for k, v in kw.items() if not callable(v)) for w, kw, r in CASES],
)
def test_every_getter_equals_megatron(world_size, kwargs, rank):
    expected, got = both_snapshots(rank, world_size, kwargs)
    differing = {key: (expected[key], got[key]) for key in expected if expected[key] != got[key]}
    assert not differing


def test_getters_before_init_raise_what_megatron_raises():
    with fake_world(0, 4):
        for module in (megatron, ours):
            for getter in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_group",
                           "get_pipeline_model_parallel_world_size", "get_data_parallel_group"):
                with pytest.raises(AssertionError):
                    getattr(module, getter)()
            assert module.get_expert_tensor_parallel_world_size() is None
        with pytest.raises(NotInitializedError) as raised:
            ours.get_tensor_model_parallel_rank()
        assert str(raised.value) == (
            "tensor model parallel group is not initialized; call initialize_model_parallel() first"
        )
    assert ours.get_data_parallel_world_size() == megatron.get_data_parallel_world_size() == 0
    assert ours.get_context_parallel_rank() == megatron.get_context_parallel_rank() == 0


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(tensor_model_parallel_size=16), RuntimeError,
         "world size 8 is not divisible by tp*cp*pp = 16*1*1 = 16"),
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=8), RuntimeError,
         "world size 8 is not divisible by tp*cp*pp = 2*1*8 = 16"),
        (dict(virtual_pipeline_model_parallel_size=2), RuntimeError,
         "pipeline-model-parallel size should be greater than 1 with interleaved schedule, got "
         "pipeline_model_parallel_size=1 and virtual_pipeline_model_parallel_size=2"),
        (dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 2]), AssertionError,
         "hierarchical_context_parallel_sizes [2, 2] multiply to 4, but context_parallel_size is 2"),
        (dict(num_distributed_optimizer_instances=3), AssertionError,
         "data parallel size with context parallel, dp*cp = 8*1 = 8, is not divisible by "
         "num_distributed_optimizer_instances = 3"),
        (dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
         AssertionError,
         "order 'tp-cp-ep-pp-dp' does not end with 'pp', which needs equal dense and expert "
         "data-parallel sizes, but dp = 4 and edp = 2"),
        (dict(sharp_enabled_group="dp"), AssertionError,
         "sharp_enabled_group is only valid when use_sharp is True"),
        # megatron-core asks torch.cuda.current_device() first: a CUDA build of torch without
        # a GPU (torch 2.14.1's wheel) raises RuntimeError there, a CPU build lets it assert
        (dict(use_sharp=True), (AssertionError, RuntimeError),
         "use_sharp needs the NCCL backend; this world runs fake"),
        (dict(pipeline_model_parallel_comm_backend="mpi"), RuntimeError,
         '"mpi" backend for PP communication is not supported; use "nccl" or "ucc"'),
    ],
)
def test_bad_init_raises_what_megatron_raises_with_a_better_message(kwargs, error, message):
    with fake_world(0, 8):
        with pytest.raises(error):
            megatron.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        megatron.destroy_model_parallel()
        with pytest.raises(ParallelStateError) as raised:
            ours.initialize_model_parallel(**kwargs)
        assert isinstance(raised.value, (RuntimeError, AssertionError, ValueError))
        assert str(raised.value) == message
        assert not ours.is_initialized()


def test_second_init_without_destroy_is_refused():
    with fake_world(0, 8):
        ours.initialize_model_parallel(2)
        with pytest.raises(ParallelStateError, match="already initialized"):
            ours.initialize_model_parallel(2)
        ours.destroy_model_parallel()
        ours.destroy_model_parallel()


def test_overrides_equal_megatron():
    with fake_world(3, 8):
        for module in (megatron, ours):
            module.set_tensor_model_parallel_world_size(4)
            module.set_tensor_model_parallel_rank(3)
            module.set_pipeline_model_parallel_world_size(2)
            module.set_pipeline_model_parallel_rank(1)
        assert (ours.get_tensor_model_parallel_world_size(), ours.get_tensor_model_parallel_rank()) == (4, 3)
        assert ours.is_pipeline_last_stage() == megatron.is_pipeline_last_stage() is True
        assert ours.get_expert_tensor_parallel_world_size() == megatron.get_expert_tensor_parallel_world_size() == 4
        megatron.destroy_model_parallel()
        megatron.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
        ours.destroy_model_parallel()
        ours.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
        for module in (megatron, ours):
            module.set_data_parallel_rank(7)
            module.set_expert_model_parallel_world_size(5)
            module.set_tensor_model_parallel_rank(None)
        assert snapshot(ours) == snapshot(megatron)
        megatron.destroy_model_parallel()
        megatron._MPU_DATA_PARALLEL_RANK = None
        ours.destroy_model_parallel()
        assert ours._MPU_DATA_PARALLEL_RANK is None and ours._TENSOR_MODEL_PARALLEL_GROUP is None


def test_overrides_set_before_init_outlive_it_as_in_megatron():
    with fake_world(3, 8):
        for module in (megatron, ours):
            module.destroy_model_parallel()
            module.set_tensor_model_parallel_rank(7)
            module.set_data_parallel_rank(2)
        megatron.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
        ours.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
        assert ours.get_tensor_model_parallel_rank() == megatron.get_tensor_model_parallel_rank() == 7
        assert snapshot(ours) == snapshot(megatron)
        reset_megatron()
        ours.destroy_model_parallel()
        assert ours._MPU_TENSOR_MODEL_PARALLEL_RANK is None


def test_rank_generator_and_masked_groups_equal_megatron():
    for kwargs in [dict(tp=2, ep=1, dp=3, pp=2, cp=2, order="tp-cp-ep-dp-pp"),
                   dict(tp=2, ep=4, dp=2, pp=2, cp=1, order="tp-ep-dp-pp", rank_offset=8),
                   dict(tp=1, ep=1, dp=4, pp=2, cp=1, order="pp-dp")]:
        theirs, mine = megatron.RankGenerator(**kwargs), ours.RankGenerator(**kwargs)
        assert mine.order == theirs.order and mine.ordered_size == theirs.ordered_size
        for token in ["tp", "dp", "pp", "cp", "ep", "tp-dp", "dp-cp", "tp-pp", "tp-ep-pp", "dp-tp-cp-ep-pp"]:
            assert mine.get_ranks(token) == theirs.get_ranks(token), (kwargs, token)
    for sizes, mask in [([2, 3, 4], [False, True, False]), ([2, 2, 2], [True, False, True]),
                        ([4, 2], [False, False]), ([3, 2, 2], [True, True, True])]:
        world = 1
        for size in sizes:
            world *= size
        assert ours.generate_masked_orthogonal_rank_groups(world, sizes, mask) == \
            megatron.generate_masked_orthogonal_rank_groups(world, sizes, mask)
    with pytest.raises(RuntimeError):
        ours.RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="dp-pp")
    with pytest.raises(AssertionError):
        ours.RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")


def test_helpers_equal_megatron():
    assert ours.default_embedding_ranks([1, 5, 9]) == megatron.default_embedding_ranks([1, 5, 9])
    assert ours.default_embedding_ranks([4]) == megatron.default_embedding_ranks([4])
    assert ours.default_position_embedding_ranks([1, 5]) == megatron.default_position_embedding_ranks([1, 5])
    theirs, mine = {}, {}
    megatron.overwrite_nccl_comm_cfgs(theirs, "dp", ("max_ctas", 8))
    ours.overwrite_nccl_comm_cfgs(mine, "dp", ("max_ctas", 8))
    assert mine == theirs
    assert ours.get_nccl_options("tp", {}) is None


def test_memory_buffer_works_on_cpu():
    with fake_world(0, 4):
        ours.initialize_model_parallel(2)
        buffer = ours.get_global_memory_buffer()
        first = buffer.get_tensor((2, 3), torch.float32, "scratch")
        again = buffer.get_tensor((3,), torch.float32, "scratch")
        assert first.shape == (2, 3) and again.data_ptr() == first.data_ptr()
        with pytest.raises(ParallelStateError, match="already initialized"):
            ours._set_global_memory_buffer()
        ours.destroy_global_memory_buffer()
        with pytest.raises(NotInitializedError):
            ours.get_global_memory_buffer()
        if not NEWER:  # megatron-core 0.19 moved the symmetric buffer out of parallel_state
            ours._set_global_symmetric_memory_buffer()
            assert ours.get_global_symmetric_memory_buffer().maybe_get_tensor((4,), torch.float32) == {
                "tensor": None, "handle": None}
        ours.destroy_model_parallel()


def test_process_group_collection_equals_megatron():
    from megatron.core.process_groups_config import ProcessGroupCollection as Theirs

    from meshstate.megatron.process_groups import ProcessGroupCollection

    kwargs = dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                  expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                  num_distributed_optimizer_instances=2, hierarchical_context_parallel_sizes=[2, 1])
    for rank in (0, 5, 13):
        with fake_world(rank, 16):
            reset_megatron()
            megatron.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
            theirs = Theirs.use_mpu_process_groups()
            expected = {f: ranks_of(getattr(theirs, f)) for f in theirs.__dataclass_fields__}
            reset_megatron()
            ours.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
            mine = ProcessGroupCollection.use_mpu_process_groups()
            assert {f: ranks_of(getattr(mine, f)) for f in expected} == expected
            only_tp = ProcessGroupCollection.from_mesh(ours.get_mesh(), ["tp"])
            assert "pp" not in vars(only_tp) and getattr(only_tp, "pp", None) is None
            assert repr(mine).startswith("ProcessGroupCollection(tp(2), pp(2), mp(4)")
            ours.destroy_model_parallel()


def test_process_group_collection_from_a_plain_mesh():
    import meshstate
    from meshstate.megatron.process_groups import ProcessGroupCollection

    with fake_world(5, 8):
        mesh = meshstate.init_mesh(tp=2, pp=2)
        pgs = ProcessGroupCollection.from_mesh(mesh)
        assert dist.get_process_group_ranks(pgs.tp) == [4, 5]
        assert dist.get_process_group_ranks(pgs.mp) == [0, 1, 4, 5]
        assert pgs.intra_dp_cp is pgs.dp_cp and pgs.embd is None and pgs.hcp is None
        with pytest.raises(ValueError, match="Invalid process groups requested: \\['tpp'\\]"):
            ProcessGroupCollection.from_mesh(mesh, ["tpp"])
        with mesh:
            assert ProcessGroupCollection.use_mpu_process_groups(["tp"]).tp is pgs.tp
        mesh.destroy()
