"""diffusers-compatible pipelines running PipeFusion, one per model family."""

from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.flux import PipeFusionFluxPipeline
from xfuse.pipelines.hunyuandit import PipeFusionHunyuanDiTPipeline
from xfuse.pipelines.pixart import PipeFusionPixArtSigmaPipeline
from xfuse.pipelines.sd3 import PipeFusionStableDiffusion3Pipeline

__all__ = [
    "PipeFusionFluxPipeline",
    "PipeFusionHunyuanDiTPipeline",
    "PipeFusionPipelineBase",
    "PipeFusionPixArtSigmaPipeline",
    "PipeFusionStableDiffusion3Pipeline",
]
