"""Real ``xfuse serve`` worlds for the tests: torchrun (or plain python) in its own session, on a free loopback port,
torn down with its whole process group whatever happens."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import time

import httpx
from PIL import Image

from tests.support.cli_fns import command_then_exit
from tests.support.world import World, exit_code

ENV = dict(os.environ)  # offline: tests/conftest.py
READY = re.compile(r"xfuse serve: ready on (http://[\d.]+:\d+)")

# The tiny HunyuanDiT at 128 px (16 latent rows -> 8 token rows, 2 patches), 4 steps: ~0.2 s a request here.
BASE_SETTINGS = (
    "model=tiny",
    "parallel.pipefusion_degree=2",
    "parallel.num_patches=2",
    "parallel.warmup_steps=1",
    "generation.height=128",
    "generation.width=128",
    "generation.num_inference_steps=4",
    "generation.seed=0",
)


class ServedWorld:
    """``torchrun --nproc_per_node=N -m xfuse serve`` (``nproc=1``: plain ``python -m xfuse serve``; ``launcher=
    "xfuse"``: ``python -m xfuse serve --nproc-per-node N``, the one command that starts its ranks itself;
    ``launcher="world"``: the command on the ranks of a test world, as torchrun's ranks run it, with no launcher
    process: new rank processes forked from the preloaded server, which import nothing again, their output in the
    same two files, each rank's exit code read from its end)."""

    def __init__(
        self,
        tmp_path,
        *,
        nproc: int = 2,
        settings=(),
        api_key: str | None = None,
        start_timeout=120,
        launcher: str = "torchrun",
    ):
        self.log_out, self.log_err = tmp_path / "serve.out", tmp_path / "serve.err"
        sets = [
            arg for kv in (*BASE_SETTINGS, f"parallel.pipefusion_degree={nproc}", *settings) for arg in ("--set", kv)
        ]
        own = ["--nproc-per-node", str(nproc)] if launcher == "xfuse" else []
        argv = ["serve", *sets, "--port", "0", *own] + (["--api-key", api_key] if api_key else [])
        self.api_key = api_key
        self.nproc, self.launcher = nproc, launcher
        self.world: World | None = None
        self.proc: subprocess.Popen | None = None
        if launcher == "world":
            self.log_out.write_text("")
            self.log_err.write_text("")
            self.world = World(nproc)
            self.world.submit(command_then_exit, argv, {}, str(self.log_out), str(self.log_err))
        else:
            if nproc == 1 or launcher == "xfuse":
                start = [sys.executable, "-m", "xfuse"]
            else:
                start = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                start += ["-m", "xfuse"]
            with open(self.log_out, "w") as out, open(self.log_err, "w") as err:
                # Its own session: the whole tree (launcher and ranks) can be signalled and reaped as one group.
                self.proc = subprocess.Popen([*start, *argv], stdout=out, stderr=err, env=ENV, start_new_session=True)
        self.url = self._wait_ready(start_timeout)
        self.pids = self.rank_pids()  # torchrun starts every rank in a session of its own: track them by pid

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = READY.search(self.log_out.read_text())
            if found:
                return found.group(1)
            if self.world is not None and not self.world.alive:
                raise AssertionError(f"a rank of xfuse serve ended before ready:\n{self.stderr()}")
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"xfuse serve exited ({self.proc.returncode}) before ready:\n{self.stderr()}")
            time.sleep(0.1)
        self.close()
        raise AssertionError(f"xfuse serve not ready within {timeout} s:\n{self.stderr()}")

    def stdout(self) -> str:
        return self.log_out.read_text()

    def stderr(self) -> str:
        return self.log_err.read_text()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def rank_pids(self) -> dict[int, int]:
        """Rank -> pid of every live rank process (from /proc: the ranks' RANK environment variable)."""
        if self.world is not None:
            return {rank: pid for rank, pid in enumerate(self.world.pids) if alive([pid])}
        if self.nproc == 1 and self.launcher != "xfuse":
            return {0: self.proc.pid}
        ranks = {}
        for pid in child_pids(self.proc.pid):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = pid
        return ranks

    def wait(self, timeout: float) -> int:
        """The launcher's exit code; a test world's: the first non-zero exit code of its ranks, or 0."""
        if self.world is not None:
            return exit_code(self.world.collect(timeout), "\n" + self.stderr()[-3000:])
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Kill whatever is left of the world (the launcher's process group and every rank) and reap the launcher."""
        for pid in alive(getattr(self, "pids", {}).values()):
            os.kill(pid, signal.SIGKILL)
        if self.world is not None:
            self.world.close()
            return
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (not gone, not zombies)."""
    out = []
    for pid in pids:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def left_behind(world: ServedWorld) -> list[int]:
    """Processes of the world still running: its ranks (each in a session of its own) and its launcher's group."""
    if world.proc is None:  # a test world's ranks have no launcher
        return sorted(alive(world.pids.values()))
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == world.proc.pid and fields[0] != "Z":
                members.append(int(entry))
    return sorted(set(members) | set(alive(world.pids.values())))


def peak_rss_kib(pid: int) -> int:
    """VmHWM of a process: its peak resident memory, read by the test from /proc (not reported by the server)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def decode_png(b64: str) -> Image.Image:
    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(data))


def poll_health(url: str, until, timeout: float, interval: float = 0.05):
    """Poll ``GET /health`` until ``until(response or None)``; return (seconds, the last response or None)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        try:
            last = httpx.get(f"{url}/health", timeout=1.0)
        except httpx.HTTPError:
            last = None
        if until(last):
            return time.monotonic() - start, last
        time.sleep(interval)
    return None, last


def gauge(url: str, name: str, headers: dict | None = None) -> float:
    """The served world's unlabelled metric ``name`` (from ``/metrics``; ``headers``: its API key's)."""
    metrics = httpx.get(f"{url}/metrics", headers=headers).text
    return float(re.search(rf"^{name} (\S+)", metrics, re.M).group(1))


def await_metrics(url: str, expected: dict[str, float], running, headers: dict | None = None, log=None,
                  limit_s: float = 60) -> None:  # fmt: skip
    """Poll ``/metrics`` until each of ``expected``'s unlabelled metrics reads its value, while every request of
    ``running`` (futures) is still in flight: one that ends first, or ``limit_s`` passing, fails the test (with the
    tail of ``log()``, e.g. the world's stderr)."""
    deadline = time.monotonic() + limit_s
    while any(gauge(url, name, headers) != value for name, value in expected.items()):
        ended = [future.result() for future in running if future.done()]
        assert not ended and time.monotonic() < deadline, (expected, ended, log()[-3000:] if log else "")
        time.sleep(0.02)


def requests_running(url: str) -> float:
    """The served world's ``xfuse_requests_running`` gauge (its running batch, or every request of its stream)."""
    return gauge(url, "xfuse_requests_running")
