"""Rank functions for tests/multirank/test_world.py.

They live in their own small module because World pickles functions by reference:
each rank imports this module, and it should not drag pytest or the tests in.
"""

import os
import time

import torch
import torch.distributed as dist

_state: dict = {}  # per-process: survives between calls on the same rank


def whoami():
    return (
        dist.get_rank(),
        dist.get_world_size(),
        os.getpid(),
        torch.get_num_threads(),
        os.environ.get("HF_HUB_OFFLINE"),
    )


def all_reduce_sum(scale=1.0):
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return t.item()


def remember(key, value):
    _state[key] = (value, dist.get_rank())
    return len(_state)


def recall(key):
    return _state[key]


class CustomError(Exception):
    pass


class UnpicklableError(Exception):
    """Needs two constructor args, so pickle's default (type, args) round trip fails."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def fail_on(rank, kind="custom"):
    if dist.get_rank() != rank:
        return dist.get_rank() * 10
    if kind == "custom":
        raise CustomError(f"boom on rank {rank}")
    raise UnpicklableError("x", "y")


def unpicklable_value():
    return (lambda: 1) if dist.get_rank() == 0 else "ok"


def recv_never_matched():
    """Rank 0 waits for a message nobody sends; the others return."""
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    return "done"


def sleep_then_barrier(sleep_rank, seconds):
    if dist.get_rank() == sleep_rank:
        time.sleep(seconds)
    dist.barrier()
    return "passed"


def exit_on(rank, code):
    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()
