"""``xfuse serve``: the OpenAI Images API on rank 0 of a torchrun world, PipeFusion behind it.

``protocol`` (request schema, limits, error envelope) -> ``app`` (HTTP routes, rank 0's background thread) ->
``service`` (rank 0's state and bounded queue) -> ``loop`` (every rank's main thread) -> ``control`` (the gloo
control plane) ; ``server`` starts and stops it all; ``metrics`` is what ``/metrics`` exports. Needs the ``serve``
extra (FastAPI, uvicorn, prometheus-client).
"""
