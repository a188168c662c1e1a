"""Every rank of a world in this process: torch's ``LocalTensorMode`` on the fake backend.

``simulated_world(8).run(fn)`` keeps :class:`~meshstate.testing.launch.LocalWorld`'s
contract (one result per rank, in rank order) without a process per rank: the
process is rank 0 of torch's ``fake`` backend, ``LocalTensorMode`` runs every
tensor op once per simulated rank and computes every collective's result, and
meshstate answers each rank's rank-dependent questions per rank
(:mod:`meshstate.simulation.per_rank`). So ``fn`` runs once, for all ranks at
once; inside it ``torch.distributed.get_rank()`` is a per-rank integer, and a
Python branch the ranks would take apart raises
:class:`~meshstate.errors.SimulationError`, as does what torch's
simulation cannot do (send and recv, a group only some ranks make with
``new_group``, a collective over ranks that are no regular grid). Each rank's
result is ``fn``'s return value with every per-rank tensor, integer, bool and
group replaced by that rank's.

A test body runs as it does in processes: a per-rank integer takes each rank's
shard (``W[:, t*3:(t+1)*3]``, ``W[t]``, ``W.narrow(1, t*3, 3)``, ``W.chunk(2, 1)[t]``
and the parts of ``split``, ``tensor_split`` and ``unbind``) and makes tensors
(``torch.tensor([rank, 1])``); an explicit ``torch.Generator`` draws each rank's
stream, seeded with a per-rank seed too; a group's members and rank
(``get_process_group_ranks``, ``group.rank()``, ``DeviceMesh.mesh``),
``all_gather_object``, ``broadcast_object_list``, ``allclose`` and ``assert_close``
(its failure names the ranks) answer per rank. Text is the exception: ``repr`` of a
per-rank integer describes every rank's (``per rank (0 on ranks 0, 2; 1 on ranks 1,
3)``), but ``str()`` and formats (f-strings, ``print``, a per-rank shape's repr)
raise, since one string cannot hold each rank's text and one text for all would be
wrong; logging formats its ``%s`` arguments per rank, a line per text naming its
ranks. A write into a tensor every rank shares (one made outside the body), a float
``.item()`` that differs, DistributedDataParallel and FSDP1 (FSDP2 runs), and what
``torch.compile`` cannot trace raise :class:`~meshstate.errors.SimulationError` naming
the call. Under ``torch.compile`` dynamo traces one graph that carries no rank, as for
:func:`~meshstate.compile_on_one_rank`, which torch's simulation runs for every rank;
AOTAutograd cannot trace a ``shard_map`` body's graph over torch's simulated tensors.

A pipeline's world can run stage by stage, as torch's own pipelines do:
``simulated_world(1024, stages=4).run(fn)`` splits the world into 4 contiguous blocks
of 256 ranks and runs ``fn`` once per block, each in a process of its own (forked from
this one, so ``fn`` may be any function) that simulates the block's ranks. With pp the
layout's outermost axis (Megatron's default order) a block is a pipeline stage: the
mesh, collectives over groups inside the stage and everything above work as in a
whole simulated world, and point-to-point between stages is real: a send from every
rank of a stage to its peer in another (torch's ``PipelineStage`` and schedules such
as ``Schedule1F1B``, ``dist.send`` over ``mesh.group("pp")``) is one message carrying
every rank's tensor, received into the other stage's per-rank tensor
(:mod:`meshstate.testing.stages`). ``all_reduce``, ``all_gather_into_tensor`` and
``broadcast`` over a group that spans stages (pp, a joint group with pp) run through that channel
too; any other collective over one is refused with a
:class:`~meshstate.errors.SimulationError` naming it, and so is a layout whose pp is
not the outermost axis. ``run`` still gives every rank's result, in rank order.

Example::

    def world_sum() -> float:
        t = torch.full((1,), dist.get_rank(), dtype=torch.float)
        dist.all_reduce(t)
        return t

    simulated_world(4).run(world_sum)   # [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from meshstate.errors import OTHER_WORLDS, MeshStateError, SimulationError
from meshstate.core.current import destroy_every_mesh
from meshstate.core.world import simulating_here
from meshstate.testing import torch_internals
from meshstate.testing.fork_server import autograd_survives_a_fork, clean_context, uncollected
from meshstate.testing.launch import DEFAULT_TIMEOUT
from meshstate.testing.report import RankTimeout, _describe_ranks

_FORK = multiprocessing.get_context("fork")


def _stage_starter(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Callable[..., Any]]:
    """How a stage's process starts, and the ``fn`` it runs: forked from this process, or,
    where a fork of it could not run autograd (torch 2.14, after a DTensor backward here),
    from the harness's fork server, ``fn`` and its arguments pickled by importable names
    (a body a decorator wraps at its name, ``@distributed``'s, by that name). A function
    that does not pickle so (typed at ``python -``) is refused there by name."""
    if autograd_survives_a_fork():
        return _FORK, fn
    named = sys.modules.get(getattr(fn, "__module__", "") or "")
    decorated = getattr(named, getattr(fn, "__qualname__", "") or "", None)
    if decorated is not fn and getattr(decorated, "__wrapped__", None) is fn:
        fn = _WrappedBody(fn.__module__, fn.__qualname__)
    try:
        pickled = pickle.dumps((fn, args, kwargs))
    except Exception:
        pickled = b"__main__"
    if b"__main__" in pickled:
        raise SimulationError(
            "a world simulated in stages cannot fork this process: it ran a DTensor backward, "
            "after which torch (2.14) runs no autograd in a forked process, and "
            f"{getattr(fn, '__qualname__', fn)!r} cannot be imported by name in a fresh one; "
            "define it in a module, or run the stages in a process that ran no DTensor backward"
        )
    return clean_context(), fn


@dataclass(frozen=True)
class _WrappedBody:
    """The function a decorator wraps at ``module.name``, found by that name where called."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name).__wrapped__(*args, **kwargs)


class SimulatedWorld:
    """A world of ``world_size`` ranks simulated in this process (or, in ``stages`` blocks,
    in a process per stage); see the module docstring.

    ``run`` keeps :class:`~meshstate.testing.launch.LocalWorld`'s contract: ``timeout``
    (the world's, or ``run``'s own) bounds the run, and is not passed on to ``fn``;
    ranks that do not finish within it raise :class:`~meshstate.testing.report.RankTimeout`.
    In one process no rank waits for another, so only a world of stages can run out of
    it (its stage processes are then ended). It is also a context manager: every ``run``
    initialises the fake default group, and destroys it and every mesh left alive on the
    way out; ``close`` refuses further runs.
    """

    def __init__(self, world_size: int, stages: int = 1, *, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshStateError(f"world size must be a positive integer, got {world_size!r}")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or world_size % stages:
            raise SimulationError(
                f"stages={stages!r} does not split a world of {world_size} ranks into blocks of "
                "equal size: give a positive integer that divides the world size"
            )
        self.world_size = world_size
        self.stages = stages
        self.timeout = timeout
        self._closed = False

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` once for every simulated rank; the results by rank.

        Raises :class:`~meshstate.testing.report.RankTimeout` if the stages do not finish
        within ``timeout`` (default the world's).
        """
        from meshstate.simulation.per_rank import value_on

        if self._closed:
            raise MeshStateError("this SimulatedWorld is closed; start a new one")
        if self.stages > 1:
            by_stage = self._run_stages(fn, args, kwargs, each_rank=True, timeout=timeout or self.timeout)
            return [result for stage_results in by_stage for result in stage_results]
        result = self.call(fn, *args, **kwargs)
        return [value_on(result, rank) for rank in range(self.world_size)]

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` once for every simulated rank; its result as it is,
        per-rank values and all (for a caller that reads every rank's itself). In a world
        of stages, each stage's result as its process returned it (pickled), by stage."""
        if self.stages > 1:
            return self._run_stages(fn, args, kwargs, each_rank=False, timeout=self.timeout)
        return _simulate(self.world_size, range(self.world_size), contextlib.nullcontext, fn, args, kwargs)

    def _run_stages(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], each_rank: bool,
        timeout: timedelta,
    ) -> list[Any]:
        """Run ``fn`` in a forked process per stage; each stage's result (by rank if
        ``each_rank``), by stage. The first stage to fail ends the others; every stage's
        process ends once all have answered, or once ``timeout`` has passed."""
        if dist.is_initialized():
            raise SimulationError(
                "this process already has a default process group; a simulated world needs "
                "one of its own (destroy it first, or run this where none is initialised)"
            )
        processes: dict[multiprocessing.connection.Connection, tuple[int, Any]] = {}
        results: dict[int, Any] = {}
        _import_for_the_stages()
        starter, fn = _stage_starter(fn, args, kwargs)
        with tempfile.TemporaryDirectory(prefix="meshstate-stages-") as folder:
            try:
                with uncollected():
                    for stage in range(self.stages):
                        reader, writer = starter.Pipe(duplex=False)
                        process = starter.Process(
                            target=self._stage_process, name=f"meshstate stage {stage}",
                            args=(stage, os.path.join(folder, "store"), writer, fn, args, kwargs,
                                  each_rank, timeout),
                        )
                        process.start()
                        writer.close()
                        processes[reader] = (stage, process)
                waiting = dict(processes)
                deadline = time.monotonic() + timeout.total_seconds()
                while waiting:
                    left = deadline - time.monotonic()
                    ready_now = multiprocessing.connection.wait(list(waiting), max(left, 0.0))
                    if not ready_now and left <= 0:
                        raise self._timed_out(fn, sorted(stage for stage, _ in waiting.values()), timeout)
                    for ready in ready_now:
                        reader = cast(multiprocessing.connection.Connection, ready)
                        stage, process = waiting.pop(reader)
                        results[stage] = self._outcome(stage, reader, process)
            finally:
                for reader, (_, process) in processes.items():
                    if process.is_alive():
                        process.kill()
                    process.join()
                    reader.close()
        return [results[stage] for stage in range(self.stages)]

    def _timed_out(self, fn: Callable[..., Any], stages: list[int], timeout: timedelta) -> RankTimeout:
        """The error of a run whose ``stages`` did not answer within ``timeout``."""
        stage_size = self.world_size // self.stages
        ranks = [rank for stage in stages for rank in range(stage * stage_size, (stage + 1) * stage_size)]
        named = ", ".join(map(str, stages))
        return RankTimeout(
            f"{getattr(fn, '__qualname__', repr(fn))}: {_describe_ranks(ranks)} of {self.world_size} "
            f"did not finish within {timeout.total_seconds():g} s (simulated in the process of "
            f"stage{'s' if len(stages) > 1 else ''} {named}, now ended)"
        )

    def _stage_process(
        self, stage: int, store_path: str, writer: multiprocessing.connection.Connection,
        fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], each_rank: bool,
        timeout: timedelta,
    ) -> None:
        """A stage's process: simulate the stage's ranks running ``fn``, send back the result
        (or the error) through ``writer``."""
        from meshstate.testing import stages as staged
        from meshstate.simulation.per_rank import value_on

        gc.freeze()  # nothing of the caller's is collected (destroyed) in this fork
        gc.enable()  # off since the fork (see fork_server.uncollected)
        parent = multiprocessing.parent_process()
        assert parent is not None, "a stage's process is forked by its caller"
        # Whatever this process is doing, it ends when its caller does (killed, even by SIGKILL).
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
        torch.set_num_threads(1)  # the stages share the machine's cores
        stage_size = self.world_size // self.stages
        ranks = range(stage * stage_size, (stage + 1) * stage_size)

        try:
            channel = staged.StageChannel(store_path, stage, self.stages, self.world_size, timeout)
            result = _simulate(
                self.world_size, ranks, lambda: staged.between_stages(channel), fn, args, kwargs)
            outcome = ("result", [value_on(result, rank) for rank in ranks] if each_rank else result)
            writer.send_bytes(pickle.dumps(outcome))
        except BaseException as error:
            writer.send_bytes(_pickled_error(error))
        # Held, channel and all, until the caller ends this process: another stage may still be
        # reading this one's last messages, and a failed stage's closed connections would make
        # the stages waiting for it fail too, hiding its error behind theirs.
        multiprocessing.connection.wait([parent.sentinel])

    def _outcome(
        self, stage: int, reader: multiprocessing.connection.Connection, process: Any
    ) -> Any:
        """What stage ``stage``'s process sent: its result, else its error raised here."""
        stage_size = self.world_size // self.stages
        where = f"stage {stage} (ranks {stage * stage_size}-{(stage + 1) * stage_size - 1})"
        try:
            kind, value = pickle.loads(reader.recv_bytes())
        except EOFError:
            process.join()
            raise SimulationError(
                f"the process of {where} ended without a result (exit code {process.exitcode})"
            ) from None
        if kind == "result":
            return value
        error, text = value
        error.add_note(f"raised in the process of {where}:\n{text}")
        raise error

    def close(self) -> None:
        """Refuse further runs (a simulated world holds nothing between them)."""
        self._closed = True

    def __enter__(self) -> SimulatedWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _import_for_the_stages() -> None:
    """Import here, once, what every stage's process would import on each run: the
    simulation, and dynamo (torch's ops under ``LocalTensorMode`` import it; 0.6 s)."""
    torch_internals.import_dynamo()
    from meshstate.testing import stages, torch_per_rank  # noqa: F401


def _simulate(
    world_size: int, ranks: range, between_stages: Callable[[], contextlib.AbstractContextManager[None]],
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
) -> Any:
    """``fn`` run once for ``ranks`` of a world of ``world_size`` (the whole world, or one
    stage), simulated in this process as rank 0 of the fake backend; its result as it is."""
    from meshstate.simulation import local_compat
    from meshstate.testing.torch_per_rank import per_rank_torch

    if dist.is_initialized():
        raise SimulationError(
            "this process already has a default process group; a simulated world needs "
            "one of its own (destroy it first, or run this where none is initialised)"
        )
    # Rank 0 even for another stage: torch's simulation reads a group's root (broadcast,
    # scatter) relative to the process's group, which it takes to start at 0.
    dist.init_process_group("fake", store=torch_internals.fake_store(), rank=0, world_size=world_size)
    try:
        with local_compat.local_tensor_mode(frozenset(ranks)), per_rank_torch(), between_stages(), \
                simulating_here():
            return fn(*args, **kwargs)
    except Exception as error:
        if isinstance(error, SimulationError):
            raise
        simulation_errors = (AssertionError, AttributeError, NotImplementedError, RuntimeError)
        if not isinstance(error, simulation_errors) or isinstance(error, MeshStateError):
            _add_ranks(error, ranks, world_size)
            raise
        if local_compat.failed_compiling(error):
            cause = _root_cause(error)
            backend = (
                ": dynamo traced one graph for every rank, which its backend could not compile "
                "over torch's simulated tensors (AOTAutograd, under aot_eager and inductor, "
                "cannot; a backend that runs dynamo's graph as it is can)"
                if local_compat.failed_in_the_backend(error) else ""
            )
            raise SimulationError(
                f"torch.compile cannot trace this with every rank's values in one process "
                f"({type(error).__name__}: {type(cause).__name__}: {_first_line(cause)}){backend}; "
                f"{OTHER_WORLDS}"
            ) from error
        if not local_compat.raised_inside(error):
            _add_ranks(error, ranks, world_size)
            raise
        raise SimulationError(
            f"torch's simulation of every rank in one process cannot run this "
            f"({type(error).__name__}: {error}); {OTHER_WORLDS}"
        ) from error
    finally:
        destroy_every_mesh()
        dist.destroy_process_group()
        local_compat.forget_random_state()


def _add_ranks(error: Exception, ranks: range, world_size: int) -> None:
    """Name the ranks that raised ``error``, as a local world's report does: every simulated
    one (a condition that differed between them would have raised ``SimulationError``),
    unless the error names them (an ``assert`` that fails on some) or a stage's process does
    (its caller notes the stage and its ranks)."""
    if len(ranks) == world_size and not any(
        note.startswith("raised on ") for note in getattr(error, "__notes__", ())
    ):
        error.add_note(f"raised on every simulated rank: {_describe_ranks(ranks)} of {world_size}")


def _exit_with(sentinel: int) -> None:
    """Wait until ``sentinel`` (the caller's) is ready, then end this process at once."""
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _pickled_error(error: BaseException) -> bytes:
    """``error`` and its traceback's text, pickled to cross to the parent process; an error
    that does not pickle crosses as a :class:`SimulationError` of its type and message."""
    text = "".join(traceback.format_exception(error)).rstrip()
    try:
        pickle.loads(pickle.dumps(error))  # some errors pickle but do not unpickle
        return pickle.dumps(("error", (error, text)))
    except Exception:
        stand_in = SimulationError(f"{type(error).__name__}: {error}")
        return pickle.dumps(("error", (stand_in, text)))


def _root_cause(error: BaseException) -> BaseException:
    """The exception ``error`` was raised for, through the exceptions it wraps."""
    while (cause := error.__cause__ or error.__context__) is not None:
        error = cause
    return error


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def simulated_world(
    world_size: int, stages: int = 1, *, timeout: timedelta = DEFAULT_TIMEOUT
) -> SimulatedWorld:
    """A :class:`SimulatedWorld` of ``world_size`` ranks in this process, or in ``stages``
    blocks of contiguous ranks, each simulated in a process of its own.

    Example: ``simulated_world(8).run(body) == local_world(8).run(body)`` for a
    body that sticks to collectives over regular groups, and
    ``simulated_world(8, stages=2).run(pipeline_step) == local_world(8).run(pipeline_step)``
    for a pipeline with pp=2 outermost (Megatron's default order).
    """
    return SimulatedWorld(world_size, stages, timeout=timeout)
