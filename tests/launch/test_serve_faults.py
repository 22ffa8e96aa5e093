"""A served world losing a rank: a worker SIGKILLed or SIGSTOPped while idle and while a request runs. Readiness
turns 503 naming the rank, the running request is answered 503 (never left hanging), every surviving process exits
non-zero within ``comm.timeout_s`` + 5 s, and nothing is left behind. One world per case (each is used up): a test
world's ranks (``ServedWorld(launcher="world")``: no launcher terminates a survivor, each ends by itself), and under
torchrun the drain a worker's SIGTERM starts."""

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tests.support.serve_fns import ServedWorld, await_metrics, left_behind, poll_health

TIMEOUT_S = 5.0  # comm.timeout_s: a stalled peer mid-request is noticed by the data plane after this
LONG_REQUEST = {"prompt": "long", "num_inference_steps": 60, "size": "256x256"}  # several seconds here


def _names_rank_1(response) -> bool:
    return response is not None and response.status_code == 503 and "rank 1" in (response.json()["reason"] or "")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("when", ["idle", "busy"])
def test_lost_worker_is_named_and_the_world_exits_non_zero(tmp_path, sig, when):
    world = ServedWorld(tmp_path, launcher="world", settings=(f"comm.timeout_s={TIMEOUT_S}",))
    try:
        pids = world.rank_pids()
        # Wait for a heartbeat round, so the worker is in its loop when it goes.
        assert poll_health(world.url, lambda r: r is not None and r.json()["ranks"][1]["heartbeat_age_s"] < 0.5, 10)[0]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = None
            if when == "busy":
                running = pool.submit(httpx.post, f"{world.url}/v1/images/generations", json=LONG_REQUEST, timeout=60)
                time.sleep(1.0)
                assert not running.done()
            signalled = time.monotonic()
            os.kill(pids[1], getattr(signal, sig))
            # Readiness names the rank while rank 0 lingers; or rank 0 is gone already and its last words name it.
            limit = 3.0 if sig == "SIGKILL" else TIMEOUT_S + 5
            named_after, last = poll_health(world.url, lambda r: r is None or _names_rank_1(r), limit)
            assert named_after is not None, (last.json() if last is not None else None, world.stderr()[-3000:])
            if running is not None:
                response = running.result(timeout=TIMEOUT_S + 5)  # answered, not left hanging
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "service_broken"
                assert "rank 1" in response.json()["error"]["message"]
        # Every surviving process exits non-zero within the timeout + 5 s.
        while pids[0] in world.rank_pids().values() and time.monotonic() - signalled < TIMEOUT_S + 5:
            time.sleep(0.05)
        assert pids[0] not in world.rank_pids().values(), world.stderr()[-3000:]
        if sig == "SIGSTOP":  # the stopped rank is no survivor: let it run on and end by itself, no launcher here
            os.kill(pids[1], signal.SIGCONT)
        assert world.wait(timeout=TIMEOUT_S + 10) != 0
        stderr = world.stderr()
        last_words = next(line for line in stderr.splitlines() if "rank 0 stopped serving" in line)
        assert "rank 1" in stderr[stderr.index(last_words) :].split("\n[", 1)[0], stderr[-3000:]
        assert left_behind(world) == []  # no orphan
    finally:
        world.close()


def test_sigterm_on_a_worker_drains_the_whole_world(tmp_path):
    """ "SIGTERM on any rank": the worker tells rank 0 in its next answer; every rank exits 0."""
    with ServedWorld(tmp_path) as world:
        pids = world.rank_pids()
        os.kill(pids[1], signal.SIGTERM)
        assert world.wait(timeout=30) == 0, world.stderr()[-3000:]
        assert "drained; every rank answered the shutdown" in world.stderr()
        assert left_behind(world) == []


# Several requests in flight: behind a blocker of another size, four of one size run as one batch streamed through
# the pipeline with a second call (a batch of two of another size); two more (a third size) wait.
BATCHED = (f"comm.timeout_s={TIMEOUT_S}", "serve.max_batch=4", "serve.max_inflight=2", "serve.max_queued_work=100")
BLOCKER = {"prompt": "blocker", "num_inference_steps": 60, "size": "256x256"}
IN_BATCH = {"num_inference_steps": 40, "size": "128x128"}
IN_STREAM = {"num_inference_steps": 30, "size": "64x128"}
QUEUED = {"num_inference_steps": 4, "size": "128x64"}


