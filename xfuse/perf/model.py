"""Predicted latency of any family under any layout (cfg x pipefusion x ulysses x ring) on a machine.

The engine's own schedule (``xfuse.parallel.schedule``: per-rank task orders and messages) is replayed with
durations instead of run, one pipeline stage at a time (every rank of a stage's sequence-parallel group runs the
same timeline on its share of the tokens):

- a task costs, per block of its segment, what a pass of the block's FLOPs on its patch (``ModelSpec.block_flops``;
  divided by the sequence-parallel degree) was measured to cost on a GPU (``xfuse.perf.measured``: the family's pass
  curve, carried to another device by its fitted relative efficiency); for a family not measured, or on the CPU, the
  FLOPs over the device's fitted throughput for the family, plus the memory traffic of the block's elementwise work
  (norms, activations, residuals: ``traffic`` bytes per token and width element, over the memory bandwidth), divided
  by the sequence-parallel degree, plus a fixed cost per block launch;
- sequence parallelism adds, per attention module that mixes image tokens: Ulysses' two all-to-alls (q/k/v
  in, the output back; not overlapped), and Ring's K/V blocks passed ``ring - 1`` times, overlapped with that
  module's attention (only what exceeds it counts);
- a hand-off arrives ``bytes / bandwidth + latency`` after its producer finished (messages between the same two
  ranks queue on their link); classifier-free-guidance parallelism swaps the noise prediction once per step;
- outside the loop, text encoding and VAE decoding take a fitted time per megapixel, scaled by the device's peak.

Links that cross nodes (the world is ``cfg x pipefusion x ulysses x ring`` with sequence parallelism innermost, as
``xfuse.runtime.world`` lays it out) use the network's profile. Not modelled: contention between different pairs on
NVSwitch, NCCL kernels taking SMs, compile/CUDA graphs (the published points compared with are eager PyTorch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from xfuse.config import ParallelConfig
from xfuse.errors import ConfigError
from xfuse.families.common.flops import attention_flops
from xfuse.families.spec import ModelSpec
from xfuse.parallel.control import ControlResiduals
from xfuse.parallel.patch_grid import PatchGrid, patch_grid
from xfuse.parallel.request_stream import build_stream
from xfuse.parallel.schedule import (
    COLLECT,
    Message,
    Schedule,
    StreamShape,
    Task,
    TaskGraph,
    batch_parts,
    build_schedule,
)
from xfuse.perf.hardware import DEVICE_ALIASES, DEVICES, LINKS, Device, Link, link_key
from xfuse.perf.measured import REFERENCE, PassCurve


@dataclass(frozen=True)
class Calibration:
    """The fitted constants (``xfuse.perf.calibration`` fits them to published points)."""

    efficiency: dict[str, float]  # device key -> fraction of its peak reached by FLUX's whole-image blocks
    family: dict[str, float]  # family name -> throughput relative to FLUX on the same device
    traffic: float  # bytes of memory traffic per token and width element in one block (elementwise work)
    launch: float  # seconds per block per task beyond its kernels' measured time (the host's per-pass work; with no
    # curve, the kernel launches and small-kernel tails as well)
    outside: float  # seconds per megapixel outside the loop on a 312-TFLOPS GPU (text encoders, VAE decode)
    latency: dict[str, float]  # link key -> fitted seconds per message, where the spec's figure is not the cost
    curves: dict[str, PassCurve] = field(default_factory=dict)  # family name -> measured block passes (GPU)

    def link(self, key: str, link: Link) -> Link:
        return replace(link, latency=self.latency[key]) if key in self.latency else link

    def curve(self, family: str, device: Device) -> PassCurve | None:
        """The family's measured pass curve, where it has one and ``device`` is a GPU (the CPU keeps its fit)."""
        return self.curves.get(family) if device.gpu else None

    def relative(self, device_key: str) -> float:
        """A device's fitted efficiency on FLUX's blocks over what FLUX's whole pass reached when the curves were
        measured (``xfuse.perf.measured.REFERENCE``): how a measured time carries to that device."""
        return self.efficiency[device_key] / self.curves[REFERENCE].efficiency

    def throughput(self, device_key: str, device: Device, family: str) -> float:
        return device.peak_flops * self.efficiency[device_key] * self.family.get(family, 1.0)


