"""Rank 0's service state without processes: the bounded queue, Retry-After, deadlines, drain and broken states,
and ``/health``'s verdicts (the same objects the HTTP thread and the engine loop share)."""

import dataclasses
import math
import time

import pytest

from xfuse.errors import RequestCancelled
from xfuse.serve.loop import _all_abandoned
from xfuse.serve.metrics import ServeMetrics
from xfuse.serve.protocol import GenerationJob, RequestLimits
from xfuse.serve.service import GenerationResult, QueueFull, Service, Unavailable

JOB = GenerationJob("p", None, 64, 64, 1, 4, 5.0, 1)
LIMITS = RequestLimits("tiny", 64, 64, 4, 5.0, None, 2, 512, 512 * 512, 100, 100, check_size=lambda w, h: None)


def job(seed, **kw) -> GenerationJob:
    """A 64² request of 4 steps, one image, seeded ``seed``; ``kw`` changes any field."""
    return GenerationJob(**{**dict(prompt=f"p{seed}", negative_prompt=None, width=64, height=64, num_images=1,
                                   num_inference_steps=4, guidance_scale=5.0, seed=seed), **kw})  # fmt: skip


def service(**kw) -> Service:
    args = dict(max_queue=2, request_timeout_s=60.0, heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0)
    return Service(world_size=2, metrics=ServeMetrics(world_size=2, info={}), **{**args, **kw})


def test_starting_refuses_with_503_then_ready_accepts():
    s = service()
    with pytest.raises(Unavailable, match="starting") as err:
        s.submit(JOB)
    assert err.value.status == 503 and s.health()[0] == 503
    s.set_ready(LIMITS)
    assert s.health() == (200, s.health()[1]) and s.health()[1]["status"] == "ok"
    future = s.submit(JOB)
    pending = s.next_request(timeout_s=0.1)
    assert pending.job is JOB and s.health()[1]["running"]
    s.finish(pending, GenerationResult(["image"], 1, 0.0, 0.5))
    assert future.result(timeout=1).images == ["image"]


def test_full_queue_is_429_with_retry_after_from_the_measured_seconds_per_work():
    s = service()
    s.set_ready(LIMITS)
    with pytest.raises(QueueFull) as err:  # nothing measured yet: a second per request
        s.submit(JOB), s.submit(JOB), s.submit(JOB)
    assert err.value.retry_after_s == 3 and "the queue is full (2 requests wait" in str(err.value)
    s.finish(s.next_request(0.1), GenerationResult([], 1, 0.0, 3.0))  # 3 s for 64 x 64 x 4 steps
    s.finish(s.next_request(0.1), GenerationResult([], 1, 0.0, 3.0))
    assert s.health()[1]["queued_work"] == 0
    s.submit(JOB)
    s.submit(JOB)
    with pytest.raises(QueueFull) as err:
        s.submit(JOB)
    assert err.value.status == 429
    # two queued requests of 3 s each as measured, and the running one's mean (1.0 -> 1.4 -> 1.72 s)
    assert err.value.retry_after_s == math.ceil(2 * 3.0 + 1.72)


def test_admission_by_work_lets_small_requests_in_where_a_large_one_does_not_fit():
    """``serve.max_queued_work`` (megapixel-steps): a request is queued while its work fits in what the queued ones
    leave; an empty queue takes any servable request; a request leaving the queue frees its work."""
    small, large = (
        GenerationJob("s", None, 512, 512, 1, 10, 5.0, 1),
        GenerationJob("l", None, 1024, 1024, 2, 20, 5.0, 1),
    )
    assert (small.work, large.work) == (2.62144, 41.94304)
    s = service(max_queue=8)
    s.set_ready(dataclasses.replace(LIMITS, max_queued_work=10.0))
    s.submit(large)  # the queue was empty: taken though it alone is past the budget
    said = (
        r"the queue holds 41.9 of its 10 megapixel-steps of work \(serve.max_queued_work\) and this request needs 2.62"
    )
    with pytest.raises(QueueFull, match=said):
        s.submit(small)
    assert s.next_request(0.1).job is large and s.health()[1]["queued_work"] == 0
    for _ in range(3):  # 3 x 2.62 = 7.9 of 10
        s.submit(small)
    with pytest.raises(QueueFull, match="needs 2.62"):
        s.submit(small)
    assert s.health()[1]["queued_work"] == pytest.approx(3 * small.work)
    assert s.metrics.queued_work._value.get() == pytest.approx(3 * small.work)
    s.next_request(0.1)
    s.submit(small)  # one left the queue: its work is free again
    assert s.start_draining() == 3 and s.health()[1]["queued_work"] == 0


