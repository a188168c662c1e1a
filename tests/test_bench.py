"""meshstate bench's logic at a small world: counts, table and JSON schema (no timing asserts)."""

import importlib.util
import json
import sys

import pytest

from meshstate.tools.bench import checkpoints as bench_checkpoints
from meshstate.tools.bench import compiled as bench_compile
from meshstate.tools.bench import explicit as bench_explicit
from meshstate.tools.bench import harness as bench_harness
from meshstate.tools.bench import init as bench_init
from meshstate.tools.bench import processes as bench_processes
from meshstate.tools.bench import report as bench
from meshstate.tools.bench import runtime as bench_runtime
from meshstate.tools.cli import main

SIZES = dict(order="tp-cp-ep-dp-pp", tp=2, cp=2, pp=2, ep=2, etp=1)


@pytest.fixture(scope="module")
def report():
    return bench.run([64], SIZES, rank=5, repeats=1, process_world_sizes=(4,),
                     process_sizes=dict(tp=2, pp=2, ep=2, etp=1), with_titan=False,
                     with_runtime=False, simulated_checks=(8,))


def test_every_approach_measured(report):
    assert [row.approach for row in report.rows] == list(bench_init.APPROACHES)
    assert [(r.world_size, r.backend, r.approach) for r in report.process_rows] == [
        (4, "gloo", approach) for approach in bench_init.APPROACHES]
    for row in report.rows:
        assert set(bench_init.GETTERS[:4]) <= set(row.getter_ns) <= set(bench_init.GETTERS)


def test_group_counts(report):
    rows = {row.approach: row for row in report.rows}
    # meshstate creates one group per distinct rank set it is in, nothing for other ranks.
    for approach in (bench_init.INIT_MESH, bench_init.PARALLEL_STATE):
        row = rows[approach]
        assert row.creation_calls == row.member_groups == row.distinct_rank_sets
    # tp cp dp pp tp-cp dp-cp tp-dp tp-dp-cp tp-pp ep etp etp-ep etp-ep-pp edp on rank 5 of 64
    # (tp=2 cp=2 pp=2 ep=2 etp=1): 10 distinct sets, including the one single-rank group.
    assert rows[bench_init.INIT_MESH].distinct_rank_sets == 10
    # megatron-core takes part in creating every group of the world and keeps duplicates.
    megatron = rows[bench_init.MEGATRON]
    assert megatron.creation_calls > 300 and megatron.member_groups > megatron.distinct_rank_sets
    assert rows[bench_init.DEVICE_MESH].creation_calls > 300
    assert megatron.layout_seconds is not None and rows[bench_init.INIT_MESH].layout_seconds is not None


def test_table_and_json(report):
    table = bench.format_report(report)
    assert "world approach" in table.replace("  ", " ")
    assert "     64 meshstate init_mesh" in table
    assert "real processes, init wall time of the slowest rank" in table
    decoded = json.loads(bench.report_json(report))
    assert set(decoded) == {
        "machine", "config", "rows", "process_config", "process_rows", "axis_set_rows",
        "harness_rows", "runtime_rows", "query_rows", "explicit_rows", "simulated_check_rows",
        "compile_rows", "checkpoint_rows",
        "notes"}
    assert [(r["world_size"], r["axes"], r["declared"]) for r in decoded["axis_set_rows"]] == [
        (4, list(bench_processes.UNDECLARED_AXES), bench_processes.DECLARED_KEY)]
    assert "psum of 1024 floats over an axis tuple not declared at init" in table
    assert set(decoded["rows"][0]) == {
        "world_size", "approach", "init_seconds", "creation_calls", "member_groups",
        "distinct_rank_sets", "state_kib", "getter_ns", "layout_seconds", "rss_mib",
        "torch_seconds"}
    assert 0 < decoded["rows"][0]["torch_seconds"] < decoded["rows"][0]["init_seconds"]
    assert "init growth and memory" in table and "own " in table and "hot getters at world 64" in table
    assert decoded["config"]["world_sizes"] == [64]
    [simulated] = decoded["simulated_check_rows"]
    assert simulated["world_size"] == 8 and simulated["verified"]
    assert simulated["peak_rss_mib"] >= simulated["before_rss_mib"] > 0
    assert "check --simulate (every rank in one process), tp=2 cp=2 pp=2" in table


