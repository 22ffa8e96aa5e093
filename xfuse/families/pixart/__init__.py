"""PixArt-Σ (diffusers `PixArtTransformer2DModel` / `PixArtSigmaPipeline`): spec, adapter, pipeline, presets."""
