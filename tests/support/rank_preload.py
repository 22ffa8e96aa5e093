"""What a test rank imports before its first call, imported once into the test world's fork server
(``tests.support.world``): torch and its process groups, diffusers and transformers, and every registered family's
diffusers classes and xfuse pipeline. Importing has no side effect a rank could notice: no thread starts, no
group forms, nothing is read from disk but modules. What it imported is then frozen
(``xfuse.runtime.heap.freeze_startup_heap``): a test of a rank's own freezing unfreezes first
(``tests.support.pipeline_fns.heap_after_build_pipeline``), and freed memory is kept in the heap
(``xfuse.runtime.heap.keep_freed_heap``), both as in xfuse's own ranks after start-up."""

import diffusers
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401

from xfuse.families.registry import FAMILIES
from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

for _spec in FAMILIES:
    for _name in (_spec.diffusers_pipeline, _spec.diffusers_transformer, _spec.image_to_video):
        if _name:
            getattr(diffusers, _name)
    _spec.pipeline_class()

# What was imported lives as long as the rank: the collector never scans it again in the ranks forked from here, as
# in xfuse's own ranks after start-up; without it each full collection in a test rank walks some 430,000 objects,
# 0.25 s on this machine. (``gc.freeze`` before fork also keeps those pages shared between the ranks.)
freeze_startup_heap()
# Freed memory stays in the heap, as in xfuse's own ranks (``xfuse.build``): a pass's buffers are reused, not mapped
# and faulted in anew (``mallopt`` settings are inherited by the forked ranks): ``test_vae_decode.py``'s system time
# went from 19.6 to 14.6 s.
keep_freed_heap()
