"""The ``xfuse`` command line: ``plan`` (no processes), ``generate``, ``serve`` and ``doctor``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from xfuse.config.io import load_config
from xfuse.errors import ConfigError
from xfuse.runtime.heap import collector_paused
from xfuse.stderr import write_stderr


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", help="YAML file (keys: model, parallel, comm, cache, runtime, generation, serve)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set parallel.num_patches=4 (repeatable)",
    )


def _launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start the N ranks of this node from this command (default: the world size the config's parallel "
        "degrees make; under torchrun: the ranks torchrun started). SIGTERM/SIGINT drain them; exit 0 once all did",
    )


def _ranks_to_start(args) -> int:
    """How many ranks this command starts itself (``xfuse.runtime.launcher``): 0 when it is a rank already (under
    torchrun or this launcher) or the world is one rank; refuses a ``--nproc-per-node`` the config cannot run."""
    if "RANK" in os.environ:  # a rank of a launched world: run it
        if args.nproc_per_node is not None:
            raise ConfigError(
                "--nproc-per-node", "starts the ranks itself: give it to xfuse, not to a rank that torchrun started"
            )
        return 0
    config = _run_config(args)
    if args.nproc_per_node is None:
        return config.world_size if config.world_size > 1 and not args.auto else 0
    if args.nproc_per_node < 1 or (args.nproc_per_node != config.world_size and not args.auto):
        raise ConfigError(
            "--nproc-per-node",
            f"must be the world size the config's parallel degrees make, {config.world_size} (cfg "
            f"{config.parallel.cfg_degree} x pipefusion {config.parallel.pipefusion_degree} x ulysses "
            f"{config.parallel.ulysses_degree} x ring {config.parallel.ring_degree}), or use --auto to choose a "
            f"layout for it (got {args.nproc_per_node})",
        )
    return args.nproc_per_node if args.nproc_per_node > 1 else 0


def _run_config(args):
    """The config ``generate`` or ``serve`` runs (before ``--auto``), its files checked (``xfuse.build.check_files``):
    every rank, and the launcher before it starts them, refuses a missing file alike before any communication."""
    from xfuse.build import check_files

    config = load_config(args.config, _command_overrides(args))
    check_files(config)
    return config


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N`` / ``--nproc-per-node=N``: what each started rank runs."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _command_overrides(args) -> list[str]:
    """The ``--set`` overrides and the subcommand's shortcuts (``--prompt``, ``--host``, ``--port``)."""
    overrides = list(args.overrides)
    if getattr(args, "prompt", None):
        overrides.append(f"generation.prompt={args.prompt!r}")
    if getattr(args, "image", None):
        overrides.append(f"generation.image={args.image!r}")
    if getattr(args, "lora", None):
        weights = {}
        for given in args.lora:  # PATH or PATH=WEIGHT
            path, _, weight = given.rpartition("=") if "=" in given else (given, "", "1")
            weights[path] = float(weight) if _is_number(weight) else weight  # a bad weight: the config names it
        overrides.append(f"generation.lora={json.dumps(weights)}")
    if getattr(args, "host", None) is not None:
        overrides.append(f"serve.host={args.host!r}")
    if getattr(args, "port", None) is not None:
        overrides.append(f"serve.port={args.port}")
    return overrides


def _auto_args(parser: argparse.ArgumentParser, *, plan: bool) -> None:
    """The options that pick the layout by the performance model (``xfuse.perf.planner``)."""
    from xfuse.perf.hardware import DEVICE_ALIASES, DEVICES, LINK_KINDS

    what = "rank every layout of --gpus devices" if plan else "run the layout the performance model ranks first"
    parser.add_argument("--auto", action="store_true", help=f"{what} (replaces the config's parallel degrees)")
    parser.add_argument("--link", choices=LINK_KINDS, help="between the devices of a node (default: gloo on a CPU, "
                        "nvlink for A100/H100, pcie for L40)")  # fmt: skip
    parser.add_argument("--device", choices=sorted([*DEVICES, *DEVICE_ALIASES]),
                        help="the device kind (default: this machine's)")  # fmt: skip
    if plan:
        parser.add_argument("--gpus", type=int, help="devices (ranks) of the world to plan for, with --auto")
        parser.add_argument("--nodes", type=int, default=1, help="nodes they are spread over (100 GbE between)")


