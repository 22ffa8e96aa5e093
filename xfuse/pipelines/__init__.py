"""diffusers-compatible pipelines running PipeFusion, one per model family."""

from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.hunyuandit import PipeFusionHunyuanDiTPipeline
from xfuse.pipelines.pixart import PipeFusionPixArtSigmaPipeline

__all__ = ["PipeFusionHunyuanDiTPipeline", "PipeFusionPipelineBase", "PipeFusionPixArtSigmaPipeline"]
