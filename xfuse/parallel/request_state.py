"""Several requests' state on one stage: what the engine switches between when a stream of requests
(``xfuse.parallel.request_stream``) has more than one in flight.

A stage keeps one request's state between tasks: its stale K/V buffers, the text K/V its cross-attention computed
once, the batch parts' slices of the text, a family's position table. Those live on a few objects (the stage, its
K/V cache, its attention processors), each naming its per-request attributes in ``REQUEST_STATE``; the stage lists
the objects (``Stage.request_state_holders``). ``RequestStates`` keeps one *slot* of those attributes per request
in flight and puts a slot's values onto the objects before any of that request's work: switching is a few
attribute assignments, nothing is copied. Slot 0 is the stage's own state (a request alone never switches).

A new slot starts from the objects' values with every container emptied (a fresh dict, list or set): its request's
``begin_request`` then sets the rest, and its K/V buffers are its own, allocated at its first pass. A slot keeps
its buffers after its stream for the next stream's request in that slot (reused where the shapes match, as a
request alone reuses slot 0's): the memory held is at most one request's state per slot, and the slots are as many
as the longest stream (``serve.max_inflight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Slot = list[dict[str, Any]]  # per holder, attribute -> value


def _blank(value: Any) -> Any:
    """A new request's start for one attribute: an empty container of its type; other values are set by the
    request's ``begin_request`` (or its passes) before they are read."""
    return type(value)() if isinstance(value, dict | list | set) else value


class RequestStates:
    """Slots of per-request state over ``holders`` (objects with a ``REQUEST_STATE`` tuple of attribute names)."""

    def __init__(self, holders: Sequence[object]):
        self.holders = [(holder, tuple(type(holder).REQUEST_STATE)) for holder in holders]  # type: ignore[attr-defined]
        self.active = 0  # the slot whose values are on the holders
        self._saved: dict[int, Slot] = {}  # every other slot's values, while it is not active

    @property
    def slots(self) -> int:
        """Slots that exist: the active one and those saved."""
        return len(self._saved) + 1

    def use(self, slot: int) -> None:
        """Put ``slot``'s values onto the holders (a slot never used starts blank), keeping the active slot's."""
        if slot == self.active:
            return
        current = [{name: getattr(holder, name) for name in names} for holder, names in self.holders]
        self._saved[self.active] = current
        values = self._saved.pop(slot, None)
        if values is None:
            values = [{name: _blank(value) for name, value in held.items()} for held in current]
        for (holder, _), held in zip(self.holders, values, strict=True):
            for name, value in held.items():
                setattr(holder, name, value)
        self.active = slot