def _auto_machine(args, gpus: int, nodes: int):
    """The machine ``--auto`` (and ``plan``'s VAE decode) plans for: ``--device`` / ``--link``, or this machine's
    device and its usual link."""
    from xfuse.plan_report import local_machine

    return local_machine(gpus, nodes, args.device, args.link)


def _auto_layout(args, config):
    """``--auto`` on generate/serve: the config with the top-ranked layout for this world (``WORLD_SIZE`` ranks,
    ``LOCAL_WORLD_SIZE`` per node), chosen the same on every rank from the same inputs; rank 0 says which."""
    if not args.auto:
        return config
    from xfuse.perf.planner import choose, layout_name

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    where = _auto_machine(args, world, max(world // per_node, 1))
    chosen, best = choose(config, world, where)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"--auto: {best.name} for {world} x {where.device.name} ({where.link.name}), "
            f"{best.prediction.seconds:.2f} s predicted; the config's was {layout_name(config.parallel)}",
            flush=True,
        )
    return chosen


def cmd_plan(args) -> int:
    from xfuse.plan_report import format_plan_report, plan_report, predicted_latency

    config = load_config(args.config, args.overrides)
    if args.auto:
        from xfuse.perf.planner import format_ranking

        gpus = args.gpus if args.gpus is not None else config.world_size
        if gpus < 1:
            raise ConfigError("--gpus", f"must be a positive number of devices (got {gpus})")
        print(format_ranking(config, gpus, _auto_machine(args, gpus, args.nodes)))
        return 0
    chosen = args.device or args.link or args.nodes != 1  # else this machine's device, if it has a profile
    if args.controlnet_layers < 0:
        raise ConfigError("--controlnet-layers", f"must be 0 or a number of blocks (got {args.controlnet_layers})")
    where = _auto_machine(args, config.world_size, args.nodes) if chosen else None
    report = plan_report(config, where, controlnet_layers=args.controlnet_layers)
    print(format_plan_report(report))
    for link in args.predict:
        print(predicted_latency(report, link))
    return 0


def write_clip(frames, output: str, fps: int) -> tuple[str, str | None]:
    """Write a clip (a list of PIL frames) at ``fps``: an MP4 (or what ``output``'s suffix names) with diffusers'
    ``export_to_video`` when ``imageio`` and ``imageio-ffmpeg`` are installed (``xfuse[video]``), else an animated GIF
    with PIL next to ``output`` (its suffix ``.gif``); a ``.gif`` output is always PIL's. Returns the path written and,
    for the fallback, the line that says why it is a GIF."""
    stem, suffix = os.path.splitext(output)
    missing = None
    if suffix.lower() != ".gif":
        for module in ("imageio", "imageio_ffmpeg"):  # export_to_video needs both (imageio's ffmpeg plugin)
            try:
                __import__(module)
            except ImportError:
                missing = module.replace("_", "-")
                break
        else:
            from diffusers.utils import export_to_video

            # imageio-ffmpeg starts ffmpeg with a Python preexec_fn (os.setpgrp) unless told not to. A rank has threads
            # (the failure monitor, gloo's), and a fork that runs Python in the child of a threaded process can
            # deadlock before exec (subprocess's documentation; imageio-ffmpeg's own workaround is this variable):
            # rank 0 then blocks for ever writing frames to an ffmpeg that never started.
            os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")
            return export_to_video(frames, output, fps=fps), None
        output = stem + ".gif"
    # GIF frame times are whole centiseconds: 1000 / 16 = 62.5 ms is stored as 60 ms
    frames[0].save(output, save_all=True, append_images=list(frames[1:]), duration=1000 / fps, loop=0)
    note = (
        f"xfuse generate: {missing} is not installed, so {output} is an animated GIF, not an MP4 "
        "(pip install 'xfuse[video]' writes MP4)"
        if missing
        else None
    )
    return output, note


def cmd_generate(args) -> int:
    """Generate one image (or, with a video model, one clip). Under torchrun every rank runs this; rank 0 writes the
    PNG (MP4) and reports."""
    # Start-up to the loaded pipeline, whose build freezes what start-up left (xfuse.runtime.heap): its imports and the
    # load allocate about a million objects and leave almost none as garbage.
    with collector_paused():
        from xfuse.build import (
            build_pipeline,
            check_lora_family,
            control_call_kwargs,
            default_size,
            default_video_size,
            image_call_kwargs,
            load_lora_adapters,
            video_call_kwargs,
            warm_up_compile,
        )
        from xfuse.families.registry import resolve
        from xfuse.runtime.host_deadline import register_stack_dump

        register_stack_dump()  # kill -USR1: this rank's stacks on stderr, and it goes on
        config = _auto_layout(args, _run_config(args))
        gen, par = config.generation, config.parallel
        model = resolve(config.model)  # the one look-up of the run's model; the build and the call read it
        video = model.video
        if video:  # before any weights load: a num_frames the VAE cannot take is refused naming its key
            width, height, num_frames = default_video_size(config, model)
        else:
            width, height = default_size(config, model)
        if gen.lora:
            check_lora_family(model, "generation.lora")
        pipe = build_pipeline(config, model)
    if gen.lora:  # every rank: its share of each file, then the run's weights
        names = {f"lora{i}": path for i, path in enumerate(gen.lora)}
        load_lora_adapters(pipe, names, "generation.lora")
        pipe.set_adapters(list(names), adapter_weights=list(gen.lora.values()))
    if os.environ.get("LOCAL_RANK") is not None:  # under torchrun: say why if the launcher stops this rank
        pipe.context.monitor.install_sigterm_handler()
    if os.environ.get("XFUSE_FAULT"):  # failure drills: see xfuse/runtime/faults.py
        from xfuse.runtime.faults import install

        install(pipe.stage, pipe.context.rank, vae=pipe.pipeline.vae, text=pipe.text_group)
    if args.trace:
        pipe.enable_trace()
    request = dict(
        prompt=gen.prompt,
        negative_prompt=gen.negative_prompt,
        width=width,
        height=height,
        num_inference_steps=gen.num_inference_steps,
        guidance_scale=gen.guidance_scale,
        seed=gen.seed,
        spec=model.spec,
    )
    if video:  # image-to-video: every rank reads the first frame (diffusers checks it on every rank)
        from PIL import Image

        image = Image.open(gen.image).convert("RGB") if gen.image else None
        call = video_call_kwargs(**request, num_frames=num_frames, image=image)
    else:
        call = image_call_kwargs(**request)
    if gen.controlnet is not None:  # every rank reads the control image (diffusers checks it on rank 0, which encodes)
        from PIL import Image

        call |= control_call_kwargs(gen, Image.open(gen.control_image).convert("RGB"))
    # any compile.mode but off: the configured sizes (default: this request's) compiled first, each rank saying so
    warm_up_compile(pipe, call, config.compile.warmup or [(call["width"], call["height"])])
    if gen.controlnet is not None:
        import torch

        # SD3's pipeline draws the control image's VAE sample from torch's global generator: seeded with the run's
        # seed, so the config reproduces the run (FLUX draws from the run's generator)
        torch.manual_seed(gen.seed)
    start = time.perf_counter()
    out = pipe(**call)
    wall = time.perf_counter() - start
    stats = pipe.rank_stats()
    events = pipe.write_trace(args.trace) if args.trace else None
    if out is not None:
        suffix = ".mp4" if video else ".png"
        output = args.output or os.path.join("outputs", f"xfuse_{config.model.replace('/', '_')}_{gen.seed}{suffix}")
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        if video:
            frames = out.frames[0]
            output, note = write_clip(frames, output, gen.fps)
            if note is not None:
                write_stderr(note)
            what = (
                f"{len(frames)} frames of {frames[0].width}x{frames[0].height} at {gen.fps} fps "
                f"({len(frames) / gen.fps:.2f} s)"
            )
        else:
            out.images[0].save(output)
            what = f"{out.images[0].width}x{out.images[0].height}"
        print(
            f"wrote {output}: {what}, {gen.num_inference_steps} steps in "
            f"{wall:.2f} s on {config.world_size} rank(s) (pipefusion {par.pipefusion_degree} x cfg "
            f"{par.cfg_degree}, {pipe.plan.placement}, {par.resolved_num_patches} patches, warm-up "
            f"{par.warmup_steps}; VAE decode on {pipe.decode_ranks} rank(s); text encoders {pipe.text_placement})"
        )
        for rank, stat in enumerate(stats):
            sent = stat["sent"]
            kinds = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(sent.items())) or "nothing"
            memory = f"peak RSS {stat['peak_rss_mib']:.0f} MiB" + (
                "" if stat["peak_cuda_mib"] is None else f", peak CUDA {stat['peak_cuda_mib']:.0f} MiB"
            )
            print(f"  rank {rank} sent {sum(sent.values()) / 2**20:.2f} MiB ({kinds}); {memory}{_decode_share(stat)}")
        if gen.lora:
            print("LoRA: " + ", ".join(f"{path} ({weight:g})" for path, weight in gen.lora.items()))
        if gen.controlnet is not None:
            print(
                f"ControlNet: {gen.controlnet} on {gen.control_image} (scale {gen.controlnet_conditioning_scale:g}, "
                f"steps {gen.control_guidance_start:g}-{gen.control_guidance_end:g} of the run)"
            )
        if stats[0]["cache_steps"] is not None:
            cache = config.cache
            computed, skipped = stats[0]["cache_steps"]
            print(
                f"step cache ({cache.method}, threshold {cache.threshold}): {computed} of {computed + skipped} steps "
                f"computed, {skipped} skipped (every patch takes its step's branch"
                + ("; CFG group 0's decisions)" if par.cfg_degree > 1 else ")")
            )
        if events is not None:
            print(f"wrote {args.trace}: {events} trace events (open in https://ui.perfetto.dev)")
    return 0


