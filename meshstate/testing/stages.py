"""One pipeline stage of a world simulated stage by stage, and the real channel between stages.

``simulated_world(N, stages=P)`` (:mod:`meshstate.testing.simulated`) runs each of P
contiguous blocks of N/P ranks as a program of its own, in a process of its own: rank 0
of torch's fake backend (holding rank 0's groups, from which torch's simulation infers
every other group, as in a whole simulated world), with ``LocalTensorMode`` simulating
the block's ranks only. With pp the outermost axis of the layout (Megatron's default
order) a block is a pipeline stage, and every group either lies inside one stage or
meets every stage alike (pp, and the joint groups with pp).

:class:`StageChannel` connects the stages' processes: a gloo group with one member per
stage. While a body runs, :func:`between_stages` makes point-to-point real across
stages: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` (so torch's
``PipelineStage`` and its schedules), ``send_object_list`` and ``recv_object_list``.
Each simulated rank's peer is worked out as its own process would (a member of its
group, or the rank it names); every rank of the block must reach the rank the same
distance away, in another stage, so that one message carries the whole block's
tensors, received into the peer block's per-rank tensor. torch's own modules name
peers as the process sees them; a peer the ranks would not reach alike is refused.
``all_reduce``, ``all_gather_into_tensor`` (``all_gather_single``) and ``broadcast``
over a group that spans stages run through the channel too: each stage reduces or
gathers its members (or holds the source's tensor), then the stages exchange their parts. Any other collective over such a group raises
:class:`~meshstate.errors.SimulationError` naming the call and the group, where
torch's simulation would skip it without a word.

Example, in stage 0 of ``simulated_world(8, stages=2)`` with ``init_mesh(tp=2, pp=2)``::

    dist.send(torch.full((1,), dist.get_rank()), group=mesh.group("pp"), group_dst=1)
    # one message: ranks 0-3's tensors, received into ranks 4-7's
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshstate.errors import OTHER_WORLDS, SimulationError
from meshstate.layout.ranks import ranks_text
from meshstate.simulation import local_compat
from meshstate.simulation.the_body import from_a_library
from meshstate.simulation.per_rank import (
    holds_per_rank,
    members,
    per_rank_int,
    per_rank_value,
    simulated_groups,
    value_on,
)

_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                   "recv_object_list")
"""What :func:`between_stages` replaces in ``torch.distributed`` and in c10d (whose
``P2POp`` checks an op against its own ``isend`` and ``irecv``)."""
_REDUCTIONS: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: lambda parts: parts.sum(0),
    dist.ReduceOp.AVG: lambda parts: parts.sum(0),  # divided by the group's size after
    dist.ReduceOp.PRODUCT: lambda parts: parts.prod(0),
    dist.ReduceOp.MAX: lambda parts: parts.amax(0),
    dist.ReduceOp.MIN: lambda parts: parts.amin(0),
}
"""Each reduction an all-reduce across stages runs, over one stage's members of a group."""


