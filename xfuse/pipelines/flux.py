"""``xfuse.pipelines.flux``: the import path users know; the class lives in its family's folder."""

from xfuse.families.flux.pipeline import PipeFusionFluxPipeline

__all__ = ["PipeFusionFluxPipeline"]
