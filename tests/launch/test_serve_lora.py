"""LoRA through the commands: ``xfuse serve`` with adapters (``serve.lora_adapters``) on a real 2-rank torchrun world of
the tiny SD3, real HTTP on loopback, the ``openai`` client (requests pick adapters per request), and ``xfuse generate
--lora``; every image equals diffusers' own pipeline called with the same adapters (exact mode: warm-up = all
steps)."""

import concurrent.futures
import os
import signal
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.support.lora_fns import save_lora
from tests.support.serve_fns import ServedWorld, decode_png, peak_rss_kib
from xfuse.build import image_call_kwargs
from xfuse.families.registry import load_pipeline, model_spec

PRESET, SIZE, STEPS, GUIDANCE = "sd3-tiny", (96, 128), 4, 5.0  # warm-up 4 = every step: exact mode
# Each request's adapters: one, the other, none (the base model), both with weights.
MIXES = ["a", "b", None, {"a": 0.7, "b": 0.4}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, pipe = tmp_path_factory.mktemp("lora"), load_pipeline(PRESET)
    return {
        "a": save_lora(pipe, root / "a", seed=1, rank=4, alpha=8),
        "b": save_lora(pipe, root / "b", seed=2, rank=2, alpha=2),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory, adapters):
    listed = ", ".join(f"{name}: {path}" for name, path in adapters.items())
    settings = (f"model={PRESET}", "parallel.warmup_steps=4", "generation.width=96", "generation.height=128",
                f"serve.lora_adapters={{{listed}}}", "comm.timeout_s=30", "serve.max_batch=4",
                "serve.max_inflight=4")  # fmt: skip
    served = ServedWorld(tmp_path_factory.mktemp("serve"), settings=settings, launcher="world")
    yield served
    served.close()


def direct(pipe, mix, seed, steps=STEPS):
    """diffusers' own pipeline, the same call as the server makes, with the same adapters active."""
    if mix is None:
        pipe.disable_lora()
    else:
        weights = {mix: 1.0} if isinstance(mix, str) else mix
        pipe.enable_lora()
        pipe.set_adapters(list(weights), adapter_weights=list(weights.values()))
    kwargs = image_call_kwargs(prompt=f"a cat {seed}", negative_prompt=None, width=SIZE[0], height=SIZE[1],
                               num_inference_steps=steps, guidance_scale=GUIDANCE, seed=seed,
                               spec=model_spec(PRESET))  # fmt: skip
    with torch.no_grad():
        return np.asarray(pipe(**kwargs).images[0])


def test_twenty_requests_alternating_adapters_equal_direct_calls_with_memory_flat(world, adapters):
    """20 requests cycling a, b, none and a 0.7 + b 0.4: each image is diffusers' with the same adapters (within one
    8-bit level, exact mode), the adapters change the images, and no rank's peak memory grows after the first cycle."""
    client = openai.OpenAI(base_url=f"{world.url}/v1", api_key="unused", max_retries=0, timeout=120)
    pipe = load_pipeline(PRESET)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name)
    pids, peaks, images = world.rank_pids(), {}, {}
    for i in range(20):
        mix = MIXES[i % 4]
        extra = {"seed": i, "num_inference_steps": STEPS, "guidance_scale": GUIDANCE}
        if mix is not None:
            extra["lora"] = mix
        result = client.images.generate(model=PRESET, prompt=f"a cat {i}", size="96x128", extra_body=extra)
        got = np.asarray(decode_png(result.data[0].b64_json)).astype(int)
        expected = direct(pipe, mix, i).astype(int)
        assert np.abs(got - expected).max() <= 1, (i, mix)
        images[i] = got
        if i + 1 in (4, 20):
            peaks[i + 1] = {rank: peak_rss_kib(pid) for rank, pid in pids.items()}
    assert world.rank_pids() == pids
    for rank in pids:
        assert peaks[20][rank] <= 1.05 * peaks[4][rank], (rank, peaks)
    # Same prompt and seed under each mix: the adapters are what differ.
    base = direct(pipe, None, 0).astype(int)
    assert all(np.abs(direct(pipe, mix, 0).astype(int) - base).max() > 2 for mix in ("a", "b", {"a": 0.7, "b": 0.4}))


