"""The allowed values of xfuse's settings, one home each: the config validates against these ``Literal`` types; the
planner and the pipelines, which check placements and dtypes themselves, read those tuples. Pure: importing it
imports nothing else of xfuse, nor torch."""

from typing import Literal, get_args

Placement = Literal["balanced", "folded", "linear"]  # how blocks map to ranks: xfuse.parallel.stage_plan
Backend = Literal["auto", "nccl", "gloo"]  # auto: NCCL on CUDA, gloo on CPU
Wait = Literal["auto", "stream", "host"]  # how a rank waits for a message: xfuse.comm.p2p
Device = Literal["auto", "cpu", "cuda"]  # auto: CUDA when available
DtypeName = Literal["float32", "bfloat16", "float16"]  # torch's names (``getattr(torch, name)``)
VaeParallel = Literal["auto", "on", "off"]  # the VAE decode over every rank: xfuse.parallel.vae_decode
TextEncoderPlacement = Literal["auto", "rank0", "split", "offload"]  # where text encoders run: xfuse.perf.memory
VideoPatches = Literal["temporal", "spatial"]  # a video's patches: runs of frames or strips of rows (video_layout)
Adapter = Literal["family", "generic"]  # a rank's share of the model: its family's stage or xfuse.families.generic's

PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
DTYPES: tuple[DtypeName, ...] = get_args(DtypeName)
VIDEO_PATCHES: tuple[VideoPatches, ...] = get_args(VideoPatches)
