"""What the ``meshstate`` commands share: exit codes, progress lines and how sizes and ranks read.

Imports neither torch nor any other tools module (only the layout's pure config), so
the entry point, the parser, the commands and the bench all import it from below.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from meshstate.layout.config import MeshConfig, sizes_text

EXIT_MISMATCH = 1
"""``check`` found a group that differs from the layout, or local ranks failed."""
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a program Ctrl-C ended
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
EXIT_TERMINATED = 143  # 128 + SIGTERM

SLOW_SECONDS = 2.0
"""A step that takes longer than this says on stderr what it is doing."""


@dataclass(frozen=True)
class Progress:
    """Progress lines on stderr, ``meshstate check: starting 8 local ranks (gloo)``.

    Silent unless ``enabled``; picklable, so a worker rank can report its phases.
    """

    command: str
    enabled: bool

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"meshstate {self.command}: {message}", file=sys.stderr, flush=True)

    @contextmanager
    def if_slow(self, message: str, after: float = SLOW_SECONDS) -> Iterator[None]:
        """Report ``message`` if the block is still running ``after`` seconds in.

        Example: ``with progress.if_slow("importing torch"): import torch`` prints
        ``meshstate plan: importing torch`` only on a machine where that takes over 2 s.
        """
        timer = threading.Timer(after, self, (message,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def layout_text(config: MeshConfig) -> str:
    """A layout as the commands' headers name it: ``"order tp-cp-ep-dp-pp, tp=2 cp=1 ..."``."""
    return f"order {config.order}, {sizes_text(config.sizes())}"
