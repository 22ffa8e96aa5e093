"""What a test rank imports before its first call, imported once into the test world's fork server
(``tests.support.world``): torch and its process groups, diffusers and transformers, and every registered family's
diffusers classes and xfuse pipeline. Importing has no side effect a rank could notice: no thread starts, no
group forms, nothing is read from disk but modules. What it imported is then frozen
(``xfuse.runtime.heap.freeze_startup_heap``): a test of a rank's own freezing unfreezes first
(``tests.support.pipeline_fns.heap_after_build_pipeline``)."""

import diffusers
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401

from xfuse.families.registry import FAMILIES
from xfuse.runtime.heap import freeze_startup_heap

for _spec in FAMILIES:
    for _name in (_spec.diffusers_pipeline, _spec.diffusers_transformer, _spec.image_to_video):
        if _name:
            getattr(diffusers, _name)
    _spec.pipeline_class()

# What was imported lives as long as the rank: the collector never scans it again in the ranks forked from here, as
# in xfuse's own ranks after start-up; without it each full collection in a test rank walks some 430,000 objects,
# 0.25 s on this machine. (``gc.freeze`` before fork also keeps those pages shared between the ranks.)
freeze_startup_heap()
from xfuse.runtime.heap import keep_freed_heap  # noqa: E402
keep_freed_heap()
