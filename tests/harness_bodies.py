"""Functions the harness tests run on worker ranks (module level, so they reach the workers)."""

import logging
import os
import time
import warnings

import torch.distributed as dist


def all_ranks_assert():
    assert dist.get_rank() < 0, "no rank is negative"


def low_and_high_ranks_disagree():
    raise ValueError("low" if dist.get_rank() < dist.get_world_size() // 2 else "high")


def say_hello():
    print(f"hello from {dist.get_rank()}")
    os.write(2, f"fd 2 of {dist.get_rank()}\n".encode())   # as C++ code writes
    return os.getpgrp()


def log_and_warn():
    logging.getLogger("meshstate.tests").warning("logged on %d", dist.get_rank())
    warnings.warn(f"warned on {dist.get_rank()}")


def takes_anything(value):
    return value is not None


def wait_forever_on_rank_two():
    if dist.get_rank() == 2:
        while True:
            time.sleep(1)
    return dist.get_rank()


def record_pid_then_sleep():
    """For the signal tests: leave the pids of this worker and its fork server in
    $MESHSTATE_PID_DIR, then block."""
    for pid in (os.getpid(), os.getppid()):
        with open(os.path.join(os.environ["MESHSTATE_PID_DIR"], str(pid)), "w"):
            pass
    time.sleep(600)


def send_uncaught_exception_hook(connection):
    """A worker's hook for uncaught exceptions as it starts (torch.distributed wraps it at
    init), sent back on ``connection``."""
    import sys
    connection.send(sys.excepthook.__name__)
