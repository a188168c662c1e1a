"""meshstate check --simulate: every rank of a large world built and verified in one process."""

import subprocess
import sys

import pytest

import meshstate
from meshstate.testing import simulated_world
from meshstate.tools.cli import main
from meshstate.tools.verify import KindSummary, rank_and_one, verify_every_rank


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshstate", *args], capture_output=True, text=True, timeout=timeout
    )


def test_check_simulates_1024_ranks_and_prints_the_table() -> None:
    done = run_cli("check", "--simulate", "--world-size", "1024", "--tp", "8", "--cp", "2",
                   "--pp", "4", "--verbose")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("meshstate check: 1024 ranks (simulated), order tp-cp-ep-dp-pp, tp=8 cp=2 "
                        "ep=1 etp=8 pp=4 dp=16 edp=32")
    assert lines[1].split() == ["kind", "size", "groups", "result"]
    assert lines[2].split() == ["tp", "8", "128", "ok"]
    assert lines[-1] == "all 14 group kinds verified on 1024 ranks"
    assert "verifying 'edp' (14 of 14 kinds) on every rank" in done.stderr


def test_check_simulates_an_expert_layout(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["--world-size", "64", "--tp", "2", "--pp", "4", "--ep", "4", "--etp", "1"]
    assert main(["check", "--simulate", *arguments]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1] == "all 14 group kinds verified on 64 ranks"
    assert "etp-ep-pp      16       4  ok" in table


def test_check_simulates_pipelines_of_strided_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--simulate", "--world-size", "16", "--pp", "4"]) == 0
    assert "pp              4       4  ok" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--world-size", "1001", "--tp", "8"],
     "meshstate check: error: world size 1001 is not divisible by tp*cp*pp = 8*1*1 = 8"),
    (["--backend", "gloo"], "argument --backend: not allowed with argument --simulate"),
])
def test_a_layout_error_exits_2_before_anything_is_built(args: list[str], message: str) -> None:
    done = run_cli("check", "--simulate", *args, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_rank_sums_stay_exact_past_float32() -> None:
    assert rank_and_one(2**24 + 1).tolist() == [2**24 + 1, 1]


def verify_with_tp_given_cp_groups() -> list[KindSummary]:
    mesh = meshstate.init_mesh(tp=2, cp=2)
    assert mesh.simulated is not None
    mesh._group_of["tp"] = mesh._group_of["cp"]
    return verify_every_rank(mesh)


def test_a_wrong_group_fails_on_every_rank() -> None:
    rows = {row.key: row for row in simulated_world(8).call(verify_with_tp_given_cp_groups)}
    assert rows["tp"].failed_ranks == tuple(range(8))
    assert rows["tp"].first_problem == "process group has ranks [0, 2], expected [0, 1]"
    assert all(row.ok for key, row in rows.items() if key != "tp")
