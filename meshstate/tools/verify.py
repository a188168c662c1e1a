"""Check a built mesh with real collectives, group by group.

For every group kind the calling rank checks that its process group holds
exactly the ranks the layout says, in that order: an all-reduce of
``[global rank, 1]`` must give the sum and the count of the member ranks, an
all-gather of the global ranks must return them in group order, and the
DeviceMesh of the kind must hold the same ranks (the mesh itself refuses one
whose local rank disagrees with its group's). This is what
``meshstate check`` runs on every rank (:func:`check_layout`: build, verify,
destroy); :func:`verify_every_rank` makes the same checks for every rank of a
world simulated in one process (:func:`check_every_rank`, ``meshstate check
--simulate``, and the bench's timing of it), or for one stage's ranks of a world
simulated stage by stage, where it also checks the pp send/recv between stages
(``meshstate check --simulate --stages P``; :func:`merge_stages` makes one table).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core.build import init_mesh
from meshstate.layout.config import MeshConfig
from meshstate.errors import MeshStateError
from meshstate.core.mesh import ParallelMesh
from meshstate.core.world import outside_simulation, simulated_ranks



@dataclass(frozen=True)
class KindCheck:
    """The outcome of checking one group kind on one rank."""

    key: str
    ranks: tuple[int, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether the group matched the layout in every check."""
        return not self.problems


def rank_and_one(rank: int, device: torch.device | None = None) -> torch.Tensor:
    """``[rank, 1]``, which an all-reduce turns into a group's rank sum and size (integers:
    a float32 sum of 2,048 ranks past 8,192 is off by some)."""
    return torch.tensor([rank, 1], dtype=torch.int64, device=device)


def check_layout(
    config: MeshConfig, progress: Callable[[str], object] | None = None
) -> list[KindCheck]:
    """Build ``config``'s mesh on this rank, verify every group kind, destroy it.

    Rank 0 reports each phase to ``progress``.
    """
    say = progress if progress is not None and dist.get_rank() == 0 else None
    if say:
        say(f"{dist.get_world_size()} ranks ready; building the mesh")
    mesh = init_mesh(**config.arguments())
    try:
        if say:
            say("verifying every group kind with collectives")
        return verify_mesh(mesh)
    finally:
        mesh.destroy()


def check_every_rank(
    config: MeshConfig, progress: Callable[[str], object] = lambda message: None
) -> list[KindSummary]:
    """Build ``config``'s mesh for every rank of a simulated world and verify every group
    kind on all of them; run it in ``simulated_world(config.world_size).call`` (or, with
    ``stages=``, in every stage, each giving its own ranks' rows: :func:`merge_stages`).
    The first stage reports to ``progress``."""
    if 0 not in (simulated_ranks() or {0}):
        progress = _quiet
    progress(f"building the mesh of every rank ({config.world_size} ranks)")
    mesh = init_mesh(**config.arguments())
    try:
        return verify_every_rank(mesh, progress)
    finally:
        mesh.destroy()


def _quiet(message: str) -> None:
    pass


