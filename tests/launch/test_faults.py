"""Failures with real processes: ranks really killed, stalled or raising (on test worlds' ranks, and under torchrun);
mismatched start-up; bad inputs refused on every rank. Every world here has a wall-clock limit, so a regression fails
instead of hanging.
"""

import datetime
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from tests.support.fault_fns import (
    build_errors,
    generate_on_a_fresh_world,
    passes_until_the_fault,
    start_with_config,
)
from tests.support.pipeline_fns import run_calls
from tests.support.reports import REPORT, at, parse_reports
from tests.support.world import World
from xfuse.families.hunyuandit.presets import save_tiny_pipeline
from xfuse.runtime.monitor import LEFT, TERMINATED_KEY, FailureMonitor

ENV = dict(os.environ)  # offline: tests/conftest.py
FAULT = re.compile(
    r"\[xfuse-fault (\d\d:\d\d:\d\d\.\d{3})\] rank (\d+): (\w+) at (step \d+|the VAE decode|the text encoder)"
)


def launch(tmp_path, degree, fault, timeout_s, steps=6, settings=(), config="configs/tiny/pp2.yaml", launcher="world"):
    """A PipeFusion generation of ``config`` with a fault armed, by ``xfuse generate`` on ``degree`` ranks; return
    (exit code, stderr, fault time, end time, {rank: (report time, report text)}).

    ``launcher="world"``: on a fresh test world's ranks (forked from the preloaded server, not importing torch and
    diffusers again: 4-5 s of CPU a rank here), each rank's output in its own file, the exit code the first non-zero
    one of its ranks'; no launcher stops a survivor, so each must end by itself. ``"torchrun"``: under
    ``torch.distributed.run``, which terminates the survivors once it sees a rank end."""
    argv = [
        "generate",
        "--config",
        config,
        "--set",
        f"parallel.pipefusion_degree={degree}",
        "--set",
        f"parallel.num_patches={degree}",
        "--set",
        f"comm.timeout_s={timeout_s}",
        "--set",
        f"generation.num_inference_steps={steps}",
        "--output",
        str(tmp_path / "never.png"),
        *(arg for setting in settings for arg in ("--set", setting)),
    ]
    if launcher == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}"]
        out = subprocess.run(
            [*torchrun, "-m", "xfuse", *argv], capture_output=True, text=True, env={**ENV, "XFUSE_FAULT": fault},
            timeout=240,
        )  # fmt: skip
        end = datetime.datetime.now().timestamp()
        returncode, stderr = out.returncode, out.stderr
    else:
        returncode, stderr, end = generate_on_a_fresh_world(degree, argv, {"XFUSE_FAULT": fault}, tmp_path)
    day = datetime.date.today()
    assert "terminate called" not in stderr, stderr[-3000:]  # the error path tears down in order too
    fault_match = next((m for line in stderr.splitlines() if (m := FAULT.search(line))), None)
    assert fault_match is not None, f"the fault {fault} never fired (rc {returncode}):\n{stderr[-4000:]}"
    reports = parse_reports(stderr, day)
    return returncode, stderr, at(fault_match.group(1), day), end, reports


# 2 ranks under torchrun: the victim's one peer, the whole command as users launch it; 8 on a test world: every
# survivor, six of them never its neighbour, names it within 5 s and ends by itself (no launcher terminates it). A
# run at 4 ranks, between the two, showed nothing they do not.
@pytest.mark.parametrize("launcher, degree", [("torchrun", 2), ("world", 8)])
def test_killed_rank_stops_every_rank_quickly_naming_it(tmp_path, launcher, degree):
    timeout_s, victim = 30, degree - 1
    rc, stderr, fault_t, end_t, reports = launch(tmp_path, degree, f"kill:{victim}:2", timeout_s, launcher=launcher)
    assert rc != 0
    assert end_t - fault_t < timeout_s + 5  # nobody sat out the 30 s timeout
    survivors = set(range(degree)) - {victim}
    assert set(reports) >= survivors, stderr[-3000:]
    for rank in survivors:
        when, text = reports[rank]
        assert when - fault_t < 5 and f"rank {victim}" in text, text  # each names the lost rank


