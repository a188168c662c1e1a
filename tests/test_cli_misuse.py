"""The meshstate command misused: oversize worlds, absurd numbers, closed pipes, signals, help."""

import json
import multiprocessing.process
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import heed_ctrl_c
import torch

from meshstate.tools.bench import init as bench_init
from meshstate.tools.bench import processes as bench_processes
from meshstate.tools.cli import commands as cli_commands
from meshstate.tools.cli import parser as cli_parser
from meshstate.tools.cli import plan as cli_plan
from meshstate.tools.cli import shared as cli_shared
from meshstate.tools.cli import main
from meshstate.tools.cli.commands import LocalCapacity

GIB = 2**30


def run_main(capsys, *argv):
    """``main(argv)`` in this process: (status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if anything starts a process (a rank, a LocalWorld)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(cli_commands, "run_local", refuse)
    monkeypatch.setattr(bench_processes, "LocalWorld", refuse)


@pytest.fixture
def two_cpus_24_gib(monkeypatch):
    monkeypatch.setattr(cli_commands, "local_capacity", lambda: LocalCapacity(2, 24 * GIB))


@pytest.mark.parametrize(
    "capacity, limit",
    [
        (LocalCapacity(2, 24 * GIB), 16),  # this machine and CI: the CPUs bound it
        (LocalCapacity(2, 2 * GIB), 4),  # little memory left
        (LocalCapacity(64, None), 512),  # memory unknown: CPUs alone
        (LocalCapacity(1, 100 * 2**20), 1),  # never below one rank
    ],
)
def test_local_capacity(capacity, limit):
    assert capacity.limit == limit


def test_this_machine_holds_the_default_check_and_bench():
    assert cli_commands.local_capacity().limit >= 16


def test_oversize_check_is_refused_before_any_process_starts(capsys, no_processes, two_cpus_24_gib):
    status, out, err = run_main(capsys, "check", "--world-size", "4096")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "meshstate check: error: 4096 local ranks are more than this machine holds: at most 16 "
        "(2 CPUs x 8 ranks; 24.0 GiB available / 0.5 GiB per rank); `meshstate plan "
        "--world-size 4096` shows the groups without processes, `meshstate bench` simulates "
        "large worlds, or add --force to start them anyway"
    ]


def test_oversize_bench_processes_are_refused_before_anything_runs(
    capsys, no_processes, two_cpus_24_gib
):
    status, out, err = run_main(capsys, "bench", "--world-sizes", "1024", "--processes", "8,64")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "meshstate bench: error: 64 local ranks are more than this machine holds: at most 16 "
        "(2 CPUs x 8 ranks; 24.0 GiB available / 0.5 GiB per rank); pass smaller --processes "
        "(0 for none), or add --force to start them anyway"
    ]


class Started(Exception):
    """Raised by a stand-in for ``run_local`` once the CLI has decided to start ranks."""


def test_force_starts_an_oversize_world(monkeypatch, two_cpus_24_gib):
    def record(fn, world_size, *args, **kwargs):
        raise Started(world_size)

    monkeypatch.setattr(cli_commands, "run_local", record)
    with pytest.raises(Started) as started:
        main(["check", "--world-size", "4096", "--force"])
    assert started.value.args == (4096,)


def test_under_torchrun_the_launched_world_is_used_without_a_limit(monkeypatch):
    def unused():
        raise AssertionError("the capacity was consulted under torchrun")

    def record(*args, **kwargs):
        raise Started(os.environ["WORLD_SIZE"])

    monkeypatch.setattr(cli_commands, "local_capacity", unused)
    monkeypatch.setattr(cli_commands, "init_mesh", record)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4096")
    with pytest.raises(Started) as started:
        main(["check"])
    assert started.value.args == ("4096",)


TOO_MANY = str(2**31)
ABSURD = [
    (["plan", "--world-size", TOO_MANY],
     "argument --world-size: expected at most 2147483647 (the most ranks c10d can address), "
     "got 2147483648"),
    (["plan", "--world-size", "8", "--tp", str(2**40)],
     "argument --tp: expected at most 2147483647 (the most ranks c10d can address), "
     "got 1099511627776"),
    (["plan", "--world-size", "8", "--pp", "abc"],
     "argument --pp: expected a positive integer, got 'abc'"),
    (["plan", "--world-size", "8", "--etp", "-2"],
     "argument --etp: expected a positive integer, got -2"),
    (["plan", "--world-size", str(2**31 - 1), "--json"],
     "--json: listing every group needs a world of at most 1048576 ranks, got 2147483647; "
     "without it the table (and --rank) works at any world size"),
    (["plan", "--world-size", str(2**21), "--json", "--gpus-per-node", "8"],
     "--json and --gpus-per-node: listing every group needs a world of at most 1048576 ranks, "
     "got 2097152; without them the table (and --rank) works at any world size"),
    (["plan", "--world-size", "8", "--rank", str(2**40)], "--rank 1099511627776 is outside 0..7"),
    (["check", "--world-size", "0"], "argument --world-size: expected a positive integer, got 0"),
    (["check", "--timeout", "0"], "argument --timeout: expected a positive integer, got 0"),
    (["check", "--timeout", str(10**20)],
     "argument --timeout: expected at most 86400 (one day), got 100000000000000000000"),
    (["bench", "--world-sizes", "0"],
     "argument --world-sizes: expected a positive integer, got 0"),
    (["bench", "--world-sizes", "1024,,16384"],
     "argument --world-sizes: expected a positive integer, got ''"),
    (["bench", "--world-sizes", str(2**23), "--processes", "0"],
     "fake world size 8388608 is above 4194304, the most one process can stand a rank in for "
     "(DeviceMesh and megatron-core hold world-sized maps)"),
    (["bench", "--world-sizes", "1024", "--rank", "1024", "--processes", "0"],
     "rank 1024 is outside 0..1023"),
    (["bench", "--repeat", "0"], "argument --repeat: expected a positive integer, got 0"),
    (["bench", "--processes", "0,8"], "argument --processes: expected a positive integer, got 0"),
    (["bench", "--world-sizes", "1024", "--processes", "12"],
     "local processes (tp=2 cp=2 pp=2 ep=2 etp=1): world size 12 is not divisible by "
     "tp*cp*pp = 2*2*2 = 8"),
]


@pytest.mark.parametrize("argv, message", ABSURD, ids=[" ".join(argv) for argv, _ in ABSURD])
def test_absurd_numbers_are_one_line_errors(capsys, no_processes, two_cpus_24_gib, argv, message):
    status, out, err = run_main(capsys, *argv)
    assert (status, out) == (2, "")
    assert err.splitlines() == [f"meshstate {argv[0]}: error: {message}"]


def test_nccl_without_gpus_is_one_line_before_any_process(capsys, monkeypatch, no_processes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = run_main(capsys, "check", "--backend", "nccl")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "meshstate check: error: --backend nccl needs a GPU per local rank: 8 ranks, "
        "0 GPUs visible; use --backend gloo"
    ]


def test_nccl_under_torchrun_needs_a_gpu_per_local_rank(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_commands, "init_mesh", lambda *a, **k: pytest.fail("init_mesh was called"))
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    status, out, err = run_main(capsys, "check", "--backend", "nccl")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "meshstate check: error: --backend nccl needs a GPU per local rank: 2 ranks, "
        "0 GPUs visible; use --backend gloo"
    ]


def test_a_bug_still_shows_its_traceback(monkeypatch):
    def broken(args, progress):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli_plan, "run_plan", broken)
    with pytest.raises(ZeroDivisionError):
        main(["plan", "--world-size", "8"])


def test_plan_table_at_the_largest_c10d_world(capsys):
    status, out, _ = run_main(capsys, "plan", "--world-size", str(2**31 - 1), "--rank", "5")
    assert status == 0
    lines = out.splitlines()
    assert "dp         2147483647       1  [0, 1, 2, 3, 4, 5, 6, 7, …]" in lines
    assert "dp              5  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, …]" in lines


# --- a closed stdout pipe ---------------------------------------------------------------


def test_closed_pipe_in_process_is_quiet(capsys):
    read_end, write_end = os.pipe()
    os.close(read_end)
    saved = sys.stdout
    sys.stdout = os.fdopen(write_end, "w")
    try:
        status = main(["plan", "--world-size", "64", "--tp", "2", "--json"])
    finally:
        sys.stdout.close()
        sys.stdout = saved
    assert status == cli_shared.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def run_into_closed_pipe(*argv):
    """Run ``meshstate argv`` with a stdout nobody reads, as ``| head`` leaves it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "meshstate", *argv], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    return result