def _decode_share(stat: dict) -> str:
    """``; decode: ...`` for a rank's summary line: the bytes its part of the VAE decode sent and what it added to the
    rank's memory at its peak (``local_stats``' ``decode_peak``); empty where the rank did not decode."""
    if stat.get("decode_peak") is None:
        return ""
    kind, mib = stat["decode_peak"]
    sent = sum(nbytes for name, nbytes in stat["sent"].items() if name.startswith("vae "))
    peak = "not measurable here" if mib is None else f"+{mib:.0f} MiB {kind} at its peak"
    return f"; decode: sent {sent / 2**20:.2f} MiB, {peak}"


def _shutdown_or_exit(code: int) -> int:
    """Tear down what xfuse started (``xfuse.runtime.world.shutdown``: monitor -> channels -> groups) and return
    ``code``. If the monitor's thread cannot be joined (stuck in a store call), leave now with ``os._exit(code)``:
    finalizing the interpreter under that thread is what aborts a finished run with SIGABRT."""
    distributed = sys.modules.get("xfuse.runtime.world")  # never imported: nothing was started (plan)
    if distributed is not None and not distributed.shutdown():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_serve(args) -> int:
    """Serve the OpenAI Images API on rank 0 until stopped (every rank runs this under torchrun)."""
    with collector_paused():  # start-up, as generate's; serve pauses it again for the load
        from xfuse.runtime.host_deadline import register_stack_dump
        from xfuse.serve.server import serve

        register_stack_dump()  # kill -USR1: this rank's stacks on stderr, and it goes on
        config = _auto_layout(args, _run_config(args))
    return serve(config, api_key=args.api_key or os.environ.get("XFUSE_API_KEY") or None)


