"""xfuse: PipeFusion patch-level pipeline parallelism for diffusion transformers (HunyuanDiT, PixArt-Σ)."""

__version__ = "0.1.0"
__all__ = ["PipeFusionHunyuanDiTPipeline", "PipeFusionPixArtSigmaPipeline", "__version__"]


def __getattr__(name):
    # Lazy: importing xfuse (every test rank does) must not import diffusers.
    if name in ("PipeFusionHunyuanDiTPipeline", "PipeFusionPixArtSigmaPipeline"):
        import xfuse.pipelines

        return getattr(xfuse.pipelines, name)
    raise AttributeError(f"module 'xfuse' has no attribute {name!r}")
