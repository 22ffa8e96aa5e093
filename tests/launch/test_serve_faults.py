"""A served world losing a rank: a worker SIGKILLed or SIGSTOPped while idle and while a request runs. Readiness
turns 503 naming the rank, the running request is answered 503 (never left hanging), every surviving process exits
non-zero within ``comm.timeout_s`` + 5 s, and nothing is left behind. One world per case (each is used up)."""

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tests.support.serve_fns import ServedWorld, left_behind, poll_health

TIMEOUT_S = 5.0  # comm.timeout_s: a stalled peer mid-request is noticed by the data plane after this
LONG_REQUEST = {"prompt": "long", "num_inference_steps": 100, "size": "256x256"}  # several seconds here


def _names_rank_1(response) -> bool:
    return response is not None and response.status_code == 503 and "rank 1" in (response.json()["reason"] or "")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("when", ["idle", "busy"])
def test_lost_worker_is_named_and_the_world_exits_non_zero(tmp_path, sig, when):
    world = ServedWorld(tmp_path, settings=(f"comm.timeout_s={TIMEOUT_S}",))
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
        if sig == "SIGSTOP":  # the stopped rank is no survivor: let it run into its launcher's SIGTERM
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
