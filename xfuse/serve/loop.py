"""The loop every rank's main thread runs under ``xfuse serve``: the only code that touches ``torch.distributed``.

Rank 0 takes the next request from the service's bounded queue (or, idle for ``serve.heartbeat_interval_s``, sends a
tick), posts it on the control plane, runs its own share of the pipeline call and answers the request's future.
Workers receive, run the same call, answer. Every message ends in an answer round, so rank 0 hears from every rank at
least once a second while idle and after every request. A worker's loop returns only on ``shutdown``; anything else
that ends it is an exception, and the process exits non-zero (torchrun restarts a world only on a non-zero exit: a
worker that returned 0 would leave rank 0 serving alone).
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xfuse.build import image_call_kwargs
from xfuse.errors import RequestCancelled
from xfuse.serve.control import JOB, SHUTDOWN, TICK, ControlPlane
from xfuse.serve.protocol import GenerationJob
from xfuse.serve.service import GenerationResult, Service
from xfuse.stderr import clock, write_stderr

if TYPE_CHECKING:
    from xfuse.families.registry import ResolvedModel

# Under torchrun the agent is every rank's parent. If it is killed (SIGKILL reaches no child), the ranks are
# re-parented and would go on serving with nobody to restart them: a rank that notices stops the world.
_LAUNCHER_PID = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def check_launcher() -> None:
    if _LAUNCHER_PID is not None and os.getppid() != _LAUNCHER_PID:
        raise RuntimeError(f"the launcher (pid {_LAUNCHER_PID}: torchrun or xfuse) is gone; nothing would restart us")


class DrainSignal:
    """SIGTERM / SIGINT set ``requested`` (and the service's ``drain_requested`` on rank 0) and nothing else: the
    loop drains at its next turn, within a heartbeat interval when idle or after the running request."""

    def __init__(self) -> None:
        self.requested = False
        self.service: Service | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        if self.service is not None:
            self.service.drain_requested = True


def _answer(pipe, drain: DrainSignal, job_done: bool = False) -> dict[str, Any]:
    stats = pipe.local_stats()
    return {
        "rank": pipe.context.rank,
        "drain": drain.requested,
        "peak_rss_bytes": int(stats["peak_rss_mib"] * 2**20),
        "sent_bytes": sum(stats["sent"].values()) if job_done else 0,  # the counters hold the last call's bytes
        # step caching's (computed, skipped) steps, once per pipeline group (its first rank's)
        "cache_steps": stats["cache_steps"] if job_done and pipe.context.pipe_rank == 0 else None,
    }


def use_adapters(pipe, lora) -> None:
    """Make the request's LoRA adapters (``GenerationJob.lora``: (name, weight) pairs) the active ones, or run the
    base model: every rank switches between the same requests in the same order, on its own share of the weights."""
    if not lora:
        pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in lora], adapter_weights=[weight for _, weight in lora])


def job_call(model: ResolvedModel, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pipeline call of one request, or of a batch of requests of one ``batch_key``, to the served ``model``: the
    prompts as a list, one generator per request seeded with its seed (diffusers draws each sample's noise from its
    own generator, as the request alone draws it)."""
    import torch

    job = jobs[0]
    call = image_call_kwargs(
        prompt=job["prompt"],
        negative_prompt=job["negative_prompt"],
        width=job["width"],
        height=job["height"],
        num_inference_steps=job["num_inference_steps"],
        guidance_scale=job["guidance_scale"],
        seed=job["seed"],
        num_images=job["num_images"],
        spec=model.spec,
    )
    if len(jobs) > 1:
        call["prompt"] = [j["prompt"] for j in jobs]
        call["generator"] = [torch.Generator().manual_seed(j["seed"]) for j in jobs]
    return call


def run_calls(pipe, model: ResolvedModel, calls: list[list[dict[str, Any]]], stop_if: list | None = None) -> list:
    """This rank's share of the pipeline calls of one turn of the loop (each a batch of jobs, ``job_call``), with
    their adapters (one set for all of them: ``Service.next_stream``): one call alone, or several streamed through
    the pipeline together (``run_stream``). Every rank makes the same calls; rank 0 gets the outputs, in order, and
    asks ``stop_if`` (one condition per call) once per step of a streamed call (a call alone: the ``cancel_if``
    around it). A call stopped between steps (its clients went away) is the ``RequestCancelled`` every rank gets
    alike, said once per rank."""
    lora = calls[0][0]["lora"]
    if lora or (hasattr(pipe, "get_list_adapters") and pipe.get_list_adapters()):  # a server with adapters
        use_adapters(pipe, lora)
    if len(calls) > 1:
        outputs = pipe.run_stream([job_call(model, jobs) for jobs in calls], stop_if=stop_if)
    else:
        try:
            outputs = [pipe(**job_call(model, calls[0]))]
        except RequestCancelled as stopped:
            outputs = [stopped]
    for index, output in enumerate(outputs):
        if isinstance(output, RequestCancelled):
            which = f"call {index + 1} of {len(calls)} of a stream" if len(calls) > 1 else "request"
            write_stderr(
                f"[xfuse {clock()}] rank {pipe.context.rank}: {which} stopped before step {output.stopped_at} of "
                f"{output.num_steps} on every rank: its client went away"
            )
    return outputs


def server_loop(
    pipe,
    model: ResolvedModel,
    control: ControlPlane,
    service: Service,
    *,
    heartbeat_interval_s: float,
    drain: DrainSignal,
    http_alive: Callable[[], bool] = lambda: True,
    max_batch: int = 1,
    batch_max_pixels: int = 0,
    max_inflight: int = 1,
) -> None:
    """Rank 0: serve until a drain is requested (on any rank), then shut every rank down in order. Raises on any
    failure of any rank, or when the HTTP thread has stopped; the caller turns that into 503s and a non-zero exit."""
    metrics = service.metrics

    def answer_round(job_done: bool = False) -> None:
        answers = control.answer_round(_answer(pipe, drain, job_done))
        now = time.monotonic()
        for answer in answers:
            metrics.answered(answer["rank"], now, answer["peak_rss_bytes"])
            metrics.sent_bytes.labels(str(answer["rank"])).inc(answer["sent_bytes"])
            if answer["cache_steps"] is not None:
                computed, skipped = answer["cache_steps"]
                metrics.cache_steps.labels("computed").inc(computed)
                metrics.cache_steps.labels("skipped").inc(skipped)
            if answer["drain"]:  # a worker was asked to stop: the whole world drains
                service.drain_requested = True

    def draining() -> bool:
        return drain.requested or service.drain_requested

    last_round = time.monotonic()
    while not draining():
        timeout_s = heartbeat_interval_s - (time.monotonic() - last_round)
        stream = service.next_stream(timeout_s, max_batch, batch_max_pixels, max_inflight)
        if not stream:
            if draining():
                break
            if not http_alive():  # nobody can reach this world any more: let it be restarted
                raise RuntimeError("rank 0's HTTP server thread has stopped")
            check_launcher()
            control.post(TICK)
            answer_round()
            last_round = time.monotonic()
            continue
        calls = [[_with_seed(pending.job) for pending in batch] for batch in stream]
        started = time.monotonic()
        control.post(JOB, calls)
        stop_if = [functools.partial(_all_abandoned, batch) for batch in stream]  # each asked once per step
        with pipe.cancel_if(stop_if[0]):  # (a call alone's)
            outputs = run_calls(pipe, model, calls, stop_if if len(stream) > 1 else None)
        answer_round(job_done=True)
        last_round = time.monotonic()
        sharing = sum(len(batch) for batch in stream)  # the requests that shared the generation time
        for batch, jobs, output in zip(stream, calls, outputs, strict=True):
            if isinstance(output, RequestCancelled):
                service.stopped(batch, output)
                continue
            images = iter(output.images)  # in the jobs' order, each request's n of them
            for pending, job in zip(batch, jobs, strict=True):
                mine = [next(images) for _ in range(job["num_images"])]
                result = GenerationResult(mine, job["seed"], started - pending.enqueued, last_round - started,
                                          len(batch), len(stream), sharing)  # fmt: skip
                service.finish(pending, result)
    service.start_draining()
    control.post(SHUTDOWN)
    answer_round()


def _all_abandoned(batch: list) -> bool:
    """Whether every request of a running batch lost its client (one that still waits keeps the call going)."""
    return all(pending.abandoned for pending in batch)


def _with_seed(job: GenerationJob) -> dict[str, Any]:
    """The job as it travels to every rank, with a seed (rank 0 draws one where the request named none)."""
    return {**job.as_dict(), "seed": job.seed if job.seed is not None else secrets.randbelow(2**32)}


def worker_loop(pipe, model: ResolvedModel, control: ControlPlane, drain: DrainSignal) -> None:
    """Ranks 1..N-1: follow rank 0 until it says ``shutdown``. Raises on any failure (including rank 0's loss)."""
    while True:
        kind, payload = control.receive()
        check_launcher()
        if kind == TICK:
            control.answer_round(_answer(pipe, drain))
        elif kind == JOB:
            run_calls(pipe, model, payload)
            control.answer_round(_answer(pipe, drain, job_done=True))
        elif kind == SHUTDOWN:
            control.answer_round(_answer(pipe, drain))
            return
        else:
            raise RuntimeError(f"unknown control message {kind!r} from rank 0")
