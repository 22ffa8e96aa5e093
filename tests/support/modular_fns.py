"""diffusers' modular pipelines ``xfuse.parallelize`` runs (FLUX.1's ``FluxAutoBlocks``, Wan 2.1's ``WanBlocks``, Wan
2.2's two experts' ``Wan22Blocks``, LTX-Video's ``LTXAutoBlocks``) on tiny presets, and a rank's run of one through
``xfuse.parallelize`` (``tests/multirank/test_modular.py``). Each is named by a key of ``CALLS``."""

import torch
from PIL import Image

# family -> its modular pipeline's call: FLUX.1 128 x 96 px; the videos 9 frames, CFG 5 and 3 (their guiders')
CALLS = {
    "flux": dict(prompt="a red house by a lake", height=128, width=96, num_inference_steps=3, guidance_scale=3.5,
                 max_sequence_length=16),
    "flux-img2img": dict(prompt="a red house by a lake", image=Image.new("RGB", (96, 128), "red"), strength=0.6,
                         height=128, width=96, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=16),
    "wan": dict(prompt="a red house by a lake", negative_prompt="blurry", height=64, width=96, num_frames=9,
                num_inference_steps=3, max_sequence_length=16),
    "wan2.2": dict(prompt="a red house by a lake", negative_prompt="blurry", height=64, width=96, num_frames=9,
                   num_inference_steps=4, max_sequence_length=16),  # steps on both sides of the experts' boundary
    "ltx": dict(prompt="a red house by a lake", negative_prompt="blurry", height=128, width=96, num_frames=9,
                num_inference_steps=3, max_sequence_length=16),  # 2 latent frames of 4 x 3: 8 token rows
}  # fmt: skip
# key -> (its preset, diffusers.modular_pipelines' blocks, the family)
MODULAR = {
    "flux": ("flux-tiny", "FluxAutoBlocks", "flux"),
    "flux-img2img": ("flux-tiny", "FluxAutoBlocks", "flux"),  # an image's latents noised to strength 0.6
    "wan": ("wan-tiny", "WanBlocks", "wan"),
    "wan2.2": ("wan2.2-tiny", "Wan22Blocks", "wan"),
    "ltx": ("ltx-tiny", "LTXAutoBlocks", "ltx"),
}
CALL = CALLS["flux"]


def modular_pipeline(key="flux"):
    """diffusers' blocks of ``MODULAR[key]`` as a pipeline, with its preset's components (seeded: the same weights
    on every rank)."""
    import diffusers.modular_pipelines

    from xfuse.families.registry import load_pipeline

    preset, blocks, _ = MODULAR[key]
    pipe = load_pipeline(preset)
    modular = getattr(diffusers.modular_pipelines, blocks)().init_pipeline()
    modular.update_components(**{name: value for name, value in pipe.components.items() if value is not None})
    return modular


def flux_modular():
    return modular_pipeline("flux")


def block_names(blocks) -> list[str]:
    """The class names of ``blocks`` and every block nested in it."""
    return [type(blocks).__name__] + [n for b in getattr(blocks, "sub_blocks", {}).values() for n in block_names(b)]


def modular_latents(modular, call=CALL, seed=0, output="latents"):
    """The pipeline's ``output`` for ``call``: its final latents (FLUX.1's unpacked, as its ``unpack_latents`` step
    leaves them), or ``"images"``: its decode's (``output_type`` np)."""
    extra = {"output_type": "np"} if output == "images" else {}
    return modular(**call, **extra, generator=torch.Generator().manual_seed(seed), output=output)


def parallel_modular_latents(parallel, family="flux", seed=0, output="latents"):
    """On a rank: the tiny modular pipeline ``MODULAR[family]`` through ``xfuse.parallelize(..., parallel=parallel)``,
    its ``output`` (every rank returns what it holds after the call) and the class names of the pipeline's blocks."""
    import xfuse

    modular = xfuse.parallelize(modular_pipeline(family), parallel=parallel)
    return modular_latents(modular, CALLS[family], seed, output), block_names(modular.blocks)
