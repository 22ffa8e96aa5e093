"""Modular Diffusers as a second face: ``xfuse.parallelize(modular_pipeline, parallel=...)`` puts xfuse's denoising
loop in place of a modular pipeline's denoise step, so the pipeline runs its own blocks (inputs, text encoders,
timesteps, latents, decode) and PipeFusion runs the loop.

What a family knows of its modular pipeline lives in its folder (``modular.py``: the name of diffusers' denoise step
it replaces, and how that step's block state becomes the engine's request and back); this module finds the step in the
pipeline's blocks, builds the family's xfuse pipeline around the same components (``from_pipe``: each rank keeps only
its blocks of the transformer), and runs it. As with diffusers' own ``enable_parallelism``, every rank runs the whole
modular pipeline with the same arguments (under ``torchrun``) and every rank returns the same output: the denoised
latents are broadcast from the rank that stepped them before the pipeline's next block reads them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from xfuse.errors import ConfigError

# What the modular pipeline does itself on every rank, so xfuse must leave it whole: the text encoders (its encode
# step runs on every rank) and the VAE (its decode step too). ``auto`` is resolved so; the other values are refused.
_MODULAR_PLACEMENTS = {"text_encoder": ("rank0", "its text encoder step"), "vae_parallel": ("off", "its decode step")}


def _family_of(modular_pipeline):
    """The registered family whose transformer the modular pipeline holds (and that has a modular denoise step)."""
    from xfuse.families.registry import FAMILIES

    transformer = getattr(modular_pipeline, "transformer", None)
    if transformer is None:
        raise ValueError("parallelize: the modular pipeline has no transformer loaded (load_components first)")
    name = type(transformer).__name__
    for spec in FAMILIES:
        if spec.diffusers_transformer == name and spec.modular_denoise:
            return spec
    held = [spec.name for spec in FAMILIES if spec.modular_denoise]
    raise ValueError(f"parallelize: no xfuse family runs a modular pipeline of {name} (families with a modular "
                     f"denoise step: {', '.join(held)})")  # fmt: skip


def classifier_free_guidance(guider, step: str) -> tuple[float, float]:
    """(scale, rescale) of a modular pipeline's guider as xfuse's loop combines a CFG batch, refused by name where it
    combines otherwise: diffusers' ``ClassifierFreeGuidance`` on every step, the usual formulation, a scale of at
    least 1 (a scale of 1: no unconditional call, as the guider skips it). ``step``: the modular step, for messages."""
    name = type(guider).__name__
    if name != "ClassifierFreeGuidance":
        raise ValueError(f"guider: xfuse's {step} runs ClassifierFreeGuidance only (got {name})")
    runs = {  # the settings xfuse's loop combines as the guider does (its step range: the guider's private state)
        "use_original_formulation": (guider.use_original_formulation, False),
        "start": (getattr(guider, "_start", 0.0), 0.0),
        "stop": (getattr(guider, "_stop", 1.0), 1.0),
        "enabled": (getattr(guider, "_enabled", True), True),
    }
    for key, (value, runs_only) in runs.items():
        if value != runs_only:
            raise ValueError(f"guider.{key}: xfuse's {step} runs {runs_only} only (got {value})")
    scale = float(guider.guidance_scale)
    if math.isclose(scale, 1.0):
        return 1.0, float(guider.guidance_rescale)
    if scale < 1:
        raise ValueError(f"guider.guidance_scale: must be at least 1 (got {scale})")
    return scale, float(guider.guidance_rescale)


def _modular_parallel(parallel: dict | None, family) -> dict:
    """``parallel`` for the xfuse pipeline a modular pipeline's loop runs on: the placements the modular pipeline
    needs (``_MODULAR_PLACEMENTS``), and no CFG parallelism where the family's modular step has no CFG batch."""
    parallel = dict(parallel or {})
    for key, (value, step) in _MODULAR_PLACEMENTS.items():
        given = parallel.get(key, "auto")
        if given not in ("auto", value):
            raise ConfigError(f"parallel.{key}", f"must be auto or {value} for a modular pipeline, which runs {step} "
                              f"on every rank (got {given!r})")  # fmt: skip
        parallel[key] = value
    if not family.CFG_BATCH and parallel.get("cfg_degree", 1) != 1:
        raise ConfigError("parallel.cfg_degree", f"must be 1: this modular pipeline's denoise step has no CFG batch "
                          f"(got {parallel['cfg_degree']})")  # fmt: skip
    return parallel


def _replace_denoise_steps(blocks, step_classes: tuple[str, ...], make) -> int:
    """Replace every sub-block of ``blocks`` (recursively) that is one of diffusers' ``step_classes`` with
    ``make(old)``, and
    every other denoising loop (a ``LoopSequentialPipelineBlocks``: another task's, e.g. LTX-Video's image-to-video)
    with a step that refuses to run, naming it (the transformer it would call is sharded); the count replaced."""
    from diffusers.modular_pipelines import LoopSequentialPipelineBlocks

    replaced = 0
    for name, block in list(getattr(blocks, "sub_blocks", {}).items()):
        if type(block).__name__ in step_classes:
            blocks.sub_blocks[name] = make(block)
            replaced += 1
        elif isinstance(block, LoopSequentialPipelineBlocks):
            blocks.sub_blocks[name] = RefusedDenoiseStep(block, " or ".join(step_classes))
        else:
            replaced += _replace_denoise_steps(block, step_classes, make)
    return replaced


