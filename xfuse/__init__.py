"""xfuse: PipeFusion patch-level pipeline parallelism for diffusion transformers (HunyuanDiT first)."""

__version__ = "0.1.0"
__all__ = ["PipeFusionHunyuanDiTPipeline", "__version__"]


def __getattr__(name):
    # Lazy: importing xfuse (every test rank does) must not import diffusers.
    if name == "PipeFusionHunyuanDiTPipeline":
        from xfuse.pipelines.hunyuandit import PipeFusionHunyuanDiTPipeline

        return PipeFusionHunyuanDiTPipeline
    raise AttributeError(f"module 'xfuse' has no attribute {name!r}")