def _batch_in_flight(world, pool):
    """The blocker, then four requests that run as one batch streamed with a call of two more, and two that wait
    behind them; returns the futures of the blocker, the six in flight and the two waiting once the stream runs and
    the two are queued (``xfuse_requests_running`` 6, ``xfuse_queue_depth`` 2: a request that reaches the server
    only after a rank is lost is refused with the reason known then, not answered as one that waited). Each group is
    posted once the server holds the one before (its metrics, not a sleep: under a loaded machine a post can take
    longer than a batch), all eight behind the blocker, so the batch, the stream and the queue are what admission
    makes of them."""
    post = lambda body: pool.submit(  # noqa: E731
        httpx.post, f"{world.url}/v1/images/generations", json=body, timeout=60
    )
    blocker = post(BLOCKER)
    await_metrics(world.url, {"xfuse_requests_running": 1}, [blocker], log=world.stderr)
    batch = [post({**IN_BATCH, "prompt": f"in batch {i}", "seed": i}) for i in range(4)]
    batch += [post({**IN_STREAM, "prompt": f"in stream {i}", "seed": i}) for i in range(2)]
    await_metrics(world.url, {"xfuse_queue_depth": 6}, [blocker, *batch], log=world.stderr)
    queued = [post({**QUEUED, "prompt": f"queued {i}"}) for i in range(2)]
    await_metrics(world.url, {"xfuse_queue_depth": 8}, [blocker, *batch], log=world.stderr)
    await_metrics(world.url, {"xfuse_requests_running": 6, "xfuse_queue_depth": 2}, batch, log=world.stderr)
    return blocker, batch, queued


def test_a_worker_killed_under_a_stream_answers_every_request_in_flight(tmp_path):
    """SIGKILL of rank 1 while a stream of two calls (a batch of four, a batch of two) runs and two requests wait:
    every one of the eight clients gets 503 naming the rank, readiness names it, every survivor exits non-zero,
    nothing is left behind."""
    world = ServedWorld(tmp_path, launcher="world", settings=BATCHED)
    try:
        pids = world.rank_pids()
        with concurrent.futures.ThreadPoolExecutor(9) as pool:  # a thread per request
            blocker, batch, queued = _batch_in_flight(world, pool)
            assert blocker.result(timeout=60).status_code == 200
            os.kill(pids[1], signal.SIGKILL)
            named_after, last = poll_health(world.url, lambda r: r is None or _names_rank_1(r), 3.0)
            assert named_after is not None, (last.json() if last is not None else None, world.stderr()[-3000:])
            for future in batch + queued:
                response = future.result(timeout=TIMEOUT_S + 5)
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["code"] == "service_broken", error
                assert "rank 1" in error["message"], (error, world.stderr()[-3000:])
        assert world.wait(timeout=TIMEOUT_S + 10) != 0
        assert left_behind(world) == []
    finally:
        world.close()


def test_sigterm_lets_the_stream_in_flight_finish_and_turns_the_queue_away(tmp_path):
    """SIGTERM on rank 0 while a stream of two calls (a batch of four, a batch of two) runs and two requests wait:
    the six are answered with their images (batch 4 or 2, stream 2), the two waiting get 503 (draining), every rank
    exits 0."""
    with ServedWorld(tmp_path, launcher="world", settings=BATCHED) as world:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:  # a thread per request
            blocker, batch, queued = _batch_in_flight(world, pool)
            os.kill(world.rank_pids()[0], signal.SIGTERM)
            for future, size in zip(batch, [4] * 4 + [2] * 2, strict=True):
                response = future.result(timeout=60)
                assert response.status_code == 200, response.text
                assert (response.json()["batch"], response.json()["stream"]) == (size, 2), response.text
            for future in queued:
                response = future.result(timeout=60)
                assert response.status_code == 503 and response.json()["error"]["code"] == "service_draining"
        assert world.wait(timeout=30) == 0, world.stderr()[-3000:]
        assert left_behind(world) == []