# 4 ranks: the first rank to time out may wait on a rank that waits on the stalled one, and the chain still ends at
# it (at 2 ranks, with the same assertions, the waiting rank is the stalled one's only peer: nothing more shown).
@pytest.mark.parametrize("degree", [4])
def test_stalled_rank_gives_comm_timeout_with_rank_peer_op_step_patch(tmp_path, degree):
    timeout_s, victim = 3, 1
    rc, stderr, fault_t, end_t, reports = launch(tmp_path, degree, f"stall:{victim}:2", timeout_s)
    assert rc != 0
    timeouts = [(when, text) for rank, (when, text) in reports.items() if "CommTimeout" in text.splitlines()[0]]
    assert timeouts, stderr[-3000:]
    when, text = min(timeouts)
    assert when - fault_t < timeout_s + 2
    # the op may be the stalled rank's last message of step 1: a rank runs step 2's first patch on its outbound
    # segment before step 1's last one on its return segment (fill before drain), and the stall is before the former
    assert re.search(
        r"rank \d+: (recv|send) of hidden \(2, \d+, 32\) float32, \d+ bytes, (from|to) rank \d+ timed "
        r"out after 3.0 s at step [12], patch \d",
        text,
    ), text
    assert f"rank {victim}: not communicating" in text  # who-waits-for-whom ends at the stalled rank
    assert end_t - fault_t < timeout_s + 10


# Sequence parallelism at degree 2 (one pipeline rank): the victim stops before its first block of step 2, so its
# peer waits inside the attention's all-to-all (Ulysses) or ring exchange (Ring) of that step.
SEQUENCE = {
    "ulysses2": (
        "ulysses qkv",
        ["parallel.pipefusion_degree=1", "parallel.num_patches=1", "parallel.ulysses_degree=2"],
    ),
    "ring2": ("ring kv", ["parallel.pipefusion_degree=1", "parallel.num_patches=1", "parallel.ring_degree=2"]),
}


@pytest.mark.parametrize("layout", SEQUENCE)
def test_killed_rank_inside_sequence_parallel_attention_is_named(tmp_path, layout):
    timeout_s = 30
    rc, stderr, fault_t, end_t, reports = launch(tmp_path, 2, "kill:1:2", timeout_s, settings=SEQUENCE[layout][1])
    assert rc != 0
    assert end_t - fault_t < timeout_s + 5
    when, text = reports[0]
    assert when - fault_t < 5 and "rank 1" in text, stderr[-3000:]


@pytest.mark.parametrize("layout", SEQUENCE)
def test_stalled_rank_inside_sequence_parallel_attention_times_out_naming_the_op(tmp_path, layout):
    timeout_s = 3
    kind, settings = SEQUENCE[layout]
    rc, stderr, fault_t, end_t, reports = launch(tmp_path, 2, "stall:1:2", timeout_s, settings=settings)
    assert rc != 0
    when, text = reports[0]
    assert text.startswith("rank 0 failed: CommTimeout: "), stderr[-3000:]
    assert re.search(rf"rank 0: recv of {kind} \(.*\) float32, \d+ bytes, from rank 1 timed out after 3.0 s at step 2",
                     text), text  # fmt: skip
    assert "rank 1: not communicating" in text  # who-waits-for-whom ends at the stalled rank
    assert when - fault_t < timeout_s + 2
    assert end_t - fault_t < timeout_s + 10


# Phases outside the denoising loop, each stopped as the victim (rank 1) starts its share, with the settings that run
# it over both ranks and the message rank 0 then waits for:
# - the band-parallel VAE decode: rank 0, which scattered the latent, waits for the victim's halo rows of the
#   decoder's first convolution (a video's: Wan's causal convolution, its rows with the two causal zero frames);
# - the text encoder split over the pipeline group (FLUX.2 [klein]'s Qwen3): rank 0, which handed the victim the
#   hidden state, waits for its layers' hidden states, the place named "prompt encoding".
PHASES = {
    "decode": (
        ["parallel.vae_parallel=on"],
        r"recv of vae halo \(1, \d+, 1, 32\) float32, \d+ bytes, from rank 1 timed out after 3.0 s",
    ),
    "decode_video": (
        ["config=configs/wan/pp2.yaml", "parallel.vae_parallel=on"],
        r"recv of vae halo \(1, 4, 3, 1, 28\) float32, \d+ bytes, from rank 1 timed out after 3.0 s",
    ),
    "text": (
        ["model=flux2-klein-tiny", "parallel.placement=linear", "parallel.text_encoder=split"],
        r"recv of text-encoder-layers \(\d+, 1, \d+, 16\) float32, \d+ bytes, from rank 1 timed out after 3.0 s "
        r"at prompt encoding",
    ),
}


