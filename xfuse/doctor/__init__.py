"""``xfuse doctor``: what this machine offers xfuse, and a 2-rank gloo self-test of the comm layer on loopback;
``--listen PORT`` / ``--peer HOST:PORT``: which interfaces work between two hosts, both ways (see
``xfuse.doctor.peers``), to pick ``comm.socket_ifname`` before a multi-node launch.

Nothing is compiled or built: flash-attn is only looked up (xfuse runs torch's scaled_dot_product_attention).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import socket
import time


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def self_test_rank(timeout_s: float) -> str:
    """On each of 2 ranks: exchange tensors of three dtypes both ways through P2PChannels and check them."""
    import torch
    import torch.distributed as dist

    from xfuse.comm.p2p import P2PChannels, Recv, Send

    rank = dist.get_rank()
    peer = 1 - rank
    channels = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=2, device=torch.device("cpu"))
    for step, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        mine = torch.arange(4096, dtype=torch.float32).mul_(rank + 1).to(dtype).reshape(2, 64, 32)
        sends, recvs = channels.exchange(
            [Send(peer, "hidden", mine, step, 0)], [Recv(peer, "hidden", (2, 64, 32), dtype, step, 0)]
        )
        got = recvs[0].wait().clone()
        recvs[0].release()
        sends[0].wait()
        expected = torch.arange(4096, dtype=torch.float32).mul_(peer + 1).to(dtype).reshape(2, 64, 32)
        if not torch.equal(got, expected):
            raise AssertionError(f"rank {rank}: {dtype} tensor from rank {peer} arrived corrupted")
    return f"{channels.counters.sent_bytes['hidden']} bytes each way"


def _self_test_process(rank: int, store_path: str, timeout_s: float, results) -> None:
    """One rank of the self-test, in its own spawned process: join a 2-rank gloo group, run the test, report."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
        results.put((rank, True, self_test_rank(timeout_s)))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported by the parent as the FAIL line
        results.put((rank, False, f"{type(err).__name__}: {err}"))


def run_self_test(timeout_s: float) -> str:
    """Spawn 2 ranks, run ``self_test_rank`` on both, return rank 0's summary; raise naming the first failure.

    Bounded: ranks that have not answered within ``6 * timeout_s`` (start-up and test) are killed, and no process
    outlives this call.
    """
    import multiprocessing as mp
    import queue
    import tempfile

    context = mp.get_context("spawn")  # fresh interpreters: torch's state of this process is not inherited
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="xfuse-doctor-") as folder:
        ranks = [
            context.Process(target=_self_test_process, args=(rank, os.path.join(folder, "store"), timeout_s, results))
            for rank in (0, 1)
        ]
        for process in ranks:
            process.start()
        answers = {}
        deadline = time.monotonic() + 6 * timeout_s
        try:
            while len(answers) < 2:
                try:
                    rank, ok, text = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(2)) - set(answers))
                    raise TimeoutError(f"rank(s) {missing} did not answer within {6 * timeout_s:.0f} s") from None
                if not ok:
                    raise RuntimeError(f"rank {rank}: {text}")
                answers[rank] = text
        finally:
            for process in ranks:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()
    return answers[0]


