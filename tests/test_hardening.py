"""Ranks that disagree, ranks that never arrive, repeated init/destroy, fuzzed input, threads."""

import contextlib
import dataclasses
import gc
import io
import sys
import threading
import tracemalloc
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed import distributed_c10d as c10d

import meshstate
from meshstate.megatron import parallel_state as mpu
from meshstate.tools.cli import main
from meshstate.errors import (
    ConfigError,
    ConfigMismatchError,
    MeshStateError,
    MeshTimeoutError,
)
from meshstate.testing import fake_world, local_world

TIMEOUT = timedelta(seconds=3)
"""How long the ranks that arrive wait for one that never does."""
EVERY_RANK_ARRIVES = timedelta(seconds=120)
"""A limit no rank reaches where every rank arrives, on a loaded machine too (CI's Python 3.12
leg once saw three pooled ranks start their build more than 3 s after the fourth)."""


def build_with_rank3_tp(tp_on_rank3):
    tp = tp_on_rank3 if dist.get_rank() == 3 else 2
    try:
        meshstate.init_mesh(tp=tp, timeout=EVERY_RANK_ARRIVES).destroy()
    except MeshStateError as error:
        return type(error).__name__, str(error)
    return "built", ""


def test_a_rank_with_a_different_tp_makes_every_rank_raise_the_same_error():
    results = local_world(4).run(build_with_rank3_tp, 1)
    assert results == [(
        "ConfigMismatchError",
        "ranks disagree on the mesh config: rank 3 has tp=1 (rank 0: tp=2)",
    )] * 4
    assert local_world(4).run(build_with_rank3_tp, 2) == [("built", "")] * 4


def build_unless_rank3():
    if dist.get_rank() == 3:
        return None
    try:
        meshstate.init_mesh(tp=2, timeout=TIMEOUT)
    except MeshTimeoutError as error:
        return str(error)
    return "built"


def test_a_rank_that_never_arrives_ends_in_a_timeout_naming_it():
    results = local_world(4).run(build_unless_rank3)
    assert results == [
        "rank 3 did not reach the mesh build within 3 s (3 of 4 ranks arrived)"] * 3 + [None]


def megatron_style_mismatch():
    vpp = 3 if dist.get_rank() == 1 else 2
    try:
        mpu.initialize_model_parallel(pipeline_model_parallel_size=2,
                                      virtual_pipeline_model_parallel_size=vpp)
    except ConfigMismatchError as error:
        return str(error)
    finally:
        mpu.destroy_model_parallel()
    return "built"


def test_initialize_model_parallel_agrees_on_its_own_arguments_too():
    assert local_world(4).run(megatron_style_mismatch) == [
        "ranks disagree on the mesh config: rank 1 has "
        "virtual_pipeline_model_parallel_size=3 (rank 0: virtual_pipeline_model_parallel_size=2)"
    ] * 4


def cycles_on_gloo(count):
    before = len(c10d._world.pg_map)
    for cycle in range(count):
        sizes = [dict(tp=2), dict(tp=2, pp=2), dict(cp=2, ep=4, etp=1), dict(tp=4)][cycle % 4]
        mpu.initialize_model_parallel(**{
            "tensor_model_parallel_size": sizes.get("tp", 1),
            "pipeline_model_parallel_size": sizes.get("pp", 1),
            "context_parallel_size": sizes.get("cp", 1),
            "expert_model_parallel_size": sizes.get("ep", 1),
            "expert_tensor_parallel_size": sizes.get("etp"),
        })
        mpu.destroy_model_parallel()
        mpu.destroy_model_parallel()
    return len(c10d._world.pg_map) - before


def test_twenty_init_destroy_cycles_on_gloo_leave_no_groups():
    assert local_world(4).run(cycles_on_gloo, 20) == [0] * 4


def test_two_hundred_cycles_on_the_fake_backend_leave_no_groups_and_flat_memory():
    configs = [dict(tp=2), dict(tp=4, pp=2), dict(cp=2, ep=4, etp=1), dict(tp=8), dict(pp=4, ep=2)]
    with fake_world(5, 64):
        before = len(c10d._world.pg_map)

        def cycles(count):
            for cycle in range(count):
                meshstate.init_mesh(**configs[cycle % len(configs)]).destroy()

        tracemalloc.start()
        cycles(200)  # torch fills its bounded caches on the way
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        cycles(200)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(c10d._world.pg_map) == before
        assert end - start < 16 * 1024, f"{end - start} bytes kept by 200 more cycles"


