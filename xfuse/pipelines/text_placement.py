"""Where a pipeline's text encoders run: ``parallel.text_encoder`` resolved (``xfuse.perf.memory.text_placement``)
and applied to the loaded components.

- ``rank0``: whole on global rank 0's device (the other ranks never load them);
- ``split``: each text encoder that can be split (``xfuse.parallel.text_encoder_split.splittable``) split by layers
  over the pipeline group of rank 0, the others whole on rank 0;
- ``offload``: on rank 0, its weights in host memory, each module moved to the device while it runs (accelerate's
  ``cpu_offload``, which diffusers' ``enable_sequential_cpu_offload`` uses); on a CPU device there is nothing to move.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from xfuse.config import XfuseConfig
from xfuse.errors import ConfigError
from xfuse.parallel.text_encoder_split import SplitTextEncoder, TextGroup, shard_text_encoder, splittable
from xfuse.runtime.world import ParallelContext, pipeline_group_ranks


def text_placement(config: XfuseConfig, device: torch.device) -> str:
    """``parallel.text_encoder`` resolved for this world on ``device`` (every rank alike: the same config and model,
    and on a GPU its total memory, which the start-up handshake compares): as configured, or ``auto``'s choice for
    the config's request (``xfuse.perf.memory.place_text``; ``rank0`` on a CPU, or where the model's shapes are not
    known)."""
    wanted = config.parallel.text_encoder
    if wanted != "auto":
        return wanted
    if device.type != "cuda":
        return "rank0"
    from xfuse.perf.memory import place_text
    from xfuse.perf.planner import workload

    memory = torch.cuda.get_device_properties(device).total_memory
    try:
        work = workload(config)
    except ConfigError:  # a pipeline given to from_pipe without its folder: its shapes are not known to the plan
        return "rank0"
    return place_text(config.model, work, config.parallel, config.runtime.torch_dtype(), memory).text


def text_components(pipeline) -> list[str]:
    """The pipeline's text encoders: its ``text_encoder*`` components that are loaded modules."""
    return [name for name, module in pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)]  # fmt: skip


def loads_text_encoders(context: ParallelContext, placement: str) -> bool:
    """Whether this rank loads the text encoders: rank 0, and with ``split`` every rank of its pipeline group."""
    if context.is_output:
        return True
    parallel = context.config.parallel
    return placement == "split" and context.rank in pipeline_group_ranks(parallel)


def load_text_shares(pipeline, folder: str, context: ParallelContext, placement: str, dtype: torch.dtype) -> None:
    """``from_pretrained``'s text encoders on the ranks of a split other than rank 0 (which loads them with the
    pipeline): one rank at a time reads each from ``folder`` and keeps only its share (``shard_text_encoder``) before
    the next reads, so the host holds one whole text encoder at a time, not one per rank (a 24 B encoder is 45 GiB).
    Collective with ``split`` over more than one pipeline rank: every rank of the world takes part in each turn."""
    ranks = pipeline_group_ranks(context.config.parallel)
    if placement != "split" or len(ranks) == 1:
        return
    import transformers

    from xfuse.families.folder import component_class, text_encoder_components

    index = ranks.index(context.rank) if context.rank in ranks else None
    names = text_encoder_components(folder)
    for turn in range(1, len(ranks)):
        dist.barrier(group=context.control_group)
        if index != turn:
            continue
        for name in names:
            model_class = getattr(transformers, component_class(folder, name))
            module = model_class.from_pretrained(folder, subfolder=name, dtype=dtype, local_files_only=True).eval()
            if splittable(module):  # else it stays whole on rank 0: this rank drops it
                shard_text_encoder(module, index, len(ranks))
                setattr(pipeline, name, module)
    dist.barrier(group=context.control_group)


def place_text_encoders(pipeline, context: ParallelContext, placement: str) -> TextGroup | None:
    """Apply ``placement`` to ``pipeline``'s text encoders on this rank; the text group this rank serves or leads
    (``None``: no text encoder is split). Collective with ``split`` over more than one pipeline rank: every rank of
    the world creates the group's process group."""
    names = text_components(pipeline) if loads_text_encoders(context, placement) else []
    if placement == "offload" and context.is_output and context.device.type == "cuda":
        from accelerate import cpu_offload

        for name in names:
            cpu_offload(getattr(pipeline, name), execution_device=context.device)
        return None
    ranks = pipeline_group_ranks(context.config.parallel)
    if placement != "split" or len(ranks) == 1:
        return None
    group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=context.config.comm.timeout_s))
    if context.rank not in ranks:
        return None
    index = ranks.index(context.rank)
    encoders = {}
    for name in names:
        module = getattr(pipeline, name)
        if splittable(module):  # sharded on the host, then this rank's share moved to its device
            encoders[name] = SplitTextEncoder(module, name=name, index=index, ranks=ranks, channels=context.channels,
                                              group=group, device=context.device)  # fmt: skip
            module.to(context.device)
        if index > 0:
            setattr(pipeline, name, None)  # this rank runs its layers through the group, never the pipeline's encode
    return TextGroup(encoders, group) if encoders else None