@pytest.mark.parametrize("form", [["--json"], []], ids=["json", "table"])
def test_closed_pipe_is_quiet(form):
    result = run_into_closed_pipe("plan", "--world-size", "64", "--tp", "2", *form)
    assert result.returncode == cli_shared.EXIT_BROKEN_PIPE
    assert result.stderr == ""


def test_head_reads_part_of_the_json_quietly():
    result = subprocess.run(
        f"{sys.executable} -m meshstate plan --world-size 4096 --tp 2 --json | head -c 10; "
        'echo " ${PIPESTATUS[0]}"',
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120,
    )
    assert result.stdout == '{"world_si 141\n'
    assert result.stderr == ""


# --- progress and help ------------------------------------------------------------------

BENCH_SMALL = ["bench", "--world-sizes", "16", "--tp", "2", "--cp", "1", "--pp", "2", "--ep", "2",
               "--repeat", "1", "--processes", "0", "--without-megatron", "--without-torchtitan",
               "--harness-tests", "0", "--without-runtime", "--simulated-checks", "0",
               "--simulated-pipeline", "0", "--compile-ranks", "0", "--checkpoint-ranks", "0",
               "--json"]


def test_bench_progress_only_when_asked_or_on_a_terminal(capsys):
    status, out, err = run_main(capsys, *BENCH_SMALL)
    assert status == 0 and json.loads(out) and err == ""
    status, out, err = run_main(capsys, *BENCH_SMALL, "--verbose")
    assert status == 0 and json.loads(out)
    assert err.splitlines() == [
        f"meshstate bench: world 16, rank 9: {approach}"
        for approach in (bench_init.INIT_MESH, bench_init.PARALLEL_STATE, bench_init.DEVICE_MESH)
    ]