def test_batches_and_streams_never_mix_adapters_and_each_image_is_its_own_adapters(world, adapters):
    """``serve.max_batch: 4``, ``serve.max_inflight: 4``: two requests with adapter a and two with b queue together
    behind a running one, and one more of each with other steps; each pair runs as one pipeline call (``batch`` 2:
    requests of different adapters never share one), streamed with the call of the third request of its adapter
    (``stream`` 2: nor do they share a stream), and each image is diffusers' with its request's adapter, steps and
    seed (within one 8-bit level, exact mode)."""
    pipe = load_pipeline(PRESET)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name)
    url = f"{world.url}/v1/images/generations"
    blocker = {"prompt": "busy", "size": "512x512", "num_inference_steps": 30, "seed": 0}
    bodies = {seed: {"prompt": f"a cat {seed}", "size": "96x128", "seed": seed, "num_inference_steps": STEPS,
                     "guidance_scale": GUIDANCE, "lora": mix} for seed, mix in ((31, "a"), (32, "b"), (33, "a"),
                                                                                (34, "b"))}  # fmt: skip
    for seed in (35, 36):  # a call of its own (35: adapter a, as 31; 36: b), streamed with its adapter's pair
        bodies[seed] = {**bodies[seed - 4], "prompt": f"a cat {seed}", "seed": seed, "num_inference_steps": STEPS - 1}
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        running = pool.submit(httpx.post, url, json=blocker, timeout=120)
        time.sleep(0.5)
        assert not running.done()
        posted = pool.map(lambda body: httpx.post(url, json=body, timeout=120), bodies.values())
        replies = dict(zip(bodies, posted, strict=True))
        assert running.result().status_code == 200
    for seed, reply in replies.items():
        assert reply.status_code == 200, (seed, reply.text[:300])
        assert (reply.json()["batch"], reply.json()["stream"]) == (1 if seed > 34 else 2, 2), (seed, reply.text[:300])
        got = np.asarray(decode_png(reply.json()["data"][0]["b64_json"])).astype(int)
        expected = direct(pipe, bodies[seed]["lora"], seed, bodies[seed]["num_inference_steps"])
        assert np.abs(got - expected.astype(int)).max() <= 1, seed


def test_models_lists_the_adapters_and_unknown_ones_are_refused(world):
    client = openai.OpenAI(base_url=f"{world.url}/v1", api_key="unused", max_retries=0, timeout=120)
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [PRESET, "a", "b"]
    assert cards["a"].model_extra["parent"] == PRESET and "parent" not in cards[PRESET].model_extra
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a cat", size="96x128", extra_body={"lora": "c"})
    error = e.value.body
    assert error["param"] == "lora" and error["code"] == "adapter_not_found"
    assert error["message"] == "lora: 'c' is not an adapter of this server; it has 'a', 'b' (GET /v1/models)"
    result = client.images.generate(model="b", prompt="a cat", size="96x128", extra_body={"seed": 1})  # vLLM's way
    assert decode_png(result.data[0].b64_json).size == SIZE
    os.kill(world.rank_pids()[0], signal.SIGTERM)  # last: rank 0 drains the world
    assert world.wait(timeout=60) == 0, world.stderr()[-3000:]


def test_generate_applies_its_loras_with_their_weights(adapters, tmp_path):
    """``xfuse generate --lora PATH=WEIGHT`` twice on 2 ranks: the PNG equals diffusers' with both adapters at those
    weights (one 8-bit level), and the summary names them."""
    from PIL import Image

    from tests.support.cli_fns import on_a_fresh_world

    target = tmp_path / "lora.png"
    sets = [f"model={PRESET}", "parallel.pipefusion_degree=2", "parallel.warmup_steps=4", "generation.width=96",
            "generation.height=128", f"generation.num_inference_steps={STEPS}", f"generation.guidance_scale={GUIDANCE}",
            "generation.prompt=a cat 7", "generation.seed=7"]  # fmt: skip
    argv = ["generate", *[a for kv in sets for a in ("--set", kv)], "--output", str(target)]
    argv += ["--lora", f"{adapters['a']}=0.7", "--lora", f"{adapters['b']}=0.4"]
    out = on_a_fresh_world(argv)  # as torchrun's ranks run it (tests.support.cli_fns)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"LoRA: {adapters['a']} (0.7), {adapters['b']} (0.4)" in out.stdout
    pipe = load_pipeline(PRESET)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name)
    expected = direct(pipe, {"a": 0.7, "b": 0.4}, 7).astype(int)
    got = np.asarray(Image.open(target)).astype(int)
    assert np.abs(got - expected).max() <= 1
    assert np.abs(direct(pipe, None, 7).astype(int) - got).max() > 2  # the adapters were applied


def test_adapters_for_a_family_without_lora_are_refused_before_start(tmp_path):
    import subprocess
    import sys

    from tests.support.cli_fns import cli_here
    from tests.support.serve_fns import ENV

    out = subprocess.run(
        [sys.executable, "-m", "xfuse", "serve", "--set", "model=tiny",
         "--set", f"serve.lora_adapters={{a: {tmp_path}}}", "--port", "0"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    says = "serve.lora_adapters: tiny is a hunyuandit model, whose diffusers pipeline (HunyuanDiTPipeline) has no LoRA"
    assert says in out.stderr, out.stderr[-2000:]
    out = cli_here(["generate", "--set", "model=tiny", "--lora", str(tmp_path)])  # refused before it runs
    assert out.returncode == 2 and "generation.lora: tiny is a hunyuandit model" in out.stderr, out.stderr[-2000:]
