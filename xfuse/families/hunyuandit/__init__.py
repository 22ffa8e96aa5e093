"""HunyuanDiT (diffusers `HunyuanDiT2DModel` / `HunyuanDiTPipeline`): spec, adapter, pipeline, presets, and the
serial reference loop the engine tests and benchmarks compare with."""
