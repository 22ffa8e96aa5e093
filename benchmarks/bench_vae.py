"""The VAE decode on CPU: diffusers' serial ``vae.decode``, xfuse's exact band-parallel decode on 2 ranks
(``xfuse.parallel.vae_decode.ParallelVAEDecode``) and diffusers' tiled decode (``vae.enable_tiling()``): wall time,
peak resident memory per rank, and how far each image is from the serial one.

    python benchmarks/bench_vae.py --vae shapes   --sizes 1024 2048 4096 --repeats 3
    python benchmarks/bench_vae.py --vae released --sizes 1024 2048 4096 --repeats 3 --skip-serial-above 2048
    python benchmarks/bench_vae.py --vae wan2.1 --frames 5 --sizes 64 128 192 256 --repeats 3
    python benchmarks/bench_vae.py --vae wan-tiny --frames 9 --sizes 720x1280 --repeats 3

What is decoded: one image (batch 1) of ``size`` x ``size`` px from the same latents for every variant: a standard
normal (B, 4, size/8, size/8) drawn with seed ``--seed``, divided by the VAE's ``scaling_factor`` (what a pipeline
hands to ``vae.decode``), float32.

The VAEs (``--vae``):

* ``shapes``: the shipped model's VAE (``xfuse.families.registry.load_pipeline("shapes").vae``; widths 16-64, tiles of
  256 px when tiled).
* ``released``: an ``AutoencoderKL`` with the widths of the released SDXL VAE (block_out_channels (128, 256, 512,
  512), 2 layers per block, 32 norm groups, 4 latent channels, sample_size 1024 as in its config, so tiles of 1024 px
  with 25 % overlap when tiled) and random weights (seed 0). The time and memory are those of the real network; the
  tiled PSNR measures the seams tiling leaves in this random network's output, not on a real image.
* ``wan2.1``, ``wan2.2``: Wan's causal 3-D ``AutoencoderKLWan`` with the released widths (the ``wan2.1-t2v-14b`` and
  ``wan2.2-ti2v-5b`` presets' VAEs: base width 96, and 160 with a 256-wide decoder) and random weights (seed 0),
  decoding a clip of ``--frames`` frames (4k + 1): latents (1, z_dim, 1 + (frames - 1) / 4, size / f, size / f),
  a standard normal (f: 8, Wan 2.2's 16). The parallel variant is ``ParallelWanDecode``
  (``xfuse.parallel.video_vae_decode``); tiled is diffusers' own ``enable_tiling`` (256 px tiles, 192 px stride).
* ``wan-tiny``: the ``wan-tiny`` preset's VAE (the release's layout at a 24th of its width), for memory at large
  frames on this CPU.

A size is a side in px (a square) or ``HxW``.

The variants, each decode run in a fresh world of its own (one torch thread per rank, every rank pinned to its own
core, gloo over loopback), timed in turns: a round decodes serial, parallel 2, tiled, in that order, so the machine's
drift falls on every ratio alike:

* ``diffusers serial``: ``vae.decode(latents)`` in one process (core 0).
* ``xfuse parallel 2``: ``ParallelVAEDecode`` over 2 ranks (cores 0 and 1); rank 0 holds the latents and gets the
  image; its time is the decode's.
* ``diffusers tiled``: ``vae.enable_tiling()`` then ``vae.decode(latents)`` in one process (core 0). Where the latent
  is no larger than one tile, diffusers does not tile and the image is the serial one.

Each rank builds the VAE, decodes a warm-up image of 64 px (the same variant: kernels, lazy imports and the gloo
connections), collects garbage, then times the measured decode between a barrier and its return (rank 0's clock).

Memory: every measured decode runs in a fresh process, so no earlier large decode has raised its high-water mark.
Right before the decode each rank resets its peak resident size to the current one (``echo 5 >
/proc/self/clear_refs``, Linux >= 4.0) and reads its resident size (``VmRSS``); after the decode it reads the peak
(``VmHWM``). Reported per rank: ``peak``, the process's peak resident size during the decode (the libraries, the
VAE's weights, the latents and the decode's activations; on rank 0 also the whole image), and ``increase``, that
peak less the resident size right before the decode (what the decode itself added). ``VmHWM`` rather than
``ru_maxrss``: a spawned process's ``ru_maxrss`` can carry the resident size of the parent it was forked from
before its exec. Where ``clear_refs`` cannot be written, ``ru_maxrss`` is reported instead and the JSON says so
(``memory_method``). glibc's default allocator settings in every variant (a user's own process; xfuse's
``keep_freed_heap`` is not applied).

Accuracy: images are compared with the serial one of the same round: the max abs difference of the raw decoder
output, and the PSNR (dB) of both mapped from [-1, 1] to [0, 1] and clamped. Where the serial decode is skipped
(``--skip-serial-above``: the released VAE's serial decode at 4096 px needs more than 24 GiB, one activation at full
resolution alone being 128 ch x 4096^2 x 4 B = 8.6 GB), the parallel image (exact: it matches the serial one to
float rounding at the sizes where both run) is the reference, and the JSON's ``reference`` says so. Both ranks of
the parallel decode run on one machine here, so their memory adds up: ``--skip-parallel-above`` skips it as well.
A decode that fails (a rank killed for memory, a timeout) is recorded with its error and that variant is not run
again at that size; the others go on.

Results: a table on stdout and ``benchmarks/results/vae_<vae>.json`` (``--json`` to write elsewhere), rewritten
after every size, with the machine (date UTC, CPU, cores, memory, torch and diffusers versions).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import pin_to_core, spread  # noqa: E402  (after the path insert, as run directly)
from xfuse.families.common.presets import SDXL_VAE_SCALING, tiny_vae_config  # noqa: E402
from xfuse.runtime.peak import reset_rss_peak, status_mib  # noqa: E402

SERIAL, PARALLEL, TILED = "diffusers serial", "xfuse parallel 2", "diffusers tiled"
RANKS = {SERIAL: 1, PARALLEL: 2, TILED: 1}  # the order of a round
WARMUP_PX = 64
# The released SDXL VAE's architecture (its config.json; random weights): the presets' four-level layout
# (xfuse.families.common.presets.tiny_vae_config) at the released widths.
RELEASED_VAE = tiny_vae_config(1024, scaling_factor=SDXL_VAE_SCALING) | dict(
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32
)
QUIET = {  # the ranks' stderr: no loading bars or advisories (load_pipeline builds the whole shapes pipeline)
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------------------------------------ in a rank
VIDEO_VAES = {"wan2.1": "wan2.1-t2v-14b", "wan2.2": "wan2.2-ti2v-5b", "wan-tiny": "wan-tiny"}  # --vae -> its preset


def build_vae(name: str, seed: int = 0):
    """The VAE ``--vae`` names (module docstring), float32, in eval mode."""
    if name in VIDEO_VAES:
        import torch
        from diffusers import AutoencoderKLWan

        from xfuse.families.wan.presets import preset_vae_config

        config = {k: v for k, v in preset_vae_config(VIDEO_VAES[name]).items() if not k.startswith("_")}
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return AutoencoderKLWan(**config).eval()
    if name == "shapes":
        from xfuse.families.registry import load_pipeline

        return load_pipeline("shapes").vae.eval()
    if name == "released":
        import torch
        from diffusers import AutoencoderKL

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return AutoencoderKL(**RELEASED_VAE).eval()
    raise ValueError(f"unknown VAE {name!r}: shapes or released")


def latents_for(vae, size: tuple[int, int], seed: int, frames: int = 1):
    """An image VAE's (1, latent channels, h/8, w/8): a standard normal divided by the VAE's scaling factor; a video
    VAE's (1, z_dim, latent frames, h/f, w/f) for a clip of ``frames`` frames: a standard normal."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    (height, width), config = size, vae.config
    if "z_dim" in config:
        factor = config.scale_factor_spatial
        shape = (1, config.z_dim, (frames - 1) // 4 + 1, height // factor, width // factor)
        return torch.randn(shape, generator=generator)
    shape = (1, config.latent_channels, height // 8, width // 8)
    return torch.randn(shape, generator=generator) / config.scaling_factor


def _vae_facts(vae) -> dict:
    facts = dict(
        config={k: list(v) if isinstance(v, tuple) else v for k, v in vae.config.items() if not k.startswith("_")},
        decoder_parameters=sum(p.numel() for p in vae.decoder.parameters()),
    )
    if hasattr(vae, "tile_sample_min_size"):  # AutoencoderKL's square tiles
        facts |= dict(tile_px=vae.tile_sample_min_size, tile_latent=vae.tile_latent_min_size,
                      tile_overlap=vae.tile_overlap_factor)  # fmt: skip
    else:  # AutoencoderKLWan's
        factor = vae.config.scale_factor_spatial
        facts |= dict(tile_px=vae.tile_sample_min_height, tile_latent=vae.tile_sample_min_height // factor,
                      tile_stride_px=vae.tile_sample_stride_height)  # fmt: skip
    return facts


def decode_rank(vae_name: str, variant: str, size: tuple[int, int], seed: int, image_path: str, p2p_timeout_s: float,
                frames: int = 1) -> dict:  # fmt: skip
    """On every rank of a fresh world: build the VAE, a warm-up decode, then the measured one (module docstring).
    Rank 0 saves the image to ``image_path``. Returns the time (rank 0's), the memory and the VAE's facts."""
    import gc
    import resource

    import diffusers
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    pin_to_core(rank, world)
    torch.set_num_threads(1)
    diffusers.utils.logging.disable_progress_bar()
    vae = build_vae(vae_name, seed=0)
    if variant == TILED:
        vae.enable_tiling()
    parallel = None
    if variant == PARALLEL:
        from xfuse.comm.p2p import P2PChannels
        from xfuse.parallel.video_vae_decode import band_decoder

        channels = P2PChannels(rank=rank, timeout_s=p2p_timeout_s, max_inflight=2, device="cpu")
        parallel = band_decoder(vae, ranks=list(range(world)), rank=rank, channels=channels)

    def decode(latents):
        if parallel is not None:
            return parallel.decode(latents if rank == 0 else None, tuple(latents.shape))
        with torch.no_grad():
            return vae.decode(latents, return_dict=False)[0]

    decode(latents_for(vae, (WARMUP_PX, WARMUP_PX), seed, frames))
    latents = latents_for(vae, size, seed, frames)
    gc.collect()
    dist.barrier()
    reset = reset_rss_peak()
    rss_before = status_mib("VmRSS")
    start = time.perf_counter()
    image = decode(latents)
    seconds = time.perf_counter() - start
    if reset:
        peak = status_mib("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.barrier()
    if rank == 0:
        torch.save(image, image_path)
    return dict(
        seconds=seconds,
        peak_rss_mib=peak,
        rss_before_mib=rss_before,
        increase_mib=peak - rss_before,
        memory_method="VmHWM after clear_refs" if reset else "ru_maxrss",
        vae=_vae_facts(vae) if rank == 0 else None,
    )


# ------------------------------------------------------------------------------------------------ the parent
def run_decode(vae_name: str, variant: str, size: tuple[int, int], seed: int, image_path: str, timeout_s: float,
               frames: int = 1) -> list[dict]:  # fmt: skip
    """One measured decode in a fresh world of ``RANKS[variant]`` processes; per rank, ``decode_rank``'s dict."""
    from tests.support.world import World

    with World(RANKS[variant], threads_per_rank=1, env=QUIET, start_timeout=600) as world:
        return world.run_ok(
            decode_rank, vae_name, variant, size, seed, image_path, min(timeout_s, 1800), frames, timeout=timeout_s
        )


def compare(image, reference) -> dict:
    """Max abs difference of the raw outputs; PSNR (dB) of both mapped to [0, 1] and clamped (None: identical)."""
    import torch

    max_abs = (image - reference).abs().max().item()
    a, b = ((image.double() + 1) / 2).clamp(0, 1), ((reference.double() + 1) / 2).clamp(0, 1)
    mse = torch.mean((a - b) ** 2).item()
    return dict(max_abs=max_abs, psnr_db=10 * math.log10(1 / mse) if mse > 0 else None)


def ratios(rows: dict, over: str, under: str) -> dict | None:
    """``over``'s time over ``under``'s, round by round (the rounds both ran): median, min, max, runs."""
    pairs = [
        (a, b)
        for a, b in zip(rows[over]["times"], rows[under]["times"], strict=True)
        if a is not None and b is not None
    ]
    if not pairs:
        return None
    per_round = [a / b for a, b in pairs]
    return dict(
        **spread(per_round), of_medians=statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)
    )


def skip_reason(variant: str, size: tuple[int, int], args) -> str | None:
    limit = {SERIAL: args.skip_serial_above, PARALLEL: args.skip_parallel_above}.get(variant)
    if limit is not None and max(size) > limit:
        flag = "--skip-serial-above" if variant == SERIAL else "--skip-parallel-above"
        return f"skipped: {max(size)} px > {flag} {limit}"
    return None


def measure_size(args, size: tuple[int, int], workdir: str) -> tuple[dict, dict | None]:
    """Every variant at ``size``, ``args.repeats`` rounds in turns; the result and the VAE's facts (None: no decode
    ran)."""
    import torch

    rows = {
        variant: dict(times=[], ranks=[], max_abs=[], psnr_db=[], skipped=skip_reason(variant, size, args), error=None)
        for variant in RANKS
    }
    facts, references = None, []
    for round_ in range(args.repeats):
        images = {}
        for variant, row in rows.items():
            if row["skipped"] or row["error"]:
                row["times"].append(None)
                continue
            path = os.path.join(workdir, f"{variant.replace(' ', '_')}_{size[0]}x{size[1]}.pt")
            try:
                results = run_decode(args.vae, variant, size, args.seed, path, args.timeout_s, args.frames)
            except Exception as exc:  # a rank killed for memory, a timeout: recorded, the others go on
                row["error"] = f"round {round_ + 1}: {type(exc).__name__}: {exc}"[:2000]
                row["times"].append(None)
                print(f"  {size[0]}x{size[1]} px {variant}: FAILED ({row['error'].splitlines()[0]})", flush=True)
                continue
            row["times"].append(results[0]["seconds"])
            row["ranks"].append([{k: v for k, v in r.items() if k != "vae"} for r in results])
            facts = facts or results[0]["vae"]
            images[variant] = torch.load(path)
            os.remove(path)
            memory = " / ".join(f"{r['peak_rss_mib']:.0f} (+{r['increase_mib']:.0f})" for r in results)
            print(
                f"  {size[0]}x{size[1]} px round {round_ + 1} {variant}: {results[0]['seconds']:.2f} s, "
                f"peak RSS per rank {memory} MiB",
                flush=True,
            )
        reference = SERIAL if SERIAL in images else PARALLEL if PARALLEL in images else None
        references.append(reference)
        for variant, image in images.items():
            if reference is not None and variant != reference:
                distance = compare(image, images[reference])
                rows[variant]["max_abs"].append(distance["max_abs"])
                rows[variant]["psnr_db"].append(distance["psnr_db"])
        del images
    for row in rows.values():
        runs = [t for t in row["times"] if t is not None]
        row.update(spread(runs) if runs else {})
        if row["ranks"]:  # the worst round per rank: what must fit
            row["peak_rss_mib"] = [max(r[i]["peak_rss_mib"] for r in row["ranks"]) for i in range(len(row["ranks"][0]))]
            row["increase_mib"] = [max(r[i]["increase_mib"] for r in row["ranks"]) for i in range(len(row["ranks"][0]))]
            row["memory_method"] = row["ranks"][0][0]["memory_method"]
        psnrs = [p for p in row["psnr_db"] if p is not None]
        row["worst_max_abs"] = max(row["max_abs"]) if row["max_abs"] else None
        row["worst_psnr_db"] = min(psnrs) if psnrs else None
        row["identical"] = bool(row["max_abs"]) and max(row["max_abs"]) == 0
    out = dict(reference=sorted({r for r in references if r}), variants=rows)
    if facts is not None:
        config = facts["config"]
        if "z_dim" in config:  # a clip's latents
            f = config["scale_factor_spatial"]
            out["latent"] = [1, config["z_dim"], (args.frames - 1) // 4 + 1, size[0] // f, size[1] // f]
        else:
            out["latent"] = [1, config["latent_channels"], size[0] // 8, size[1] // 8]
        out["tiling_applied"] = max(out["latent"][-2:]) > facts["tile_latent"]
    out["serial_over_parallel"] = ratios(rows, SERIAL, PARALLEL)
    out["tiled_over_parallel"] = ratios(rows, TILED, PARALLEL)
    return out, facts


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, KeyError, ValueError):
        with open("/proc/meminfo") as fh:
            return int(next(line for line in fh if line.startswith("MemTotal:")).split()[1]) / 2**20
    return None


def table(report: dict) -> str:
    out = [
        f"{report['vae']} VAE; {report['machine']}; {report['date']}; {report['repeats']} rounds in turns; memory: "
        f"{report['memory_method']} per rank, peak (+ increase during the decode) in MiB.",
        "",
        "| px | variant | median s (min–max) | peak RSS per rank, MiB (+ decode) | vs serial |",
        "|---|---|---|---|---|",
    ]
    notes = []
    for size, result in report["sizes"].items():
        ref = " / ".join(result["reference"]) or "-"
        for variant, row in result["variants"].items():
            if row["skipped"] or (row["error"] and not row["ranks"]):
                out.append(f"| {size} | {variant} | {row['skipped'] or 'FAILED'} | - | - |")
                if row["error"]:
                    notes.append(f"{size} px {variant}: {row['error'].splitlines()[0]}")
                continue
            time_s = f"{row['median']:.2f} ({row['min']:.2f}–{row['max']:.2f})"
            memory = " / ".join(
                f"{p:.0f} (+{i:.0f})" for p, i in zip(row["peak_rss_mib"], row["increase_mib"], strict=True)
            )
            if variant in result["reference"]:
                versus = "reference" if variant == SERIAL else "reference (serial skipped)"
            elif row["identical"]:
                versus = "identical" + (
                    "" if result.get("tiling_applied", True) or variant != TILED else " (not tiled)"
                )
            elif row["worst_max_abs"] is None:
                versus = "-"
            else:
                psnr = row["worst_psnr_db"]
                versus = f"max abs {row['worst_max_abs']:.1e}, PSNR " + (f"{psnr:.1f} dB" if psnr else "inf")
                if ref != SERIAL:
                    versus += f" (vs {ref})"
            out.append(f"| {size} | {variant} | {time_s} | {memory} | {versus} |")
            if row["error"]:
                notes.append(f"{size} px {variant}: {row['error'].splitlines()[0]}")
    out.append("")
    for size, result in report["sizes"].items():
        parts = []
        for key, label in (
            ("serial_over_parallel", "serial / parallel 2"),
            ("tiled_over_parallel", "tiled / parallel 2"),
        ):
            r = result[key]
            if r is None:
                parts.append(f"{label}: - (not both ran)")
            else:
                parts.append(f"{label} {r['median']:.2f}x (rounds {r['min']:.2f}–{r['max']:.2f})")
        out.append(f"{size} px: " + "; ".join(parts))
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)


def parse_size(text: str) -> tuple[int, int]:
    """``1024`` -> (1024, 1024); ``720x1280`` -> (720, 1280)."""
    height, _, width = text.partition("x")
    return int(height), int(width or height)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", choices=("shapes", "released", *VIDEO_VAES), default="shapes")
    parser.add_argument(
        "--sizes", type=parse_size, nargs="+", default=[(1024, 1024), (2048, 2048), (4096, 4096)],
        help="side or HxW, px (multiples of the VAE's factor)",
    )  # fmt: skip
    parser.add_argument("--frames", type=int, default=1, help="a video VAE's clip: 4k + 1 frames")
    parser.add_argument("--repeats", type=int, default=3, help="rounds in turns")
    parser.add_argument("--skip-serial-above", type=int, default=None, metavar="PX")
    parser.add_argument("--skip-parallel-above", type=int, default=None, metavar="PX")
    parser.add_argument("--seed", type=int, default=0, help="of the latents")
    parser.add_argument("--timeout-s", type=float, default=6 * 3600, help="per decode, world start-up included")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/vae_<vae>.json")
    args = parser.parse_args()
    factor = 16 if args.vae == "wan2.2" else 8
    if any(side % factor or side < 2 * factor for size in args.sizes for side in size):
        parser.error(f"every side must be a multiple of {factor} and at least {2 * factor} px (a latent row per band)")
    if args.frames % 4 != 1 or (args.frames > 1 and args.vae not in VIDEO_VAES):
        parser.error("--frames: 4k + 1 frames, for a video VAE (wan2.1, wan2.2, wan-tiny)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers
    import torch

    clip = f"_{args.frames}f" if args.vae in VIDEO_VAES else ""
    path = args.json or os.path.join(RESULTS, f"vae_{args.vae}{clip}.json")
    report = dict(
        vae=args.vae,
        machine=f"{_cpu_model()}, {os.cpu_count()} cores, {_memory_gib() or 0:.1f} GiB, CPU only",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        torch=torch.__version__,
        diffusers=diffusers.__version__,
        python=platform.python_version(),
        repeats=args.repeats,
        seed=args.seed,
        latents="standard normal (seed), float32, batch 1"
        + (f", a clip of {args.frames} frames" if args.vae in VIDEO_VAES else " / scaling_factor"),
        frames=args.frames,
        memory_method="VmHWM after clear_refs",
        skip_serial_above=args.skip_serial_above,
        skip_parallel_above=args.skip_parallel_above,
        vae_facts=None,
        sizes={},
    )
    with tempfile.TemporaryDirectory(prefix="xfuse-bench-vae-") as workdir:
        for size in args.sizes:
            name = str(size[0]) if size[0] == size[1] else f"{size[0]}x{size[1]}"
            print(f"{name} px:", flush=True)
            result, facts = measure_size(args, size, workdir)
            report["sizes"][name] = result
            report["vae_facts"] = report["vae_facts"] or facts
            methods = {row.get("memory_method") for row in result["variants"].values()} - {None}
            if methods - {"VmHWM after clear_refs"}:
                report["memory_method"] = "ru_maxrss (clear_refs not writable: includes start-up and the parent)"
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as fh:
                json.dump(report, fh, indent=2)
    print()
    print(table(report))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
