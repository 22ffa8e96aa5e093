"""``xfuse.pipelines.pixart``: the import path users know; the class lives in its family's folder."""

from xfuse.families.pixart.pipeline import PipeFusionPixArtSigmaPipeline

__all__ = ["PipeFusionPixArtSigmaPipeline"]
