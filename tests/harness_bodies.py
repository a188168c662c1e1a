"""Functions the harness tests run on worker ranks (module level, so they reach the workers)."""

import os
import time

import torch.distributed as dist


def all_ranks_assert():
    assert dist.get_rank() < 0, "no rank is negative"


def low_and_high_ranks_disagree():
    raise ValueError("low" if dist.get_rank() < dist.get_world_size() // 2 else "high")


def say_hello():
    print(f"hello from {dist.get_rank()}")
    os.write(2, f"fd 2 of {dist.get_rank()}\n".encode())   # as C++ code writes
    return os.getpgrp()


def takes_anything(value):
    return value is not None


def wait_forever_on_rank_two():
    if dist.get_rank() == 2:
        while True:
            time.sleep(1)
    return dist.get_rank()


def record_pid_then_sleep():
    """For the signal tests: leave this worker's pid in $MESHSTATE_PID_DIR, then block."""
    with open(os.path.join(os.environ["MESHSTATE_PID_DIR"], str(os.getpid())), "w"):
        pass
    time.sleep(600)
