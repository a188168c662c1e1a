"""Check a built mesh with real collectives, group by group.

For every group kind the calling rank checks that its process group holds
exactly the ranks the layout says, in that order: an all-reduce of
``[global rank, 1]`` must give the sum and the count of the member ranks, an
all-gather of the global ranks must return them in group order, and the
DeviceMesh of the kind must hold the same ranks (the mesh itself refuses one
whose local rank disagrees with its group's). This is what
``meshstate check`` runs on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshstate.core.errors import MeshStateError
from meshstate.core.mesh import ParallelMesh


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
    total = torch.tensor([float(mesh.global_rank), 1.0], device=device)
    dist.all_reduce(total, group=group)
    expected_total = [float(sum(ranks)), float(len(ranks))]
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
