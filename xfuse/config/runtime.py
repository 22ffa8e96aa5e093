"""``comm`` and ``runtime``: how the ranks talk (the process-group backend, the waits for messages and their bounds)
and what they run on (device and dtype)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field

from xfuse.config.section import NonEmptyStr, PositiveInt, Seconds, Section, yaml_switch
from xfuse.types import Backend, Device, DtypeName, Wait


class CommConfig(Section):
    """Point-to-point communication settings. ``backend: auto`` means NCCL on CUDA, gloo on CPU.

    ``wait``: how a rank waits for a message (``xfuse.comm.p2p``). ``stream``: queued on the CUDA stream, the host
    goes on, a watchdog thread bounds it by ``timeout_s``; ``host``: the host blocks until the message is there,
    bounded by ``timeout_s`` (on CUDA one host/device synchronisation per message); ``auto``: stream on CUDA, host on
    CPU. ``stream`` on CPU runs the watchdog path over gloo (whose waits block anyway): a drill of the GPU path's
    failure handling.

    ``host_timeout_s``: how long a rank's host may go without finishing a task of the denoising loop outside its waits
    for messages before it reports ``HostStalled`` and the world stops (``xfuse.runtime.host_deadline``: a host blocked
    inside CUDA, where no wait runs to time out). ``auto``: twice ``timeout_s`` on CUDA, ``off`` on CPU, where the host
    computes each task itself and a large model's task has no bound.
    """

    SECTION: ClassVar[str] = "comm"
    backend: Backend = "auto"
    timeout_s: Seconds = 60.0
    max_inflight: PositiveInt = 2
    socket_ifname: NonEmptyStr | None = None
    wait: Wait = "auto"
    host_timeout_s: Annotated[
        Seconds | Literal["auto", "off"],
        BeforeValidator(yaml_switch),  # ``--set comm.host_timeout_s=off`` arrives as False
        Field(description="'auto', 'off' or a finite number of seconds > 0"),
    ] = "auto"

    def resolved_host_timeout_s(self, device_type: str) -> float | None:
        """``host_timeout_s`` on a device type (``"cuda"`` or ``"cpu"``): seconds, or None for off; pure."""
        if self.host_timeout_s == "off" or (self.host_timeout_s == "auto" and device_type != "cuda"):
            return None
        return 2 * self.timeout_s if self.host_timeout_s == "auto" else float(self.host_timeout_s)

    def stream_ordered(self, device_type: str) -> bool:
        """Whether waits are stream-ordered on a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        return self.wait == "stream" or (self.wait == "auto" and device_type == "cuda")

    def resolved_backend(self, device_type: str) -> str:
        """The process-group backend for a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"


class RuntimeConfig(Section):
    """Device and dtype. ``device: auto`` means CUDA when available (resolved at launch, not here)."""

    SECTION: ClassVar[str] = "runtime"
    device: Device = "auto"
    dtype: DtypeName = "float32"

    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return getattr(torch, self.dtype)
