"""The meshstate command: plan (no processes) and check (real processes)."""

import json
import subprocess
import sys

import pytest

from meshstate.tools.cli import main
from meshstate.layout.config import MeshConfig
from meshstate.layout.layout import GROUP_KINDS, HSDP_KINDS, ParallelLayout
from meshstate.tools.verify import KindCheck, format_summary, summarize

from conftest import megatron_groups
from test_layout import TABLE


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "meshstate", *args], capture_output=True, text=True, timeout=timeout
    )


def plan_json(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def flags(config):
    return [
        "--world-size", str(config.world_size), "--order", config.order,
        "--tp", str(config.tp), "--cp", str(config.cp), "--ep", str(config.ep),
        "--etp", str(config.etp), "--pp", str(config.pp),
    ]


@pytest.mark.parametrize("config", TABLE[::7], ids=str)
def test_plan_json_equals_megatron(capsys, config):
    plan = plan_json(capsys, *flags(config))
    assert plan["world_size"] == config.world_size
    assert plan["order"] == config.order
    assert plan["sizes"] == config.sizes()
    assert list(plan["groups"]) == list(GROUP_KINDS)
    assert plan["groups"] == megatron_groups(config)


def test_plan_json_with_rank_view(capsys):
    plan = plan_json(capsys, "--world-size", "16", "--tp", "2", "--pp", "2", "--rank", "5")
    view = plan["rank"]
    assert view["coordinate"] == {"tp": 1, "cp": 0, "dp": 2, "pp": 0, "etp": 1, "ep": 0, "edp": 2}
    assert view["groups"]["dp"] == {"ranks": [1, 3, 5, 7], "index": 2}
    assert view["groups"]["tp-pp"] == {"ranks": [4, 5, 12, 13], "index": 1}


def test_plan_with_dp_replicate_lists_the_hsdp_groups(capsys):
    plan = plan_json(capsys, "--world-size", "16", "--cp", "2", "--dp-replicate", "2",
                     "--rank", "3", "--gpus-per-node", "8")
    assert plan["sizes"]["dp_replicate"] == 2 and plan["sizes"]["dp_shard"] == 4
    layout = ParallelLayout(MeshConfig(16, cp=2, dp_replicate=2))
    for kind in HSDP_KINDS:
        assert plan["groups"][kind] == layout.groups(kind).tolist()
    assert plan["groups"]["dp_replicate"][:2] == [[0, 8], [1, 9]]
    assert plan["rank"]["groups"]["dp_shard"] == {"ranks": [1, 3, 5, 7], "index": 1}
    assert plan["locality"]["dp_shard-cp"] == {"nodes_spanned": 1, "intra_node": True}
    assert plan["locality"]["dp_replicate"] == {"nodes_spanned": 2, "intra_node": False}
    assert main(["plan", "--world-size", "16", "--cp", "2", "--dp-replicate", "2"]) == 0
    assert "dp_shard-cp       8       2  [0, 1, 2, 3, 4, 5, 6, 7] [8, 9" in capsys.readouterr().out


def test_plan_table(capsys):
    assert main(["plan", "--world-size", "8", "--tp", "2", "--cp", "2", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "world size 8, order tp-cp-ep-dp-pp, tp=2 cp=2 ep=1 etp=2 pp=1 dp=2 edp=4" in out
    assert "dp-cp           4       2  [0, 2, 4, 6] [1, 3, 5, 7]" in out
    assert "rank 3: tp=1 cp=1 dp=0 pp=0 etp=1 ep=0 edp=1" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--world-size", "12", "--tp", "2", "--pp", "8"],
         "meshstate plan: error: world size 12 is not divisible by tp*cp*pp = 2*1*8 = 16"),
        (["plan", "--world-size", "8", "--order", "tp-xp"],
         "meshstate plan: error: order 'tp-xp' has unknown axis 'xp'; valid axes are "
         "tp, cp, ep, dp, pp"),
        (["plan", "--world-size", "zero"],
         "meshstate plan: error: argument --world-size: expected a positive integer, got 'zero'"),
        (["plan", "--world-size", "8", "--tp", "0"],
         "meshstate plan: error: argument --tp: expected a positive integer, got 0"),
        (["plan", "--world-size", "8", "--rank", "8"],
         "meshstate plan: error: --rank 8 is outside 0..7"),
        (["plan"], "meshstate plan: error: the following arguments are required: --world-size"),
        (["check", "--world-size", "6", "--tp", "4"],
         "meshstate check: error: world size 6 is not divisible by tp*cp*pp = 4*1*1 = 4"),
        (["launch"], "meshstate: error: argument command: invalid choice: 'launch' "
                     "(choose from 'plan', 'check', 'bench')"),
        (["plan", "--world-size", "16", "--tp", "2", "--dp", "4"],
         "meshstate plan: error: --dp 4: dp is inferred, not given: world size / (tp*cp*pp); "
         "with tp*cp*pp = 2*1*1 = 2, --world-size 8 gives dp 4"),
        (["check", "--pp", "2", "--ep", "2", "--edp", "2"],
         "meshstate check: error: --edp 2: edp is inferred, not given: world size / (etp*ep*pp); "
         "with etp*ep*pp = 1*2*2 = 4, --world-size 8 gives edp 2"),
        (["plan", "--world-size", "16", "--dp-replicate", "2", "--cp", "2", "--dp-shard", "2"],
         "meshstate plan: error: --dp-shard 2: dp_shard is inferred, not given: world size / "
         "(dp_replicate*tp*cp*pp); with dp_replicate*tp*cp*pp = 2*1*2*1 = 4, --world-size 8 "
         "gives dp_shard 2"),
        (["plan", "--world-size", "16", "--dp-replicate", "3"],
         "meshstate plan: error: dp = 16 (world size 16 / tp*cp*pp = 1) is not divisible by "
         "dp_replicate = 3"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    try:
        status = main(args)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    assert (status, out, err.splitlines()) == (2, "", [message])


def test_bad_input_in_a_process_of_its_own_exits_2_with_one_line():
    """The same through the `meshstate` entry point: one line, exit 2, no traceback."""
    result = run_cli("plan", "--world-size", "12", "--tp", "2", "--pp", "8")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "meshstate plan: error: world size 12 is not divisible by tp*cp*pp = 2*1*8 = 16"
    ]


def test_check_spawns_8_ranks_and_verifies_every_kind():
    result = run_cli("check", "--tp", "2", "--cp", "2", "--ep", "2", "--etp", "1",
                     "--dp-replicate", "2", "--verbose")
    assert result.returncode == 0, result.stderr
    phases = [line.rpartition("meshstate check: ")[2] for line in result.stderr.splitlines()]
    phases = [phase for phase in phases if phase != "importing torch"]  # said if it took 2 s
    assert phases == ["starting 8 local ranks (gloo)", "8 ranks ready; building the mesh",
                      "verifying every group kind with collectives"]
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "meshstate check: 8 ranks (gloo), order tp-cp-ep-dp-pp, "
        "tp=2 cp=2 ep=2 etp=1 pp=1 dp=2 edp=4 dp_replicate=2 dp_shard=1"
    )
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert list(rows) == list(GROUP_KINDS + HSDP_KINDS)
    assert all(row[-1] == "ok" for row in rows.values())
    assert rows["tp-cp"][1:3] == ["4", "2"]
    assert rows["dp_replicate"][1:3] == ["2", "4"]
    assert lines[-1] == "all 17 group kinds verified on 8 ranks"


def test_check_summary_reports_failed_ranks():
    good = KindCheck("tp", (0, 1), ())
    bad = KindCheck("tp", (0, 1), ("all_gather of ranks gave [1, 0], expected [0, 1]",))
    rows = summarize([[good], [bad]])
    assert not rows[0].ok and rows[0].failed_ranks == (1,)
    assert format_summary(rows).splitlines()[1] == (
        "tp              2       1  FAILED on ranks [1]: "
        "all_gather of ranks gave [1, 0], expected [0, 1]"
    )


def test_check_under_torchrun_uses_the_launched_ranks():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "-m", "meshstate", "check", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "meshstate check: 4 ranks (gloo), order tp-cp-ep-dp-pp, " in result.stdout
    assert result.stdout.count("all 14 group kinds verified on 4 ranks") == 1