def phase_settings(phase: str) -> tuple[str, list[str], str]:
    """(config file, --set settings, the message rank 0 waits for) of a ``PHASES`` entry."""
    settings, waited = PHASES[phase]
    config = next((s.removeprefix("config=") for s in settings if s.startswith("config=")), "configs/tiny/pp2.yaml")
    return config, [s for s in settings if not s.startswith("config=")], waited


@pytest.mark.parametrize("phase", PHASES)
def test_killed_rank_outside_the_loop_is_named(tmp_path, phase):
    timeout_s = 30
    config, settings, _ = phase_settings(phase)
    where = phase.removesuffix("_video")
    rc, stderr, fault_t, end_t, reports = launch(
        tmp_path, 2, f"kill:1:{where}", timeout_s, steps=2, settings=settings, config=config
    )
    assert rc != 0
    assert end_t - fault_t < timeout_s + 5
    when, text = reports[0]
    assert when - fault_t < 5 and "rank 1" in text, stderr[-3000:]


@pytest.mark.parametrize("phase", PHASES)
def test_stalled_rank_outside_the_loop_times_out_naming_the_op(tmp_path, phase):
    timeout_s = 3
    config, settings, waited = phase_settings(phase)
    where = phase.removesuffix("_video")
    rc, stderr, fault_t, end_t, reports = launch(
        tmp_path, 2, f"stall:1:{where}", timeout_s, steps=2, settings=settings, config=config
    )
    assert rc != 0
    when, text = reports[0]
    assert text.startswith("rank 0 failed: CommTimeout: "), stderr[-3000:]
    assert re.search(rf"rank 0: {waited}", text), text
    assert "rank 1: not communicating" in text  # who-waits-for-whom ends at the stalled rank
    assert when - fault_t < timeout_s + 2
    assert end_t - fault_t < timeout_s + 10


def test_stalled_rank_with_stream_ordered_waits_is_named_by_the_watchdog(tmp_path):
    # comm.wait=stream on CPU: gloo's wait blocks the main thread as a device synchronisation behind a lost message
    # would on CUDA; the comm watchdog times the wait out, waits its 2 s grace for the main thread, then reports
    # from its own thread (who-waits-for-whom included) and ends the process.
    timeout_s, victim, grace_s = 3, 1, 2
    rc, stderr, fault_t, end_t, reports = launch(
        tmp_path, 2, f"stall:{victim}:2", timeout_s, settings=["comm.wait=stream"]
    )
    assert rc != 0
    when, text = reports[0]
    assert text.startswith("rank 0 failed: CommTimeout: "), stderr[-3000:]
    assert re.search(
        r"rank 0: (recv|send) of hidden \(2, \d+, 32\) float32, \d+ bytes, (from|to) rank 1 timed out after 3.0 s "
        r"at step 2, patch \d",
        text,
    ), text
    assert "rank 1: not communicating" in text  # who-waits-for-whom ends at the stalled rank
    assert when - fault_t < timeout_s + grace_s + 1.5
    assert end_t - fault_t < timeout_s + 10


