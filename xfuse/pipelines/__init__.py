"""diffusers-compatible pipelines running PipeFusion, one per model family.

Each class lives in its family's folder (``xfuse/families/<family>/pipeline.py``, reached through its spec's
``pipeline_class``) and subclasses ``xfuse.pipelines.base.PipeFusionPipelineBase``; this package gathers them under
the import paths users know (``from xfuse.pipelines import PipeFusionFluxPipeline``, ``xfuse.pipelines.flux``).
Lazily: a family's pipeline module imports ``xfuse.pipelines.base``, so this package must not import the families
while it loads.
"""


def __getattr__(name: str):
    if name == "PipeFusionPipelineBase":
        from xfuse.pipelines.base import PipeFusionPipelineBase

        return PipeFusionPipelineBase
    from xfuse.families.registry import PIPELINE_SPECS  # the names come from the registry: one line per family

    if name == "__all__":
        return sorted([*PIPELINE_SPECS, "PipeFusionPipelineBase"])
    if name in PIPELINE_SPECS:
        return PIPELINE_SPECS[name].pipeline_class_named(name)
    raise AttributeError(f"module 'xfuse.pipelines' has no attribute {name!r}")
