"""Every valid layout of a world for one request, ranked by the performance model: ``xfuse plan --auto`` and
``--auto`` on ``generate`` / ``serve``.

A layout is ``cfg x pipefusion x ulysses x ring`` multiplying to the world (CFG only when the request batches
[uncond, cond]), with the engine's defaults otherwise (M = pipefusion degree, the family's placement, the config's
warm-up). Each candidate is first checked the way a run is (``ModelSpec.check_layout``: heads the Ulysses degree must
divide, tokens per sequence chunk, rows per patch); a refused one is listed with the reason the run would give. On
a device whose memory is known, each layout's text encoders are placed as ``parallel.text_encoder`` says (``auto``:
the first of rank 0, split over the pipeline group, offloaded, that fits) and a layout whose busiest rank would not
hold its weights, stale K/V, text encoders and VAE there (``xfuse.perf.memory``) is dropped, saying which rank needs
how much. Choosing needs no communication: every rank of
a world computes the same ranking from the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xfuse.build import request_size
from xfuse.config import ConfigError, GenerationConfig, ParallelConfig, XfuseConfig, config_from_dict, parallel_config
from xfuse.families.registry import resolve
from xfuse.perf.calibration import FITTED
from xfuse.perf.hardware import DEVICES
from xfuse.perf.memory import Placed, place_text, text_encoder_bytes
from xfuse.perf.model import Calibration, Machine, Prediction, Workload, predict
from xfuse.perf.vae import conv_scratch_on


@dataclass(frozen=True)
class Ranked:
    parallel: ParallelConfig
    prediction: Prediction
    placed: Placed | None = None  # its memory with the text encoders placed (None: the device's memory not known)

    @property
    def name(self) -> str:
        return layout_name(self.parallel)


def layout_name(p: ParallelConfig) -> str:
    parts = [f"{k} {v}" for k, v in (("cfg", p.cfg_degree), ("pipefusion", p.pipefusion_degree),
                                       ("ulysses", p.ulysses_degree), ("ring", p.ring_degree)) if v > 1]  # fmt: skip
    return " x ".join(parts) or "1 rank"


def local_device() -> str:
    """This machine's device kind for the model: the CUDA device's name (A100, H100, L40), else ``cpu``;
    ``ConfigError`` naming ``--device`` for a GPU the model has no profile of."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for key in ("a100", "h100", "l40", "rtx4090"):
        if key in name.lower().replace(" ", ""):
            small = key == "a100" and torch.cuda.get_device_properties(0).total_memory < 50 * 2**30
            return "a100-40gb" if small else key
    raise ConfigError("--device", f"this machine's {name!r} has no profile; give one of {sorted(DEVICES)}")


