"""FLUX.1's modular pipeline (``diffusers.FluxModularPipeline``) on its tiny preset, and a rank's run of it through
``xfuse.parallelize`` (``tests/multirank/test_modular.py``)."""

import torch

CALL = dict(prompt="a red house by a lake", height=128, width=96, num_inference_steps=3, guidance_scale=3.5,
            max_sequence_length=16)  # fmt: skip


def flux_modular():
    """diffusers' FLUX.1 auto blocks as a pipeline, with the ``flux-tiny`` preset's components (seeded: the same
    weights on every rank)."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    from xfuse.families.registry import MODEL_SPECS

    spec = MODEL_SPECS["flux"]
    pipe = spec.build_preset_pipeline(spec.presets[0])
    modular = FluxAutoBlocks().init_pipeline()
    modular.update_components(**{name: value for name, value in pipe.components.items() if value is not None})
    return modular


def modular_latents(modular, call=CALL, seed=0, output="latents"):
    """The pipeline's ``output`` for ``call``: its final latents (unpacked, as its ``unpack_latents`` step leaves
    them), or ``"images"``: its decode's (``output_type`` np)."""
    extra = {"output_type": "np"} if output == "images" else {}
    return modular(**call, **extra, generator=torch.Generator().manual_seed(seed), output=output)


def parallel_modular_latents(parallel, call=CALL, seed=0, output="latents"):
    """On a rank: the tiny FLUX.1 modular pipeline through ``xfuse.parallelize(..., parallel=parallel)``, its
    ``output`` (every rank returns what it holds after the call) and the name of the step that ran the loop."""
    import xfuse

    modular = xfuse.parallelize(flux_modular(), parallel=parallel)
    result = modular_latents(modular, call, seed, output)
    step = modular.blocks.sub_blocks["denoise"].sub_blocks["denoise"]
    return result, type(step).__name__
