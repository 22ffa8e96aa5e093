"""diffusers' modular pipelines of the families ``xfuse.parallelize`` runs (FLUX.1's ``FluxAutoBlocks``, Wan 2.1's
``WanBlocks``) on their tiny presets, and a rank's run of one through ``xfuse.parallelize``
(``tests/multirank/test_modular.py``)."""

import torch

CALLS = {  # family -> its modular pipeline's call: FLUX.1 128 x 96 px; Wan 9 frames of 64 x 96 px, CFG 5 (its guider's)
    "flux": dict(prompt="a red house by a lake", height=128, width=96, num_inference_steps=3, guidance_scale=3.5,
                 max_sequence_length=16),
    "wan": dict(prompt="a red house by a lake", negative_prompt="blurry", height=64, width=96, num_frames=9,
                num_inference_steps=3, max_sequence_length=16),
}  # fmt: skip
BLOCKS = {"flux": "FluxAutoBlocks", "wan": "WanBlocks"}  # diffusers.modular_pipelines' blocks of each
CALL = CALLS["flux"]


def modular_pipeline(family="flux"):
    """diffusers' blocks of ``family`` as a pipeline, with the family's smallest preset's components (seeded: the
    same weights on every rank)."""
    import diffusers.modular_pipelines

    from xfuse.families.registry import MODEL_SPECS

    spec = MODEL_SPECS[family]
    pipe = spec.build_preset_pipeline(spec.presets[0])
    modular = getattr(diffusers.modular_pipelines, BLOCKS[family])().init_pipeline()
    modular.update_components(**{name: value for name, value in pipe.components.items() if value is not None})
    return modular


def flux_modular():
    return modular_pipeline("flux")


def modular_latents(modular, call=CALL, seed=0, output="latents"):
    """The pipeline's ``output`` for ``call``: its final latents (FLUX.1's unpacked, as its ``unpack_latents`` step
    leaves them), or ``"images"``: its decode's (``output_type`` np)."""
    extra = {"output_type": "np"} if output == "images" else {}
    return modular(**call, **extra, generator=torch.Generator().manual_seed(seed), output=output)


def parallel_modular_latents(parallel, family="flux", seed=0, output="latents"):
    """On a rank: ``family``'s tiny modular pipeline through ``xfuse.parallelize(..., parallel=parallel)``, its
    ``output`` (every rank returns what it holds after the call) and the name of the step that ran the loop."""
    import xfuse

    modular = xfuse.parallelize(modular_pipeline(family), parallel=parallel)
    result = modular_latents(modular, CALLS[family], seed, output)
    step = modular.blocks.sub_blocks["denoise"].sub_blocks["denoise"]
    return result, type(step).__name__
