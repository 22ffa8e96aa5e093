"""Predicted end-to-end latency of HunyuanDiT with PipeFusion on GPUs.

The engine's own schedule (the per-rank task orders and message lists of ``xfuse.parallel.schedule``) is replayed
with durations instead of run: a task takes the FLOPs of its blocks on its patch divided by the GPU's effective
throughput, plus a fixed cost per block launch; a message arrives ``bytes / bandwidth + latency`` after its
producer finished. Warm-up steps are whole-image tasks, streamed in CFG's two batch parts as xfuse runs them (xDiT's
runs whole, and the calibration replays it so). Outside the loop, text encoding and VAE decoding take a
fixed time per image size. Messages between the same two GPUs queue on their link. Not modelled: contention
between different links (e.g. PCIe switches shared by several pairs), the compute NCCL kernels take from the
SMs, CFG parallelism.

Calibration (``fit``): xDiT publishes HunyuanDiT latencies on A100 for its linear placement (1, 2, 4, 8 GPUs at
1024 and 2048 px, 50 steps). Per size, an effective throughput and a time outside the loop; shared, a cost per
block launch: 5 parameters for 8 numbers, fitted by least squares. L40 figures are predictions from the A100 fit
scaled by the spec-sheet throughput ratio, with the PCIe link profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.patch_grid import PatchGrid, patch_grid
from xfuse.parallel.schedule import COLLECT, Message, Schedule, Task, batch_parts, build_schedule
from xfuse.parallel.stage_plan import stage_plan

# HunyuanDiT-v1.2 (DiT-g/2) transformer shape.
HIDDEN, LAYERS, MLP_RATIO = 1408, 40, 4.3637
BATCH = 2  # CFG's [uncond, cond] batch of one image
TEXT_TOKENS, VAE = sum(HUNYUANDIT.text_lengths), HUNYUANDIT.vae_scale_factor
XDIT_A100 = {  # xDiT's published HunyuanDiT latencies in seconds (linear placement, PipeFusion only, 50 steps)
    1024: {1: 19.9, 2: 12.5, 4: 9.0, 8: 7.3},
    2048: {1: 90.2, 2: 57.5, 4: 51.0, 8: 50.7},
}


@dataclass(frozen=True)
class LinkProfile:
    """Point-to-point link between neighbouring GPUs (per direction)."""

    name: str
    bandwidth: float  # bytes per second
    latency: float  # seconds per message


# Effective NCCL point-to-point figures, not peak: A100 SXM through NVSwitch (NVLink 3) and L40 over PCIe 4.0 x16,
# whose P2P usually goes through the host bridge.
LINKS = {
    "a100-nvlink": LinkProfile("A100 SXM, NVLink 3 / NVSwitch", 200e9, 10e-6),
    "l40-pcie": LinkProfile("L40, PCIe 4.0 x16 (P2P through the host)", 14e9, 25e-6),
}


@dataclass(frozen=True)
class ComputeProfile:
    """One GPU: effective throughput on HunyuanDiT blocks, cost per block launch, time outside the loop."""

    name: str
    flops: dict[int, float]  # image size (px) -> effective FLOP/s on the transformer blocks at that size
    per_block: float  # seconds per block per task (kernel launches, small-kernel inefficiency)
    outside_loop: dict[int, float]  # image size (px) -> seconds of text encoding + VAE decoding + setup


def block_flops(query_tokens: int, image_tokens: int, batch: int = BATCH) -> float:
    """FLOPs of one HunyuanDiT block on ``query_tokens`` tokens attending to ``image_tokens`` (CFG batch 2)."""
    d = HIDDEN
    # projections: self-attn q, k, v, out (4 d^2) + cross-attn q, out (2 d^2) + MLP (2 * ratio * d^2)
    linear = 2 * (6 + 2 * MLP_RATIO) * d * d * query_tokens
    attention = 4 * d * query_tokens * (image_tokens + TEXT_TOKENS)  # QK^T and AV, self + cross
    return batch * (linear + attention)


def _duration(schedule: Schedule, grid: PatchGrid, compute: ComputeProfile):
    route = schedule.plan.route

    def duration(task: Task) -> float:
        if task.hop == COLLECT:
            return 0.0
        query = grid.num_tokens if task.patch is None else grid[task.patch].num_tokens
        blocks = len(route[task.hop].blocks)
        size = grid.latent_height * VAE
        batch = BATCH if task.part is None else BATCH // schedule.batch_parts
        flops = block_flops(query, grid.num_tokens, batch)
        return blocks * (flops / compute.flops[size] + compute.per_block)

    return duration


def _transfer(schedule: Schedule, grid: PatchGrid, link: LinkProfile, dtype_bytes: int = 2):
    def transfer(m: Message) -> float:
        tokens = grid.num_tokens if m.patch is None else grid[m.patch].num_tokens
        if m.kind == "latent":  # (B, 4, rows, W) of one image batch
            nbytes = (BATCH // 2) * 4 * tokens * 4 * dtype_bytes
        else:  # (B, tokens, hidden), a batch part's rows of it
            batch = BATCH if m.part is None else BATCH // schedule.batch_parts
            nbytes = batch * tokens * HIDDEN * dtype_bytes
        return nbytes / link.bandwidth + link.latency

    return transfer


def replay(schedule: Schedule, duration, transfer) -> float:
    """Run every rank's task order with the given durations; return the makespan in seconds."""
    orders = {rank: list(order) for rank, order in schedule.orders.items()}
    position = dict.fromkeys(orders, 0)
    free = dict.fromkeys(orders, 0.0)
    arrival: dict[Message, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                task = order[position[rank]]
                needs = schedule.recvs(task)
                if any(m not in arrival for m in needs):
                    break
                start = max([free[rank], *(arrival[m] for m in needs)])
                free[rank] = start + duration(task)
                for m in schedule.sends(task):  # messages between one pair of GPUs share its link: one at a time
                    pair = (m.src, m.dst)
                    begin = max(free[rank], link_free.get(pair, 0.0))
                    link_free[pair] = arrival[m] = begin + transfer(m)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule cannot be replayed: a rank waits for a message nobody sends")
    return max(free.values())


def predict(
    compute: ComputeProfile,
    link: LinkProfile,
    *,
    degree: int,
    placement: str,
    size: int,
    steps: int = 50,
    warmup: int = 1,
    num_patches: int | None = None,
    split=None,
    split_warmup: bool = True,
) -> float:
    """Seconds for one 50-step (default) HunyuanDiT image of ``size`` px on ``degree`` GPUs. ``split_warmup``:
    warm-up steps in batch parts, as xfuse runs them (``False``: whole, as xDiT does)."""
    plan = stage_plan(LAYERS, degree, placement, split, skips=HUNYUANDIT.skip_pairs(LAYERS))
    grid = patch_grid(size // VAE, size // VAE, num_patches or degree, 2)
    parts = batch_parts(BATCH, degree) if split_warmup else 1
    schedule = build_schedule(plan, steps, min(warmup, steps), grid.num_patches, parts)
    loop = replay(schedule, _duration(schedule, grid, compute), _transfer(schedule, grid, link))
    return compute.outside_loop[size] + loop


PLACEMENT_ROWS = ("linear", "folded", "balanced")  # the order of the table's rows

# Result of ``fit()`` (python -m xfuse.perf_model --fit), kept so that `xfuse plan --predict` is instant.
A100 = ComputeProfile(
    "A100 (fit to xDiT)", {1024: 93.6e12, 2048: 205.92e12}, 4.0e-4, {1024: 4.306385630385606, 2048: 38.0439086232397}
)


def fit(steps: int = 50, per_block_grid=None, efficiency_grid=None) -> ComputeProfile:
    """Least-squares fit of the A100 profile to all of xDiT's numbers (linear placement, M = N, warm-up 1).

    Per image size: an effective throughput and a time outside the loop; shared: the cost per block launch.
    For each candidate (throughput, launch cost) the best time outside the loop is the mean residual; the candidate
    with the smallest squared error wins. Slow (thousands of replays): run ``python -m xfuse.perf_model --fit``
    and paste the result into ``A100``.
    """
    per_block_grid = per_block_grid or [i * 2.5e-5 for i in range(0, 17)]
    efficiency_grid = efficiency_grid or [0.10 + 0.02 * i for i in range(36)]  # fraction of 312 TFLOPS
    best = None
    for per_block in per_block_grid:
        flops, outside, error = {}, {}, 0.0
        for size, measured in XDIT_A100.items():
            size_best = None
            for eff in efficiency_grid:
                trial = ComputeProfile("", {size: eff * 312e12}, per_block, {size: 0.0})
                loops = {  # xDiT's schedule: linear, warm-up steps whole
                    n: predict(
                        trial,
                        LINKS["a100-nvlink"],
                        degree=n,
                        placement="linear",
                        size=size,
                        steps=steps,
                        split_warmup=False,
                    )
                    for n in measured
                }
                o = max(sum(measured[n] - loops[n] for n in measured) / len(measured), 0.0)
                err = sum((measured[n] - loops[n] - o) ** 2 for n in measured)
                if size_best is None or err < size_best[0]:
                    size_best = (err, eff * 312e12, o)
            error += size_best[0]
            flops[size], outside[size] = size_best[1], size_best[2]
        if best is None or error < best[0]:
            best = (error, ComputeProfile("A100 (fit to xDiT)", flops, per_block, outside))
    return best[1]


def l40_profile(a100: ComputeProfile) -> ComputeProfile:
    """L40 from the A100 fit: dense bf16 throughput ratio 181/312 (spec sheets), the same launch cost, and the
    time outside the loop scaled by the same ratio."""
    ratio = 181 / 312
    return ComputeProfile(
        "L40 (A100 fit x 181/312)",
        {k: v * ratio for k, v in a100.flops.items()},
        a100.per_block,
        {k: v / ratio for k, v in a100.outside_loop.items()},
    )


def table(profile: ComputeProfile, link: LinkProfile, sizes=(1024, 2048), degrees=range(1, 9)) -> dict:
    """{(size, placement, degree): seconds} for every degree and every placement."""
    return {
        (size, placement, n): predict(profile, link, degree=n, placement=placement, size=size)
        for size in sizes
        for placement in PLACEMENT_ROWS
        for n in degrees
    }


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="HunyuanDiT PipeFusion latency model")
    parser.add_argument("--fit", action="store_true", help="refit the A100 profile to xDiT's numbers (slow)")
    args = parser.parse_args(argv)
    a100 = fit() if args.fit else A100
    print(a100)
    for name, profile, link in (
        ("A100 NVLink", a100, LINKS["a100-nvlink"]),
        ("L40 PCIe", l40_profile(a100), LINKS["l40-pcie"]),
    ):
        rows = table(profile, link)
        print(f"\n{name}: predicted seconds per 50-step image (M = N, warm-up 1)")
        print("| size | placement | " + " | ".join(f"N={n}" for n in range(1, 9)) + " |")
        print("|---|---|" + "---|" * 8)
        for size in (1024, 2048):
            for placement in PLACEMENT_ROWS:
                print(
                    f"| {size} | {placement} | "
                    + " | ".join(f"{rows[size, placement, n]:.1f}" for n in range(1, 9))
                    + " |"
                )
            if name.startswith("A100"):
                print(
                    f"| {size} | xDiT measured | "
                    + " | ".join(f"{XDIT_A100[size][n]:.1f}" if n in XDIT_A100[size] else "" for n in range(1, 9))
                    + " |"
                )


if __name__ == "__main__":
    main()
