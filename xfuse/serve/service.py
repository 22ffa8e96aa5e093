"""Rank 0's service state, shared by the HTTP thread (which submits and reads) and the engine loop on the main
thread (which takes requests, resolves their futures and changes the state). Nothing here touches
``torch.distributed``.

Admission: a request is queued while the queue holds fewer than ``serve.max_queue`` requests and its work
(``GenerationJob.work``, megapixel-steps) fits in what ``serve.max_queued_work`` leaves (an empty queue takes any
servable request); otherwise 429 with ``Retry-After`` from the measured seconds per megapixel-step. With
``serve.max_batch`` > 1 the loop takes, with the next request, the queued requests it can run in the same pipeline
call (``batch_key``: one image each, the same size, steps, guidance, negative prompt and adapters, at most
``serve.batch_max_pixels``), in their queue order; the others keep their places. With ``serve.max_inflight`` > 1 it
takes up to that many such calls of the same adapters (``next_stream``), streamed through the pipeline together.

States: ``starting`` (the model loads) -> ``ready`` -> ``draining`` (SIGTERM/SIGINT: no new requests, the running one
finishes, queued ones get 503) or ``broken`` (a rank died or stalled: every pending request gets 503 and the process
exits non-zero so the launcher restarts the world).
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from xfuse.serve.metrics import ServeMetrics
from xfuse.serve.protocol import GenerationJob, RequestError, RequestLimits

STARTING, READY, DRAINING, BROKEN = "starting", "ready", "draining", "broken"
DRAIN_POLL_S = 0.1  # how soon an idle loop sees a drain request


class Unavailable(RequestError):
    """503: starting, draining, broken, or a request that waited past ``serve.request_timeout_s``."""

    def __init__(self, message: str, code: str = "service_unavailable", retry_after_s: int | None = None):
        super().__init__(message, param=None, status=503, code=code)
        self.retry_after_s = retry_after_s


class QueueFull(RequestError):
    """429 with ``Retry-After``: the bounded queue is full."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, param=None, status=429, code="queue_full")
        self.retry_after_s = retry_after_s


@dataclass
class PendingRequest:
    job: GenerationJob
    enqueued: float  # time.monotonic()
    deadline: float  # not started by then: 503, never reaches the ranks
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    abandoned: bool = False  # its client went away while it was generated: the engine stops it between steps


@dataclass
class GenerationResult:
    images: list[Any]  # PIL images
    seed: int
    queue_wait_s: float
    generation_s: float
    batch: int = 1  # the requests of the pipeline call that made it
    stream: int = 1  # the pipeline calls streamed through the pipeline together with its own (serve.max_inflight)
    sharing: int = 1  # the requests whose generation took generation_s together (a batch's, or a stream's)