def test_request_past_its_deadline_is_answered_503_and_never_taken():
    s = service(request_timeout_s=0.05)
    s.set_ready(LIMITS)
    stale = s.submit(JOB)
    time.sleep(0.1)
    assert s.next_request(timeout_s=0.05) is None
    with pytest.raises(Unavailable, match="waited") as err:
        stale.result(timeout=1)
    assert err.value.code == "queue_timeout"


def test_drain_answers_queued_503_and_refuses_new():
    s = service()
    s.set_ready(LIMITS)
    queued = s.submit(JOB)
    s.drain_requested = True  # what the signal handler does
    assert s.health()[0] == 503 and s.health()[1]["status"] == "draining"
    with pytest.raises(Unavailable, match="draining"):
        s.submit(JOB)
    assert s.start_draining() == 1
    assert queued.exception(timeout=1).code == "service_draining"


def test_broken_answers_running_and_queued_503_naming_the_cause():
    s = service()
    s.set_ready(LIMITS)
    running, queued = s.submit(JOB), s.submit(JOB)
    s.next_request(0.1)
    assert s.set_broken("rank 1 did not answer the heartbeat") == 2
    for future in (running, queued):
        assert "rank 1 did not answer" in str(future.exception(timeout=1))
    code, body = s.health()
    assert code == 503 and body["status"] == "broken" and "rank 1" in body["reason"]


def test_health_turns_503_when_idle_heartbeats_stop():
    s = service(heartbeat_interval_s=0.01, heartbeat_timeout_s=0.01)  # stale after 1.02 s
    s.set_ready(LIMITS)
    time.sleep(1.1)  # and no answer round since: the loop stopped
    code, body = s.health()
    assert code == 503 and "has not answered a heartbeat" in body["reason"]


def test_request_whose_client_hung_up_while_queued_is_never_taken():
    s = service()
    s.set_ready(LIMITS)
    gone, kept = s.submit(JOB), s.submit(JOB)
    assert gone.cancel()  # what the HTTP side does when the client disconnects
    taken = s.next_request(timeout_s=0.1)
    assert taken.future is kept and not kept.cancel()  # taken: its future cannot be cancelled, answering it cannot fail
    s.finish(taken, GenerationResult([], 1, 0.0, 0.1))
    assert kept.result(timeout=1).seed == 1


@pytest.mark.parametrize("setting,budget", [("auto", 8 * 128 * 96 * 4 / 1e6), (12.5, 12.5)])
def test_the_work_budget_is_a_full_queue_of_default_requests_unless_set(setting, budget):
    from xfuse.config import XfuseConfig
    from xfuse.families.registry import load_pipeline, resolve
    from xfuse.serve.server import request_limits

    config = XfuseConfig(model="tiny", parallel={"pipefusion_degree": 1},
                         generation={"width": 128, "height": 96, "num_inference_steps": 4},
                         serve={"max_queue": 8, "max_queued_work": setting})  # fmt: skip
    model = resolve("tiny")
    pipe = model.spec.pipeline_class().from_pipe(load_pipeline("tiny"), config=config)
    assert request_limits(config, model, pipe).max_queued_work == pytest.approx(budget)


@pytest.mark.parametrize("setting", [0, -1.0, "half", None])
def test_a_bad_work_budget_names_the_key_and_what_it_takes(setting):
    from xfuse.config import XfuseConfig
    from xfuse.errors import ConfigError

    with pytest.raises(ConfigError, match=r"serve.max_queued_work: .*'auto' or a number of megapixel-steps > 0"):
        XfuseConfig(serve={"max_queued_work": setting})


