"""Errors of the communication layer.

Every failed point-to-point operation becomes a :class:`CommError` that names the
whole operation (who, to/from whom, what, how big, where in the schedule), because
the backend's own messages ("Connection closed by peer [127.0.0.1]:42917") say
nothing about which tensor of which step was lost.

All failures are fatal: after a timeout or a lost peer the process group is
unusable on this rank (gloo closes the pair; NCCL must be aborted), so callers
report and tear down; they never retry.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "CommError",
    "CommTimeout",
    "PeerLost",
    "InflightLimitError",
    "describe_op",
    "describe_place",
    "error_from_backend",
]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "?"


def describe_op(*, rank, op, kind, shape, dtype, nbytes, peer) -> str:
    """``rank 1: recv of hidden (2, 64, 32) float32, 16384 bytes, from rank 0`` (shared by all messages)."""
    direction = "to" if op == "send" else "from"
    return (
        f"rank {rank}: {op} of {kind} {tuple(shape) if shape is not None else '?'} {_dtype_name(dtype)}, "
        f"{nbytes} bytes, {direction} rank {peer}"
    )


def describe_place(step, patch, part=None) -> str:
    """Where in the schedule: ``step 3, patch 1``, ``step 0, whole image``, ``step 0, whole image, batch part 1``
    (a whole-image step streamed in batch parts, see ``xfuse.parallel.schedule.batch_parts``); ``start-up`` for
    the connection exchange (step None, ``P2PChannels.connect``); a phase outside the loop by its name (a ``str``
    step: ``prompt encoding``)."""
    if step is None:
        return "start-up"
    if isinstance(step, str):
        return step
    where = f"step {step}, " + ("whole image" if patch is None else f"patch {patch}")
    return where if part is None else f"{where}, batch part {part}"


class CommError(RuntimeError):
    """A point-to-point operation failed; the attributes name the operation.

    ``op`` is ``"send"`` or ``"recv"``; ``kind`` is the caller's label for the tensor
    ("hidden", "skip", "latent", ...); ``detail`` holds the backend's message, if any.
    Constructed with the message as the only positional argument so that the default
    exception pickling (used to ship errors between processes) round-trips it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        peer: int | None = None,
        op: str | None = None,
        kind: str | None = None,
        shape: tuple | None = None,
        dtype: torch.dtype | None = None,
        nbytes: int | None = None,
        step: int | None = None,
        patch: int | None = None,
        part: int | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.op_log = ""  # the channels' recent operations, filled in where it is raised (and pickled with it)
        self.rank, self.peer, self.op, self.kind = rank, peer, op, kind
        self.shape = tuple(shape) if shape is not None else None
        self.dtype, self.nbytes, self.step, self.patch, self.part = dtype, nbytes, step, patch, part
        self.detail = detail

    @classmethod
    def for_op(cls, *, what: str, detail: str | None = None, **fields) -> CommError:
        """Build the error with the standard message.

        ``what`` says what happened ("timed out after 5.0 s", "failed: peer lost");
        ``fields`` are rank, peer, op, kind, shape, dtype, nbytes, step, patch, part.
        """
        msg = (
            describe_op(**{k: fields.get(k) for k in ("rank", "op", "kind", "shape", "dtype", "nbytes", "peer")})
            + f" {what} at "
            + describe_place(fields.get("step"), fields.get("patch"), fields.get("part"))
        )
        if detail:
            msg += f": {detail}"
        return cls(msg, detail=detail, **fields)


class CommTimeout(CommError):
    """The operation did not complete within the channel's timeout."""


class PeerLost(CommError):
    """The connection to the peer is gone: its process died, or it tore down after a failure of its own.

    (gloo cannot tell the two apart: when rank A times out and closes its pairs, its peers
    see the same "Connection closed by peer" as when A is killed.)
    """


class InflightLimitError(RuntimeError):
    """More receives outstanding on one (peer, kind) channel than ``max_inflight``.

    This is a scheduling bug (buffers not released, or a schedule that runs further
    ahead than it declared), never a network problem, so it is not a CommError:
    nothing was posted, and the process group is still usable.
    """


# Substrings of backend errors (gloo first, then NCCL) that mean "the other side is gone".
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "connection refused",
    "remote process exited",  # NCCL ncclRemoteError
    "remote worker crashing",
)
_TIMEOUT_MARKERS = ("timed out", "timeout waiting")


def error_from_backend(exc: BaseException, *, timeout_s: float, **fields) -> CommError:
    """Map a backend exception raised by ``Work.wait()`` (or by posting) to a CommError subclass.

    gloo raises plain RuntimeErrors, so the only way to classify them is their text:
    "Timed out waiting 1500ms for recv operation to complete" -> CommTimeout,
    "Connection closed by peer ..." / "Connection reset ..." -> PeerLost; anything else
    (e.g. "Application timeout caused pair closure", seen on the next op after a
    timeout) stays a CommError with the backend's message appended.
    """
    text = str(exc).strip() or type(exc).__name__
    low = text.lower()
    # A pair closed by our own earlier timeout is not a fresh timeout of this op.
    if "caused pair closure" not in low and any(m in low for m in _TIMEOUT_MARKERS):
        # The backend's text ("Timed out waiting 1500ms ...") adds nothing to ours.
        return CommTimeout.for_op(what=f"timed out after {float(timeout_s)} s", **fields)
    if any(m in low for m in _PEER_LOST_MARKERS):
        return PeerLost.for_op(what="failed: peer lost", detail=text, **fields)
    return CommError.for_op(what="failed", detail=text, **fields)