def test_getters_are_safe_from_many_threads():
    with fake_world(5, 16):
        mpu.initialize_model_parallel(2, 2)
        expected = (1, 2, 0, True, 4)
        failures, turns = [], []
        start = threading.Barrier(8)

        def read(reader):
            start.wait()
            for _ in range(20000):
                turns.append(reader)
                got = (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                       mpu.get_pipeline_model_parallel_rank(), mpu.is_pipeline_first_stage(),
                       mpu.get_data_parallel_world_size(with_context_parallel=True))
                if got != expected:
                    failures.append(got)

        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=read, args=(n,)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(switch_interval)
            mpu.destroy_model_parallel()
        assert not failures
        # The readers really interleaved: the turns switch between threads many times.
        assert sum(a != b for a, b in zip(turns, turns[1:])) > 8


def test_each_thread_has_its_own_current_mesh():
    with fake_world(1, 8):
        meshes = [meshstate.init_mesh(tp=2), meshstate.init_mesh(tp=4)]
        step = threading.Barrier(2)
        seen = [[], []]

        def work(index):
            mesh = meshes[index]
            with mesh:
                for _ in range(3):
                    step.wait()  # both threads are inside their own `with` here
                    seen[index].append(meshstate.current_mesh().size("tp"))
            step.wait()
            try:
                meshstate.current_mesh()
            except meshstate.NotInitializedError:
                seen[index].append(None)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for mesh in meshes:
            mesh.destroy()
        assert seen == [[2, 2, 2, None], [4, 4, 4, None]]


def test_consistency_guard_refuses_a_device_mesh_that_disagrees_with_its_group():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        ordered = mesh.ordered  # the layout's answer, shifted: it now disagrees with the group
        mesh.ordered = lambda axes: dataclasses.replace(
            ordered(axes), index=(ordered(axes).index + 1) % 4)
        with pytest.raises(MeshStateError, match="DeviceMesh dim 'tp-cp' puts rank 1 at 1, but"):
            mesh["tp-cp"]
        mesh.destroy()


# -- fuzzing -------------------------------------------------------------------------------

ANYTHING = st.one_of(
    st.integers(-3, 70), st.just(0), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
    st.none(), st.lists(st.integers(), max_size=2),
)
ORDERS = st.one_of(
    st.lists(st.sampled_from(["tp", "cp", "ep", "dp", "pp", "xp", "", "TP", "etp"]), max_size=6).map("-".join),
    st.text(max_size=12), st.integers(), st.none(),
)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(world=ANYTHING, order=ORDERS, tp=ANYTHING, cp=ANYTHING, ep=ANYTHING, etp=ANYTHING, pp=ANYTHING)
def test_fuzzed_configs_raise_only_config_errors(world, order, tp, cp, ep, etp, pp):
    try:
        config = meshstate.MeshConfig(world, order=order, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp)
    except ConfigError:
        return
    layout = meshstate.ParallelLayout(config)
    for kind in meshstate.GROUP_KINDS:
        groups = layout.groups(kind)
        assert groups.numel() == config.world_size
        assert list(layout.group_ranks(config.world_size - 1, kind)) in groups.tolist()


SMALL = st.sampled_from([1, 1, 2, 3, 4, 0, -1])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tp=SMALL, cp=SMALL, ep=SMALL, etp=st.one_of(st.none(), SMALL), pp=SMALL,
       order=st.permutations(["tp", "cp", "ep", "dp", "pp"]).map("-".join),
       instances=SMALL, rank=st.integers(0, 15))
def test_fuzzed_initialize_model_parallel_raises_only_meshstate_errors(tp, cp, ep, etp, pp, order,
                                                                       instances, rank):
    with fake_world(rank, 16):
        try:
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp, order=order,
                num_distributed_optimizer_instances=instances)
        except MeshStateError:
            assert not mpu.is_initialized()
            return
        assert mpu.get_tensor_model_parallel_world_size() == tp
        mpu.destroy_model_parallel()


FLAG_VALUES = st.sampled_from(["1", "2", "4", "0", "-1", "x", "", "8", "3"])


@settings(max_examples=120, deadline=None, derandomize=True)
@given(args=st.lists(st.tuples(st.sampled_from(["--world-size", "--tp", "--cp", "--ep", "--etp", "--pp",
                                                "--order", "--rank", "--bogus"]),
                               st.one_of(FLAG_VALUES, st.sampled_from(["tp-dp", "dp-xp", "tp-tp"]))),
                     max_size=5))
def test_fuzzed_cli_plan_prints_one_line_and_exits_2(args):
    argv = ["plan"] + [part for pair in args for part in pair]
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    if status == 0:
        assert stdout.getvalue().startswith("world size ")
    else:
        assert status == 2
        assert len(stderr.getvalue().splitlines()) == 1, stderr.getvalue()
        assert "Traceback" not in stderr.getvalue()
