"""One command starts the world (``xfuse serve|generate --nproc-per-node N``, ``xfuse.runtime.launcher``), and its
signals and exit code mean what they say: real processes on loopback, signalled as a supervisor or a terminal does."""

import concurrent.futures
import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time

import httpx
import numpy as np
from PIL import Image

from tests.support.cli_fns import on_a_fresh_world
from tests.support.serve_fns import (
    BASE_SETTINGS,
    ENV,
    READY,
    ServedWorld,
    alive,
    await_metrics,
    child_pids,
    left_behind,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLOW = {"prompt": "long", "num_inference_steps": 60, "size": "256x256"}  # 1.3 s on 2 idle ranks of this machine


def _generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)


def _stop_while_a_request_runs(url: str, stop) -> None:
    """``stop()`` (a signal to the command) lands while a request runs: readiness turns 503 while that request goes
    on, and it is answered 200, not cut off."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, url, SLOW)
        await_metrics(url, {"xfuse_requests_running": 1}, [running])
        stop()
        late = None
        for _ in range(100):
            late = _generate(url, {"prompt": "after"})
            if late.status_code == 503:
                break
            time.sleep(0.02)
        assert late.status_code == 503 and late.json()["error"]["code"] == "service_draining", late.text
        assert not running.done()  # refused while the running request goes on
        assert running.result().status_code == 200


def _xfuse(*args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "xfuse", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout
    )


def test_generate_starts_its_ranks_and_writes_the_png_its_ranks_write_unlaunched(tmp_path):
    """``--nproc-per-node 2`` against the command's own 2 ranks as torchrun's run it: equal pixels, exit 0, no
    traceback and no deprecation warning in the output. (The config's own world size, no option, is the demos'
    launch: ``test_demo_start_up_has_no_deprecation_warning``.)"""
    config = os.path.join(REPO, "configs/tiny/pp2.yaml")
    ours = _xfuse("generate", "--config", config, "--nproc-per-node", "2", "--output", "ours.png", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr[-3000:]
    # the command's 2 ranks as torchrun's run them, no launcher (tests.support.cli_fns)
    launched = on_a_fresh_world(["generate", "--config", config, "--output", "launched.png"], cwd=str(tmp_path))
    assert launched.returncode == 0, launched.stderr[-3000:]
    pixels = [np.asarray(Image.open(tmp_path / name)) for name in ("ours.png", "launched.png")]
    assert np.array_equal(pixels[0], pixels[1])
    assert "on 2 rank(s)" in ours.stdout
    assert "Traceback" not in ours.stderr and "deprecated" not in (ours.stdout + ours.stderr).lower()


def test_a_world_size_the_config_cannot_run_is_refused_naming_the_option(tmp_path):
    out = _xfuse("generate", "--config", os.path.join(REPO, "configs/tiny/pp2.yaml"), "--nproc-per-node", "3",
                 cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--nproc-per-node: must be the world size the config's parallel degrees make, 2" in out.stderr
    assert "(got 3)" in out.stderr and "Traceback" not in out.stderr


def test_sigterm_to_the_command_drains_and_it_exits_0(tmp_path):
    """As systemd and Kubernetes stop a service: SIGTERM to the process they started (the launcher)."""
    world = ServedWorld(tmp_path, launcher="xfuse")
    try:
        ranks = list(world.rank_pids().values())
        assert len(ranks) == 2
        _stop_while_a_request_runs(world.url, lambda: os.kill(world.proc.pid, signal.SIGTERM))
        assert world.wait(timeout=60) == 0, world.stderr()[-3000:]
        assert "xfuse serve: stopped by SIGTERM: every rank of 2 exited 0" in world.stderr()
        assert "Traceback" not in world.stderr() + world.stdout()
        assert alive(ranks) == [] and left_behind(world) == []
    finally:
        world.close()


def test_ctrl_c_in_a_terminal_drains_and_it_exits_0():
    """Ctrl-C typed into the terminal the command runs in (a pty): SIGINT reaches the launcher's process group only,
    the ranks drain, the command exits 0 with one line and no traceback."""
    sets = [arg for kv in BASE_SETTINGS for arg in ("--set", kv)]
    cmd = [sys.executable, "-m", "xfuse", "serve", *sets, "--port", "0", "--nproc-per-node", "2"]
    master, slave = pty.openpty()

    def controlling_terminal():  # the child's own session, with the pty as its terminal
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=ENV, start_new_session=True,
                            preexec_fn=controlling_terminal)  # fmt: skip
    os.close(slave)
    output: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            output.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            found = READY.search(b"".join(output).decode(errors="replace"))
            url = found.group(1) if found else None
            time.sleep(0.1)
        assert url is not None, b"".join(output).decode(errors="replace")[-3000:]
        ranks = child_pids(proc.pid)
        assert len(ranks) == 2
        # Ctrl-C: the terminal sends SIGINT to its foreground process group
        _stop_while_a_request_runs(url, lambda: os.write(master, b"\x03"))
        assert proc.wait(timeout=60) == 0
        assert alive(ranks) == []
        time.sleep(0.2)
        text = b"".join(output).decode(errors="replace")
        assert "xfuse serve: stopped by SIGINT: every rank of 2 exited 0" in text
        assert "Traceback" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_a_killed_rank_stops_the_command_non_zero_naming_it(tmp_path):
    world = ServedWorld(tmp_path, launcher="xfuse")
    try:
        ranks = world.rank_pids()
        os.kill(ranks[1], signal.SIGKILL)
        code = world.wait(timeout=60)
        assert code == 1, world.stderr()[-3000:]
        assert f"xfuse serve: rank 1 (pid {ranks[1]}) was killed by SIGKILL" in world.stderr()
        assert "the world stopped (exit 1)" in world.stderr()
        assert alive(ranks.values()) == [] and left_behind(world) == []
    finally:
        world.close()


def test_demo_start_up_has_no_deprecation_warning():
    """``bash scripts/demo.sh``: the plan, then the one-command 2-rank generate of the shipped model."""
    out = subprocess.run(["bash", "scripts/demo.sh"], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wrote outputs/demo.png" in out.stdout and "on 2 rank(s)" in out.stdout and "Traceback" not in out.stderr
    assert "deprecat" not in (out.stdout + out.stderr).lower(), (out.stdout + out.stderr)[-3000:]


def test_the_video_demo_writes_the_trained_models_clip():
    """``bash scripts/demo.sh --video``: the plan, then the 2-rank generate of ``shapes-video`` to an MP4."""
    out = subprocess.run(
        ["bash", "scripts/demo.sh", "--video"], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wrote outputs/demo.mp4: 13 frames of 64x64 at 8 fps (1.62 s), 20 steps" in out.stdout, out.stdout
    assert "on 2 rank(s)" in out.stdout and "deprecat" not in (out.stdout + out.stderr).lower()
