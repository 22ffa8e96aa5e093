"""Preallocated receive buffers, reused across patches and steps.

A pipelined step receives the same few shapes over and over; allocating a fresh
tensor per receive costs allocator time on the hot path and, on GPU, fragments
memory. The pool keeps a small list of buffers per (peer, kind, shape, dtype) and
hands out a free one; the caller gives it back explicitly (``release``). How many
may be busy at once is bounded by the channels (``max_inflight``), so the pool
never grows beyond ``max_inflight`` buffers per key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BufferSlot", "RecvBufferPool"]

BufferKey = tuple  # (peer, kind, shape, dtype)


@dataclass(eq=False)
class BufferSlot:
    """One pooled buffer; ``busy`` from acquire (receive posted) to release."""

    key: BufferKey
    tensor: torch.Tensor
    busy: bool = field(default=False)
    # CUDA, stream-ordered waits: recorded at release on the stream that read the buffer; the next receive into it
    # is queued behind this event, so a buffer is reused when its reader is done on the device, not on the host.
    read_done: torch.cuda.Event | None = None


class RecvBufferPool:
    """Receive buffers keyed ``(peer, kind, shape, dtype)`` on one device. Not thread-safe."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._slots: dict[BufferKey, list[BufferSlot]] = {}
        self._busy_per_channel: dict[tuple[int, str], int] = {}

    def busy(self, peer: int, kind: str) -> int:
        """Buffers of channel (peer, kind) handed out and not yet released, over all shapes."""
        return self._busy_per_channel.get((peer, kind), 0)

    def acquire(self, peer: int, kind: str, shape: tuple, dtype: torch.dtype) -> BufferSlot:
        """A free buffer for this key; allocates only when every existing one is busy."""
        key = (peer, kind, tuple(shape), dtype)
        slots = self._slots.setdefault(key, [])
        slot = next((s for s in slots if not s.busy), None)
        if slot is None:
            # torch.empty: every byte is overwritten by the receive before anyone reads it.
            slot = BufferSlot(key, torch.empty(key[2], dtype=dtype, device=self.device))
            slots.append(slot)
        slot.busy = True
        self._busy_per_channel[(peer, kind)] = self.busy(peer, kind) + 1
        return slot

    def release(self, slot: BufferSlot) -> None:
        if not slot.busy:
            raise RuntimeError(f"buffer {slot.key} released twice")
        slot.busy = False
        self._busy_per_channel[slot.key[:2]] -= 1

    def num_buffers(self) -> int:
        return sum(len(s) for s in self._slots.values())

    def num_busy(self) -> int:
        return sum(self._busy_per_channel.values())

    def clear(self) -> None:
        """Drop every buffer (a new request shape); refused while any is busy."""
        if self.num_busy():
            busy = [s.key for slots in self._slots.values() for s in slots if s.busy]
            raise RuntimeError(f"cannot drop receive buffers while {len(busy)} are in use: {busy}")
        self._slots.clear()
        self._busy_per_channel.clear()
