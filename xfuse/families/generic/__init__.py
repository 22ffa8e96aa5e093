"""The generic family: a diffusers DiT run through PipeFusion from its own forward, context-parallel plan and attention
dispatcher (``forward_plan``: what xfuse reads of a model; ``stage``: the ``Stage`` built from them)."""