def verify_mesh(mesh: ParallelMesh) -> list[KindCheck]:
    """Check every group kind of ``mesh`` on the calling rank; every rank must call it.

    Example: on 8 ranks after ``init_mesh(tp=2)``, ``verify_mesh(mesh)[0]`` is
    ``KindCheck(key="tp", ranks=(0, 1), problems=())`` on rank 0.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    return [_check_kind(mesh, key, device) for key in mesh.kinds]


def _check_kind(mesh: ParallelMesh, key: str, device: torch.device) -> KindCheck:
    ranks = mesh.ranks(key)
    group = mesh.group(key)
    problems = []
    group_ranks = tuple(dist.get_process_group_ranks(group))
    if group_ranks != ranks:
        problems.append(f"process group has ranks {list(group_ranks)}, expected {list(ranks)}")
    if dist.get_rank(group) != mesh.rank(key):
        problems.append(f"rank in group is {dist.get_rank(group)}, expected {mesh.rank(key)}")
    total = rank_and_one(mesh.global_rank, device)
    dist.all_reduce(total, group=group)
    expected_total = [sum(ranks), len(ranks)]
    if total.tolist() != expected_total:
        problems.append(f"all_reduce of [rank, 1] gave {total.tolist()}, expected {expected_total}")
    mine = torch.tensor([mesh.global_rank], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    gathered_ranks = tuple(int(t.item()) for t in gathered)
    if gathered_ranks != ranks:
        problems.append(f"all_gather of ranks gave {list(gathered_ranks)}, expected {list(ranks)}")
    try:
        device_mesh = mesh[key]
    except MeshStateError as refused:
        problems.append(str(refused))
    else:
        if tuple(device_mesh.mesh.flatten().tolist()) != ranks:
            problems.append(f"DeviceMesh {key!r} holds {device_mesh.mesh.flatten().tolist()}")
    return KindCheck(key, tuple(ranks), tuple(problems))


def verify_every_rank(
    mesh: ParallelMesh, progress: Callable[[str], object] = lambda message: None
) -> list[KindSummary]:
    """:func:`verify_mesh` for every rank of a simulated world at once: the table's rows.

    Each collective runs once, over every group of its kind (torch's
    simulation); every rank's result is then compared with its group in the
    layout, as tensors over all ranks. ``progress`` is told each kind as it starts.
    In one stage of a world simulated stage by stage the rows are its ranks', and a
    last row (:data:`PIPELINE_SENDS`) checks the pp send/recv: each rank sends its
    rank to the next stage's rank of its pp group and receives the previous one's.

    Example: in ``simulated_world(8).call``, after ``init_mesh(tp=2)``,
    ``verify_every_rank(mesh)[0]`` is ``KindSummary("tp", 2, 4, (), "")``.
    """
    simulated = _simulated(mesh)
    world_size = dist.get_world_size()
    rows = []
    for number, key in enumerate(mesh.kinds, 1):
        progress(f"verifying {key!r} ({number} of {len(mesh.kinds)} kinds) on every rank")
        failed, first_problem = _check_kind_everywhere(mesh, key, simulated)
        size = mesh.size(key)
        rows.append(KindSummary(key, size, world_size // size, failed, first_problem))
    if len(simulated) < world_size:
        progress("verifying the pp send/recv between stages")
        rows.append(_check_pipeline_sends(mesh, simulated))
    return rows


PIPELINE_SENDS = "pp p2p"
"""The row of the pp send/recv between the stages of a world simulated stage by stage."""


def merge_stages(rows_by_stage: Sequence[Sequence[KindSummary]]) -> list[KindSummary]:
    """One table from every stage's rows (:func:`verify_every_rank` in each stage): a row
    fails on the ranks it fails on in any stage, with the first such rank's problem."""
    merged = []
    for stage_rows in zip(*rows_by_stage):
        failed = [row for row in stage_rows if row.failed_ranks]
        merged.append(replace(
            stage_rows[0], failed_ranks=tuple(rank for row in failed for rank in row.failed_ranks),
            first_problem=failed[0].first_problem if failed else "",
        ))
    return merged


def _simulated(mesh: ParallelMesh) -> torch.Tensor:
    """The ranks a simulated world's mesh answers for, in order (one stage's, or all)."""
    if mesh.simulated is None:
        raise MeshStateError("verify_every_rank takes a mesh built in a simulated world")
    with outside_simulation():  # one tensor, not one per simulated rank
        return torch.tensor(sorted(mesh.simulated))


