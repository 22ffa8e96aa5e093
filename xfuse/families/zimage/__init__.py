"""Z-Image (diffusers `ZImageTransformer2DModel` / `ZImagePipeline`): spec, adapter, pipeline, presets."""
