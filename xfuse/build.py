"""The configured pipeline on this rank, and the keyword arguments of one image (or video) request.

``xfuse generate`` and ``xfuse serve`` both build their pipeline and call it through here, so a served request and a
``generate`` run with the same prompt, size, steps, guidance and seed make the same call and the same image. A video
family's call (``ModelSpec.video``: Wan) is :func:`video_call_kwargs`, its default clip :func:`default_video_size`.

The functions that need the model read the run's :class:`~xfuse.families.registry.ResolvedModel` (the config's
``model`` resolved once, ``xfuse.families.registry.resolve``), passed beside the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from xfuse.config import XfuseConfig
from xfuse.errors import ConfigError
from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

if TYPE_CHECKING:
    from xfuse.families.registry import ResolvedModel
    from xfuse.families.spec import ModelSpec


def build_pipeline(config: XfuseConfig, model: ResolvedModel):
    """Load ``config.model`` (``model``, resolved) with its family's PipeFusion pipeline on this rank (joining the
    world).

    Every rank must hold the same ``config``: it is compared at start-up (``xfuse.runtime.handshake``).
    """
    from xfuse.families.folder import resolve_model
    from xfuse.families.registry import load_pipeline

    pipeline_class = _pipeline_class(config, model)
    dtype = config.runtime.torch_dtype()
    extra = {}
    if config.generation is not None and config.generation.controlnet is not None:
        # every rank reads it (the pipeline keeps it on each group's embedding rank only) and refuses it alike
        extra["controlnet"] = _load_controlnet(pipeline_class, config.generation.controlnet, dtype)
    if model.preset:  # built-in random-weight model: every rank builds the same one from its seed
        diffusers_pipe = load_pipeline(model.name, dtype, pipeline_class.diffusers_name(), extra)
        pipe = pipeline_class.from_pipe(diffusers_pipe, config=config)
    else:
        pipe = pipeline_class.from_pretrained(resolve_model(model.name), config=config, **extra)
    freeze_startup_heap()
    keep_freed_heap()
    return pipe


def check_files(config: XfuseConfig) -> None:
    """The files ``config`` names exist: ``generation``'s LoRA files, first frame, ControlNet folder and control image,
    and ``serve.lora_adapters``' files. ``xfuse generate`` and ``xfuse serve`` call it on every rank (and the launcher
    before it starts them) before any communication, so a missing file is the same ``ConfigError`` everywhere."""
    import os

    gen = config.generation
    if gen is not None:
        for path in gen.lora:
            if not os.path.exists(path):
                raise ConfigError("generation.lora", f"no LoRA file or folder at {path!r}")
        if gen.image is not None and not os.path.isfile(gen.image):
            raise ConfigError(
                "generation.image",
                f"must be an image file, the first frame of an image-to-video clip (not found: {gen.image!r})",
            )
        if gen.controlnet is not None and not os.path.isfile(os.path.join(gen.controlnet, "config.json")):
            raise ConfigError(
                "generation.controlnet",
                f"must be a local diffusers ControlNet folder, with config.json (not found in {gen.controlnet!r})",
            )
        if gen.control_image is not None and not os.path.isfile(gen.control_image):
            raise ConfigError("generation.control_image", f"must be an image file (not found: {gen.control_image!r})")
    for name, path in (config.serve.lora_adapters if config.serve is not None else {}).items():
        if not os.path.exists(path):
            raise ConfigError(f"serve.lora_adapters.{name}", f"no LoRA file or folder at {path!r}")


def _load_controlnet(pipeline_class: type, folder: str, dtype):
    """The diffusers ControlNet model of ``folder`` (its ``config.json`` names the class), in ``dtype``, checked by
    ``pipeline_class`` (one its family runs): a ``ConfigError`` naming ``generation.controlnet`` otherwise."""
    import json
    import os

    import diffusers

    with open(os.path.join(folder, "config.json")) as f:
        class_name = str(json.load(f).get("_class_name"))
    model_class = getattr(diffusers, class_name, None)
    if model_class is None or "ControlNet" not in class_name:
        raise ConfigError(
            "generation.controlnet", f"{folder!r} is not a diffusers ControlNet (_class_name {class_name})"
        )
    controlnet = model_class.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
    try:
        pipeline_class.check_controlnet(controlnet)
    except ValueError as err:
        raise ConfigError("generation.controlnet", f"{folder!r}: {err}") from None
    return controlnet


def check_lora_family(model: ResolvedModel, key: str) -> None:
    """``key`` (``generation.lora``, ``serve.lora_adapters``) names LoRA files: refused by name, on every rank before
    any weights load, for a model whose diffusers pipeline has no LoRA loader."""
    from xfuse.errors import ConfigError
    from xfuse.families.registry import FAMILIES

    spec = model.spec
    if not hasattr(spec.pipeline_class(), "load_lora_weights"):
        loaders = [f.diffusers_pipeline for f in FAMILIES if hasattr(f.pipeline_class(), "load_lora_weights")]
        raise ConfigError(
            key,
            f"{model.name} is a {spec.name} model, whose diffusers pipeline ({spec.diffusers_pipeline}) has no LoRA "
            f"loader; LoRA adapters are loaded for models of {', '.join(loaders)}",
        )


def load_lora_adapters(pipe, adapters: dict[str, str], key: str) -> None:
    """Every rank loads each adapter (name -> file or folder; its share of it); a file that is not a LoRA of the model
    is a ``ConfigError`` naming ``key`` and the adapter, the same on every rank (``xfuse.pipelines.lora_share``)."""
    from xfuse.errors import ConfigError

    for name, path in adapters.items():
        try:
            pipe.load_lora_weights(path, adapter_name=name)
        except ValueError as err:
            raise ConfigError(key, f"{path!r}: {err}") from None


def _pipeline_class(config: XfuseConfig, model: ResolvedModel) -> type:
    """The xfuse class ``config`` runs: its model's family's (from the preset or ``model_index.json``), or the
    family's image-to-video pipeline when ``generation.image`` names a first frame."""
    from xfuse.errors import ConfigError
    from xfuse.families.registry import FAMILIES

    spec = model.spec
    image = config.generation.image if config.generation is not None else None
    if config.generation is not None and config.generation.controlnet is not None:
        if spec.controlnet is None:
            with_controlnet = [f.diffusers_pipeline for f in FAMILIES if f.controlnet is not None]
            raise ConfigError(
                "generation.controlnet",
                f"{model.name} is a {spec.name} model; xfuse runs ControlNets for models of "
                f"{', '.join(with_controlnet)}",
            )
        return spec.pipeline_class_named(f"PipeFusion{spec.controlnet}")
    if image is None:
        return spec.pipeline_class()
    if spec.image_to_video is None:
        raise ConfigError(
            "generation.image",
            f"image-to-video needs a model whose family has an image-to-video pipeline on the same transformer (Wan "
            f"2.2 TI2V: WanImageToVideoPipeline); {model.name} is a {spec.diffusers_pipeline} model (got {image!r})",
        )
    return spec.pipeline_class_named(f"PipeFusion{spec.image_to_video}")


