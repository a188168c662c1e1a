"""The workers' output, relayed to the caller's stdout and stderr with ``[rank N] `` in front."""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

# How long the last lines of exited workers get; how often the relay looks up.
_LAST_LINES_WAIT_SECONDS = 2.0
_RELAY_POLL_SECONDS = 0.5


class _OutputRelay:
    """Copies the workers' stdout and stderr to this process's, each line prefixed ``[rank N] ``.

    A thread copies output as it arrives; :meth:`drain` copies what is already
    written, so a run's output is out before the run returns.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, daemon=True, name="meshstate-output")

    def add(self, rank: int, pipe: Connection, fd: int) -> None:
        """Relay ``pipe`` (one of a worker's streams) to this process's ``fd``."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe.fileno(), selectors.EVENT_READ,
                                _Stream(f"[rank {rank}] ".encode(), pipe, fd))

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Copy every complete line the workers have written so far."""
        with self._lock:
            for key in list(self._selector.get_map().values()):
                key.data.copy()

    def close(self) -> None:
        """Wait briefly for the last lines of workers that have exited."""
        if self._thread.is_alive():
            self._thread.join(timeout=_LAST_LINES_WAIT_SECONDS)

    def _pump(self) -> None:
        while self._selector.get_map():
            for key, _ in self._selector.select(timeout=_RELAY_POLL_SECONDS):
                with self._lock:
                    if not key.data.copy():
                        self._selector.unregister(key.fd)
                        key.data.pipe.close()


@dataclass
class _Stream:
    """One worker stream being relayed: its prefix, pipe, destination and unfinished line."""

    prefix: bytes
    pipe: Connection
    fd: int
    pending: bytes = b""

    def copy(self) -> bool:
        """Copy the complete lines the pipe holds; False at its end (the last line goes too)."""
        new, is_open = _read_available(self.pipe.fileno())
        data = self.pending + new
        if data and not is_open:
            data += b"\n"
        *lines, self.pending = data.split(b"\n")
        out = b"".join(self.prefix + line + b"\n" for line in lines)
        with contextlib.suppress(OSError):  # a closed stdout: keep draining, drop the output
            while out:
                out = out[os.write(self.fd, out):]
        return is_open


def _read_available(fd: int) -> tuple[bytes, bool]:
    """What the non-blocking pipe ``fd`` holds now; False once every writer has closed it."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data, True
        if not chunk:
            return data, False
        data += chunk
