"""Check a built mesh with real collectives, group by group.

For every group kind the calling rank checks that its process group holds
exactly the ranks the layout says, in that order: an all-reduce of
``[global rank, 1]`` must give the sum and the count of the member ranks, an
all-gather of the global ranks must return them in group order, and the
DeviceMesh of the kind must hold the same ranks (the mesh itself refuses one
whose local rank disagrees with its group's). This is what
``meshstate check`` runs on every rank; :func:`verify_every_rank` makes the
same checks for every rank of a world simulated in one process
(``meshstate check --simulate``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshstate.core.errors import MeshStateError
from meshstate.core.mesh import ParallelMesh

if TYPE_CHECKING:
    from meshstate.core.simulated_mesh import SimulatedMesh


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
    mesh: SimulatedMesh, progress: Callable[[str], object] = lambda message: None
) -> list[KindSummary]:
    """:func:`verify_mesh` for every rank of a simulated world at once: the table's rows.

    Each collective runs once, over every group of its kind (torch's
    simulation); each rank's result is then checked against that rank's group
    in the layout. ``progress`` is told each kind as it starts.

    Example: in ``simulated_world(8).call``, after ``init_mesh(tp=2)``,
    ``verify_every_rank(mesh)[0]`` is ``KindSummary("tp", 2, 4, (), "")``.
    """
    rows = []
    for number, key in enumerate(mesh.kinds, 1):
        progress(f"verifying {key!r} ({number} of {len(mesh.kinds)} kinds) on every rank")
        problems = _check_kind_everywhere(mesh, key)
        size = mesh.size(key)
        failed = tuple(sorted(problems))
        first = problems[failed[0]] if failed else ""
        rows.append(KindSummary(key, size, len(mesh.simulated) // size, failed, first))
    return rows


def _check_kind_everywhere(mesh: SimulatedMesh, key: str) -> dict[int, str]:
    """The first problem of each simulated rank whose group of ``key`` fails a check."""
    from meshstate.core import compat, local_compat
    from meshstate.core.per_rank import PerRankRanks, group_rank, simulated_groups

    ranks = mesh.ranks(key)
    assert isinstance(ranks, PerRankRanks)
    expected = {rank: ranks.on(rank) for rank in mesh.simulated}
    try:
        group = mesh.group(key)
        runs_over = simulated_groups(group)
        in_group, layout_index = group_rank(group), mesh.rank(key)
        total = local_compat.per_rank_tensor(rank_and_one)
        dist.all_reduce(total, group=group)
        mine = local_compat.per_rank_tensor(lambda rank: torch.tensor([rank]))
        gathered = local_compat.per_rank_tensor(lambda rank: torch.zeros(len(ranks), dtype=torch.int64))
        dist.all_gather_single(gathered, mine, group=group)
        device_mesh = mesh[key]
        with local_compat.simulation_paused():
            every_copy = compat.mesh_copies(device_mesh).reshape(-1, len(ranks))
    except MeshStateError as refused:
        return dict.fromkeys(mesh.simulated, str(refused))
    problems: dict[int, str] = {}
    with local_compat.simulation_paused():
        checks = _by_rank(runs_over), _values(in_group), _values(layout_index), _by_rank(every_copy.tolist())
        runs_over_of, in_group_of, index_of, copy_of = checks
        totals, gathers = local_compat.tensor_by_rank(total), local_compat.tensor_by_rank(gathered)
        assert totals is not None and gathers is not None
        for rank in sorted(mesh.simulated):
            group_ranks = expected[rank]
            found = [
                (runs_over_of[rank] != group_ranks,
                 f"process group has ranks {list(runs_over_of[rank])}, expected {list(group_ranks)}"),
                (in_group_of[rank] != index_of[rank],
                 f"rank in group is {in_group_of[rank]}, expected {index_of[rank]}"),
                (totals[rank].tolist() != [sum(group_ranks), len(group_ranks)],
                 f"all_reduce of [rank, 1] gave {totals[rank].tolist()}, expected "
                 f"{[sum(group_ranks), len(group_ranks)]}"),
                (tuple(gathers[rank].tolist()) != group_ranks,
                 f"all_gather of ranks gave {gathers[rank].tolist()}, expected {list(group_ranks)}"),
                (copy_of[rank] != group_ranks,
                 f"DeviceMesh {key!r} holds {list(copy_of[rank])}"),
            ]
            problem = next((message for failed, message in found if failed), None)
            if problem is not None:
                problems[rank] = problem
    return problems


def _by_rank(groups: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Each rank's group among disjoint ``groups``."""
    return {rank: tuple(group) for group in groups for rank in group}


def _values(value: int) -> dict[int, int]:
    """Each simulated rank's value of a per-rank int (or of a plain one)."""
    from meshstate.core.per_rank import value_on

    return {rank: value_on(value, rank) for rank in range(dist.get_world_size())}


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