def cmd_doctor(args) -> int:
    from xfuse import doctor

    if args.listen is not None:
        return doctor.listen(args.listen)
    if args.peer is not None:
        return doctor.check_peer(args.peer, args.timeout)
    return doctor.main(args.timeout, args.compile_cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="xfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print ranks -> blocks, patches, skips, bytes and memory per rank")
    _add_config_args(plan)
    plan.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="LINK",
        help="also print the modelled latency on DEVICE-LINK, e.g. a100-nvlink, h100-nvlink, l40-pcie, cpu-gloo "
        "(repeatable)",
    )
    plan.add_argument(
        "--controlnet-layers",
        type=int,
        default=0,
        metavar="N",
        help="count a ControlNet of N blocks run with the request (SD3: PipeFusionStableDiffusion3ControlNetPipeline; "
        "FLUX: PipeFusionFluxControlNetPipeline, N double blocks): its compute on the embedding rank and the residuals "
        "it sends",
    )
    _auto_args(plan, plan=True)
    plan.set_defaults(func=cmd_plan)
    gen = sub.add_parser("generate", help="generate an image or a video clip with the configured model and plan")
    _add_config_args(gen)
    gen.add_argument("--prompt", help="overrides generation.prompt")
    gen.add_argument(
        "--output",
        "-o",
        help="PNG path (default outputs/xfuse_<model>_<seed>.png); a video model's MP4 (default "
        "outputs/xfuse_<model>_<seed>.mp4; .gif: an animated GIF; an MP4 needs pip install 'xfuse[video]', "
        "else a GIF is written beside it)",
    )
    gen.add_argument(
        "--image",
        help="overrides generation.image: image-to-video from this first frame (a Wan 2.2 TI2V model)",
    )
    gen.add_argument(
        "--lora",
        action="append",
        metavar="PATH[=WEIGHT]",
        help="add to generation.lora: a LoRA file or folder applied with WEIGHT (default 1; repeatable; a model whose "
        "diffusers pipeline has a LoRA loader)",
    )
    gen.add_argument("--trace", help="write a Chrome/Perfetto timeline of every rank to this JSON file")
    _auto_args(gen, plan=False)
    _launch_args(gen)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI Images API (rank 0) with the configured model and plan")
    _add_config_args(srv)
    srv.add_argument("--host", help="overrides serve.host (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="overrides serve.port (default 8000; 0: any free port)")
    srv.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' (default: $XFUSE_API_KEY; none: no key needed)"
    )
    _auto_args(srv, plan=False)
    _launch_args(srv)
    srv.set_defaults(func=cmd_serve)
    doctor = sub.add_parser("doctor", help="versions, devices, backends, interfaces, attention; 2-rank self-test")
    doctor.add_argument("--timeout", type=float, default=30.0, help="seconds for each self-test wait / connect")
    doctor.add_argument("--compile-cache", metavar="DIR", help="report what compile.cache_dir DIR holds, per key")
    where = doctor.add_mutually_exclusive_group()
    where.add_argument(
        "--listen", type=int, metavar="PORT", help="answer `xfuse doctor --peer` from other hosts on PORT until stopped"
    )
    where.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="which local interfaces reach HOST:PORT and, if it runs `xfuse doctor --listen`, which it reaches back",
    )
    doctor.set_defaults(func=cmd_doctor)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # xfuse loads local folders only
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rank = os.environ.get("RANK", "0")
    try:
        nproc = _ranks_to_start(args) if args.command in ("generate", "serve") else 0
        if nproc:  # this command starts the node's ranks and waits for them (xfuse.runtime.launcher)
            from xfuse.runtime.launcher import launch

            return launch(args.command, _without_nproc(argv), nproc)
        code = args.func(args)
    except ConfigError as err:  # a bad value: the same on every rank
        if not err.reported:
            write_stderr(f"xfuse {args.command}: rank {rank}: error: {err}")
        code = 2
    except Exception as err:  # noqa: BLE001 - report every failure in one line after its traceback
        traceback.print_exc()
        write_stderr(f"xfuse {args.command}: rank {rank}: error: {type(err).__name__}: {err}")
        code = 1
    return _shutdown_or_exit(code)  # success and error paths alike
