"""FLUX.2 (diffusers `Flux2Transformer2DModel` / `Flux2Pipeline`): spec, adapter, pipeline, presets."""