def test_a_host_stopped_outside_its_waits_is_named_by_the_host_deadline(tmp_path):
    # A host blocked where no wait of xfuse's runs (on CUDA: inside a kernel launch behind a device queue that never
    # drains; here: the stall fault, whose sleep lets the other threads run) is named by comm.host_timeout_s, well
    # before comm.timeout_s would end the peers' waits. Rank 0 waits on rank 1 all that time: its bounded wait is not
    # aged, so the stalled rank, not the waiting one, is named.
    host_timeout_s, comm_timeout_s = 3, 60
    rc, stderr, fault_t, end_t, reports = launch(
        tmp_path, 2, "stall:1:2", comm_timeout_s, settings=[f"comm.host_timeout_s={host_timeout_s}"]
    )
    assert rc != 0
    when, text = reports[1]
    assert re.match(
        r"rank 1 failed: HostStalled: rank 1: no task of the denoising loop finished for 3\.\d s "
        r"\(comm.host_timeout_s: 3\) outside a wait for a message; the last one finished was "
        r"(the wait for the send of \w+ to rank \d from )?s\d (p\d|whole)",
        text,
    ), stderr[-3000:]
    assert "xfuse/runtime/faults.py" in text and "in _fire" in text  # where the host is: the stalled call
    assert "first failure in the world: rank 1: HostStalled" in reports[0][1], stderr[-3000:]
    assert host_timeout_s < when - fault_t < host_timeout_s + 1.5  # one poll of 0.25 s, and the start of a report
    assert end_t - fault_t < host_timeout_s + 10 < comm_timeout_s


def test_a_host_frozen_holding_the_interpreter_lock_is_ended_by_faulthandler(tmp_path):
    # No Python thread of the frozen rank runs again, the deadline's neither: faulthandler's own timer, re-armed by
    # that thread while it ran, ends the process with every thread's stack; its peer loses it and names it.
    host_timeout_s, comm_timeout_s = 2, 60
    rc, stderr, fault_t, end_t, reports = launch(
        tmp_path, 2, "freeze:1:2", comm_timeout_s, settings=[f"comm.host_timeout_s={host_timeout_s}"]
    )
    assert rc != 0
    assert re.search(r"Timeout \(0:00:1[2-9]\)!", stderr), stderr[-3000:]  # host_timeout_s + 2 x BACKSTOP_S
    dump = stderr[stderr.index("Timeout (0:00:1") :]
    assert re.search(r'File ".*xfuse/runtime/faults.py", line \d+ in _fire', dump), dump[:3000]
    when, text = reports[0]
    # its peer loses it and names it, unless torchrun, seeing rank 1 exit, terminates rank 0 first
    lost = r"rank 0 failed: PeerLost: rank 0: (recv|send) of hidden .* rank 1 failed: peer lost"
    assert re.match(lost, text) or text.startswith("rank 0 terminated by the launcher (SIGTERM)"), text
    # faulthandler's timer fires host_timeout_s + 2 x BACKSTOP_S after its last re-arming, which came at most
    # BACKSTOP_S and one poll (0.25 s) before the freeze
    assert host_timeout_s + 5 - 0.25 < when - fault_t < host_timeout_s + 10 + 3
    assert end_t - fault_t < comm_timeout_s


# 4 ranks: ranks that never talk to rank 1 report its exception too (at 2 ranks, the same assertions, nothing more).
@pytest.mark.parametrize("degree", [4])
def test_exception_in_a_forward_stops_every_rank_naming_it(tmp_path, degree):
    rc, stderr, fault_t, end_t, reports = launch(tmp_path, degree, "raise:1:1", 30)
    assert rc != 0 and end_t - fault_t < 10
    assert set(reports) == set(range(degree)), stderr[-3000:]
    for _, text in reports.values():
        assert "RuntimeError: injected fault: rank 1 raised in its forward at step 1" in text, text
    assert "xfuse generate: rank 1: error: RuntimeError: injected fault" in stderr


# The tiny model at 128 x 96 px: 8 x 6 = 48 tokens, 2 patches of 24; CFG's batch of 2 streamed in 2 parts of 1
# row in the warm-up step (degree 2). The fault must fire on its step's first pass however many passes a step takes.
WARMUP_PARTS, PATCHES = [(1, 48)] * 2, [(2, 24)] * 2


@pytest.mark.parametrize(
    "step, placement, passes, place",
    [
        (0, "linear", WARMUP_PARTS[:1], "step 0, whole image, batch part 0"),
        (2, "folded", WARMUP_PARTS + PATCHES + PATCHES[:1], "step 2, patch 0"),
    ],
)
def test_a_fault_fires_on_its_steps_first_pass(step, placement, passes, place):
    with World(2) as world:
        _, (error_type, message, shapes) = world.run_ok(passes_until_the_fault, f"raise:1:{step}", placement, 2.0)
    assert error_type == "RuntimeError" and message == f"injected fault: rank 1 raised in its forward at {place}"
    assert [shape[:2] for shape in shapes] == passes  # the last pass recorded is the one the fault fired in


