"""What a test rank imports before its first call, imported once into the test world's fork server
(``tests.support.world``): torch and its process groups, diffusers and transformers, and every registered family's
diffusers classes and xfuse pipeline. Importing has no side effect a rank could notice: no thread starts, no
group forms, nothing is read from disk but modules."""

import diffusers
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401

from xfuse.families.registry import FAMILIES

for _spec in FAMILIES:
    for _name in (_spec.diffusers_pipeline, _spec.diffusers_transformer, _spec.image_to_video):
        if _name:
            getattr(diffusers, _name)
    _spec.pipeline_class()
