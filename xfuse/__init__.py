"""xfuse: PipeFusion patch-level pipeline parallelism for diffusion transformers (HunyuanDiT first)."""

__version__ = "0.1.0"
