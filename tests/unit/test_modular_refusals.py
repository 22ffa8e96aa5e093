"""``xfuse.parallelize``'s refusals, each naming what is wrong, before any rank communicates: a modular pipeline with
no transformer loaded, a transformer no family runs a modular denoise step of, and a call argument xfuse's denoise step
does not run (refused on every rank from its own block state)."""

import re
import types

import pytest
import torch

import xfuse
from tests.support.modular_fns import CALL, CALLS, flux_modular, modular_pipeline
from xfuse.families.registry import load_pipeline


def test_a_modular_pipeline_without_its_transformer_is_refused():
    from diffusers.modular_pipelines import FluxAutoBlocks

    with pytest.raises(ValueError, match=r"the modular pipeline has no transformer loaded \(load_components first\)"):
        xfuse.parallelize(FluxAutoBlocks().init_pipeline(), parallel={"pipefusion_degree": 1})


def test_a_transformer_no_family_runs_modularly_is_refused_naming_those_that_do():
    pipeline = types.SimpleNamespace(transformer=load_pipeline("pixart-tiny").transformer)
    message = r"no xfuse family runs a modular pipeline of PixArtTransformer2DModel \(families with a modular " \
              r"denoise step: flux, wan, ltx\)"  # fmt: skip
    with pytest.raises(ValueError, match=message):
        xfuse.parallelize(pipeline, parallel={"pipefusion_degree": 1})


def test_joint_attention_kwargs_are_refused_by_name():
    modular = xfuse.parallelize(flux_modular(), parallel={"pipefusion_degree": 1})
    with pytest.raises(ValueError, match="joint_attention_kwargs: not run by xfuse's modular FLUX.1 denoise step"):
        modular(**CALL, joint_attention_kwargs={"scale": 0.5}, generator=torch.Generator().manual_seed(0),
                output="latents")  # fmt: skip


@pytest.mark.parametrize(
    "parallel,message",
    [
        ({"cfg_degree": 2}, r"parallel.cfg_degree: must be 1: this modular pipeline's denoise step has no CFG batch "
                            r"\(got 2\)"),
        ({"text_encoder": "split"}, r"parallel.text_encoder: must be auto or rank0 for a modular pipeline, which runs "
                                    r"its text encoder step on every rank \(got 'split'\)"),
        ({"vae_parallel": "on"}, r"parallel.vae_parallel: must be auto or off for a modular pipeline, which runs its "
                                 r"decode step on every rank \(got 'on'\)"),
    ],
)  # fmt: skip
def test_a_layout_the_modular_pipeline_cannot_run_is_refused_by_its_key(parallel, message):
    from xfuse.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        xfuse.parallelize(flux_modular(), parallel={"pipefusion_degree": 1, **parallel})


@pytest.mark.parametrize(
    "guider,message",
    [
        ({"guidance_rescale": 0.7}, r"guider.guidance_rescale: .* runs 0.0 only \(got 0.7\)"),
        ({"use_original_formulation": True}, r"guider.use_original_formulation: .* runs False only \(got True\)"),
        ({"stop": 0.5}, r"guider.stop: xfuse's modular Wan denoise step runs 1.0 only \(got 0.5\)"),
        ({"guidance_scale": 0.5}, r"guider.guidance_scale: must be at least 1 \(got 0.5\)"),
    ],
)  # fmt: skip
def test_a_guider_xfuse_does_not_combine_as_diffusers_does_is_refused_by_name(guider, message):
    """Wan's modular step batches its guider's two calls: a guider whose combination xfuse's loop does not make
    (rescaled, the original formulation, a step range, a scale below 1) is refused, naming the setting."""
    from diffusers.guiders import ClassifierFreeGuidance

    modular = xfuse.parallelize(modular_pipeline("wan"), parallel={"pipefusion_degree": 1})
    modular.update_components(guider=ClassifierFreeGuidance(**{"guidance_scale": 5.0, **guider}))
    with pytest.raises(ValueError, match=message):
        modular(**CALLS["wan"], generator=torch.Generator().manual_seed(0), output="latents")


def test_another_tasks_denoising_loop_is_refused_by_name():
    """``LTXAutoBlocks`` routes a call with an ``image`` to its image-to-video loop, which xfuse does not run: the call
    is refused naming it (its transformer is sharded), where the text-to-video call runs."""
    from PIL import Image

    modular = xfuse.parallelize(modular_pipeline("ltx"), parallel={"pipefusion_degree": 1})
    image = Image.new("RGB", (CALLS["ltx"]["width"], CALLS["ltx"]["height"]), "red")
    message = "this call runs LTXImage2VideoDenoiseStep, which xfuse does not run (its loop runs LTXDenoiseStep"
    with pytest.raises(ValueError, match=re.escape(message)):
        modular(**CALLS["ltx"], image=image, generator=torch.Generator().manual_seed(0), output="latents")
    assert modular(**CALLS["ltx"], generator=torch.Generator().manual_seed(0), output="latents").shape == (
        1,
        8,
        2,
        4,
        3,
    )


def test_wan_2_2s_experts_guided_on_different_batches_are_refused():
    """Wan 2.2's two guiders: xfuse runs both experts on one CFG batch, so one guiding (scale > 1) where the other does
    not (scale 1: no unconditional call) is refused, naming guider_2."""
    from diffusers.guiders import ClassifierFreeGuidance

    modular = xfuse.parallelize(modular_pipeline("wan2.2"), parallel={"pipefusion_degree": 1})
    modular.update_components(guider_2=ClassifierFreeGuidance(guidance_scale=1.0))
    with pytest.raises(ValueError, match=r"guider_2.guidance_scale: must be 1 exactly where guider.guidance_scale is"):
        modular(**CALLS["wan2.2"], generator=torch.Generator().manual_seed(0), output="latents")