def parallelize(modular_pipeline, parallel: dict | None = None, comm: dict | None = None, cache: dict | None = None):
    """The modular pipeline with its denoise step on xfuse's engine over the world's ranks: a new pipeline of the
    same blocks (but that step) and the same components.

    ``parallel``, ``comm``, ``cache``: the sections ``from_pretrained`` takes (``parallel.adapter: generic`` runs the
    transformer's own forward); the text encoders and the VAE stay whole on every rank (``parallel.text_encoder``
    rank0, ``parallel.vae_parallel`` off: the modular pipeline's own steps run them on every rank). Call it on every
    rank after ``load_components``, then call the returned pipeline with the same arguments on every rank. The
    transformer is sharded in place (each rank keeps its blocks), so the pipeline it was given no longer runs its own
    denoise step.
    """
    import diffusers

    spec = _family_of(modular_pipeline)
    family = spec.modular()
    parallel = _modular_parallel(parallel, family)  # (before any communication)
    diffusers_class = getattr(diffusers, spec.diffusers_pipeline)
    components = {name: value for name, value in modular_pipeline.components.items() if value is not None}
    # the diffusers pipeline's arguments: its components, and its configs from the modular pipeline's (Wan 2.2's
    # boundary_ratio)
    names = set(inspect.signature(diffusers_class.__init__).parameters) - {"self"}
    configs = dict(getattr(modular_pipeline, "config", None) or {})
    arguments = {name: components[name] if name in components else configs.get(name) for name in names}
    xfuse_pipe = spec.pipeline_class().from_pipe(diffusers_class(**arguments), parallel=parallel, comm=comm,
                                                 cache=cache)  # fmt: skip
    blocks = modular_pipeline.blocks  # (diffusers' property: a copy of the pipeline's blocks)
    replaced = _replace_denoise_steps(blocks, spec.modular_denoise,
                                     lambda old: ParallelDenoiseStep(old, xfuse_pipe, family))  # fmt: skip
    if replaced == 0:
        steps = " or ".join(spec.modular_denoise)
        raise ValueError(f"parallelize: the pipeline's blocks have no {steps} (the denoise step xfuse replaces for the "
                         f"{spec.name} family)")  # fmt: skip
    parallel_pipeline = blocks.init_pipeline()
    kept = {name: configs[name] for name in parallel_pipeline._config_specs if name in configs}  # (Wan 2.2's boundary)
    parallel_pipeline.update_components(**components, **kept)
    parallel_pipeline.xfuse_pipeline = xfuse_pipe  # what runs the loop (its plan, its context), for the caller to see
    return parallel_pipeline


def _modular_blocks_base():
    from diffusers.modular_pipelines import ModularPipelineBlocks

    return ModularPipelineBlocks


class _StandIn(_modular_blocks_base()):  # type: ignore[misc]
    """A block standing in for one of diffusers' denoising loops in a parallelised pipeline's blocks: the replaced
    loop's model name, components, configs, inputs and outputs, so the pipeline's state flows through it unchanged."""

    def __init__(self, replaced):
        self._replaced = replaced
        super().__init__()

    def __deepcopy__(self, memo) -> _StandIn:
        return self  # it holds the rank's engine and process groups: a copy of the blocks shares them

    @property
    def model_name(self) -> str | None:  # type: ignore[override]
        return self._replaced.model_name

    @property
    def expected_components(self) -> list:
        return self._replaced.expected_components

    @property
    def expected_configs(self) -> list:
        return self._replaced.expected_configs

    @property
    def inputs(self) -> list:
        return self._replaced.inputs

    @property
    def intermediate_outputs(self) -> list:
        return self._replaced.intermediate_outputs


class ParallelDenoiseStep(_StandIn):
    """The denoise step xfuse runs: the replaced step's inputs and outputs, the loop on the engine."""

    def __init__(self, replaced, xfuse_pipe, family):
        self._xfuse, self._family = xfuse_pipe, family
        super().__init__(replaced)

    @property
    def description(self) -> str:
        return f"xfuse's PipeFusion loop in place of {type(self._replaced).__name__} ({self._xfuse.parallel})"

    @torch.no_grad()
    def __call__(self, components, state) -> tuple[Any, Any]:
        block_state, pipe = self.get_block_state(state), self._xfuse
        tensors = self._family.loop_inputs(block_state, components)  # (its refusals: on every rank, before a message)
        block_state.latents = pipe.denoise_everywhere(
            tensors, lambda tensors: self._family.denoise_request(pipe, tensors, block_state, components)
        )
        self.set_block_state(state, block_state)
        return components, state


class RefusedDenoiseStep(_StandIn):
    """Another denoising loop of the pipeline's blocks than the one xfuse runs: refused by name when the pipeline
    routes a call to it (its transformer is sharded over the ranks)."""

    def __init__(self, replaced, runs: str):
        self._runs = runs
        super().__init__(replaced)

    @property
    def description(self) -> str:
        return f"{type(self._replaced).__name__}, refused: xfuse.parallelize runs {self._runs} only"

    def __call__(self, components, state):
        raise ValueError(
            f"parallelize: this call runs {type(self._replaced).__name__}, which xfuse does not run (its "
            f"loop runs {self._runs}, e.g. text-to-image or text-to-video, not another task's inputs)"
        )