def workload(config: XfuseConfig, controlnet: dict | None = None) -> Workload:
    """The request ``config`` describes (its generation section, or the defaults), at the model's shape; with
    ``controlnet`` (its block counts) a ControlNet run with it (``Workload.controlnet``)."""
    resolved = resolve(config.model)
    spec, model = resolved.spec, resolved.transformer
    gen = config.generation if config.generation is not None else GenerationConfig()
    cfg_batch = spec.cfg_batch(gen.guidance_scale, gen.negative_prompt)
    width, height, num_frames = request_size(config, resolved)  # the image or clip xfuse generate would make
    return Workload(
        spec,
        model,
        height,
        width,
        gen.num_inference_steps,
        cfg_batch,
        frames=spec.latent_frames(num_frames),
        controlnet=controlnet,
        cached=config.cache.enabled,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config: XfuseConfig, world: int) -> tuple[list[ParallelConfig], list[str]]:
    """(valid layouts, refused layouts with the reason) of ``world`` ranks for ``config``'s request."""
    work = workload(config)
    base = config.parallel
    valid: list[ParallelConfig] = []
    refused: list[str] = []
    for cfg in (1, 2) if work.cfg_batch == 2 else (1,):
        if world % cfg:
            continue
        for pp in _divisors(world // cfg):
            for ulysses in _divisors(world // cfg // pp):
                ring = world // cfg // pp // ulysses
                name = f"cfg {cfg} x pipefusion {pp} x ulysses {ulysses} x ring {ring}"
                try:
                    parallel = parallel_config(
                        {"pipefusion_degree": pp, "cfg_degree": cfg, "ulysses_degree": ulysses,
                         "ring_degree": ring, "warmup_steps": base.warmup_steps,
                         "text_encoder": base.text_encoder}
                    )  # fmt: skip
                    work.spec.check_layout(
                        parallel,
                        num_blocks=work.num_blocks,
                        patch_size=work.spec.token_patch(work.config),
                        height=work.height,
                        width=work.width,
                        num_heads=work.spec.num_heads(work.config),
                        latent_frames=work.frames,
                    )
                except ConfigError as err:
                    refused.append(f"{name}: {err}")
                    continue
                valid.append(parallel)
    return valid, refused


def rank_layouts(
    config: XfuseConfig, world: int, where: Machine, calibration: Calibration = FITTED
) -> tuple[list[Ranked], list[str]]:
    """Valid layouts of ``world`` ranks on ``where`` that fit its devices' memory, fastest first, and why the others
    were refused (``does not fit``: which rank needs how much)."""
    work = workload(config)
    valid, refused = candidates(config, world)
    placed: dict[int, Placed] = {}
    if where.device.memory is not None:
        fitting = []
        for parallel in valid:
            option = place_text(config.model, work, parallel, _dtype(where.device.dtype_bytes), where.device.memory,
                                conv_scratch=conv_scratch_on(where))  # fmt: skip
            if option.fits:
                fitting.append(parallel)
                placed[id(parallel)] = option
            else:
                refused.append(f"{layout_name(parallel)}: does not fit: {option.busiest.describe(where.device.memory)}"
                               f"; {option.words(parallel.text_encoder)}")  # fmt: skip
        valid = fitting
    predicted = {id(p): _with_offload(predict(work, p, where, calibration), placed.get(id(p)), config, where)
                 for p in valid}  # fmt: skip
    ranked = sorted((Ranked(p, predicted[id(p)], placed.get(id(p))) for p in valid), key=lambda r: r.prediction.seconds)
    return ranked, refused


def _with_offload(prediction: Prediction, placed: Placed | None, config: XfuseConfig, where: Machine) -> Prediction:
    """``prediction`` plus, where the text encoders are offloaded, their weights' copy from host memory once per
    request (``Device.host_bandwidth``), outside the loop."""
    if placed is None or placed.text != "offload" or not where.device.gpu:
        return prediction
    whole = text_encoder_bytes(config.model, "rank0", 1, _dtype(where.device.dtype_bytes))[0]
    copy = whole / where.device.host_bandwidth
    return replace(prediction, seconds=prediction.seconds + copy, outside=prediction.outside + copy)


def _dtype(dtype_bytes: int):
    import torch

    return {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]


def choose(config: XfuseConfig, world: int, where: Machine) -> tuple[XfuseConfig, Ranked]:
    """``config`` with the fastest layout of ``world`` ranks on ``where`` (degrees, M and placement back to their
    defaults; warm-up and everything else kept), and that layout's ranking entry."""
    ranked, refused = rank_layouts(config, world, where)
    if not ranked:
        raise ConfigError("parallel", f"no layout of {world} ranks runs this request: " + "; ".join(refused))
    best = ranked[0].parallel
    data = config.to_dict()
    data["parallel"] = {
        **data.get("parallel", {}),
        "pipefusion_degree": best.pipefusion_degree,
        "cfg_degree": best.cfg_degree,
        "ulysses_degree": best.ulysses_degree,
        "ring_degree": best.ring_degree,
        "num_patches": None,
        "placement": None,
        "stage_split": None,
    }  # text_encoder kept: each rank resolves it as the ranking did (xfuse.perf.memory.place_text)
    return config_from_dict(data), ranked[0]


def format_ranking(config: XfuseConfig, world: int, where: Machine, top: int = 10) -> str:
    """What ``xfuse plan --auto`` prints: the ranking, the breakdown of each layout's time, and the choice."""
    work = workload(config)
    ranked, refused = rank_layouts(config, world, where)
    nodes = world // where.gpus_per_node if world > where.gpus_per_node else 1
    lines = [
        f"{config.model} ({work.spec.name}), {work.height}x{work.width} px, {work.steps} steps, transformer batch "
        f"{work.cfg_batch}; {world} x {where.device.name}"
        + (f" on {nodes} nodes" if nodes > 1 else "")
        + f", {where.link.name}",
        "",
        f"{'layout':<38} {'predicted':>9} {'loop':>8} {'compute':>8} {'SP comm':>8} {'waiting':>8}  (seconds; "
        "compute and SP comm: the busiest rank's)",
    ]
    memory = where.device.memory
    if memory is not None:
        lines[-1] = lines[-1].replace("  (seconds;", f" {'text enc':>8} {'busiest':>8}  (seconds;", 1)
    for r in ranked[:top]:
        p = r.prediction
        line = (
            f"{r.name:<38} {p.seconds:>9.2f} {p.loop:>8.2f} {p.compute:>8.2f} {p.sequence_comm:>8.2f} {p.waiting:>8.2f}"
        )
        if r.placed is not None:
            line += f" {r.placed.text:>8} {r.placed.busiest.total / 2**30:>6.1f} G"
        lines.append(line)
    if len(ranked) > top:
        lines.append(f"... {len(ranked) - top} more")
    for reason in refused:
        lines.append(f"refused: {reason}")
    if memory is not None:
        lines.append(
            f"memory per rank (busiest: GiB the layout's busiest rank holds): transformer weights, stale K/V, text "
            f"encoders placed by parallel.text_encoder ({config.parallel.text_encoder}; text enc: rank0, split over "
            f"the pipeline group, or offload), the VAE and the request's activations (traced for a preset), in bf16, "
            f"against {where.device.name}'s {memory / 2**30:.1f} GiB (xfuse.perf.memory)"
        )
    if ranked:
        best = ranked[0]
        why = _why(best, ranked[1] if len(ranked) > 1 else None)
        lines += ["", f"choice: {best.name} ({best.prediction.seconds:.2f} s predicted). {why}"]
    lines.append(
        "model: xfuse.perf (the schedule replayed with FLOPs from the shapes, link bandwidths and fitted "
        "efficiencies; its error on published points: docs/performance.md#performance-model-predicted)"
    )
    return "\n".join(lines)


def _why(best: Ranked, runner_up: Ranked | None) -> str:
    p = best.prediction
    parts = []
    if runner_up is not None:
        q = runner_up.prediction
        gap = q.seconds / p.seconds - 1
        parts.append(f"Next: {runner_up.name}, {gap:.0%} slower")
        if q.sequence_comm > p.sequence_comm + 0.05 * q.loop:
            parts.append(f"its sequence-parallel exchanges cost {q.sequence_comm:.2f} s on this link")
        elif q.waiting > p.waiting + 0.05 * q.loop:
            parts.append(f"it waits {q.waiting:.2f} s for pipeline fill, drain and hand-offs")
        elif q.compute > p.compute:
            parts.append(f"its busiest rank computes {q.compute:.2f} s against {p.compute:.2f} s")
    if p.sequence_comm == 0 and best.parallel.pipefusion_degree > 1:
        parts.append("PipeFusion's hand-offs are one patch per stage boundary, no per-layer exchange")
    return "; ".join(parts) + "."