def default_size(config: XfuseConfig, model: ResolvedModel) -> tuple[int, int]:
    """(width, height) in pixels when a request names none: ``generation.width/height``, else the model's own."""
    from xfuse.config import GenerationConfig

    gen = config.generation or GenerationConfig()  # a config without the section plans the default request
    return gen.width or model.native_side, gen.height or model.native_side


def default_video_size(config: XfuseConfig, model: ResolvedModel) -> tuple[int, int, int]:
    """(width, height, num_frames) of a video model's clip when a request names none: ``generation.width/height/
    num_frames``, else a preset's own size (its presets module's ``DEFAULT_SIZE``, (height, width, frames)), else the
    diffusers pipeline's defaults (a folder; Wan: 832 x 480 px, 81 frames). A ``num_frames`` the video VAE cannot
    take (Wan: 4k + 1) is refused here, naming ``generation.num_frames``, before any weights load."""
    spec, gen = model.spec, config.generation
    if not model.video:
        raise ValueError(f"{model.name} is an image model ({spec.diffusers_pipeline}): use default_size")
    if model.preset:
        height, width, frames = spec.preset_builders().DEFAULT_SIZE[model.name]
    else:
        height, width, frames = model.native_side, spec.default_width(model.transformer), spec.native_frames
    if gen is not None:
        height, width, frames = gen.height or height, gen.width or width, gen.num_frames or frames
    spec.check_num_frames(frames, "generation.num_frames")
    return width, height, frames


def request_size(config: XfuseConfig, model: ResolvedModel) -> tuple[int, int, int]:
    """(width, height, num_frames) of the request ``config`` describes, as ``xfuse generate`` makes it: an image's
    size (``default_size``; 1 frame) or a clip's (``default_video_size``); a config without a ``generation`` section
    plans the defaults."""
    if model.video:
        return default_video_size(config, model)
    return (*default_size(config, model), 1)


def takes_negative_prompt(spec: ModelSpec) -> bool:
    """Whether the family's pipeline takes a ``negative_prompt`` (FLUX.2's do not: [dev] has no CFG, [klein] guides
    with the empty prompt)."""
    import inspect

    return "negative_prompt" in inspect.signature(spec.pipeline_class().__call__).parameters


