"""``xfuse.pipelines.sd3``: the import path users know; the class lives in its family's folder."""

from xfuse.families.sd3.pipeline import PipeFusionStableDiffusion3Pipeline

__all__ = ["PipeFusionStableDiffusion3Pipeline"]