@pytest.mark.parametrize("degree", [2, 4])
def test_ranks_with_different_yaml_files_are_refused_at_start(tmp_path, degree):
    base = open("configs/tiny/pp2.yaml").read().replace("pipefusion_degree: 2", f"pipefusion_degree: {degree}")
    paths = []
    for rank in range(degree):
        text = base.replace("warmup_steps: 1", "warmup_steps: 2") if rank == degree - 1 else base
        text = text.replace("seed: 0", "seed: 7") if rank == 0 else text
        (tmp_path / f"rank{rank}.yaml").write_text(text)
        paths.append(str(tmp_path / f"rank{rank}.yaml"))
    with World(degree) as world:
        results = world.run_ok(start_with_config, paths, timeout=120)
    others = ", ".join(map(str, range(degree - 1)))
    for error_type, message in results:  # the same error, naming each field and who holds what, on every rank
        assert error_type == "StartupMismatch"
        assert f"parallel.warmup_steps: rank{'s' if degree > 2 else ''} {others} = 1; rank {degree - 1} = 2" in message
        assert "generation.seed: rank 0 = 0" not in message and "generation.seed: rank 0 = 7" in message


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "HunyuanDiT-tiny")


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


import torch  # noqa: E402  (after the fixtures: only the tables below need it)

BAD_CONFIG = [  # from_pretrained keyword arguments -> (error type, text naming the field)
    (dict(parallel={"pipefusion_degree": 3}), "ConfigError", "parallel.pipefusion_degree"),
    (dict(parallel={"pipefusion_degree": 2, "num_patches": 0}), "ConfigError", "parallel.num_patches"),
    (dict(parallel={"pipefusion_degree": 2, "placement": "diagonal"}), "ConfigError", "parallel.placement"),
    (dict(parallel={"pipefusion_degree": 2, "cfg_degree": 3}), "ConfigError", "parallel.cfg_degree"),
    (dict(parallel={"pipefusion_degree": 2, "warmup_steps": -1}), "ConfigError", "parallel.warmup_steps"),
    (dict(parallel={"pipefusion_degree": 2, "stage_split": [1, 2]}), "ConfigError", "parallel.stage_split"),
    (dict(parallel={"pipefusion_degre": 2}), "ConfigError", "parallel.pipefusion_degre"),
    (dict(parallel={"pipefusion_degree": 2}, comm={"timeout_s": 0}), "ConfigError", "comm.timeout_s"),
    (dict(parallel={"pipefusion_degree": 2}, comm={"max_inflight": 0}), "ConfigError", "comm.max_inflight"),
    (dict(parallel={"pipefusion_degree": 2}, comm={"backend": "mpi"}), "ConfigError", "comm.backend"),
    (
        dict(parallel={"pipefusion_degree": 2}, comm={"socket_ifname": "nope0"}),
        "ConfigError",
        "comm.socket_ifname: no interface 'nope0' on this host; it has: ",
    ),
    (dict(parallel={"pipefusion_degree": 2}, torch_dtype=torch.int8), "ValueError", "torch_dtype must be one of"),
]
CALL = dict(
    prompt="a red house", height=128, width=96, num_inference_steps=3, output_type="np", use_resolution_binning=False
)
BAD_CALLS = [  # __call__ overrides -> (error type, text naming the field)
    (dict(height=100), "ValueError", "height must be a positive multiple of 16 (got 100; diffusers would silently"),
    (dict(width=96.0), "ValueError", "width must be a positive multiple of 16 (got 96.0"),
    (dict(height=16), "ConfigError", "parallel.num_patches"),
    (dict(output_type="jpg"), "ValueError", "output_type must be one of"),
    (dict(num_images_per_prompt=0), "ValueError", "num_images_per_prompt must be a positive integer"),
    (dict(latents=torch.zeros(1, 4, 8, 8)), "ValueError", "latents must be a tensor of shape (1, 4, 16, 12)"),
    (dict(original_size=[1024, 1024]), "ValueError", "original_size must be a tuple of two ints"),
    (dict(crops_coords_top_left=(0.5, 0)), "ValueError", "crops_coords_top_left must be a tuple of two ints"),
    (dict(guidance_rescale=0.3), "ValueError", "guidance_rescale=0.3 needs whole-image statistics"),
    (dict(prompt=123), "ValueError", "`prompt` has to be of type `str` or `list`"),
    (dict(callback_on_step_end_tensor_inputs=["noise"]), "ValueError", "callback_on_step_end_tensor_inputs"),
    (dict(num_inference_steps=0), "ValueError", "num_inference_steps must be a positive integer"),
    (dict(seed="rank"), "ValueError", "generator must be the same on every rank"),
    (dict(prompt=None), "ValueError", "Provide either `prompt` or `prompt_embeds`"),
    (dict(prompt=None, prompt_embeds=torch.zeros(1, 77, 32)), "ValueError", "prompt_embeds_2"),
]