class StageChannel:
    """The processes of a world's stages, connected by a gloo group of one member each.

    Made in every stage's process, ``stage`` of ``stages``, once the process simulates its
    block: ranks ``stage * stage_size`` to ``(stage + 1) * stage_size - 1``. ``store_path`` is
    a file every stage's process reaches (a ``FileStore``); ``timeout`` bounds each message.
    """

    def __init__(
        self, store_path: str, stage: int, stages: int, world_size: int, timeout: timedelta
    ) -> None:
        self.stage, self.stages = stage, stages
        self.stage_size = world_size // stages
        self.world_size = world_size
        self.ranks = range(stage * self.stage_size, (stage + 1) * self.stage_size)
        # gloo's backend: send, recv, allreduce and allgather, which torch's stubs leave out.
        self.group: Any = dist.ProcessGroupGloo(local_compat.FileStore(store_path, stages), stage, stages, timeout)

    def describe(self) -> str:
        """``"stage 1 (ranks 4-7)"``."""
        return f"stage {self.stage} (ranks {self.ranks.start}-{self.ranks.stop - 1})"

    def peer_stage(self, peers: dict[int, int], what: str) -> int:
        """The stage every rank's peer in ``peers`` (by simulated rank) is in: refused unless
        each rank's peer is the same distance away, in another stage."""
        distances = {peer - rank for rank, peer in peers.items()}
        if len(distances) > 1:
            shown = ", ".join(f"{rank} -> {peer}" for rank, peer in list(peers.items())[:4])
            raise SimulationError(
                f"{what} in {self.describe()} of a world simulated in stages: the ranks' peers "
                f"({shown}, …) are not each rank's own rank shifted alike, so no one message "
                f"carries them; send over mesh.group('pp'), or {OTHER_WORLDS}"
            )
        distance = distances.pop()
        target = self.ranks.start + distance
        if distance % self.stage_size or not 0 <= target < self.world_size or distance == 0:
            raise SimulationError(
                f"{what} in {self.describe()} to ranks {distance:+d} away: a world simulated in "
                "stages sends only between stages (to a rank of another stage, the same "
                f"place in it); torch simulates send and recv inside a stage only with a thread "
                f"per rank; {OTHER_WORLDS}"
            )
        return target // self.stage_size

    def post_send(self, tensor: torch.Tensor, peer_stage: int, tag: int, what: str) -> dist.Work:
        """Send every simulated rank's ``tensor`` to ``peer_stage`` in one message."""
        with local_compat.simulation_paused():
            message = torch.stack(self._values(tensor, what)).contiguous()
            work: dist.Work = self.group.send([message], peer_stage, tag)
        return work

    def post_recv(self, tensor: torch.Tensor, peer_stage: int, tag: int, what: str) -> dist.Work:
        """Receive one message from ``peer_stage`` into every simulated rank's ``tensor``,
        once the returned work is waited for."""
        values = local_compat.tensor_by_rank(tensor)
        if values is None or local_compat.shared_between_ranks(tensor):
            raise SimulationError(
                f"{what} into a tensor of shape {tuple(tensor.shape)} that the simulated ranks "
                "share (one made outside the body, or a view of one): each rank receives its "
                "own values; make it inside the body (torch.empty, torch.zeros), or "
                f"{OTHER_WORLDS}"
            )
        first = values[self.ranks.start]
        self._same_shapes(values, what)
        with local_compat.simulation_paused():
            message = torch.empty((self.stage_size, *first.shape), dtype=first.dtype)
            work = self.group.recv([message], peer_stage, tag)

        def land() -> None:
            with local_compat.simulation_paused():
                for rank, row in zip(self.ranks, message.unbind(0)):
                    values[rank].copy_(row)

        return _Received(work, land)

    def send_objects(self, objects: list[Any], peer_stage: int) -> None:
        """Send every simulated rank's ``objects`` (pickled) to ``peer_stage``."""
        payload = pickle.dumps([value_on(objects, rank) for rank in self.ranks])
        with local_compat.simulation_paused():
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.group.send([torch.tensor([data.numel()], dtype=torch.int64)], peer_stage, 0).wait()
            self.group.send([data], peer_stage, 0).wait()

    def recv_objects(self, peer_stage: int) -> list[list[Any]]:
        """Each simulated rank's objects from ``peer_stage``, in rank order."""
        with local_compat.simulation_paused():
            size = torch.zeros(1, dtype=torch.int64)
            self.group.recv([size], peer_stage, 0).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.group.recv([data], peer_stage, 0).wait()
        received: list[list[Any]] = pickle.loads(data.numpy().tobytes())
        return received

    def spanned(self, group: dist.ProcessGroup | None) -> list[list[int]] | None:
        """For a group whose members lie in different stages: this stage's members of each of
        its groups (each group meets every stage alike, as pp and its joint groups do);
        ``None`` where every group the stage's ranks are in lies inside the stage."""
        family = simulated_groups(group or cast(dist.ProcessGroup, c10d.GroupMember.WORLD))
        mine = set(self.ranks)
        if all(mine.issuperset(ranks) for ranks in family if mine.intersection(ranks)):
            return None
        return [[rank for rank in ranks if rank in mine] for ranks in family]

    def refuse_across(
        self, collective: str, group: dist.ProcessGroup, rank_sets: Sequence[Sequence[int]]
    ) -> None:
        """Refuse ``collective``, which torch's simulation would run over ``rank_sets``, where
        one of them holds ranks of this stage and of another (torch would skip it)."""
        mine = set(self.ranks)
        for ranks in rank_sets:
            if mine.intersection(ranks) and not mine.issuperset(ranks):
                raise SimulationError(
                    f"{collective} over {group_name(group)} (a group such as {ranks_text(ranks)}) "
                    f"in {self.describe()} of a world simulated in stages: its ranks are in "
                    "different stages' processes, which exchange point-to-point messages (send, "
                    "recv, batch_isend_irecv), all_reduce, all_gather_into_tensor and broadcast only; "
                    f"{OTHER_WORLDS}"
                )

    def _values(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        values = local_compat.tensor_by_rank(tensor)
        if values is None:
            return [tensor.detach()] * self.stage_size  # every rank's the same
        self._same_shapes(values, what)
        return [values[rank].detach() for rank in self.ranks]

    def _same_shapes(self, values: dict[int, torch.Tensor], what: str) -> None:
        shapes = {tuple(value.shape) for value in values.values()}
        if len(shapes) > 1:
            raise SimulationError(
                f"{what} of a tensor whose shape differs between the simulated ranks "
                f"({', '.join(map(str, sorted(shapes)[:4]))}): one message carries every rank's "
                f"of one shape; {OTHER_WORLDS}"
            )


class _Received(dist.Work):
    """A receive posted on the channel: waited for, each rank's tensor holds its values."""

    def __init__(self, work: dist.Work, land: Callable[[], None]) -> None:
        super().__init__()
        self._work, self._land, self._landed = work, land, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._landed:
            self._work.wait()
            self._land()
            self._landed = True
        return True


class _Done(dist.Work):
    """The work of a collective already done (``async_op=True`` across stages)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def group_name(group: dist.ProcessGroup | None) -> str:
    """``"the 'pp' group"`` for a group meshstate made, else the default group or its ranks."""
    if group is None or group is c10d.GroupMember.WORLD:
        return "the default group"
    description = group.group_desc
    if description.startswith("meshstate:"):
        return f"the {description.removeprefix('meshstate:')!r} group"
    return f"the group of ranks {ranks_text(c10d.get_process_group_ranks(group))}"


class _PointToPoint:
    """``torch.distributed``'s point-to-point calls and the collectives across stages, over
    a :class:`StageChannel`."""

    def __init__(self, channel: StageChannel) -> None:
        self.channel = channel

    def get_backend(self, torchs: Callable[..., Any]) -> Callable[..., Any]:
        """``dist.get_backend``, naming gloo, which carries their messages, for the groups
        other than the world that span stages (torch 2.14's pipelining refuses to infer
        shapes over a ``fake`` group, whose receives would read zeros; here they do not)."""

        def get_backend(group: dist.ProcessGroup | None = None) -> Any:
            if group is not None and group is not c10d.GroupMember.WORLD and (
                self.channel.spanned(group) is not None
            ):
                return dist.Backend.GLOO
            return torchs(group)

        return get_backend

    def peer_stage(
        self, what: str, group: dist.ProcessGroup | None, peer: int | None,
        group_peer: int | None, library: bool,
    ) -> tuple[int, dict[int, int]]:
        """The stage ``what`` reaches, and each simulated rank's peer (a global rank): member
        ``group_peer`` of its group, or ``peer`` as each rank gives it. torch's and
        meshstate's own modules speak as the process (rank 0, whose groups it holds), so
        their ``peer`` is read as a member of its group."""
        group = group or cast(dist.ProcessGroup, c10d.GroupMember.WORLD)
        ranks = self.channel.ranks
        if peer is None and group_peer is None:
            raise SimulationError(
                f"{what} without a peer (from any source) in a world simulated in stages: name "
                f"the peer (src or group_src), or {OTHER_WORLDS}"
            )
        if peer is not None and group_peer is None and not holds_per_rank(peer):
            if not library:
                peers = dict.fromkeys(ranks, peer)
                return self.channel.peer_stage(peers, what), peers
            group_peer = c10d.get_group_rank(group, peer)  # c10d's own: the process's answer
        if group_peer is None:
            peers = {rank: value_on(peer, rank) for rank in ranks}
        else:
            of_rank = members(group)
            peers = {rank: of_rank.on(rank)[value_on(group_peer, rank)] for rank in ranks}
        return self.channel.peer_stage(peers, what), peers

    def isend(
        self, tensor: torch.Tensor, dst: int | None = None, group: dist.ProcessGroup | None = None,
        tag: int = 0, group_dst: int | None = None, library: bool = False,
    ) -> dist.Work:
        stage, _ = self.peer_stage("send", group, dst, group_dst, library)
        return self.channel.post_send(tensor, stage, tag, "send")

    def irecv(
        self, tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
        tag: int = 0, group_src: int | None = None, library: bool = False,
    ) -> dist.Work:
        stage, _ = self.peer_stage("recv", group, src, group_src, library)
        return self.channel.post_recv(tensor, stage, tag, "recv")

    def send(
        self, tensor: torch.Tensor, dst: int | None = None, group: dist.ProcessGroup | None = None,
        tag: int = 0, group_dst: int | None = None, library: bool = False,
    ) -> None:
        self.isend(tensor, dst, group, tag, group_dst, library).wait()

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
        tag: int = 0, group_src: int | None = None, library: bool = False,
    ) -> int:
        stage, peers = self.peer_stage("recv", group, src, group_src, library)
        self.channel.post_recv(tensor, stage, tag, "recv").wait()
        return per_rank_int(peers)

    def batch_isend_irecv(self, p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
        works = []
        for op in p2p_op_list:  # each op's group_peer is c10d's answer, as the process sees it
            what = "send" if op.op.__name__ == "isend" else "recv"
            stage, _ = self.peer_stage(what, op.group, None, op.group_peer, True)
            post = self.channel.post_send if what == "send" else self.channel.post_recv
            works.append(post(op.tensor, stage, op.tag, what))
        return works

    def send_object_list(
        self, object_list: list[Any], dst: int | None = None, group: dist.ProcessGroup | None = None,
        device: torch.device | None = None, group_dst: int | None = None, use_batch: bool = False,
        library: bool = False,
    ) -> None:
        stage, _ = self.peer_stage("send_object_list", group, dst, group_dst, library)
        self.channel.send_objects(object_list, stage)

    def recv_object_list(
        self, object_list: list[Any], src: int | None = None, group: dist.ProcessGroup | None = None,
        device: torch.device | None = None, group_src: int | None = None, use_batch: bool = False,
        library: bool = False,
    ) -> int:
        stage, peers = self.peer_stage("recv_object_list", group, src, group_src, library)
        received = self.channel.recv_objects(stage)
        for at in range(len(object_list)):
            object_list[at] = per_rank_value(
                {rank: objects[at] for rank, objects in zip(self.channel.ranks, received)},
                "recv_object_list",
            )
        return per_rank_int(peers)

    def all_reduce(self, previous: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.distributed.all_reduce``, through the channel for a group across stages."""

        def all_reduce(
            tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
            group: dist.ProcessGroup | None = None, async_op: bool = False,
        ) -> Any:
            values = local_compat.tensor_by_rank(tensor)
            spanned = None if values is None else self.channel.spanned(group)
            if spanned is None or values is None:
                return previous(tensor, op=op, group=group, async_op=async_op)
            if op not in _REDUCTIONS:
                raise SimulationError(
                    f"all_reduce with {op} over {group_name(group)} across stages; "
                    f"SUM, AVG, PRODUCT, MAX and MIN run there; {OTHER_WORLDS}"
                )
            with local_compat.simulation_paused():
                parts = torch.stack([_REDUCTIONS[op](torch.stack([values[rank] for rank in ranks]))
                                     for ranks in spanned])
                options = dist.AllreduceOptions()
                options.reduceOp = cast(dist.ReduceOp, dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op)
                self.channel.group.allreduce([parts], options).wait()
                if op == dist.ReduceOp.AVG:
                    parts = parts / (len(spanned[0]) * self.channel.stages)
                for part, ranks in zip(parts.unbind(0), spanned):
                    for rank in ranks:
                        values[rank].copy_(part)
            return _Done() if async_op else None

        return all_reduce

    def all_gather_into_tensor(self, previous: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.distributed.all_gather_into_tensor`` (and ``all_gather_single``), through
        the channel for a group across stages: stage by stage, its members in rank order."""

        def all_gather_into_tensor(
            output_tensor: torch.Tensor, input_tensor: torch.Tensor,
            group: dist.ProcessGroup | None = None, async_op: bool = False,
        ) -> Any:
            outputs, inputs = map(local_compat.tensor_by_rank, (output_tensor, input_tensor))
            spanned = None if outputs is None or inputs is None else self.channel.spanned(group)
            if spanned is None or outputs is None or inputs is None:
                return previous(output_tensor, input_tensor, group=group, async_op=async_op)
            with local_compat.simulation_paused():
                parts = torch.stack([torch.cat([inputs[rank].reshape(-1) for rank in ranks])
                                     for ranks in spanned])
                gathered = [torch.empty_like(parts) for _ in range(self.channel.stages)]
                self.channel.group.allgather([gathered], [parts]).wait()
                for at, ranks in enumerate(spanned):
                    whole = torch.cat([stage_parts[at] for stage_parts in gathered])
                    for rank in ranks:
                        outputs[rank].copy_(whole.view_as(outputs[rank]))
            return _Done() if async_op else None

        return all_gather_into_tensor

    def broadcast(self, previous: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.distributed.broadcast``, through the channel for a group across stages:
        the stage that holds each group's source sends its tensor, the others zeros, summed."""

        def broadcast(
            tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
            async_op: bool = False, group_src: int | None = None,
        ) -> Any:
            values = local_compat.tensor_by_rank(tensor)
            spanned = None if values is None else self.channel.spanned(group)
            if spanned is None or values is None or (src is None and group_src is None):
                return previous(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
            whole = group or cast(dist.ProcessGroup, c10d.GroupMember.WORLD)
            source = group_src if group_src is not None else c10d.get_group_rank(whole, cast(int, src))
            zeros = torch.zeros_like(next(iter(values.values())))
            with local_compat.simulation_paused():
                parts = torch.stack([values.get(ranks[source], zeros) for ranks in simulated_groups(whole)])
                self.channel.group.allreduce([parts]).wait()
                for part, ranks in zip(parts.unbind(0), spanned):
                    for rank in ranks:
                        values[rank].copy_(part)
            return _Done() if async_op else None

        return broadcast


@contextlib.contextmanager
def between_stages(channel: StageChannel) -> Iterator[None]:
    """Point-to-point across stages over ``channel``, and collectives over groups that span
    stages through it or refused by name, while a stage's body runs (inside
    :func:`~meshstate.testing.torch_per_rank.per_rank_torch`)."""
    calls = _PointToPoint(channel)
    with contextlib.ExitStack() as patches:
        for name in _POINT_TO_POINT:
            entry = _entry(getattr(calls, name))
            for module in (dist, c10d):
                patches.enter_context(mock.patch.object(module, name, entry))
        patches.enter_context(mock.patch.object(dist, "all_reduce", calls.all_reduce(dist.all_reduce)))
        patches.enter_context(mock.patch.object(dist, "broadcast", calls.broadcast(dist.broadcast)))
        for name in ("all_gather_into_tensor", "all_gather_single"):
            gather = calls.all_gather_into_tensor(getattr(dist, name))
            patches.enter_context(mock.patch.object(dist, name, gather))
        patches.enter_context(mock.patch.object(dist, "get_backend", calls.get_backend(dist.get_backend)))
        patches.enter_context(local_compat.collectives_checked(channel.refuse_across))
        yield


def _entry(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` as ``torch.distributed`` offers it, told whether torch's or meshstate's own
    modules called it (they speak as the process)."""
    if call.__name__ == "batch_isend_irecv":
        return call

    def entry(*args: Any, **kwargs: Any) -> Any:
        return call(*args, library=from_a_library(sys._getframe(1)), **kwargs)

    entry.__name__ = call.__name__
    return entry
