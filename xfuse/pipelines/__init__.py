"""diffusers-compatible pipelines running PipeFusion."""

from xfuse.pipelines.hunyuandit import PipeFusionHunyuanDiTPipeline

__all__ = ["PipeFusionHunyuanDiTPipeline"]
