"""``xfuse serve`` on a real 2-rank torchrun world, real HTTP on loopback, real clients (``openai``, ``httpx``, a
headless Chromium). One world for the whole module (started once, drained by the last test)."""

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.support.cli_fns import on_a_fresh_world
from tests.support.serve_fns import (
    BASE_SETTINGS,
    ENV,
    ServedWorld,
    await_metrics,
    decode_png,
    gauge,
    left_behind,
    peak_rss_kib,
    requests_running,
)

API_KEY = "test-key-0123"
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}
# A small queue bound for the 429 test that the 8 concurrent clients still fit: all 8 may be waiting at once, since
# they can all arrive before the worker takes the first off the queue (with a bound of 7 the eighth got a 429).
SETTINGS = ("serve.max_queue=8", "serve.max_images_per_request=3", "serve.max_side=512", "comm.timeout_s=20")
# Step caching on, as xfuse generate runs it below: the served image still equals generate's, and /metrics counts.
CACHE = ("cache.method=first_block", "cache.threshold=0.5", "cache.warmup_steps=1")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    served = ServedWorld(tmp_path_factory.mktemp("serve"), settings=(*SETTINGS, *CACHE), api_key=API_KEY)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(world):
    return openai.OpenAI(base_url=f"{world.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_client_gets_pngs_of_the_requested_size(client):
    result = client.images.generate(
        prompt="a red fox in the snow",
        size="128x64",  # WIDTHxHEIGHT, not square
        n=2,
        response_format="b64_json",
        extra_body={"seed": 11, "num_inference_steps": 3, "negative_prompt": "blurry"},
    )
    assert len(result.data) == 2
    images = [decode_png(item.b64_json) for item in result.data]
    assert all(image.size == (128, 64) and image.mode == "RGB" for image in images)
    pixels = [np.asarray(image) for image in images]
    assert pixels[0].std() > 0 and not np.array_equal(pixels[0], pixels[1])  # two images, not one twice
    assert result.model_extra["seed"] == 11


def test_served_image_equals_xfuse_generate(world, client, tmp_path):
    """The same prompt, size, steps and seed give the same image as ``xfuse generate`` with that config on 2 ranks."""
    prompt, seed, steps = "a lighthouse at dusk", 1234, 5
    served = client.images.generate(
        prompt=prompt, size="128x96", extra_body={"seed": seed, "num_inference_steps": steps}
    )
    target = tmp_path / "generate.png"
    sets = [*BASE_SETTINGS, *CACHE, "generation.width=128", "generation.height=96", f"generation.seed={seed}"]
    sets += [f"generation.num_inference_steps={steps}"]
    argv = ["generate", *[a for kv in sets for a in ("--set", kv)], "--prompt", prompt, "--output", str(target)]
    out = on_a_fresh_world(argv)  # as torchrun's ranks run it (tests.support.cli_fns)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = np.asarray(Image.open(target))
    got = np.asarray(decode_png(served.data[0].b64_json))
    assert got.shape == expected.shape == (96, 128, 3)
    assert np.array_equal(got, expected)


def test_plain_http_routes(world):
    with world.client() as http:
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["object"] == "model"
        response = http.post("/v1/images/generations", json={"prompt": "a boat", "seed": 3})
        assert response.status_code == 200
        body = response.json()
        assert set(body) == {"created", "data", "seed", "batch", "stream", "timings"} and body["seed"] == 3
        assert body["batch"] == 1  # serve.max_batch: 1, one request per pipeline call
        assert body["stream"] == 1  # serve.max_inflight: 1, one pipeline call at a time
        assert decode_png(body["data"][0]["b64_json"]).size == (128, 128)  # the config's default size
        # No seed: the server draws one and says which; asking again with it gives the same image.
        first = http.post("/v1/images/generations", json={"prompt": "a boat"}).json()
        again = http.post("/v1/images/generations", json={"prompt": "a boat", "seed": first["seed"]}).json()
        assert first["data"][0]["b64_json"] == again["data"][0]["b64_json"]
        health = http.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok" and [r["rank"] for r in health.json()["ranks"]] == [0, 1]
        assert http.get("/live").json()["status"] == "alive"
        metrics = http.get("/metrics").text
    for name in (
        'xfuse_requests_total{status="200"}',
        "xfuse_queue_wait_seconds_bucket",
        "xfuse_generation_seconds_count",
        "xfuse_queue_depth",
        "xfuse_queued_work",
        'xfuse_sent_bytes_total{rank="1"}',
        'xfuse_heartbeat_age_seconds{rank="1"}',
        "xfuse_images_generated_total",
    ):
        assert name in metrics, name
    sent = float(re.search(r'xfuse_sent_bytes_total\{rank="1"\} (\S+)', metrics).group(1))
    assert sent > 0  # rank 1 sent hidden states back to rank 0 for every request
    steps = {d: float(re.search(rf'xfuse_cache_steps_total{{decision="{d}"}} (\S+)', metrics).group(1))
             for d in ("computed", "skipped")}  # fmt: skip
    assert steps["computed"] >= 4 and steps["skipped"] >= 1, steps  # the requests above, with caching on


def test_idle_world_answers_a_heartbeat_every_interval(world):
    time.sleep(2.5)  # no request: only the heartbeats reach rank 1
    ranks = httpx.get(f"{world.url}/health").json()["ranks"]
    assert all(r["heartbeat_age_s"] < 1.5 for r in ranks), ranks  # heartbeat interval 1 s, answered every time


def test_api_key_is_required_except_for_probes(world):
    url = world.url
    missing = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x"})
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer not-the-key"})
    for response in (missing, wrong, httpx.get(f"{url}/metrics")):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/live").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).images.generate(prompt="x")


# (case id, JSON body or raw bytes, param the 400 names, fragment of the message)
BAD_REQUESTS = [
    ("missing_prompt", {"n": 1}, "prompt", "prompt is required"),
    ("empty_prompt", {"prompt": "   "}, "prompt", "non-empty string"),
    ("prompt_not_string", {"prompt": 42}, "prompt", "valid string"),
    ("prompt_too_long", {"prompt": "x" * 5000}, "prompt", "at most 4000 characters"),
    ("size_not_wxh", {"prompt": "x", "size": "large"}, "size", "'WIDTHxHEIGHT'"),
    ("size_not_string", {"prompt": "x", "size": 128}, "size", "valid string"),
    ("size_not_multiple_of_16", {"prompt": "x", "size": "100x128"}, "size", "multiple of 16 pixels"),
    ("size_too_large", {"prompt": "x", "size": "1024x128"}, "size", "at most 512 pixels a side"),
    ("size_too_few_rows", {"prompt": "x", "size": "128x16"}, "size", "parallel.num_patches"),
    ("n_zero", {"prompt": "x", "n": 0}, "n", "from 1 to 3"),
    ("n_above_limit", {"prompt": "x", "n": 4}, "n", "from 1 to 3"),
    ("n_string", {"prompt": "x", "n": "2"}, "n", "valid integer"),
    ("n_float", {"prompt": "x", "n": 1.5}, "n", "valid integer"),
    ("steps_zero", {"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "from 1 to 100"),
    ("steps_negative", {"prompt": "x", "num_inference_steps": -3}, "num_inference_steps", "from 1 to 100"),
    ("steps_too_many", {"prompt": "x", "num_inference_steps": 101}, "num_inference_steps", "from 1 to 100"),
    ("steps_bool", {"prompt": "x", "num_inference_steps": True}, "num_inference_steps", "valid integer"),
    ("guidance_negative", {"prompt": "x", "guidance_scale": -1}, "guidance_scale", ">= 0"),
    ("guidance_string", {"prompt": "x", "guidance_scale": "7"}, "guidance_scale", "valid number"),
    ("seed_negative", {"prompt": "x", "seed": -1}, "seed", "from 0 to"),
    ("seed_too_big", {"prompt": "x", "seed": 2**63}, "seed", "from 0 to"),
    ("response_format_url", {"prompt": "x", "response_format": "url"}, "response_format", "never stores them"),
    ("unknown_model", {"prompt": "x", "model": "dall-e-3"}, "model", "serves 'tiny'"),
    ("unknown_field", {"prompt": "x", "quality": "hd"}, "quality", "not a field of this API"),
    ("negative_prompt_not_string", {"prompt": "x", "negative_prompt": ["a"]}, "negative_prompt", "valid string"),
    ("user_not_string", {"prompt": "x", "user": 5}, "user", "valid string"),
    ("malformed_json", b'{"prompt": "x",', None, "not valid JSON"),
    ("body_not_object", b'["a fox"]', None, "JSON object"),
    ("nan_guidance", b'{"prompt": "x", "guidance_scale": NaN}', "guidance_scale", "finite number"),
]


@pytest.mark.parametrize("body,param,fragment", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_refused_naming_the_field(world, body, param, fragment):
    with world.client() as http:
        if isinstance(body, bytes):
            response = http.post("/v1/images/generations", content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post("/v1/images/generations", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"], error["message"]


def test_huge_body_is_refused_before_it_is_read(world):
    with world.client() as http:
        response = http.post("/v1/images/generations", content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_world_still_serves_after_bad_requests(world, client):
    result = client.images.generate(prompt="still here", extra_body={"seed": 5})
    assert decode_png(result.data[0].b64_json).size == (128, 128)


def _generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, headers=AUTHORIZED, timeout=120)


def test_eight_concurrent_openai_clients_are_all_answered(world):
    def one(i):
        c = openai.OpenAI(base_url=f"{world.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        return c.images.generate(prompt=f"client {i}", extra_body={"seed": i, "num_inference_steps": 3})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r.model_extra["seed"] for r in results] == list(range(8))
    images = {r.data[0].b64_json for r in results}
    assert len(images) == 8  # eight seeds, eight different images, none lost or swapped into another's reply
    waits = sorted(r.model_extra["timings"]["queue_s"] for r in results)
    generation = max(r.model_extra["timings"]["generation_s"] for r in results)
    assert waits[-1] >= 0.5 * generation  # served one after another: the last waited behind the others


def _generations(url: str) -> float:
    return gauge(url, "xfuse_generation_seconds_count", AUTHORIZED)


STOPPED = r"rank (\d): request stopped before step (\d+) of 100 on every rank"


def _cancelled(url: str) -> float:
    return gauge(url, "xfuse_cancelled_requests_total", AUTHORIZED)


def test_clients_that_hang_up_do_not_hurt_the_world(world):
    """A client that hangs up while its request waits: it never runs. One that hangs up while its request is
    generated: every rank stops it before the same next step (said on each rank's stderr, counted in /metrics), well
    before its end (100 steps of ~0.05 s here, stopped near step 13 as the client leaves after 0.6 s: a machine
    three times as fast still leaves more than half of them unrun), and the world's next request is the image that
    request gets when nothing was cancelled before it."""
    # Long enough (~2 s here) to still run when the next client hangs up 0.6 s later: 256 px took 0.5 s.
    long = {"prompt": "long", "num_inference_steps": 20, "size": "512x512"}
    after = {"prompt": "after", "seed": 2}
    before = _generations(world.url)
    expected = _generate(world.url, after)
    assert expected.status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, world.url, {**long, "seed": 1})
        time.sleep(0.3)
        with pytest.raises(httpx.TimeoutException):  # hangs up while its request waits in the queue
            httpx.post(f"{world.url}/v1/images/generations", json=long, headers=world.headers, timeout=0.3)
        assert running.result().status_code == 200
    cancelled, stopped_lines = _cancelled(world.url), len(re.findall(STOPPED, world.stderr()))
    with pytest.raises(httpx.TimeoutException):  # hangs up while its request is being generated
        longer = {**long, "num_inference_steps": 100}
        httpx.post(f"{world.url}/v1/images/generations", json=longer, headers=world.headers, timeout=0.6)
    stops = poll_stderr(world, STOPPED, after=stopped_lines, count=2)
    assert {rank for rank, _ in stops} == {"0", "1"} and len({step for _, step in stops}) == 1, stops
    assert int(stops[0][1]) <= 50, stops  # stopped with at least half of its steps unrun
    assert _cancelled(world.url) - cancelled == 1
    again = _generate(world.url, after)
    assert again.status_code == 200
    assert again.json()["data"][0]["b64_json"] == expected.json()["data"][0]["b64_json"]  # the same PNG bytes
    assert httpx.get(f"{world.url}/health").status_code == 200
    # The first "after", the running one, the second "after"; the queued one never ran, the cancelled one stopped.
    assert _generations(world.url) - before == 3


def poll_stderr(world, pattern: str, *, after: int, count: int, timeout: float = 30.0) -> list[tuple[str, ...]]:
    """The ``count`` matches of ``pattern`` in the world's stderr that follow its first ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(pattern, world.stderr())
        if len(found) >= after + count:
            return found[after : after + count]
        time.sleep(0.05)
    raise AssertionError(f"no {count} new lines like {pattern!r} in {timeout} s:\n{world.stderr()[-3000:]}")


def test_full_queue_answers_429_with_retry_after(world):
    """Admission by work: requests of twice the default steps weigh twice a default request, so the queue's work
    budget (``auto``: 8 default requests) holds 4 of them behind the running one, and the rest get 429 naming it."""
    body = {"prompt": "busy", "num_inference_steps": 8}
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(lambda i: _generate(world.url, {**body, "seed": i}), range(20)))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 5  # the running one and a queue of 4 x 2 default requests' work
    said = set()
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["code"] == "queue_full"
            said.add(re.sub(r"\d+(\.\d+)?", "N", error["message"]))
    assert (
        "the queue holds N of its N megapixel-steps of work (serve.max_queued_work) and this request needs N; "
        "retry in N s" in said
    ), said


def test_hundred_requests_with_invalid_ones_keep_every_rank_and_memory_flat(world):
    pids = world.rank_pids()
    assert sorted(pids) == [0, 1]
    sizes = ["128x128", "64x128", "128x64", "96x160", "160x96"]
    peaks = {}
    for i in range(100):
        if i % 10 == 3:  # 10 % invalid, of varied kinds
            bad = [{"prompt": ""}, {"prompt": "x", "size": "50x50"}, {"prompt": "x", "n": 9}][i % 3]
            assert _generate(world.url, bad).status_code == 400
        else:
            response = _generate(world.url, {"prompt": f"request {i}", "size": sizes[i % 5], "seed": i})
            assert response.status_code == 200, response.text
            width, height = map(int, sizes[i % 5].split("x"))
            assert decode_png(response.json()["data"][0]["b64_json"]).size == (width, height)
        if i + 1 in (10, 100):
            peaks[i + 1] = {rank: peak_rss_kib(pid) for rank, pid in pids.items()}
    assert world.rank_pids() == pids  # no rank died or was replaced
    print(f"peak RSS per rank (KiB) after request 10: {peaks[10]}, after request 100: {peaks[100]}")
    for rank in pids:
        assert peaks[100][rank] <= 1.05 * peaks[10][rank], (rank, peaks)


def test_example_client_saves_the_served_image(world, tmp_path):
    target = tmp_path / "served.png"
    cmd = [sys.executable, "examples/serve_client.py", "--base-url", f"{world.url}/v1", "--api-key", API_KEY]
    cmd += ["--prompt", "a lighthouse", "--size", "64x64", "--seed", "4", "--output", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"wrote {target} (seed 4," in out.stdout and Image.open(target).size == (64, 64)


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_page_form_posts_to_the_api_in_a_real_browser(world):
    from playwright.sync_api import sync_playwright

    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=flags)
        try:
            page = browser.new_page()
            page.goto(world.url + "/")
            assert page.title() == "xfuse · tiny"
            page.fill("#prompt", "a blue square")
            page.fill("#size", "128x64")
            page.fill("#seed", "7")
            page.fill("#api_key", API_KEY)
            page.click("#generate")
            page.wait_for_selector("#result img", timeout=60_000)
            size = page.eval_on_selector("#result img", "img => [img.naturalWidth, img.naturalHeight]")
            status = page.inner_text("#status")
        finally:
            browser.close()
    assert size == [128, 64]
    assert status.startswith("seed 7 · ") and "generation" in status


def test_sigterm_drains_the_running_request_and_every_rank_exits_0(world):
    """Last in the module: it stops the world."""
    pids = world.rank_pids()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # 1.3 s on a quiet machine; the signal lands once it runs and the next one waits behind it
        running = pool.submit(_generate, world.url, {"prompt": "long", "num_inference_steps": 60, "size": "256x256"})
        await_metrics(world.url, {"xfuse_requests_running": 1}, [running], AUTHORIZED)
        queued = pool.submit(_generate, world.url, {"prompt": "queued", "seed": 1})
        await_metrics(world.url, {"xfuse_queue_depth": 1}, [running], AUTHORIZED)
        os.kill(pids[0], signal.SIGTERM)
        late = None
        for _ in range(50):  # readiness turns 503 at once, while the running request goes on
            late = httpx.get(f"{world.url}/health")
            if late.status_code == 503:
                break
            time.sleep(0.02)
        assert late.status_code == 503 and late.json()["status"] == "draining"
        refused = _generate(world.url, {"prompt": "after"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_draining"
        assert not running.done()  # refused while the running request goes on
        assert running.result().status_code == 200  # finished, not cut off
        assert queued.result().status_code == 503
    assert world.wait(timeout=30) == 0, world.stderr()[-3000:]  # torchrun: every rank exited 0
    assert "drained; every rank answered the shutdown" in world.stderr()
    assert left_behind(world) == []  # nothing left behind


def test_degree_1_serves_pixart_with_plain_python(tmp_path):
    """Another family through the same command: PixArt-Σ, one process, no torchrun."""
    with ServedWorld(tmp_path, nproc=1, settings=("model=pixart-tiny",)) as served:
        with served.client() as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == "pixart-tiny"
            response = http.post("/v1/images/generations", json={"prompt": "alone", "size": "64x96", "seed": 2})
            assert response.status_code == 200 and decode_png(response.json()["data"][0]["b64_json"]).size == (64, 96)
            assert http.get("/health").json()["world_size"] == 1
        os.kill(served.proc.pid, signal.SIGINT)  # Ctrl-C drains too
        assert served.wait(timeout=30) == 0, served.stderr()[-3000:]


@pytest.mark.parametrize("preset", ["sd35-tiny", "flux-tiny"])
def test_the_mmdit_families_serve_on_two_ranks(tmp_path, preset):
    """SD3.5 and FLUX through the same command: 2 ranks (the text stream crosses them), the openai client."""
    settings = (f"model={preset}", "parallel.pipefusion_degree=2", "generation.width=96", "generation.height=128")
    with ServedWorld(tmp_path, nproc=2, settings=settings, launcher="world") as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        result = client.images.generate(model=preset, prompt="a lake", size="96x128", n=2, extra_body={"seed": 4})
        assert [decode_png(image.b64_json).size for image in result.data] == [(96, 128)] * 2
        os.kill(served.rank_pids()[0], signal.SIGTERM)  # rank 0 drains the world
        assert served.wait(timeout=60) == 0, served.stderr()[-3000:]


def test_batched_and_streamed_requests_each_equal_the_same_request_served_alone(tmp_path):
    """``serve.max_batch: 4``, ``serve.max_inflight: 4``: requests that queue together behind a running one and
    share a size, steps, guidance and adapters run as one pipeline call, each with its own seed's noise, so each
    image equals the same request served alone (pipelined, 2 ranks, PNGs within one level); a request of another
    size, of two images or of other steps is a call of its own, and the four calls are streamed through the
    pipeline together, each of those images byte for byte the request's alone; each response says how many
    requests its call held and how many calls its stream."""
    bodies = {seed: {"prompt": f"a lake {seed}", "seed": seed} for seed in (1, 2, 3, 4)}
    bodies[5] = {"prompt": "a lake 5", "seed": 5, "size": "128x96"}
    bodies[6] = {"prompt": "a lake 6", "seed": 6, "n": 2}
    bodies[7] = {"prompt": "a lake 7", "seed": 7, "num_inference_steps": 3}
    settings = ("serve.max_batch=4", "serve.max_inflight=4", "serve.max_queue=8", "serve.max_queued_work=100")
    with ServedWorld(tmp_path, nproc=2, settings=settings, launcher="world") as served:
        replies = {seed: _generate(served.url, body) for seed, body in bodies.items()}  # one at a time
        assert all(reply.status_code == 200 for reply in replies.values()), [r.text[:500] for r in replies.values()]
        alone = {seed: reply.json() for seed, reply in replies.items()}
        assert {(reply["batch"], reply["stream"]) for reply in alone.values()} == {(1, 1)}
        blocker = {"prompt": "busy", "seed": 0, "size": "384x384", "num_inference_steps": 20}  # ~2 s here
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            running = pool.submit(_generate, served.url, blocker)
            time.sleep(0.3)  # the blocker runs; the others queue together behind it
            replies_in_order = pool.map(lambda body: _generate(served.url, body), bodies.values())
            together = dict(zip(bodies, replies_in_order, strict=True))
            assert running.result().status_code == 200
        stream_stop = _a_client_of_a_stream_hangs_up(served)
    assert stream_stop["other"] == stream_stop["other_alone"]  # the same PNG bytes
    assert {rank for rank, _ in stream_stop["stops"]} == {"0", "1"}, stream_stop["stops"]
    assert len({step for _, step in stream_stop["stops"]}) == 1 and int(stream_stop["stops"][0][1]) <= 50
    replies = {seed: response.json() for seed, response in together.items()}
    assert [replies[seed]["batch"] for seed in (1, 2, 3, 4)] == [4] * 4, replies
    assert replies[5]["batch"] == replies[6]["batch"] == replies[7]["batch"] == 1
    assert {reply["stream"] for reply in replies.values()} == {4}
    for seed, reply in replies.items():
        assert reply["seed"] == seed and len(reply["data"]) == len(alone[seed]["data"])
        for mine, theirs in zip(reply["data"], alone[seed]["data"], strict=True):
            if seed > 4:  # a call of its own in the stream: the request's image alone
                assert mine["b64_json"] == theirs["b64_json"], seed
            a, b = (np.asarray(decode_png(x["b64_json"]), dtype=np.int16) for x in (mine, theirs))
            assert a.shape == b.shape and np.abs(a - b).max() <= 1, seed


# (the 100-step request may reach the queue first or second: the two clients post at once)
STREAM_STOPPED = r"rank (\d): call [12] of 2 of a stream stopped before step (\d+) of 100 on every rank"


def _a_client_of_a_stream_hangs_up(served) -> dict:
    """Behind a blocker, a short request and a 100-step one queue together and run as a stream of two; the second's
    client hangs up once both run. Returns the first's PNG and the same request's alone, and each rank's line saying
    where the second stopped (the served world of ``serve.max_inflight`` > 1, no API key)."""
    import socket

    other = {"prompt": "a lake 8", "seed": 8, "num_inference_steps": 4}
    other_alone = _generate(served.url, other).json()["data"][0]["b64_json"]
    lines = len(re.findall(STREAM_STOPPED, served.stderr()))
    host, port = served.url.removeprefix("http://").split(":")
    body = b'{"prompt": "long", "seed": 9, "num_inference_steps": 100}'
    request = (f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(_generate, served.url, {"prompt": "busy", "size": "384x384", "num_inference_steps": 20})
        time.sleep(0.3)
        short = pool.submit(_generate, served.url, other)
        with socket.create_connection((host, int(port))) as hanging:  # a client that goes away while it runs
            hanging.sendall(request)
            deadline = time.monotonic() + 60
            while requests_running(served.url) < 2:  # the stream of the short one and this one runs
                assert time.monotonic() < deadline, served.stderr()[-3000:]
                time.sleep(0.02)
        stops = poll_stderr(served, STREAM_STOPPED, after=lines, count=2)
        assert blocker.result().status_code == 200 and short.result().json()["stream"] == 2
        return {"other": short.result().json()["data"][0]["b64_json"], "other_alone": other_alone, "stops": stops}


def test_serve_compiles_its_sizes_before_ready_and_serves_a_further_size_eagerly(tmp_path):
    """``compile.mode: regional`` served (``aot_eager``: the capture without code generation, seconds): the two
    ``compile.warmup_sizes`` compile on every rank before the server says ready, one line each; requests of those
    sizes compile nothing more; a third size (past ``compile.max_shapes`` 2) is answered, eagerly on every rank, and
    said once."""
    settings = ("model=tiny", "generation.width=96", "generation.height=128", "compile.mode=regional",
                "compile.backend=aot_eager", "compile.max_shapes=2",
                "compile.warmup_sizes=[96x128, 128x128]")  # fmt: skip
    with ServedWorld(tmp_path, nproc=2, settings=settings, launcher="world") as served:
        before = served.stderr()
        assert "xfuse serve: compiling 2 size(s) before the first request" in served.stdout()
        for rank in (0, 1):
            for index, size in ((1, "96x128"), (2, "128x128")):
                assert re.search(rf"rank {rank}: compile.mode regional: shape {index} of 2 \({size}\): [1-9]\d* graph",
                                 before), before[-3000:]  # fmt: skip
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for size in ("96x128", "128x128", "96x128", "64x64"):
            result = client.images.generate(model="tiny", prompt="a lake", size=size, extra_body={"seed": 4})
            assert decode_png(result.data[0].b64_json).size == tuple(map(int, size.split("x")))
        os.kill(served.rank_pids()[0], signal.SIGTERM)  # rank 0 drains the world
        assert served.wait(timeout=60) == 0, served.stderr()[-3000:]
        after = served.stderr()[len(before) :]
    assert "compile.mode regional" not in after, after[-3000:]  # the warmed sizes compiled nothing more
    for rank in (0, 1):
        assert after.count(f"rank {rank}: compile.max_shapes = 2 shapes compiled; latents 1x4x8x8 runs eagerly") == 1


@pytest.mark.parametrize(
    "setting,says",
    [
        ("serve.max_queue=0", "serve.max_queue: must be an integer >= 1 (got 0)"),
        # the adapters' files are checked where serve starts (``xfuse.build.check_files``), before the port
        ("serve.lora_adapters={a: /nowhere/a}", "serve.lora_adapters.a: no LoRA file or folder at '/nowhere/a'"),
    ],
    ids=["bad-value", "missing-adapter-file"],
)
def test_a_bad_serve_config_is_refused_before_start(setting, says):
    out = subprocess.run(
        [sys.executable, "-m", "xfuse", "serve", "--set", setting, "--port", "0"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 2 and says in out.stderr
    assert "listening" not in out.stdout