@pytest.fixture(scope="module")
def refusals(world2, folder):
    """Every bad input tried once on both ranks of one world (one call each): what each rank answered."""
    built = world2.run_ok(build_errors, folder, [kw for kw, _, _ in BAD_CONFIG], timeout=300)
    calls = world2.run_ok(
        run_calls,
        folder,
        {"pipefusion_degree": 2, "warmup_steps": 1},
        [{**CALL, **extra} for extra, _, _ in BAD_CALLS] + [CALL],
        timeout=300,
    )
    return built, calls


def _case_id(case) -> str:
    return ",".join(f"{k}={v!r}"[:40] for k, v in case[0].items())


@pytest.mark.parametrize("index", range(len(BAD_CONFIG)), ids=[_case_id(c) for c in BAD_CONFIG])
def test_bad_config_value_refused_on_every_rank(refusals, index):
    _, err_type, text = BAD_CONFIG[index]
    for rank in range(2):
        result = refusals[0][rank][index]
        assert result is not None and result[0] == err_type and text in result[1], (rank, result)


@pytest.mark.parametrize("index", range(len(BAD_CALLS)), ids=[_case_id(c) for c in BAD_CALLS])
def test_bad_call_argument_refused_on_every_rank(refusals, index):
    _, err_type, text = BAD_CALLS[index]
    for rank in range(2):
        result = refusals[1][rank][index]
        assert result["kind"] == "error" and result["type"] == err_type and text in result["message"], (rank, result)


def test_world_still_works_after_every_refusal(refusals):
    calls = refusals[1]
    assert [calls[rank][-1]["kind"] for rank in range(2)] == ["ok", "none"]  # nothing hung; rank 0 returns


def test_a_rank_that_died_without_a_report_is_named_by_its_stale_heartbeat(tmp_path, capfd):
    """A killed rank records nothing; when its neighbours lose another peer first (the launcher already terminated
    it), the reports still name the dead rank: its heartbeat stopped, and no launcher marker explains it."""
    store = dist.PrefixStore("default_pg", dist.FileStore(str(tmp_path / "store"), 1))
    monitor = FailureMonitor(0, store, poll_s=0.05, world_size=4)
    stopped = FailureMonitor(1, store, poll_s=0.05, world_size=4)
    time.sleep(0.2)
    # Left in order: the heartbeat says so (the key stays: a reader between its check() and get() must not wait
    # in get() for a deleted key; that race stranded a report on the store's timeout in CI).
    assert stopped.stop() and store.get("xfuse/alive/1").decode() == LEFT
    store.set("xfuse/alive/2", f"{time.time() - 5:.3f}")  # killed 5 s ago
    store.set("xfuse/alive/3", f"{time.time() - 5:.3f}")
    store.set(f"{TERMINATED_KEY}/3", "12:00:00.000")  # stale too, but the launcher terminated it
    monitor.report("rank 0 failed: PeerLost: lost rank 3")
    err = capfd.readouterr().err
    assert "no heartbeat, no report (killed, or its node lost?): rank 2 (5." in err
    assert "rank 3 (" not in err and "rank 1 (" not in err
    assert monitor.stop()


