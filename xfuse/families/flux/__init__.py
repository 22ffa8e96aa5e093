"""FLUX.1 (diffusers `FluxTransformer2DModel` / `FluxPipeline`): spec, adapter, pipeline, presets."""
