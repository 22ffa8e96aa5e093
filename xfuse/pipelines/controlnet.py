"""``ShardedControlNetMixin``: what the ControlNet pipelines of the MMDiT families share when they are built.

The wrapped diffusers pipeline holds the ControlNet (``pipeline.controlnet``, loaded or passed as diffusers takes it).
Every rank checks it the same way and compares its config; each pipeline group's embedding rank runs it
(``xfuse.families.common.control.ControlModel``) and the other ranks drop it: they only receive its residuals.
"""

from __future__ import annotations

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

    def __init__(self, pipeline, context, dtype, stage=None, extra_stages=None, vae_config=None):
        controlnet = getattr(pipeline, "controlnet", None)
        self.check_controlnet(controlnet)
        super().__init__(pipeline, context, dtype, stage, extra_stages, vae_config)  # type: ignore[call-arg]
        if self.parallel.sequence_degree > 1:
            raise ConfigError("parallel.ulysses_degree", "a ControlNet runs without sequence parallelism: use 1")
        if self.config.cache.enabled:
            raise ConfigError("cache.method", "step caching does not run with a ControlNet: use off")
        self.control_config = dict(controlnet.config)
        self._same_everywhere("controlnet config", config_hash(self.control_config))
        self.control_model = None
        if context.pipe_rank == self.plan.embed_rank:
            controlnet.to(context.device)
            stage_class = self.spec.stage_class()
            self.control_model = ControlModel(stage_class, controlnet, self.control_heads(controlnet))
        else:  # only the embedding rank runs it
            pipeline.controlnet = None