def test_a_batch_takes_the_queued_requests_of_the_first_ones_key_in_queue_order():
    """``next_batch``: the next request and the queued ones it can share a pipeline call with (one image each; the
    same size, steps, guidance, negative prompt and adapters; not over ``max_pixels``), up to ``max_batch``; the
    others keep their order; a cancelled one never runs; each finished request frees its place in ``running``."""

    s = service(max_queue=8)
    s.set_ready(LIMITS)
    queued = [job(1), job(2, width=128), job(3), job(4, lora=(("style", 1.0),)), job(5, num_images=2), job(6), job(7)]
    futures = [s.submit(j) for j in queued]
    futures[5].cancel()  # its client hung up while it waited
    batch = s.next_batch(0.1, max_batch=3, max_pixels=64 * 64)
    assert [p.job.seed for p in batch] == [1, 3, 7] and s.health()[1]["running"]
    assert futures[5].cancelled()
    assert [p.job.seed for p in s._queue] == [2, 4, 5]  # the others, in their order
    for pending in batch:
        s.finish(pending, GenerationResult(["image"], pending.job.seed, 0.0, 3.0, batch=3, sharing=3))
    assert not s.health()[1]["running"] and s._seconds_per_work == pytest.approx(1.0 / job(1).work)
    assert [p.job.seed for p in s.next_batch(0.1, max_batch=3, max_pixels=64 * 64)] == [2]  # too large: alone
    assert [p.job.seed for p in s.next_batch(0.1, max_batch=3, max_pixels=128 * 128)] == [4]  # its own adapters
    assert [p.job.seed for p in s.next_batch(0.1, max_batch=3, max_pixels=128 * 128)] == [5]  # two images: alone
    assert s.next_batch(0.05, max_batch=3, max_pixels=128 * 128) == []


def test_a_stream_takes_calls_of_the_same_adapters_each_a_batch_in_queue_order():
    s = service(max_queue=8)
    s.set_ready(LIMITS)
    style = (("style", 1.0),)
    queued = [job(1), job(2, width=128), job(3, lora=style), job(4), job(5, width=128), job(6, num_images=2)]
    futures = [s.submit(j) for j in queued]
    futures[3].cancel()  # its client hung up while it waited: never runs
    stream = s.next_stream(0.1, max_batch=2, max_pixels=128 * 128, max_inflight=3)
    # calls: [1] (its batch key's other request, 4, is gone), [2, 5] (one size), then [6] (two images: alone)
    assert [[p.job.seed for p in batch] for batch in stream] == [[1], [2, 5], [6]]
    assert [p.job.seed for p in s._queue] == [3]  # other adapters: the next stream's
    assert len(s.running) == 4
    s.finish(stream[0][0], GenerationResult(["image"], 1, 0.0, 4.0, batch=1, stream=3, sharing=4))
    assert s._seconds_per_work == pytest.approx(1.0 / job(1).work)  # its share of the stream's 4 s: a quarter
    for batch in stream[1:]:
        for pending in batch:
            s.finish(pending, GenerationResult(["image"], pending.job.seed, 0.0, 4.0, len(batch), 3, 4))
    assert not s.running
    assert [[p.job.seed for p in b] for b in s.next_stream(0.1, 2, 128 * 128, 3)] == [[3]]
    assert s.next_stream(0.05, 2, 128 * 128, 3) == []


def test_a_broken_world_answers_every_request_of_the_running_batch_and_the_queue():
    s = service(max_queue=4)
    s.set_ready(LIMITS)
    futures = [s.submit(GenerationJob(f"p{i}", None, 64, 64, 1, 4, 5.0, i)) for i in range(4)]
    assert len(s.next_batch(0.1, max_batch=3, max_pixels=64 * 64)) == 3
    assert s.set_broken("rank 1 was lost (SIGKILL)") == 4
    assert all("rank 1 was lost" in str(f.exception(timeout=1)) for f in futures)
    assert s.health()[1]["running"] is False and s.metrics.running._value.get() == 0


def test_a_running_batch_stops_once_every_client_of_it_went_away():
    """``abandon`` (the HTTP side, for a client that hung up on a running request) marks it; the loop's ``cancel_if``
    condition holds once every request of the batch is marked; ``stopped`` frees their places in ``running`` and
    counts them. A queued request's future is cancelled instead (``abandon`` does not find it)."""
    s = service(max_queue=4)
    s.set_ready(LIMITS)
    futures = [s.submit(GenerationJob(f"p{i}", None, 64, 64, 1, 4, 5.0, i)) for i in range(3)]
    batch = s.next_batch(0.1, max_batch=2, max_pixels=64 * 64)
    assert [p.job.seed for p in batch] == [0, 1]
    assert not s.abandon(futures[2]) and futures[2].cancel()  # queued: never runs
    assert s.abandon(futures[0]) and not _all_abandoned(batch)  # the other client still waits: go on
    assert s.abandon(futures[1]) and _all_abandoned(batch)
    stopped = RequestCancelled(2, 4)
    s.stopped(batch, stopped)
    assert s.running == [] and s.health()[1]["running"] is False
    assert s.metrics.cancelled._value.get() == 2 and s.metrics.running._value.get() == 0
    assert all(f.exception(timeout=1) is stopped for f in futures[:2])
    assert not s.abandon(futures[0])  # (no longer running)
