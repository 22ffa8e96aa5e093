"""NCCL alone between two ranks on the one GPU, under torchrun: what ``benchmarks/gpu_suite.py``'s NCCL section runs
first, so that a refusal there says whether NCCL or xfuse's use of it stopped.

    torchrun --standalone --nproc_per_node=2 benchmarks/gpu_nccl_probe.py

Each rank looks like a host of its own to NCCL (``NCCL_HOSTID``) and every rank is on GPU 0. In order, each printed
as ``rank R: <step> ok`` or ``rank R: <step> FAILED <error>``: an all-reduce on the default group; a send and a receive
in one batch on it; two eager ``new_group`` direction groups as xfuse makes them; a send on one and a receive on the
other, each in a batch of its own, issued in the opposite order on the two ranks (every pair's first message: the
connection is made then).

    torchrun --standalone --nproc_per_node=2 benchmarks/gpu_nccl_probe.py --grouped-unlike

makes the groups, then the first messages of FLUX.2 [klein] at degree 2 as xfuse posted them before it cut its
batches to one operation per peer (``xfuse.comm.p2p.in_order`` since; they stopped both ranks on one H200): rank 0 a
batch of two sends (hidden, text) to rank 1 on "up" with a receive from rank 1 on "down", then a batch of the next two
sends; rank 1 one batch of all four receives, then its send on "down". NCCL leaves batches grouped unlike on the two
sides undefined (NVIDIA/nccl#1279): this says what it does here (``ok``, an error, or the suite's time limit).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["RANK"])
    os.environ["NCCL_HOSTID"] = f"xfuse-probe-host-{rank}"  # before NCCL reads it: its own host to NCCL
    torch.cuda.set_device(0)
    device = torch.device("cuda:0")
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    peer = 1 - rank

    def step(name: str, run) -> None:
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the probe reports what failed and stops this rank
            print(f"rank {rank}: {name} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            sys.exit(3)
        print(f"rank {rank}: {name} ok", flush=True)

    def all_reduce() -> None:
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x)
        if x.tolist() != [3.0] * 4:
            raise RuntimeError(f"all_reduce gave {x.tolist()}, not [3.0] * 4")

    def batched_on_default() -> None:
        received = torch.zeros(4, device=device)
        ops = [dist.P2POp(dist.isend, torch.ones(4, device=device), peer), dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    groups: dict[str, dist.ProcessGroup] = {}

    def direction_groups() -> None:
        groups["up"] = dist.new_group([0, 1], device_id=device, timeout=timeout)
        groups["down"] = dist.new_group([0, 1], device_id=device, timeout=timeout)

    def one_way_each() -> None:
        received = torch.zeros(4, device=device)
        send_group, recv_group = (groups["up"], groups["down"]) if rank == 0 else (groups["down"], groups["up"])
        send = [dist.P2POp(dist.isend, torch.ones(4, device=device), peer, send_group)]
        recv = [dist.P2POp(dist.irecv, received, peer, recv_group)]
        first, second = (send, recv) if rank == 0 else (recv, send)  # rank 0 sends first, rank 1 receives first
        works = dist.batch_isend_irecv(first) + dist.batch_isend_irecv(second)
        for work in works:
            work.wait()

    def grouped_unlike() -> None:
        hidden, text, back = 8192, 16384, 4096  # float32 elements: the tiny FLUX.2 [klein]'s first messages
        up, down = groups["up"], groups["down"]
        if rank == 0:
            sent = [torch.full((n,), float(i), device=device) for i, n in enumerate((hidden, text, hidden, text))]
            received = torch.zeros(back, device=device)
            first = [dist.P2POp(dist.isend, t, 1, up) for t in sent[:2]]
            works = dist.batch_isend_irecv(first) + dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 1, down)])
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, up) for t in sent[2:]])
        else:
            received_all = [torch.zeros(n, device=device) for n in (hidden, text, hidden, text)]
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0, up) for t in received_all])
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(back, device=device), 0, down)])
        for work in works:
            work.wait()
        if rank == 1 and [int(t[0]) for t in received_all] != [0, 1, 2, 3]:
            raise RuntimeError(f"received {[float(t[0]) for t in received_all]}, not [0, 1, 2, 3]")

    if "--grouped-unlike" in sys.argv:
        step("two eager direction groups", direction_groups)
        step("batches grouped unlike on the two ranks", grouped_unlike)
        dist.destroy_process_group()
        return 0
    step("all_reduce on the default group", all_reduce)
    step("send + recv in one batch on the default group", batched_on_default)
    step("two eager direction groups", direction_groups)
    step("a send on one direction group, a recv on the other", one_way_each)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
