"""``xfuse generate`` with a ControlNet (``generation.controlnet``, ``generation.control_image``) on 2 ranks (the
module's world, as torchrun's ranks run the command: ``tests.support.cli_fns``): the PNG equals diffusers' own
``StableDiffusion3ControlNetPipeline`` with the same ControlNet, control image and call (exact mode: warm-up = all
steps), and what the command cannot run is refused naming its key."""

import numpy as np
import torch
from PIL import Image

from tests.support import REPO
from tests.support.cli_fns import CliRun, cli_here, on_ranks
from tests.support.controlnet_fns import control_image, save_controlnet
from tests.support.world import World
from xfuse.build import image_call_kwargs
from xfuse.families.registry import load_pipeline, model_spec

PRESET, WIDTH, HEIGHT, STEPS, GUIDANCE, SEED = "sd3-tiny", 96, 128, 4, 5.0, 7


def direct(controlnet_folder, image, scale):
    """diffusers' ControlNet pipeline on the preset's components, the call ``xfuse generate`` makes (``None``: the
    preset's own pipeline, no ControlNet)."""
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base = load_pipeline(PRESET)
    kwargs = image_call_kwargs(prompt="a cat", negative_prompt=None, width=WIDTH, height=HEIGHT,
                               num_inference_steps=STEPS, guidance_scale=GUIDANCE, seed=SEED,
                               spec=model_spec(PRESET))  # fmt: skip
    pipe = base
    if controlnet_folder is not None:
        controlnet = SD3ControlNetModel.from_pretrained(controlnet_folder)
        pipe = StableDiffusion3ControlNetPipeline(**base.components, controlnet=controlnet)
        kwargs |= dict(control_image=image, controlnet_conditioning_scale=scale)
        torch.manual_seed(SEED)  # the control image's VAE sample: xfuse generate seeds it with the run's seed
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return np.asarray(pipe(**kwargs).images[0]).astype(int)


def generate(ranks: World, *sets: str, output) -> CliRun:
    return on_ranks(ranks, ["generate", *[a for kv in sets for a in ("--set", kv)], "--output", str(output)])


def test_generate_with_a_controlnet_equals_diffusers(ranks, tmp_path):
    """pp2 in exact mode with a 2-block ControlNet at scale 0.7: one 8-bit level from diffusers' PNG, several from the
    image without the ControlNet; the summary names it."""
    folder = save_controlnet(load_pipeline(PRESET), tmp_path / "controlnet", seed=1, num_layers=2)
    image_path = tmp_path / "edges.png"
    control_image(HEIGHT, WIDTH).save(image_path)
    target = tmp_path / "out.png"
    out = generate(ranks, f"model={PRESET}", "parallel.pipefusion_degree=2", f"parallel.warmup_steps={STEPS}",
                   f"generation.width={WIDTH}", f"generation.height={HEIGHT}",
                   f"generation.num_inference_steps={STEPS}", f"generation.guidance_scale={GUIDANCE}",
                   "generation.prompt=a cat", f"generation.seed={SEED}", f"generation.controlnet={folder}",
                   f"generation.control_image={image_path}", "generation.controlnet_conditioning_scale=0.7",
                   output=target)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"ControlNet: {folder} on {image_path} (scale 0.7, steps 0-1 of the run)" in out.stdout
    got = np.asarray(Image.open(target)).astype(int)
    expected = direct(folder, Image.open(image_path).convert("RGB"), 0.7)
    assert np.abs(got - expected).max() <= 1
    assert np.abs(direct(None, None, 0.0) - got).max() > 2  # the ControlNet acted


def test_a_controlnet_the_model_cannot_run_is_refused_naming_the_key(tmp_path):
    """A HunyuanDiT model with a ControlNet (no ControlNet pipeline in xfuse), a FLUX ControlNet for SD3, and a folder
    that is no ControlNet: exit 2, ``generation.controlnet`` named, on every rank before any weights run."""
    flux = save_controlnet(load_pipeline("flux-tiny"), tmp_path / "flux", seed=1, num_layers=1, num_single_layers=1)
    image_path = tmp_path / "edges.png"
    control_image(HEIGHT, WIDTH).save(image_path)
    shared = (f"generation.control_image={image_path}", "parallel.pipefusion_degree=1")
    not_controlnet = REPO / "xfuse/assets/shapes/transformer"
    cases = [
        (("model=tiny", f"generation.controlnet={flux}"), "tiny is a hunyuandit model"),
        ((f"model={PRESET}", f"generation.controlnet={flux}"), "one SD3ControlNetModel (got FluxControlNetModel"),
        ((f"model={PRESET}", f"generation.controlnet={not_controlnet}"), "ControlNet (_class_name HunyuanDiT2D"),
    ]
    for sets, says in cases:
        out = cli_here(["generate", *[a for kv in (*sets, *shared) for a in ("--set", kv)]])
        assert out.returncode == 2, out.stderr[-2000:]
        assert "generation.controlnet:" in out.stderr and says in out.stderr, out.stderr[-2000:]
