"""``xfuse.pipelines.wan``: the import path users know; the class lives in its family's folder."""

from xfuse.families.wan.pipeline import PipeFusionWanPipeline

__all__ = ["PipeFusionWanPipeline"]
