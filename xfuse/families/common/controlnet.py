"""``ShardedControlNetMixin``: what the ControlNet pipelines of the MMDiT families share when they are built.

The wrapped diffusers pipeline holds the ControlNet (``pipeline.controlnet``, loaded or passed as diffusers takes it).
Every rank checks it the same way and compares its config; each pipeline group's embedding rank runs it
(``xfuse.families.common.control.ControlModel``) and the other ranks drop it: they only receive its residuals. A linear
plan without a ``stage_split`` gives the embedding rank as many fewer transformer blocks as the ControlNet has
(``xfuse.parallel.control.control_split``), so that it is not the pipeline's bottleneck.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from torch import nn

from xfuse.errors import ConfigError
from xfuse.families.common.control import ControlModel
from xfuse.runtime.handshake import config_hash


class ShardedControlNetMixin:
    """Put before the family's pipeline class. The family sets ``check_controlnet`` (raises for a control model it
    cannot run) and ``control_heads`` (the ControlNet's residual layers in residual order)."""

    control_config: dict
    control_model: ControlModel | None

    @staticmethod
    def check_controlnet(controlnet) -> None:
        raise NotImplementedError

    @staticmethod
    def control_heads(controlnet) -> Sequence[nn.Module]:
        raise NotImplementedError

    def _control_blocks(self, pipeline) -> int:
        return self.spec.num_blocks(pipeline.controlnet.config)  # type: ignore[attr-defined]

    @classmethod
    def _control_blocks_of(cls, folder: str, kwargs: dict) -> int:
        """The blocks of the ControlNet passed as ``controlnet=`` (as diffusers takes it), or of the folder's own
        ``controlnet`` component; 0 without one (the pipeline then refuses to build, naming it)."""
        controlnet = kwargs.get("controlnet")
        if controlnet is not None:
            return cls.spec.num_blocks(controlnet.config)  # type: ignore[attr-defined]
        config = os.path.join(folder, "controlnet", "config.json")
        if "controlnet" in kwargs or not os.path.isfile(config):
            return 0
        with open(config) as f:
            return cls.spec.num_blocks(json.load(f))  # type: ignore[attr-defined]

    def __init__(self, pipeline, context, dtype, stage=None, extra_stages=None, vae_config=None, **kwargs):
        controlnet = getattr(pipeline, "controlnet", None)
        self.check_controlnet(controlnet)
        if controlnet.dtype != dtype:  # its residuals join hidden states that keep the transformer's dtype
            raise ValueError(
                f"controlnet is {controlnet.dtype} but the transformer runs in {dtype}: load the ControlNet with "
                f"torch_dtype={dtype}"
            )
        config = context.config  # the same on every rank (init_parallel's handshake): refused before any message
        if config.parallel.sequence_degree > 1:
            key = "parallel.ulysses_degree" if config.parallel.ulysses_degree > 1 else "parallel.ring_degree"
            raise ConfigError(key, "a ControlNet runs without sequence parallelism: use 1")
        if config.cache.enabled:
            raise ConfigError("cache.method", "step caching does not run with a ControlNet: use off")
        super().__init__(pipeline, context, dtype, stage, extra_stages, vae_config, **kwargs)  # type: ignore[call-arg]
        self.control_config = dict(controlnet.config)
        self.collectives.same_everywhere("controlnet config", config_hash(self.control_config))
        self.control_model = None
        if context.pipe_rank == self.plan.embed_rank:
            controlnet.to(context.device)
            stage_class = self.spec.stage_class()
            self.control_model = ControlModel(stage_class, controlnet, self.control_heads(controlnet))
        else:  # only the embedding rank runs it
            pipeline.controlnet = None
