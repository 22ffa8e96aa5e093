"""How a call's point-to-point operations are cut into NCCL groups (one ``batch_isend_irecv`` call each): no torch,
so that the comm layer and the protocol's checker (``xfuse.parallel.protocol``) cut them by one rule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["in_order"]

T = TypeVar("T")


def in_order(items: Sequence[T], peer_and_group: Callable[[T], tuple[int, object]]) -> list[list[T]]:
    """``items`` (operations in issue order) cut into batches, one ``batch_isend_irecv`` call (one NCCL group) each:
    in order, a batch ending before an item whose peer it already has or whose process group differs (a call is
    on one group). What ``P2PChannels.issue`` posts, and what ``xfuse.parallel.protocol.check_protocol`` models.

    With at most one operation per peer in a group, the operations between two ranks are grouped alike on both
    sides whatever each side's calls hold (NCCL leaves it undefined when two ranks group them differently,
    NVIDIA/nccl#1279): a pair's messages match one by one, in order. Keeping the order (instead of gathering each
    peer's k-th operation into batch k) keeps the one order of messages the engine issues
    (``xfuse.parallel.protocol``): a group completes only once all its operations have.
    """
    batches: list[list[T]] = []
    peers: set[int] = set()
    group: object = None
    for item in items:
        peer, item_group = peer_and_group(item)
        if not batches or peer in peers or item_group != group:
            batches.append([])
            peers, group = set(), item_group
        batches[-1].append(item)
        peers.add(peer)
    return batches