def _check_kind_everywhere(
    mesh: ParallelMesh, key: str, simulated: torch.Tensor
) -> tuple[tuple[int, ...], str]:
    """The ranks whose group of ``key`` fails a check, and the first one's first problem."""
    from meshstate.core import compat
    from meshstate.simulation import local_compat
    from meshstate.simulation.per_rank import PerRankRanks, group_rank, simulated_groups

    ranks = mesh.ranks(key)
    assert isinstance(ranks, PerRankRanks)
    count, first, size, world_size = len(simulated), int(simulated[0]), len(ranks), dist.get_world_size()
    try:
        group = mesh.group(key)
        runs_over = simulated_groups(group)
        in_group, layout_index = group_rank(group), mesh.rank(key)
        with local_compat.simulation_paused():
            every_rank = simulated.unsqueeze(1)
            totals = torch.cat([every_rank, torch.ones_like(every_rank)], 1)
            gathers = torch.zeros(count, size, dtype=torch.int32)
            total, mine, gathered = (local_compat.per_rank_rows(rows, first)
                                     for rows in (totals, every_rank.int(), gathers))
        dist.all_reduce(total, group=group)  # in place: each rank's row of totals
        dist.all_gather_single(gathered, mine, group=group)  # and of gathers
    except MeshStateError as refused:
        return tuple(simulated.tolist()), str(refused)
    device_mesh: DeviceMesh | None
    device_mesh_refused = ""
    try:
        device_mesh = mesh[key]
    except MeshStateError as refused:
        device_mesh, device_mesh_refused = None, str(refused)
    with local_compat.simulation_paused():
        expected = _Groups(torch.tensor(ranks.groups()), world_size)
        torchs = _Groups(torch.tensor(runs_over), world_size)
        copies = expected if device_mesh is None else _Groups(
            compat.mesh_copies(device_mesh).reshape(-1, size), world_size)
        in_group_of, index_of = _per_rank(in_group, simulated), _per_rank(layout_index, simulated)
        failed = (
            expected.differs(torchs, simulated) | (in_group_of != index_of)
            | (totals != torch.stack([expected.sums(simulated), torch.full((count,), size)], 1)).any(1)
            | expected.differs_from_rows(gathers, simulated) | expected.differs(copies, simulated)
        )
        if device_mesh is None:
            failed[:] = True
        failed_at = failed.nonzero().flatten().tolist()
        if not failed_at:
            return (), ""
        at = failed_at[0]
        rank = int(simulated[at])
        problem = _first_problem(
            key, ranks.on(rank), torchs.of(rank), int(in_group_of[at]), int(index_of[at]),
            totals[at].tolist(), tuple(gathers[at].tolist()), copies.of(rank),
        )
    return tuple(simulated[failed_at].tolist()), problem or device_mesh_refused


def _check_pipeline_sends(mesh: ParallelMesh, simulated: torch.Tensor) -> KindSummary:
    """The :data:`PIPELINE_SENDS` row of one stage: its ranks' sends to the next stage and
    receives from the previous one over ``mesh.group("pp")``, checked by rank."""
    from meshstate.simulation import local_compat

    stages, stage, stage_size = mesh.size("pp"), mesh.rank("pp"), len(simulated)
    world_size = stages * stage_size
    with local_compat.simulation_paused():
        sent = local_compat.per_rank_rows(simulated.unsqueeze(1), int(simulated[0]))
        received = local_compat.per_rank_tensor(
            {int(rank): torch.full((1,), -1) for rank in simulated})
    pp = mesh.group("pp")
    try:
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sent, group=pp, group_peer=(stage + 1) % stages),
            dist.P2POp(dist.irecv, received, group=pp, group_peer=(stage - 1) % stages),
        ])
        for work in works:
            work.wait()
    except MeshStateError as refused:
        return KindSummary(PIPELINE_SENDS, stages, stage_size, tuple(simulated.tolist()), str(refused))
    with local_compat.simulation_paused():
        by_rank = local_compat.tensor_by_rank(received)
        assert by_rank is not None
        got = torch.stack([by_rank[int(rank)] for rank in simulated]).flatten()
        expected = (simulated - stage_size) % world_size
        failed = (got != expected).nonzero().flatten().tolist()
    problem = "" if not failed else (
        f"rank {int(simulated[failed[0]])} received {int(got[failed[0]])} from the previous "
        f"stage, expected rank {int(expected[failed[0]])}'s"
    )
    return KindSummary(PIPELINE_SENDS, stages, stage_size, tuple(simulated[failed].tolist()), problem)


