"""diffusers-compatible pipelines running PipeFusion, one per model family.

Each class lives in its family's folder (``xfuse/families/<family>/pipeline.py``, reached through its spec's
``pipeline_class``) and subclasses ``xfuse.pipelines.base.PipeFusionPipelineBase``; this package gathers them under
the import paths users know (``from xfuse.pipelines import PipeFusionFluxPipeline``, ``xfuse.pipelines.flux``).
Lazily: a family's pipeline module imports ``xfuse.pipelines.base``, so this package must not import the families
while it loads.
"""

__all__ = [
    "PipeFusionFluxPipeline",
    "PipeFusionHunyuanDiTPipeline",
    "PipeFusionPipelineBase",
    "PipeFusionPixArtSigmaPipeline",
    "PipeFusionStableDiffusion3Pipeline",
]


def __getattr__(name: str):
    if name == "PipeFusionPipelineBase":
        from xfuse.pipelines.base import PipeFusionPipelineBase

        return PipeFusionPipelineBase
    if name in __all__:
        from xfuse.families.registry import FAMILIES

        return next(cls for cls in (spec.pipeline_class() for spec in FAMILIES) if cls.__name__ == name)
    raise AttributeError(f"module 'xfuse.pipelines' has no attribute {name!r}")
