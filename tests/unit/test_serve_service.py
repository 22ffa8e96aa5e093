"""Rank 0's service state without processes: the bounded queue, Retry-After, deadlines, drain and broken states,
and ``/health``'s verdicts (the same objects the HTTP thread and the engine loop share)."""

import time

import pytest

from xfuse.serve.metrics import ServeMetrics
from xfuse.serve.protocol import GenerationJob, RequestLimits
from xfuse.serve.service import GenerationResult, QueueFull, Service, Unavailable

JOB = GenerationJob("p", None, 64, 64, 1, 4, 5.0, 1)
LIMITS = RequestLimits("tiny", 64, 64, 4, 5.0, None, 2, 512, 512 * 512, 100, 100, check_size=lambda w, h: None)


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


def test_full_queue_is_429_with_retry_after_from_recent_generation_times():
    s = service()
    s.set_ready(LIMITS)
    first = s.submit(JOB)
    s.finish(s.next_request(0.1), GenerationResult([], 1, 0.0, 3.0))  # mean generation time moves towards 3 s
    assert first.done()
    s.submit(JOB)
    s.submit(JOB)
    with pytest.raises(QueueFull) as err:
        s.submit(JOB)
    assert err.value.status == 429 and err.value.retry_after_s == 5  # ceil(3 waiting x 1.4 s)


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
    assert taken.future is kept and not kept.cancel()  # taken: it runs to the end, answering it cannot fail
    s.finish(taken, GenerationResult([], 1, 0.0, 0.1))
    assert kept.result(timeout=1).seed == 1