class _Groups:
    """A partition of the world's ranks (or some of them) into groups of one size, one row
    each, read per rank."""

    def __init__(self, rows: torch.Tensor, world_size: int) -> None:
        self.rows = rows.long()
        groups, size = self.rows.shape
        self.group_of = torch.zeros(world_size, dtype=torch.long)
        self.group_of[self.rows.flatten()] = torch.arange(groups).repeat_interleave(size)
        self.position = torch.zeros(world_size, dtype=torch.long)
        self.position[self.rows.flatten()] = torch.arange(size).repeat(groups)

    def of(self, rank: int) -> tuple[int, ...]:
        """The group of ``rank``."""
        return tuple(self.rows[self.group_of[rank]].tolist())

    def sums(self, ranks: torch.Tensor) -> torch.Tensor:
        """Each of ``ranks``' group's sum of ranks."""
        return self.rows.sum(1)[self.group_of[ranks]]

    def differs(self, other: _Groups, ranks: torch.Tensor) -> torch.Tensor:
        """For each of ``ranks``: whether its group, or its place in it, differs in ``other``."""
        if other.rows.shape[1] != self.rows.shape[1]:
            return torch.ones(len(ranks), dtype=torch.bool)
        first = self.rows[:, 0][self.group_of[ranks]]
        others_first = other.rows[:, 0][other.group_of[ranks]]
        return (first != others_first) | (self.position[ranks] != other.position[ranks])

    def differs_from_rows(self, rows: torch.Tensor, ranks: torch.Tensor, chunk: int = 2**22) -> torch.Tensor:
        """For each ``ranks[i]``: whether ``rows[i]`` differs from its group (in slices of
        ``chunk`` elements, since a row per rank of large groups is large)."""
        step = max(1, chunk // rows.shape[1])
        return torch.cat([
            (rows[start:start + step] != self.rows[self.group_of[ranks[start:start + step]]]).any(1)
            for start in range(0, rows.shape[0], step)
        ])


def _first_problem(
    key: str,
    expected: tuple[int, ...],
    runs_over: tuple[int, ...],
    in_group: int,
    index: int,
    total: list[int],
    gathered: tuple[int, ...],
    device_mesh_ranks: tuple[int, ...],
) -> str | None:
    """The first of :func:`verify_mesh`'s checks one rank's answers fail, or ``None``."""
    expected_total = [sum(expected), len(expected)]
    if runs_over != expected:
        return f"process group has ranks {list(runs_over)}, expected {list(expected)}"
    if in_group != index:
        return f"rank in group is {in_group}, expected {index}"
    if total != expected_total:
        return f"all_reduce of [rank, 1] gave {total}, expected {expected_total}"
    if gathered != expected:
        return f"all_gather of ranks gave {list(gathered)}, expected {list(expected)}"
    if device_mesh_ranks != expected:
        return f"DeviceMesh {key!r} holds {list(device_mesh_ranks)}"
    return None


def _per_rank(value: int, ranks: torch.Tensor) -> torch.Tensor:
    """Each of ``ranks``' value of a per-rank int (or of a plain one), in order."""
    from meshstate.simulation.per_rank import value_on

    return torch.tensor([value_on(value, rank) for rank in ranks.tolist()])


@dataclass(frozen=True)
class KindSummary:
    """One row of ``meshstate check``'s table: a kind over all ranks."""

    key: str
    group_size: int
    group_count: int
    failed_ranks: tuple[int, ...]
    first_problem: str

    @property
    def ok(self) -> bool:
        """Whether every rank's group of this kind passed."""
        return not self.failed_ranks


def summarize(checks_by_rank: Sequence[Sequence[KindCheck]]) -> list[KindSummary]:
    """Fold every rank's checks into one row per kind."""
    world_size = len(checks_by_rank)
    summaries = []
    for position, first in enumerate(checks_by_rank[0]):
        column = [rank_checks[position] for rank_checks in checks_by_rank]
        failed = tuple(rank for rank, check in enumerate(column) if not check.ok)
        summaries.append(
            KindSummary(
                key=first.key,
                group_size=len(first.ranks),
                group_count=world_size // len(first.ranks),
                failed_ranks=failed,
                first_problem=column[failed[0]].problems[0] if failed else "",
            )
        )
    return summaries


def format_summary(summaries: Sequence[KindSummary]) -> str:
    """The per-kind table ``meshstate check`` prints."""
    lines = [f"{'kind':<10} {'size':>6} {'groups':>7}  result"]
    for row in summaries:
        result = "ok" if row.ok else f"FAILED on ranks {list(row.failed_ranks)}: {row.first_problem}"
        lines.append(f"{row.key:<10} {row.group_size:>6} {row.group_count:>7}  {result}")
    return "\n".join(lines)
