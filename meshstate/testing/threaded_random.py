"""Each rank of a threaded world its own default random generator, as each process has its own.

torch has one default CPU generator per process, so a threaded world's ranks would share
it: ``torch.manual_seed(0)`` then ``nn.Linear(4, 8)`` on 4 threads would give each rank
other weights (whichever thread drew first), where 4 processes give each the same. In a
rank's thread, :class:`RankRandomness` (a ``TorchFunctionMode``, which torch keeps per
thread) swaps the rank's own state into torch's generator around each call of a function
that draws from it, under one lock; :func:`seeding_per_rank` makes ``torch.manual_seed``,
``torch.initial_seed``, ``torch.seed``, ``torch.get_rng_state`` and
``torch.set_rng_state`` act on the calling rank's state. Calls traced by
``torch.compile`` draw from the process's generator.

Example (in a threaded world's rank)::

    torch.manual_seed(0)
    torch.randn(2)      # what a process seeded with 0 draws, on every rank
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from meshstate.core import compat as _compat

__all__ = ["RankRandomness", "seeding_per_rank"]

_DRAWING = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "bernoulli", "multinomial", "poisson", "normal_", "uniform_", "random_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "bernoulli_",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "dropout_", "feature_dropout", "rrelu", "rrelu_", "gumbel_softmax",
    "fractional_max_pool2d", "fractional_max_pool3d", "scaled_dot_product_attention",
    "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "orthogonal_", "sparse_",
})
"""Names of torch's functions and methods that may draw from the default generator
(``torch.nn.init``'s included: they reach the others inside, where no mode looks)."""

_swapping = threading.Lock()
_ranks = threading.local()


class RankRandomness(TorchFunctionMode):
    """One rank's default-generator state, used by the random functions its thread calls.

    Example: ``with RankRandomness(torch.default_generator.get_state()): body()``.
    """

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.state = state
        self.seed = torch.initial_seed()

    def __enter__(self) -> RankRandomness:
        _ranks.current = self
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _ranks.current = None
        super().__exit__(*exc_info)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__name__", "") not in _DRAWING or kwargs.get("generator") is not None
                or _compat.tracing()):
            return func(*args, **kwargs)
        with self.installed():
            return func(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """This rank's state in torch's default generator, no other thread's, until the block ends."""
        with _swapping:
            default = torch.default_generator
            outside = default.get_state()
            default.set_state(self.state)
            try:
                yield
            finally:
                self.state = default.get_state()
                default.set_state(outside)


def _per_rank(process_wide: Callable[..., Any], in_a_rank: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        rank: RankRandomness | None = getattr(_ranks, "current", None)
        return process_wide(*args, **kwargs) if rank is None else in_a_rank(rank, *args, **kwargs)

    call.__name__ = process_wide.__name__
    call.__doc__ = process_wide.__doc__
    return call


def _manual_seed(rank: RankRandomness, seed: Any) -> torch.Generator:
    rank.state, rank.seed = torch.Generator().manual_seed(int(seed)).get_state(), int(seed)
    return torch.default_generator


def _seed(rank: RankRandomness) -> int:
    generator = torch.Generator()
    rank.seed = generator.seed()
    rank.state = generator.get_state()
    return rank.seed


def _set_rng_state(rank: RankRandomness, state: torch.Tensor) -> None:
    rank.state = state.clone()


@contextlib.contextmanager
def seeding_per_rank() -> Iterator[None]:
    """torch's seeding functions acting on the calling rank's state inside a rank's thread
    (and as before in any other thread) until the block ends."""
    answers: dict[str, Callable[..., Any]] = {
        "manual_seed": _manual_seed, "seed": _seed, "initial_seed": lambda rank: rank.seed,
        "get_rng_state": lambda rank: rank.state.clone(), "set_rng_state": _set_rng_state,
    }
    with contextlib.ExitStack() as patches:
        for module in (torch, torch.random):
            for name, in_a_rank in answers.items():
                per_rank = _per_rank(getattr(torch.random, name), in_a_rank)
                patches.enter_context(mock.patch.object(module, name, per_rank))
        yield