def check_negative_prompt(spec: ModelSpec, negative_prompt: str | None) -> None:
    """``generation.negative_prompt`` refused by name for a pipeline that takes none."""
    if negative_prompt is not None and not takes_negative_prompt(spec):
        raise ConfigError(
            "generation.negative_prompt",
            f"{spec.diffusers_pipeline} takes no negative_prompt argument: leave it null (got {negative_prompt!r})",
        )


def _common_call_kwargs(
    *, prompt: str, negative_prompt: str | None, width: int, height: int, num_inference_steps: int,
    guidance_scale: float, seed: int, spec: ModelSpec,
) -> dict[str, Any]:  # fmt: skip
    import torch

    check_negative_prompt(spec, negative_prompt)
    return dict(
        prompt=prompt,
        # None: the family's own default (HunyuanDiT's None, PixArt's "": PixArt cannot take None)
        **({} if negative_prompt is None else {"negative_prompt": negative_prompt}),
        height=height,
        width=width,
        num_inference_steps=num_inference_steps,
        # a true-CFG family's guidance_scale is a guidance embedding its releases do not have (Qwen-Image: diffusers
        # warns and ignores it); its CFG is the negative prompt's (ModelSpec.negative_prompt_guides)
        **({} if spec.negative_prompt_guides else {"guidance_scale": guidance_scale}),
        generator=torch.Generator().manual_seed(seed),
        # the size asked for, not the nearest of the model's trained sizes
        **({"use_resolution_binning": False} if spec.resolution_binning else {}),
    )


def image_call_kwargs(
    *,
    prompt: str,
    negative_prompt: str | None,
    width: int,
    height: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
    num_images: int = 1,
    spec: ModelSpec,
) -> dict[str, Any]:
    """The pipeline call for one image request: the diffusers arguments every family takes (and, for a ``spec`` whose
    pipeline bins sizes, binning off)."""
    common = _common_call_kwargs(
        prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
        num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed, spec=spec,
    )  # fmt: skip
    return dict(common, num_images_per_prompt=num_images)


def video_call_kwargs(
    *,
    prompt: str,
    negative_prompt: str | None,
    width: int,
    height: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
    num_videos: int = 1,
    output_type: Literal["np", "pil"] = "pil",
    image=None,
    spec: ModelSpec,
) -> dict[str, Any]:
    """The pipeline call for one video request (a ``spec`` with ``video``: ``WanPipeline.__call__``'s arguments): the
    image call's, with ``num_frames`` and ``num_videos_per_prompt`` for ``num_images_per_prompt``. ``output_type``
    ``pil``: one list of PIL frames per video (diffusers rounds to 8 bits); ``np``: (videos, frames, H, W, 3) floats
    in [0, 1], WanPipeline's default. ``image``: the first frame of an image-to-video clip (a PIL image; the pipeline
    is then the family's image-to-video one, ``WanImageToVideoPipeline.__call__``)."""
    if not spec.video:
        raise ValueError(f"{spec.diffusers_pipeline} makes images: use image_call_kwargs")
    common = _common_call_kwargs(
        prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
        num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed, spec=spec,
    )  # fmt: skip
    first = {} if image is None else {"image": image}
    return dict(first, **common, num_frames=num_frames, num_videos_per_prompt=num_videos, output_type=output_type)


def control_call_kwargs(generation, control_image) -> dict[str, Any]:
    """A ControlNet pipeline call's own arguments for ``generation`` (``xfuse generate``'s ControlNet keys) and the
    control image (a PIL image)."""
    return dict(
        control_image=control_image,
        controlnet_conditioning_scale=generation.controlnet_conditioning_scale,
        control_guidance_start=generation.control_guidance_start,
        control_guidance_end=generation.control_guidance_end,
    )


def warm_up_compile(pipe, call: dict[str, Any], sizes: list[tuple[int, int]]) -> None:
    """Any ``compile.mode`` but ``off``, before the first request: ``call`` (a request's arguments) once at each of
    ``sizes`` ((width, height) pairs), with steps enough to meet every shape a request of that size meets (the
    warm-up steps' whole image, then the patches), to latents only and with a generator of its own (``call``'s is
    left as it was). Each rank prints one line per size (``StageCompiler``). Collective: every rank calls it alike."""
    import torch

    compiler = pipe.compiler
    if compiler is None:
        return
    steps = pipe.parallel.warmup_steps + 2
    for index, (width, height) in enumerate(sizes, 1):
        compiler.label = f"shape {index} of {len(sizes)} ({width}x{height})"
        warm = dict(call, width=width, height=height, num_inference_steps=steps, output_type="latent",
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
        try:
            pipe(**warm)
        finally:
            compiler.label = None