def test_bench_measures_worlds_of_one_and_two_ranks(capsys):
    status, out, err = run_main(capsys, "bench", "--world-sizes", "1,2", "--tp", "1", "--cp", "1",
                                "--pp", "1", "--ep", "1", "--etp", "1", "--repeat", "1",
                                "--processes", "0", "--harness-tests", "0", "--simulated-checks", "0",
                                "--simulated-pipeline", "0", "--compile-ranks", "0",
                                "--checkpoint-ranks", "0", "--without-megatron", "--without-torchtitan",
                                "--without-runtime", "--json")
    assert (status, err) == (0, "")
    assert {row["world_size"] for row in json.loads(out)["rows"]} == {1, 2}


def test_a_world_size_torchrun_did_not_launch_is_refused_at_once(capsys, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    status, out, err = run_main(capsys, "check", "--world-size", "16", "--tp", "2")
    assert (status, out) == (2, "")
    assert err == "meshstate check: error: --world-size 16 differs from torchrun's WORLD_SIZE 8\n"
    status, out, err = run_main(capsys, "check", "--tp", "3")  # the launched 8 ranks' layout
    assert (status, out) == (2, "")
    assert err == "meshstate check: error: world size 8 is not divisible by tp*cp*pp = 3*1*1 = 3\n"


def test_plan_says_when_it_lists_a_large_world(capsys):
    status, out, err = run_main(capsys, "plan", "--world-size", "65536", "--json", "--verbose")
    assert status == 0 and json.loads(out)["world_size"] == 65536
    assert err.splitlines() == ["meshstate plan: listing every group of 65536 ranks"]


def help_entries(capsys, command):
    """``{"--tp": "tensor parallel size (default: 1)", ...}`` from ``meshstate COMMAND --help``."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out.split("options:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", text.strip("\n"))
    return {
        entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries
    }


@pytest.mark.parametrize("command", ["plan", "check", "bench"])
def test_help_shows_every_default(capsys, command):
    entries = help_entries(capsys, command)
    flags = {"-h", "--json", "--verbose", "--force", "--without-megatron", "--without-torchtitan",
             "--without-runtime", "--simulate"}
    required = {"--world-size"} if command == "plan" else set()
    assert "--verbose" in entries
    for option, entry in entries.items():
        if option not in flags | required:
            assert "(default: " in entry, entry


def test_the_same_option_has_the_same_default_everywhere():
    parser = cli_parser.build_parser()
    defaults = {
        "plan": vars(parser.parse_args(["plan", "--world-size", "8"])),
        "check": vars(parser.parse_args(["check"])),
        "bench": vars(parser.parse_args(["bench"])),
    }
    assert defaults["plan"]["tp"] == 1 and defaults["plan"]["etp"] is None
    # bench's simulated layout is its own (a large model's) and its help says so.
    bench_layout = {"tp", "cp", "ep", "etp", "pp"}
    for option in set(defaults["plan"]) | set(defaults["check"]) | set(defaults["bench"]):
        if option in {"command", "world_size"}:
            continue
        values = {
            command: given[option] for command, given in defaults.items()
            if option in given and not (command == "bench" and option in bench_layout)
        }
        assert len({repr(v) for v in values.values()}) == 1, (option, values)


def test_bench_help_names_its_own_layout(capsys):
    entries = help_entries(capsys, "bench")
    assert entries["--tp"] == "--tp TP tensor parallel size of the simulated layout (default: 8)"


# --- what is fast: help and argument errors without torch ---------------------------------

WITHOUT_TORCH = [
    ["--help"], ["plan", "--help"], ["check", "--help"], ["bench", "--help"], ["plan"],
    ["plan", "--world-size", "8", "--dp", "4"], ["launch"],
    ["check", "--simulate", "--backend", "gloo"], ["bench", "--simulated-checks", "x"],
    ["plan", "--world-size", "12", "--tp", "8"], ["check", "--tp", "3"],
    ["check", "--simulate", "--world-size", "1001", "--tp", "8"],
]
IMPORTS_AFTER = """
import sys
from meshstate.tools.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit:
        pass
    loaded = sorted(name for name in ("torch", "numpy", "einops") if name in sys.modules)
    print(" ".join(argv), "->", loaded, file=sys.stderr)
"""


def test_help_and_argument_errors_import_no_torch():
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER.format(argvs=WITHOUT_TORCH)],
        capture_output=True, text=True, timeout=120,
    )
    reports = [line for line in result.stderr.splitlines() if " -> " in line]
    assert reports == [f"{' '.join(argv)} -> []" for argv in WITHOUT_TORCH], result.stderr


def test_a_command_without_numpy_prints_no_warning(tmp_path):
    # A fresh venv has no numpy (torch does not depend on it); hide this one's.
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert "Failed to initialize NumPy" in probe.stderr  # torch itself warns
    result = subprocess.run([sys.executable, "-m", "meshstate", "plan", "--world-size", "8",
                             "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0
    assert result.stderr == ""
    assert json.loads(result.stdout)["groups"]["dp"] == [list(range(8))]


def test_a_slow_step_says_what_it_is_doing(capsys):
    progress = cli_shared.Progress("plan", enabled=True)
    with progress.if_slow("importing torch", after=0.01):
        time.sleep(0.5)
    with progress.if_slow("listing", after=5):
        pass
    time.sleep(0.05)
    assert capsys.readouterr().err.splitlines() == ["meshstate plan: importing torch"]


# --- signals ----------------------------------------------------------------------------


def children(pid):
    """Pids descended from ``pid`` (workers are children of the fork server it starts)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def has_torch(pid):
    """Whether ``pid`` has loaded torch: a spawned worker past reading what its parent sent."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch" in maps.read()
    except OSError:
        return False


def alive(pid):
    """Whether ``pid`` runs (a zombie is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, seconds):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    "signum, status, word",
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_signal_mid_check_stops_every_worker(signum, status, word):
    marker = f"MESHSTATE_SIGNAL_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    check = subprocess.Popen(
        [sys.executable, "-m", "meshstate", "check"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=heed_ctrl_c,  # a shell's background job starts with SIGINT ignored
        env={**os.environ, name: value},
    )
    try:
        # Mid-start: the first rank is importing torch, the others may not exist yet
        # (a signal during a worker's start waits until it is recorded, then kills it).
        assert wait_for(lambda: any(map(has_torch, children(check.pid))), 120)
        check.send_signal(signum)
        out, err = check.communicate(timeout=60)
        assert check.returncode == status, err
        assert out == ""
        assert err.splitlines()[-1] == f"meshstate check: {word}"
        assert "Traceback" not in err
        assert wait_for(lambda: not marked(marker), 10), marked(marker)
    finally:
        for pid in [check.pid, *marked(marker)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        check.wait()


def marked(marker):
    """Live processes whose environment holds ``marker`` (the command and every worker)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker.encode() in environ.read().split(b"\0") and alive(int(entry)):
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found
