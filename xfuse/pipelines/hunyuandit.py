"""``xfuse.pipelines.hunyuandit``: the import path users know; the class lives in its family's folder."""

from xfuse.families.hunyuandit.pipeline import PipeFusionHunyuanDiTPipeline

__all__ = ["PipeFusionHunyuanDiTPipeline"]
