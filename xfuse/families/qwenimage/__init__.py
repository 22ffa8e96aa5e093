"""Qwen-Image (diffusers `QwenImageTransformer2DModel` / `QwenImagePipeline`): spec, adapter, pipeline, presets."""
