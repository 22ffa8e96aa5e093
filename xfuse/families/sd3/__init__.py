"""SD3 / SD3.5 (diffusers `SD3Transformer2DModel` / `StableDiffusion3Pipeline`): spec, adapter, pipeline, presets."""