def test_a_lost_live_peer_waits_for_the_dead_ranks_heartbeat(tmp_path, capfd):
    """gloo fails every pending operation of a group when one connection resets: rank 2's receive from rank 1 (alive,
    not terminated) reported rank 3's socket within 30 ms of rank 3's kill. The report must wait for the dead rank's
    heartbeat to go stale and name it, not stop at the live peer."""
    store = dist.PrefixStore("default_pg", dist.FileStore(str(tmp_path / "store"), 1))
    monitor = FailureMonitor(2, store, poll_s=0.05, world_size=4)
    for rank in (0, 1, 3):
        store.set(f"xfuse/alive/{rank}", f"{time.time():.3f}")
    killed = threading.Timer(0.5, lambda: store.set("xfuse/alive/3", f"{time.time() - 5:.3f}"))
    killed.start()
    start = time.monotonic()
    monitor.await_root_cause(1)
    waited = time.monotonic() - start
    monitor.report("rank 2 failed: PeerLost: recv of hidden from rank 1 failed: peer lost")
    assert 0.4 < waited < monitor.grace_s, waited
    assert "no heartbeat, no report (killed, or its node lost?): rank 3 (" in capfd.readouterr().err
    killed.join()
    assert monitor.stop()


def test_a_recorded_root_cause_ends_the_wait_for_heartbeats(tmp_path):
    store = dist.PrefixStore("default_pg", dist.FileStore(str(tmp_path / "store"), 1))
    monitor = FailureMonitor(2, store, poll_s=0.05, world_size=4)
    refused = FailureMonitor(1, store, poll_s=0.05, world_size=4)
    refused.record(ValueError("rank 1 refused its input"))
    start = time.monotonic()
    monitor.await_root_cause(1)
    assert time.monotonic() - start < 0.3
    assert monitor.stop() and refused.stop()


SIGTERM_DURING_REPORT = """
import os, signal, sys, time
import torch.distributed as dist
from xfuse.runtime.monitor import FailureMonitor

store = dist.FileStore(sys.argv[1], 1)
monitor = FailureMonitor(6, store, poll_s=0.05, world_size=8)
monitor.install_sigterm_handler()
monitor.record(RuntimeError("recv from rank 7 failed: peer lost"))
gather = monitor.silent_ranks

def slow_gather():  # the launcher's SIGTERM lands while the report reads the heartbeats from the store
    monitor.silent_ranks = gather
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    return gather()

monitor.silent_ranks = slow_gather
monitor.report("rank 6 failed: PeerLost: recv from rank 7 failed: peer lost")
print("the handler did not end the process", file=sys.stderr)
"""


def test_sigterm_in_the_middle_of_a_report_still_writes_one(tmp_path):
    """torchrun terminates the survivors while the dead rank's neighbour is writing its own report (gathering
    heartbeats from the store): the SIGTERM handler, which leaves with os._exit, must write the report then."""
    out = subprocess.run(
        [sys.executable, "-c", SIGTERM_DURING_REPORT, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    reports = [m.group(2) for line in out.stderr.splitlines() if (m := REPORT.search(line))]
    assert reports == ["rank 6 terminated by the launcher (SIGTERM)"], out.stderr
    assert "first failure in the world: rank 6: RuntimeError: recv from rank 7 failed: peer lost" in out.stderr


def test_a_report_goes_to_stderr_in_one_write(capfd, monkeypatch):
    """Ranks of a node share one stderr and fail together: a report written in two calls (``print``: the text,
    then its newline) let another rank's header land on the report's last line (seen in a two-node run)."""
    from xfuse import stderr

    writes = []
    real_write = os.write

    def recording_write(fd, data):
        writes.append((fd, bytes(data)))
        return real_write(fd, data)

    monkeypatch.setattr(stderr.os, "write", recording_write)
    report = "[xfuse 10:00:00.000] rank 3 failed: CommTimeout: recv of hidden\n  recent ops:\n  recv hidden"
    stderr.write_stderr(report)
    assert writes == [(sys.stderr.fileno(), (report + "\n").encode())]  # the text and its newline: one call
    assert capfd.readouterr().err == report + "\n"


def test_a_report_under_capsys_is_one_stream_write(capsys):
    from xfuse import stderr

    stderr.write_stderr("rank 0: error: bad\n  detail")  # capsys' stream has no file descriptor
    assert capsys.readouterr().err == "rank 0: error: bad\n  detail\n"