class Service:
    """See the module docstring. ``drain_requested`` is set by signal handlers (plain assignment, no lock: a
    handler runs on the main thread, which may hold the lock)."""

    def __init__(
        self,
        *,
        world_size: int,
        max_queue: int,
        request_timeout_s: float,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        metrics: ServeMetrics,
    ):
        self.world_size, self.metrics = world_size, metrics
        self.request_timeout_s = request_timeout_s
        # Idle, rank 0 sends a heartbeat every interval: a last answer older than this means its loop is stuck.
        self._stale_after_s = heartbeat_interval_s + heartbeat_timeout_s + 1.0
        self.state, self.reason = STARTING, "loading the model"
        self.limits: RequestLimits | None = None
        self.drain_requested = False
        self.running: list[PendingRequest] = []  # the request (or batch of requests) being generated
        self.max_queue = max_queue
        self._queue: collections.deque[PendingRequest] = collections.deque()  # under the lock
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # notified when a request is queued
        self._mean_generation_s = 1.0  # for Retry-After until a request measured the seconds per work unit
        self._seconds_per_work: float | None = None  # seconds per megapixel-step, updated after every request
        self._queued_work = 0.0  # megapixel-steps of the queued requests (under the lock)

    # ------------------------------------------------------------------------------------------ HTTP thread
    def submit(self, job: GenerationJob) -> concurrent.futures.Future:
        """Queue ``job``; raise `Unavailable` (503) or `QueueFull` (429) instead when it cannot be taken."""
        with self._lock:
            self.check_accepting()
            now = time.monotonic()
            pending = PendingRequest(job, now, now + self.request_timeout_s)
            budget = self.limits.max_queued_work if self.limits is not None else math.inf
            if self._queued_work > 0 and self._queued_work + job.work > budget * (1 + 1e-9):  # (sums of floats)
                retry = self._retry_after_s()
                raise QueueFull(
                    f"the queue holds {self._queued_work:.3g} of its {budget:.3g} megapixel-steps of work "
                    f"(serve.max_queued_work) and this request needs {job.work:.3g}; retry in {retry} s",
                    retry,
                )
            if len(self._queue) >= self.max_queue:
                retry = self._retry_after_s()
                raise QueueFull(
                    f"the queue is full ({self.max_queue} requests wait behind the running one); retry in {retry} s",
                    retry,
                )
            self._queue.append(pending)
            self._queued_work += job.work
            self._queue_changed()
            self._queued.notify()
        return pending.future

    def _queue_changed(self) -> None:
        """(Under the lock.) The gauges of the queue, after it changed."""
        if not self._queue:
            self._queued_work = 0.0  # (a sum of floats that drifted from zero)
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.queued_work.set(self._queued_work)

    def _retry_after_s(self) -> int:
        """Seconds until the queued work (and the running request, about one more) is done, as measured so far."""
        if self._seconds_per_work is None:  # nothing measured yet: the recent mean per request
            return max(1, math.ceil((len(self._queue) + 1) * self._mean_generation_s))
        return max(1, math.ceil(self._queued_work * self._seconds_per_work + self._mean_generation_s))

    def check_accepting(self) -> None:
        if self.state == BROKEN:
            raise Unavailable(f"the service is broken and restarting: {self.reason}", code="service_broken")
        if self.drain_requested or self.state == DRAINING:
            raise Unavailable("the service is shutting down (draining)", code="service_draining")
        if self.state == STARTING:
            raise Unavailable(f"the service is starting ({self.reason})", code="service_starting", retry_after_s=5)

    def health(self) -> tuple[int, dict]:
        """(status code, JSON body) of ``GET /health``: 200 only when ready and every rank answered lately."""
        ages = self.metrics.heartbeat_ages()
        state, reason = self.state, self.reason
        if state == READY and self.drain_requested:
            state, reason = DRAINING, "shutting down"
        if state == READY and not self.running and max(ages) > self._stale_after_s:
            worst = max(range(len(ages)), key=ages.__getitem__)
            state, reason = BROKEN, f"rank {worst} has not answered a heartbeat for {ages[worst]:.1f} s"
        body = {
            "status": "ok" if state == READY else state,
            "reason": reason if state != READY else None,
            "model": self.limits.model_name if self.limits else None,
            "world_size": self.world_size,
            "ranks": [{"rank": r, "heartbeat_age_s": round(age, 3)} for r, age in enumerate(ages)],
            "queue": len(self._queue),
            "queued_work": round(self._queued_work, 6),  # megapixel-steps
            "running": bool(self.running),
        }
        return (200 if state == READY else 503), body

    # ---------------------------------------------------------------------------------------- engine loop
    def set_ready(self, limits: RequestLimits) -> None:
        with self._lock:
            self.limits, self.state, self.reason = limits, READY, ""
            self.metrics.reset_heartbeats()
            self.metrics.ready.set(1)

    def next_request(self, timeout_s: float) -> PendingRequest | None:
        """The next queued request, waiting at most ``timeout_s`` (``None`` sooner once a drain is requested: a
        signal handler cannot wake a blocked wait); requests past their deadline are answered 503."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._queued:
                self._queued.wait_for(lambda: self._queue, max(0.0, min(DRAIN_POLL_S, deadline - time.monotonic())))
                pending = self._take(0) if self._queue else None
            if pending is None:
                if self.drain_requested or time.monotonic() >= deadline:
                    return None
                continue
            if self._start(pending):
                return pending

    def next_batch(self, timeout_s: float, max_batch: int, max_pixels: int) -> list[PendingRequest]:
        """The next queued request and, up to ``max_batch`` in all, the queued requests of its ``batch_key`` (in
        queue order; a request of more than ``max_pixels`` pixels runs alone); empty if none came in ``timeout_s``."""
        first = self.next_request(timeout_s)
        return [] if first is None else self._batch_of(first, max_batch, max_pixels)

    def next_stream(
        self, timeout_s: float, max_batch: int, max_pixels: int, max_inflight: int
    ) -> list[list[PendingRequest]]:
        """The next batch (``next_batch``) and, up to ``max_inflight`` batches in all, batches of the queued
        requests with the same LoRA adapters (the weights every call of a stream runs with), in queue order: the
        pipeline calls the loop streams through the pipeline together. Empty if nothing came in ``timeout_s``."""
        first = self.next_batch(timeout_s, max_batch, max_pixels)
        if not first:
            return []
        stream, adapters = [first], first[0].job.lora
        while len(stream) < max_inflight:
            head = self._take_first(lambda job: job.lora == adapters)
            if head is None:
                break
            stream.append(self._batch_of(head, max_batch, max_pixels))
        return stream

    def _batch_of(self, first: PendingRequest, max_batch: int, max_pixels: int) -> list[PendingRequest]:
        """``first`` and, up to ``max_batch`` in all, the queued requests of its ``batch_key``, in queue order."""
        key = batch_key(first.job, max_pixels)
        batch = [first]
        while key is not None and len(batch) < max_batch:
            pending = self._take_first(lambda job: batch_key(job, max_pixels) == key)
            if pending is None:
                break
            batch.append(pending)
        return batch

    def _take_first(self, accepts) -> PendingRequest | None:
        """The first queued request whose job ``accepts``, taken and started (``_start``); ``None`` if none is
        queued now (never waits)."""
        while True:
            with self._lock:
                index = next((i for i, p in enumerate(self._queue) if accepts(p.job)), None)
                pending = None if index is None else self._take(index)
            if pending is None:
                return None
            if self._start(pending):
                return pending

    def _take(self, index: int) -> PendingRequest:
        """(Under the lock.) Remove the queued request at ``index``: its work no longer waits."""
        pending = self._queue[index]
        del self._queue[index]
        self._queued_work = max(0.0, self._queued_work - pending.job.work)
        self._queue_changed()
        return pending

    def _start(self, pending: PendingRequest) -> bool:
        """Whether ``pending``, taken from the queue, runs: one past its deadline is answered 503; one whose client
        hung up while it waited (the HTTP side cancelled its future) never runs. From here on its future cannot be
        cancelled, so answering it cannot fail."""
        if time.monotonic() > pending.deadline:
            waited = time.monotonic() - pending.enqueued
            _fail(pending, Unavailable(f"the request waited {waited:.1f} s in the queue", code="queue_timeout"))
            return False
        with self._lock:  # running once abandon() can find it: a client that hangs up from here on is heard
            if not pending.future.set_running_or_notify_cancel():
                return False
            self.running.append(pending)
        self.metrics.running.set(len(self.running))
        return True

    def abandon(self, future: concurrent.futures.Future) -> bool:
        """The HTTP thread: the client of the running request whose future this is went away; the engine loop's
        ``cancel_if`` condition sees it at the next step (a whole batch stops once all its clients are gone).
        Whether it was running."""
        with self._lock:
            for pending in self.running:
                if pending.future is future:
                    pending.abandoned = True
                    return True
        return False

    def stopped(self, batch: list[PendingRequest], error: Exception) -> None:
        """The running ``batch`` stopped between steps (``RequestCancelled``): nobody waits for its answer."""
        with self._lock:
            for pending in batch:
                self.running.remove(pending)
                _fail(pending, error)
            self.metrics.running.set(len(self.running))
        self.metrics.cancelled.inc(len(batch))

    def finish(self, pending: PendingRequest, result: GenerationResult) -> None:
        # a batch (or a stream) of k requests took generation_s for all of them: each one's share is 1/k
        self._mean_generation_s = 0.8 * self._mean_generation_s + 0.2 * result.generation_s / result.sharing
        per_work = result.generation_s / result.sharing / max(pending.job.work, 1e-9)
        self._seconds_per_work = (
            per_work if self._seconds_per_work is None else (0.8 * self._seconds_per_work + 0.2 * per_work)
        )
        self.running.remove(pending)
        self.metrics.running.set(len(self.running))
        self.metrics.queue_wait.observe(result.queue_wait_s)
        self.metrics.generation.observe(result.generation_s)
        pending.future.set_result(result)

    def start_draining(self) -> int:
        """Stop accepting and answer every queued request 503; return how many were answered."""
        with self._lock:
            self.state, self.reason = DRAINING, "shutting down"
            self.metrics.ready.set(0)
            return self._fail_queued(Unavailable("the service is shutting down (draining)", code="service_draining"))

    def set_broken(self, reason: str, *, answer: bool = True) -> int:
        """A rank is lost: refuse new requests, turn readiness 503 with ``reason``, and (``answer``) answer the
        running and every queued request 503; return how many were answered."""
        with self._lock:
            self.state, self.reason = BROKEN, reason
            self.metrics.ready.set(0)
            if not answer:
                return 0
            error = Unavailable(f"the service is broken and restarting: {reason}", code="service_broken")
            failed = self._fail_queued(error)
            for running in self.running:
                failed += _fail(running, error)
            self.running = []
            self.metrics.running.set(0)
            return failed

    def _fail_queued(self, error: RequestError) -> int:
        failed = 0
        while self._queue:
            failed += _fail(self._queue.popleft(), error)
        self._queue_changed()
        return failed


def _fail(pending: PendingRequest, error: RequestError) -> int:
    try:
        pending.future.set_exception(error)
    except concurrent.futures.InvalidStateError:  # answered already, or cancelled by a client that hung up
        return 0
    return 1


def batch_key(job: GenerationJob, max_pixels: int) -> tuple | None:
    """What requests must share to run in one pipeline call (``None``: this one runs alone): one image each (a
    request's ``n`` images draw their noise from its one generator), the same size, steps, guidance, negative prompt
    and adapters, and at most ``max_pixels`` pixels (``serve.batch_max_pixels``: where batching stops paying)."""
    if job.num_images != 1 or job.width * job.height > max_pixels:
        return None
    return (job.width, job.height, job.num_inference_steps, job.guidance_scale, job.negative_prompt, job.lora)
