"""xfuse: PipeFusion patch-level pipeline parallelism for diffusion transformers (HunyuanDiT, PixArt-Σ, SD3/SD3.5,
FLUX.1)."""

__version__ = "0.1.0"
PIPELINES = (
    "PipeFusionHunyuanDiTPipeline",
    "PipeFusionPixArtSigmaPipeline",
    "PipeFusionStableDiffusion3Pipeline",
    "PipeFusionFluxPipeline",
)
__all__ = [*PIPELINES, "__version__"]


def __getattr__(name):
    # Lazy: importing xfuse (every test rank does) must not import diffusers.
    if name in PIPELINES:
        import xfuse.pipelines

        return getattr(xfuse.pipelines, name)
    raise AttributeError(f"module 'xfuse' has no attribute {name!r}")
