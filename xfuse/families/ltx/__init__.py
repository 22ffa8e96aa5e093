"""LTX-Video text-to-video (diffusers `LTXVideoTransformer3DModel` / `LTXPipeline`) through the generic family: spec,
pipeline, presets; no hand-written stage."""