@dataclass(frozen=True)
class Workload:
    """One request of one model: what is computed, whatever the layout."""

    spec: ModelSpec
    config: dict  # diffusers transformer config
    height: int  # pixels
    width: int
    steps: int
    cfg_batch: int  # 2: classifier-free guidance batches [uncond, cond]; 1: FLUX's distilled guidance, or none
    text: int | None = None  # prompt tokens; None: the family's default lengths
    frames: int = 1  # latent frames of a video (stacked into one tall image: xfuse.parallel.video_layout)
    controlnet: dict | None = None  # a ControlNet's block counts (``num_layers``; FLUX: ``num_single_layers``)
    cached: bool = False  # step caching on (``cache.enabled``): every computed whole-image step stores K/V
    # Steps step caching skips (which ones is the images' business, so a caller gives a pattern, e.g. a measured
    # run's): such a step runs the route's first block on the embedding rank and adds cached residuals elsewhere.
    skipped_steps: frozenset[int] = frozenset()

    def control(self) -> ControlResiduals | None:
        """The ControlNet's residual routing (``xfuse.parallel.control``), or ``None`` without one."""
        if self.controlnet is None:
            return None
        if self.spec.control_samples is None:
            raise ConfigError("--controlnet-layers", f"{self.spec.name} has no ControlNet pipeline in xfuse")
        samples = self.spec.control_samples(self.config, self.controlnet)
        return ControlResiduals(samples, self.spec.num_blocks(self.controlnet))

    @property
    def text_tokens(self) -> int:
        return sum(self.spec.text_lengths) if self.text is None else self.text

    @property
    def joint(self) -> bool:
        """An MMDiT: the text is a stream of the blocks (chunked by sequence parallelism, carried by patch 0)."""
        return bool(self.spec.streams)

    @property
    def hidden(self) -> int:
        return self.spec.width(self.config)

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks(self.config)

    def grid(self, num_patches: int) -> PatchGrid:
        scale, patch = self.spec.latent_scale, self.spec.token_patch(self.config)
        lead = self.text_tokens if self.joint else 0
        return patch_grid(self.frames * (self.height // scale), self.width // scale, num_patches, patch, lead)

    @property
    def latent_bytes_per_element(self) -> int:  # elements of the stepped latent of one image (or clip)
        scale = self.spec.latent_scale
        return self.config["in_channels"] * self.frames * (self.height // scale) * (self.width // scale)


@dataclass(frozen=True)
class Machine:
    """Where a layout runs: ``gpus_per_node`` devices per node, ``link`` inside a node, ``network`` between."""

    device_key: str
    device: Device
    link_key: str
    link: Link
    gpus_per_node: int = 8
    network: Link | None = None

    def between(self, a: int, b: int) -> Link:
        """The link between world ranks ``a`` and ``b``."""
        same = a // self.gpus_per_node == b // self.gpus_per_node
        return self.link if same or self.network is None else self.network


def machine(device: str, link: str, gpus: int, nodes: int = 1) -> Machine:
    """``gpus`` devices of kind ``device`` over ``nodes`` nodes (evenly), ``link`` inside a node, 100 GbE between."""
    device = DEVICE_ALIASES.get(device, device)
    if device not in DEVICES:
        raise ConfigError("--device", f"must be one of {sorted(DEVICES)} (got {device!r})")
    if nodes < 1 or gpus < 1 or gpus % nodes:
        raise ConfigError("--nodes", f"must divide --gpus ({gpus}) into equal nodes (got {nodes})")
    key = link_key(device, link)
    return Machine(
        DEVICES[device].kin or device,  # the key of its fitted efficiency
        DEVICES[device],
        key,
        LINKS[key],
        gpus_per_node=gpus // nodes,
        network=LINKS["ethernet"] if nodes > 1 else None,
    )


@dataclass(frozen=True)
class Prediction:
    """Seconds of one request, and where they go (per rank of the busiest stage)."""

    seconds: float
    loop: float  # the denoising loop's makespan
    outside: float  # text encoding, VAE decode (0 on a CPU: not modelled there)
    compute: float  # the busiest stage's compute inside the loop
    sequence_comm: float  # its exposed sequence-parallel communication (all-to-alls, ring steps beyond overlap)
    cfg_comm: float  # the noise-prediction swaps of CFG parallelism

    @property
    def waiting(self) -> float:
        """What the loop spends beyond the busiest stage's work: fill, drain, waits for hand-offs."""
        return max(self.loop - self.compute - self.sequence_comm - self.cfg_comm, 0.0)

    @property
    def overlap_gain(self) -> float:
        """How much more denoising throughput a world that overlaps requests could reach than one request at a time,
        at most: the loop's makespan over its busiest stage's own work. Another request's tasks can fill the fill,
        the drain and the warm-up steps' idle ranks (``waiting``); the busiest stage's work stays the bound. 1.0: no
        idle time to recover (degree 1)."""
        busy = self.loop - self.waiting
        return self.loop / busy if busy > 0 else 1.0


@functools.lru_cache(maxsize=256)
def _schedule(
    spec: ModelSpec, num_blocks: int, parallel: ParallelConfig, steps: int, parts: int, costs,
    control_blocks: int = 0, control_ranks: tuple[int, ...] = (),
) -> Schedule:  # fmt: skip
    plan = spec.plan(num_blocks, parallel, control_blocks)
    warmup = min(parallel.warmup_steps, steps)
    num_patches = parallel.resolved_num_patches
    return build_schedule(plan, steps, warmup, num_patches, parts, costs, control_ranks=control_ranks)


def replay(schedule: TaskGraph, duration: Callable[[Task], float], transfer: Callable[[Message], float]) -> dict:
    """Run every rank's task order with the given durations; return each rank's finish time in seconds."""
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
                for m in schedule.sends(task):  # messages between one pair of ranks share its link: one at a time
                    pair = (m.src, m.dst)
                    begin = max(free[rank], link_free.get(pair, 0.0))
                    link_free[pair] = arrival[m] = begin + transfer(m)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule cannot be replayed: a rank waits for a message nobody sends")
    return free


class _Costs:
    """Durations of one workload's tasks and messages under one layout on one machine."""

    def __init__(self, work: Workload, parallel: ParallelConfig, machine: Machine, calibration: Calibration):
        self.work, self.par, self.machine = work, parallel, machine
        self.sp = parallel.sequence_degree
        self.flops = calibration.throughput(machine.device_key, machine.device, work.spec.name)
        self.curve = calibration.curve(work.spec.name, machine.device)
        if self.curve is not None:
            self.relative = calibration.relative(machine.device_key)
        self.traffic, self.launch = calibration.traffic, calibration.launch
        self.batch = work.cfg_batch // parallel.cfg_degree
        self.element = machine.device.dtype_bytes
        self.grid = work.grid(parallel.resolved_num_patches)
        self.stage_ranks = self.sp  # world ranks per pipeline stage: the SP group is innermost
        self.sp_link = calibration.link(machine.link_key, machine.between(0, self.sp - 1))
        self._durations: dict[tuple, tuple[float, float]] = {}
        self.control = work.control()
        # the ControlNet's blocks, run with each hop-0 task: costed as the transformer's first blocks
        self.control_blocks = () if work.controlnet is None else tuple(range(work.spec.num_blocks(work.controlnet)))

    def _block_costs(self, block: int, queries: int, text_queries: bool, batch: float) -> tuple[float, float]:
        """(compute, exposed SP communication) seconds of one block on one SP rank."""
        work, d, sp = self.work, self.work.hidden, self.sp
        text = work.text_tokens
        tq = text if (work.joint and text_queries) else 0
        flops = batch * work.spec.block_flops(work.config, block, queries, self.grid.num_tokens, text, text_queries)
        modules = work.spec.attentions_of_block(work.config, block)
        u, r = self.par.ulysses_degree, self.par.ring_degree
        heads = work.spec.num_heads(work.config)
        skew = -(-heads // u) * u / heads  # the busiest Ulysses rank's head group over an even share (uneven groups)
        if skew > 1:  # its attention takes that much longer; the rest of the block splits by tokens, evenly
            keys = self.grid.num_tokens + (text if work.joint else 0)
            flops += (skew - 1) * batch * modules * attention_flops(queries + tq, keys, d)
        if self.curve is not None:  # measured: kernels, their launches and the device's use of a small pass
            compute = self.curve.seconds_on(flops / sp, self.machine.device, self.relative) + self.launch
        else:
            traffic = self.traffic * batch * (queries + tq) * d / self.machine.device.memory_bandwidth
            compute = (flops / self.flops + traffic) / sp + self.launch
        comm = 0.0
        passing = (queries + tq) / sp  # tokens of this pass on one SP rank (an MMDiT's text is chunked too)
        if u > 1:  # q, k, v out and the output back, (u-1)/u of each rank's chunk
            nbytes = batch * passing * d * self.element * 4 * (u - 1) / u
            exchange = nbytes / self.sp_link.group_bandwidth(u) + 2 * (u - 1) * self.sp_link.latency
            comm += modules * (exchange + 2 * self.launch)  # and the two exchanges' own kernels
        if r > 1:  # K/V blocks of every token (stale ones included) around the ring, hidden behind the attention
            keys = self.grid.num_tokens + (text if work.joint else 0)
            hop = 2 * batch * (keys / r) * (d / u) * self.element
            ring = (r - 1) * (hop / self.sp_link.group_bandwidth(r) + self.sp_link.latency)
            attention = batch * attention_flops(queries + tq, keys, d) / sp / self.flops
            exposed = max(ring - attention, 0.0) if self.sp_link.overlap else ring
            comm += modules * (exposed + (r - 1) * self.launch)  # each ring step: its own attention call and merge
        return compute, comm

    def task_costs(self, schedule: Schedule, task: Task) -> tuple[float, float]:
        """(compute, exposed SP communication) seconds of ``task`` on one rank of its stage."""
        if task.hop == COLLECT:
            return 0.0, 0.0
        queries = self.grid.num_tokens if task.patch is None else self.grid[task.patch].num_tokens
        batch = self.batch if task.part is None else self.batch / schedule.batch_parts
        first = task.patch in (None, 0)  # the step's first patch (or the whole image) computes the text stream
        skipped = task.step in self.work.skipped_steps
        key = (task.hop, queries, first, batch, skipped)
        if key not in self._durations:
            blocks = schedule.plan.route[task.hop].blocks
            if skipped:  # block 0 decides (xfuse.parallel.step_cache); every other block adds its cached residual
                blocks = blocks[:1] if task.hop == 0 else ()
            blocks += self.control_blocks if task.hop == 0 else ()
            costs = [self._block_costs(b, queries, first, batch) for b in blocks]
            self._durations[key] = (sum(c for c, _ in costs), sum(s for _, s in costs))
        return self._durations[key]

    def duration(self, schedule: Schedule) -> Callable[[Task], float]:
        def duration(task: Task) -> float:
            return sum(self.task_costs(schedule, task))

        return duration

    def transfer(self, schedule: Schedule) -> Callable[[Message], float]:
        work, element = self.work, self.element
        hidden = work.hidden

        def transfer(m: Message) -> float:
            link = self.machine.between(m.src * self.stage_ranks, m.dst * self.stage_ranks)
            tokens = self.grid.num_tokens if m.patch is None else self.grid[m.patch].num_tokens
            if m.kind == "latent":  # the stepped latent rows of one image (the rows covering the patch)
                covering = self.grid.token_rows if m.patch is None else self.grid[m.patch].num_rows
                nbytes = work.latent_bytes_per_element * covering / self.grid.token_rows * element
            else:  # (B, tokens, hidden) of a batch part, each SP rank its chunk (in parallel over SP pairs)
                batch = self.batch if m.part is None else self.batch / schedule.batch_parts
                rows = work.text_tokens if m.kind in schedule.plan.streams else tokens
                if m.kind == "control":  # the receiver's residuals, each (B, tokens, hidden)
                    assert self.control is not None
                    rows *= len(self.control.samples_of(schedule.plan.blocks_of(m.dst)))
                nbytes = batch * rows * hidden * element / self.sp
            return nbytes / link.bandwidth + link.latency

        return transfer

    def busiest(self, schedule: Schedule) -> tuple[float, float]:
        """(compute, exposed SP communication) seconds of the busiest stage over the whole loop."""
        per_rank = [[self.task_costs(schedule, t) for t in order] for order in schedule.orders.values()]
        totals = [(sum(c for c, _ in costs), sum(s for _, s in costs)) for costs in per_rank]
        return max(totals, key=sum)


def predict(
    work: Workload, parallel: ParallelConfig, machine: Machine, calibration: Calibration, *, split_warmup: bool = True
) -> Prediction:
    """Seconds of one request of ``work`` under ``parallel`` on ``machine`` (layouts are assumed valid:
    ``ModelSpec.check_layout`` and the world rule are the planner's first filter). ``split_warmup``: warm-up steps
    streamed in batch parts as xfuse runs them (``False``: whole, as xDiT does)."""
    costs = _Costs(work, parallel, machine, calibration)
    costs_key = tuple(costs.grid.cost_tokens)
    control, control_blocks = costs.control, len(costs.control_blocks)
    plan = work.spec.plan(work.num_blocks, parallel, control_blocks)
    control_ranks = () if control is None else control.ranks(plan)
    parts = batch_parts(costs.batch, parallel.pipefusion_degree, work.cached) if split_warmup else 1
    schedule = _schedule(work.spec, work.num_blocks, parallel, work.steps, parts, costs_key, control_blocks,
                         control_ranks)  # fmt: skip
    finish = replay(schedule, costs.duration(schedule), costs.transfer(schedule))
    compute, sequence = costs.busiest(schedule)
    cfg = 0.0
    if parallel.cfg_degree > 1:  # the two groups swap their noise prediction once per step
        link = machine.between(0, parallel.pipefusion_degree * costs.sp)
        cfg = work.steps * (work.latent_bytes_per_element * costs.element / link.bandwidth + link.latency)
    loop = max(finish.values()) + cfg
    megapixels = work.frames * work.height * work.width / 1e6  # a clip's latent frames, each a picture to decode
    device = machine.device
    outside = calibration.outside * megapixels * 312e12 / device.peak_flops if device.gpu else 0.0
    return Prediction(loop + outside, loop, outside, compute, sequence, cfg)


def predict_stream(
    work: Workload, parallel: ParallelConfig, machine: Machine, calibration: Calibration, *, requests: int = 4
) -> float:
    """How much more denoising throughput ``requests`` requests of ``work`` streamed through the pipeline together
    reach than one at a time (``xfuse.parallel.request_stream``: the next request's units enter while the last one's
    warm-up steps, fill and drain leave ranks idle), replayed with the same durations and transfers as ``predict``:
    ``requests`` loops of one request over the stream's loop. Below ``Prediction.overlap_gain``, the bound.
    PipeFusion alone (no ControlNet; text encoding and the VAE decode, outside the loop, are not overlapped)."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1 (got {requests})")
    costs = _Costs(work, parallel, machine, calibration)
    if costs.control is not None:
        raise ValueError("predict_stream: a ControlNet's residuals are not streamed")
    plan = work.spec.plan(work.num_blocks, parallel, 0)
    parts = batch_parts(costs.batch, parallel.pipefusion_degree, work.cached)
    shape = StreamShape(work.steps, min(parallel.warmup_steps, work.steps), parts, tuple(costs.grid.cost_tokens))
    loops = []
    for count in (1, requests):
        stream = build_stream(plan, [shape] * count)
        one = stream.requests[0]  # every request of the stream has this shape: the same costs
        loops.append(max(replay(stream, costs.duration(one), costs.transfer(one)).values()))
    return requests * loops[0] / loops[1]