def test_cli_bench_json_and_bad_input(capsys):
    assert main(["bench", "--world-sizes", "16", "--tp", "2", "--cp", "1", "--pp", "2", "--ep", "2",
                 "--etp", "1", "--repeat", "1", "--processes", "0", "--without-megatron",
                 "--without-torchtitan", "--without-runtime", "--harness-tests", "0",
                 "--simulated-checks", "0", "--simulated-pipeline", "0", "--compile-ranks", "0",
                 "--checkpoint-ranks", "0", "--json"]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert [row["approach"] for row in decoded["rows"]] == [
        bench_init.INIT_MESH, bench_init.PARALLEL_STATE, bench_init.DEVICE_MESH]
    assert decoded["simulated_check_rows"] == []  # neither checks nor the 1F1B step, told 0
    assert decoded["compile_rows"] == []
    assert main(["bench", "--world-sizes", "12", "--tp", "8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate bench: error: world size 12 is not divisible by tp*cp*pp = 8*2*8 = 128"]
    assert main(["bench", "--world-sizes", "1024", "--simulated-checks", "12"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate bench: error: simulated check (tp=2 cp=2 pp=2): world size 12 is not divisible "
        "by tp*cp*pp = 2*2*2 = 8"]
    assert main(["bench", "--world-sizes", "1024", "--compile-ranks", "12"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate bench: error: compiled step (tp=2 cp=2 pp=2): world size 12 is not divisible "
        "by tp*cp*pp = 2*2*2 = 8"]
    assert main(["bench", "--world-sizes", "1024", "--checkpoint-ranks", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshstate bench: error: checkpoint (tp=2): world size 3 is not divisible "
        "by tp*cp*pp = 2*1*1 = 2"]


def test_the_compile_table_puts_both_ways_side_by_side():
    rows = [bench_compile.CompileRow(8, every_rank_seconds=24.0, every_rank_graphs=8,
                                     one_rank_seconds=6.0, one_rank_graphs=1)]
    assert bench_compile.format_compile(rows).splitlines()[1:] == [
        "  ranks  every rank graphs  one rank graphs speed-up",
        "      8       24.0s      8      6.0s      1     4.0x",
    ]


def test_checkpoint_rows_put_meshstate_beside_dcp_on_the_same_bytes():
    """Each writer saves and loads the same blocks (DCP's own of the DTensors first); the
    table gives MB/s each way and each writer's seconds over DCP's."""
    messages = []
    rows = bench_checkpoints.measure_checkpoints([4], messages.append, layers=1, repeats=1)
    writers = [bench_checkpoints.DCP, bench_checkpoints.MESHSTATE_DCP]
    if importlib.util.find_spec("torch_checkpointing") is not None:
        writers.append(bench_checkpoints.MESHSTATE_CHECKPOINTING)
    assert [(row.world_size, row.writer) for row in rows] == [(4, writer) for writer in writers]
    assert {row.megabytes for row in rows} == {4 * 2 * 512 * 512 * 4 / 1e6}
    assert all(row.save_seconds > 0 and row.load_seconds > 0 for row in rows)
    assert messages == ["4 local ranks: checkpoint save and load, DCP and meshstate.checkpoint"]
    table = bench_checkpoints.format_checkpoints(rows).splitlines()
    assert table[0].startswith("checkpoint save and load (tp=2, dp inferred; float32 blocks of 512x512")
    assert table[1].split() == ["ranks", "writer", "MB", "save", "MB/s", "load", "MB/s", "save", "load"]
    assert table[2].split()[-2:] == ["1.00x", "1.00x"] and len(table) == 2 + len(writers)


def test_megatron_counts_as_absent_when_no_megatron_package_is_installed(monkeypatch):
    # A fresh `pip install -e .` has no `megatron` package at all.
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    assert not bench_init.megatron_available()


def test_torchtitan_rows_count_groups_per_rank(monkeypatch):
    pytest.importorskip("torchtitan.distributed.parallel_dims")
    monkeypatch.setattr(bench_init, "_ns_per_call", lambda statement, function, repeats: 1.0)
    report = bench.run([64], SIZES, rank=5, repeats=1, process_world_sizes=(), with_megatron=False,
                       with_runtime=False)
    rows = {row.approach: row for row in report.rows}
    assert list(rows)[-2:] == list(bench_init.TITAN_APPROACHES)
    ours, theirs = rows[bench_init.MESHSTATE_TITAN], rows[bench_init.TITAN]
    # one communicator per distinct rank set; torchtitan takes part in every group of the world
    assert ours.creation_calls == ours.member_groups == ours.distinct_rank_sets
    assert theirs.creation_calls > 10 * ours.creation_calls


def test_harness_rows_time_one_test_and_each_count_asked_for(monkeypatch):
    seconds_per_test = {bench_harness.SINGLE_PROCESS: 3.0, bench_harness.MESHSTATE_HARNESS: 3.5,
                        bench_harness.MULTI_PROCESS_TEST_CASE: 20.0}
    monkeypatch.setattr(bench_harness, "time_test_run",
                        lambda runner, tests, world_size: seconds_per_test[runner] * tests)
    report = bench.run([64], SIZES, rank=5, repeats=1, process_world_sizes=(),
                       with_megatron=False, with_titan=False, with_runtime=False,
                       harness_tests=[10])
    assert sorted({row.tests for row in report.harness_rows}) == [1, 10]
    runners = [row.runner for row in report.harness_rows if row.tests == 10]
    assert runners[:2] == [bench_harness.SINGLE_PROCESS, bench_harness.MESHSTATE_HARNESS]
    table = bench.format_report(report)
    assert ("meshstate @distributed       8 ranks    10 test(s)     35.0 s  "
            "+5.0 s over one process\n") in table
    assert "pytest, one process          1 rank      1 test(s)      3.0 s\n" in table


def test_runtime_table_has_every_call_traced_as_one_graph(monkeypatch):
    monkeypatch.setattr(bench_runtime, "_us_per_call", lambda call, calls=0: (call(), 2.0)[1])
    monkeypatch.setattr(bench_runtime, "_compiled_us", lambda function, *args: 3.0)
    monkeypatch.setattr(bench_runtime, "_us_per_call_side_by_side",
                        lambda first, second: (first(), second(), 2.0, 2.0)[2:])
    seen = []
    rows = bench_runtime.measure_runtime(progress=seen.append)
    assert [row.call.split("(")[0].strip() for row in rows] == [
        "psum", "all_gather", "psum_scatter", "all_to_all", "ppermute", "shard_map row-parallel",
        "shard_map row-parallel", "shard_map mlp check_vma=True", "shard_map mlp check_vma=False",
        "shard_map row-parallel", "shard_map manual over tp", "reshard P"]
    assert all((row.graphs, row.graph_breaks) == (1, 0) for row in rows)
    assert len(seen) == 10 and seen[0] == "runtime: psum(x, 'tp')"
    table = bench_runtime.format_runtime(rows)
    assert "  psum(x, 'tp')                            2.0 all_reduce(x.clone())" in table
    assert " 1.00     2.0      3.0      1      0" in table


def test_each_runtime_row_times_eager_before_it_traces(monkeypatch):
    """A trace leaves torch's DTensor sharding cache holding results on the tracer's
    wrapper of the mesh, which eager ops of the same layout then compare slowly: a
    partial-manual call timed after its trace read 105 us beside local_map's 99 (untraced)."""
    events = []
    explain = bench_runtime._explain

    def traced(function, *args):
        events.append("trace")
        return explain(function, *args)

    monkeypatch.setattr(bench_runtime, "_explain", traced)
    monkeypatch.setattr(bench_runtime, "_us_per_call",
                        lambda call, calls=0: (call(), events.append("eager"), 2.0)[2])
    monkeypatch.setattr(bench_runtime, "_us_per_call_side_by_side",
                        lambda first, second: (first(), second(), events.append("eager"), 2.0, 2.0)[3:])
    monkeypatch.setattr(bench_runtime, "_compiled_us",
                        lambda function, *args: (events.append("compiled"), 3.0)[1])
    rows = bench_runtime.measure_runtime()
    row_events = " ".join(events).split("compiled")[:-1]
    assert len(row_events) == len(rows)
    for row, seen in zip(rows, row_events):  # the typed rows time both rows' calls first
        timed = seen.split()
        assert "eager" not in timed[timed.index("trace"):], row.call
    assert events.count("eager") >= len(rows)


def test_a_simulated_check_counts_its_own_memory_not_its_parents():
    """The row's process starts fresh: a parent holding a gigabyte does not raise its peak
    (Linux keeps ``ru_maxrss`` across exec)."""
    from meshstate.tools.bench.simulated import time_simulated_check

    held = bytearray(2**30)
    held[::4096] = b"x" * len(held[::4096])  # touch every page: resident
    row = time_simulated_check(8, dict(tp=2, cp=2, pp=2))
    del held
    assert row.verified and 0 < row.before_rss_mib <= row.peak_rss_mib < 1024


def test_mesh_queries_are_measured_beside_torchs_device_mesh(monkeypatch):
    asked = []
    monkeypatch.setattr(bench_runtime, "_ns_per_call",
                        lambda statement, function: (asked.append(eval(statement, {"f": function})), 7.0)[1])
    rows = bench_runtime.measure_queries()
    assert [row.query for row in rows] == [
        "mesh.rank('dp-cp')", "mesh['tp']", "mesh.size('cp-dp')", "mesh.group('cp-tp')"]
    assert asked[0] == asked[1] and asked[4] == asked[5]  # each answer equals torch's
    table = bench_runtime.format_queries(rows)
    assert "  mesh.rank('dp-cp')          7   dp_cp.get_local_rank()        7" in table


def test_explicit_table_has_each_typed_op_beside_dtensors_traced_as_one_graph(monkeypatch):
    timed = []

    def side_by_side(mesh, typed, plain):
        with bench_explicit.explicit(mesh):
            typed_result = typed()
        timed.append((typed_result, plain()))
        return 3.0, 2.0
    monkeypatch.setattr(bench_explicit, "_side_by_side", side_by_side)
    rows = bench_explicit.measure_explicit()
    assert [row.op.split(" ")[0] for row in rows] == [
        "x", "gelu(x)", "a", "x.t()", "x.sum(0)", "matmul(x,", "x"]  # x.t() * 2.0: a view returned
    # from a compiled function is rebuilt by AOTAutograd with as_strided, which DTensor lacks
    assert all((row.graphs, row.graph_breaks) == (1, 0) for row in rows)
    # the same layout each way: a reduction's DTensor op is followed by JAX's reduction
    assert all(typed.placements == plain.placements for typed, plain in timed)
    table = bench_explicit.format_explicit(rows)
    assert "  x + y                                  3.0 x + y                        2.0  1.50" in table
