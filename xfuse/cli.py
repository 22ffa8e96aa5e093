"""The ``xfuse`` command line: ``plan`` (no processes) and ``generate``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from xfuse.config import ConfigError, load_config


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML file (keys: model, parallel, comm, runtime, generation)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set parallel.num_patches=4 (repeatable)")


def cmd_plan(args) -> int:
    from xfuse.plan_report import format_plan_report, plan_report

    print(format_plan_report(plan_report(load_config(args.config, args.overrides))))
    return 0


def _device(runtime) -> str:
    import torch

    if runtime.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return runtime.device


def cmd_generate(args) -> int:
    import torch

    from xfuse.models import load_pipeline
    from xfuse.models.local import LocalStagedTransformer
    from xfuse.plan_report import plan_report

    overrides = list(args.overrides) + ([f"generation.prompt={args.prompt!r}"] if args.prompt else [])
    config = load_config(args.config, overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ConfigError("WORLD_SIZE", f"multi-rank generation is not available yet; run with plain python, which "
                                        f"executes every stage of the plan in one process (got {world})")
    report = plan_report(config)  # validates the whole config against the model before loading anything
    gen = config.generation
    dtype = getattr(torch, config.runtime.dtype)
    pipe = load_pipeline(config.model, torch_dtype=dtype).to(_device(config.runtime))
    pipe.transformer = LocalStagedTransformer(pipe.transformer, report["plan"])
    start = time.perf_counter()
    image = pipe(
        prompt=gen.prompt, negative_prompt=gen.negative_prompt, height=report["height"], width=report["width"],
        num_inference_steps=gen.num_inference_steps, guidance_scale=gen.guidance_scale,
        generator=torch.Generator().manual_seed(gen.seed), use_resolution_binning=False,
    ).images[0]
    wall = time.perf_counter() - start
    output = args.output or os.path.join("outputs", f"xfuse_{config.model}_{gen.seed}.png")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    image.save(output)
    plan = report["plan"]
    print(f"wrote {output} ({report['width']}x{report['height']}, {gen.num_inference_steps} steps, "
          f"{wall:.2f} s): the {plan.degree} stages of the {plan.placement} plan run serially in one process")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="xfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print ranks -> blocks, patches, skips, bytes and memory per rank")
    _add_config_args(plan)
    plan.set_defaults(func=cmd_plan)
    gen = sub.add_parser("generate", help="generate an image with the configured model and plan")
    _add_config_args(gen)
    gen.add_argument("--prompt", help="overrides generation.prompt")
    gen.add_argument("--output", "-o", help="PNG path (default outputs/xfuse_<model>_<seed>.png)")
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # xfuse loads local folders only
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"xfuse {args.command}: error: {err}", file=sys.stderr)
        return 2
