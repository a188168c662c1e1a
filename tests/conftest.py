"""Shared test helpers: megatron-core's RankGenerator as the layout oracle."""

import os
import signal
import warnings

from datetime import timedelta

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.parallel_state import RankGenerator

# The scripts that recorded JAX's answers run with JAX, in a virtual environment of their own.
collect_ignore_glob = ["jax_records/*"]

# meshstate kind -> (view, megatron-core RankGenerator token)
MEGATRON_TOKENS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "pp": ("dense", "pp"),
    "tp-cp": ("dense", "tp-cp"),
    "dp-cp": ("dense", "dp-cp"),
    "tp-dp": ("dense", "tp-dp"),
    "tp-dp-cp": ("dense", "tp-dp-cp"),
    "tp-pp": ("dense", "tp-pp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "etp-ep": ("expert", "tp-ep"),
    "etp-ep-pp": ("expert", "tp-ep-pp"),
    "edp": ("expert", "dp"),
}


def megatron_groups(config):
    """Every kind's groups as megatron-core's RankGenerator builds them for ``config``."""
    generators = {
        "dense": RankGenerator(
            tp=config.tp, ep=1, dp=config.dp, pp=config.pp, cp=config.cp, order=config.order
        ),
        "expert": RankGenerator(
            tp=config.etp, ep=config.ep, dp=config.edp, pp=config.pp, cp=1, order=config.order
        ),
    }
    return {
        kind: generators[view].get_ranks(token) for kind, (view, token) in MEGATRON_TOKENS.items()
    }


@pytest.fixture
def oracle():
    return megatron_groups


WORLDS = {"processes": {}, "simulated": {"simulate": True}, "threads": {"threads": True}}


def in_both_worlds(world_size, worlds=("processes", "simulated"), timeout=None):
    """Run a test body on ``world_size`` local processes and in one of the one-process
    worlds (simulated by default, torch's LocalTensorMode; ``"threads"``: a thread per
    rank): one test, parametrized ``world`` over ``worlds``. ``timeout``: the harness's
    default unless given (a body that compiles several programs on a thread per rank
    compiles them one thread at a time: dynamo's compile lock)."""
    import inspect
    import sys

    from meshstate.testing import distributed

    def decorate(body):
        # The workers find the body by its module and name; the test takes the name.
        name = body.__name__
        body.__name__ = body.__qualname__ = f"_{name}_body"
        setattr(sys.modules[body.__module__], body.__name__, body)
        limit = {} if timeout is None else {"timeout": timeout}
        runs = {world: distributed(world_size, **WORLDS[world], **limit)(body) for world in worlds}

        def test(world, **kwargs):
            runs[world](**kwargs)

        test.__name__ = test.__qualname__ = name
        test.__module__, test.__doc__ = body.__module__, body.__doc__
        parameters = list(inspect.signature(body).parameters.values())
        world = inspect.Parameter("world", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        test.__signature__ = inspect.Signature([world, *parameters])
        return pytest.mark.parametrize("world", list(runs))(test)

    return decorate


SEVERAL_COMPILES = timedelta(seconds=600)
"""The harness's limit for compiled checks: on a thread per rank dynamo compiles one rank at a
time, 30 s here for a body of several programs and past the default 120 s on a loaded CI machine."""


def in_processes_and_threads(world_size, timeout=SEVERAL_COMPILES):
    """:func:`in_both_worlds` over processes and a thread per rank (compiled code's worlds:
    the simulated one refuses most of it by name), under the compiled checks' limit."""
    return in_both_worlds(world_size, ("processes", "threads"), timeout)


def compiled_whole(fn, graphs):
    """``fn`` compiled with ``fullgraph=True`` (a graph break raises, naming its reason) on
    ``aot_eager``, each graph dynamo hands over appended to ``graphs``: one graph there is one
    graph and no break, as ``torch._dynamo.explain`` counts them, from the one trace that also
    runs. Resets dynamo first (:func:`reset_dynamo`)."""
    import torch

    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(graph, example_inputs):
        graphs.append(graph)
        return aot_eager(graph, example_inputs)
    reset_dynamo()
    return torch.compile(fn, fullgraph=True, backend=backend)


def dynamo_graph_as_it_is(fn, graphs):
    """``fn`` compiled whole as :func:`compiled_whole` does, dynamo's graphs run as they are
    (no AOTAutograd: a simulated world's compiled code)."""
    import torch

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    reset_dynamo()
    return torch.compile(fn, fullgraph=True, backend=backend)


def reset_dynamo():
    """``torch._dynamo.reset()``; in a thread per rank, once, by rank 0, while no rank
    compiles (the threads share dynamo's caches)."""
    import torch
    import torch.distributed as dist

    from meshstate.core.world import ranks_share_the_process, simulated_ranks

    threads = dist.is_initialized() and ranks_share_the_process() and simulated_ranks() is None
    if threads:
        dist.barrier()
    if not threads or dist.get_rank() == 0:
        torch._dynamo.reset()
    if threads:
        dist.barrier()


def close(got, want, tolerance=1e-9):
    """Whether tensors ``got`` and ``want`` agree within ``tolerance`` (relative and absolute),
    on every simulated rank too (a per-rank answer there)."""
    import torch

    got, want = torch.as_tensor(got), torch.as_tensor(want, dtype=got.dtype)
    return got.shape == want.shape and bool(
        ((got - want).abs() <= tolerance * (1 + want.abs())).all()
    )


def heed_ctrl_c() -> None:
    """In a child about to start: SIGINT as a terminal's Ctrl-C finds it (the default),
    even when this test runs with SIGINT ignored, as a shell's background job does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): a pytest process per CPU this one may run on, at
    most 4 (each imports torch and the oracles; the worlds a test starts use the CPUs too)."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return min(len(usable), 4)


def pytest_collection_finish(session):
    """Move what collection built (every test module, torch, the oracles) out of the
    collector's reach: a full collection then scans only what the tests make."""
    import gc

    gc.collect()
    gc.freeze()