def lines() -> list[str]:
    import torch
    import torch.distributed as dist

    out = [
        f"xfuse {_version('xfuse')}, torch {torch.__version__}, diffusers {_version('diffusers')}, transformers "
        f"{_version('transformers')}, python {platform.python_version()} ({platform.machine()})"
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        out.append(f"devices: cpu ({os.cpu_count()} cores); cuda {torch.version.cuda}: {names}")
    else:
        out.append(f"devices: cpu ({os.cpu_count()} cores); cuda: not available")
    backends = {name: getattr(dist, f"is_{name}_available")() for name in ("gloo", "nccl", "mpi")}
    out.append(
        "backends: "
        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items())
        + f" (auto picks {'nccl' if torch.cuda.is_available() and backends['nccl'] else 'gloo'})"
    )
    interfaces = ", ".join(name for _, name in socket.if_nameindex())
    env = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
    out.append(f"interfaces: {interfaces}; {env}")
    spec = importlib.util.find_spec("flash_attn")
    out.append(
        f"flash-attn: {'installed ' + _version('flash-attn') if spec else 'not installed'} "
        f"(looked up only; xfuse never builds kernels)"
    )
    if torch.cuda.is_available():
        enabled = [
            n
            for n, on in (
                ("flash", torch.backends.cuda.flash_sdp_enabled()),
                ("memory-efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                ("math", torch.backends.cuda.math_sdp_enabled()),
            )
            if on
        ]
        attention = f"torch SDPA on CUDA, backends enabled: {', '.join(enabled)} (bf16/fp16 pick flash first)"
    else:
        attention = "torch SDPA on CPU (fused CPU kernel for fp32/bf16)"
    out.append(f"attention: {attention}")
    return out


def compile_cache_lines(cache_dir: str) -> list[str]:
    """What ``compile.cache_dir`` holds: one line per key (``xfuse.runtime.compile_cache``), and whether this
    torch would use it (a key of another torch is never looked up: its launches compile cold)."""
    import torch

    from xfuse.runtime.compile_cache import entries

    found = entries(cache_dir)
    if not found:
        return [f"compile cache {cache_dir}: empty (a launch with it as compile.cache_dir compiles cold and fills it)"]
    total = sum(size for _, size in found)
    out = [f"compile cache {cache_dir}: {len(found)} key(s), {total / 2**20:.1f} MiB"]
    for entry, size in found:
        usable = "this torch" if entry.torch == torch.__version__ else f"not this torch {torch.__version__}: unused"
        out.append(
            f"  {entry.key}: {entry.family} (model config {entry.model_config_hash}), {entry.dtype} on {entry.device}, "
            f"{entry.backend}, dynamic {str(entry.dynamic).lower()}; torch {entry.torch} ({usable}); "
            f"{len(entry.shapes)} request shape(s): {', '.join(entry.shapes) or 'none'}; {size / 2**20:.1f} MiB; "
            f"updated {entry.updated}"
        )
    return out


def main(timeout_s: float = 30.0, compile_cache: str | None = None) -> int:
    for line in lines():
        print(line, flush=True)
    if compile_cache is not None:
        for line in compile_cache_lines(compile_cache):
            print(line, flush=True)
    start = time.perf_counter()
    try:
        summary = run_self_test(timeout_s)
        print(
            f"self-test: 2-rank gloo p2p on loopback, fp32/bf16/fp16, {summary}: PASS "
            f"({time.perf_counter() - start:.1f} s)"
        )
        return 0
    except Exception as err:  # noqa: BLE001 - the one line says what failed
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"self-test: 2-rank gloo p2p on loopback: FAIL ({type(err).__name__}: {first})")
        return 1


def listen(port: int) -> int:
    """Answer ``xfuse doctor --peer`` checks on ``port`` (every local address) until SIGINT or SIGTERM."""
    import signal
    import threading

    from xfuse.doctor.peers import serve_doctor
    from xfuse.runtime.netprobe import local_interfaces

    def on_check(request: dict, reply: dict) -> None:
        results = ", ".join(
            f"{name} {address} {'reached' if reply['reach_back'].get(address) is None else 'no'}"
            for name, address in request["interfaces"]
        )
        print(f"checked by {request.get('host', '?')}: reached back: {results}", flush=True)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    listener = serve_doctor(port, on_check)
    interfaces = ", ".join(f"{i.name} {i.address}" for i in local_interfaces())
    print(f"xfuse doctor listening on port {listener.port} of every address ({interfaces}); Ctrl-C stops", flush=True)
    stop.wait()
    listener.close()
    return 0


def check_peer(peer: str, timeout_s: float) -> int:
    """Print which local interfaces reach ``peer`` (HOST:PORT) and back; 0 if one works both ways, else 1."""
    from xfuse.doctor.peers import ask_peer, format_peer_report

    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        print(f"xfuse doctor: --peer: expected HOST:PORT, got {peer!r}")
        return 2
    report = ask_peer(host, int(port), min(timeout_s, 5.0))
    for line in format_peer_report(report):
        print(line, flush=True)
    return 0 if report.working() else 1
