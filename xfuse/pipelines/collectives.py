"""What every rank of a pipeline exchanges outside the engine, over the world's control group (gloo, CPU objects):
rank 0's gathers and broadcasts, a check that a value is the same everywhere, the generator every rank steps with, and
the CFG groups' swap of noise predictions. The call driver (``PipeFusionPipelineBase._run``) puts them in one order
on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from xfuse.comm.p2p import Recv, Send
from xfuse.parallel.trace import CALL, null_span
from xfuse.runtime.world import ParallelContext


class Collectives:
    def __init__(self, context: ParallelContext):
        self.context = context

    def gather(self, value) -> list | None:
        """Every rank's ``value``, indexed by rank, on global rank 0 (``None`` elsewhere)."""
        if self.context.world_size == 1:
            return [value]
        gathered = [None] * self.context.world_size
        dist.all_gather_object(gathered, value, group=self.context.control_group)
        return gathered if self.context.is_output else None

    def broadcast(self, payload):
        """Broadcast a picklable object from global rank 0 (tensors travel on the CPU)."""
        if self.context.world_size == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=self.context.control_group)
        return box[0]

    def from_rank0(self, tensors):
        """Global rank 0's ``tensors`` (a tensor or a dict of them; ``None`` on the other ranks) on this rank's
        device everywhere: through the host where they are sent; as they are in a world of one (no copy to the
        host and back, and a meta-device pipeline's tensors, which have no data, never leave it)."""
        if self.context.world_size == 1:
            received = tensors
        else:
            host = tree_map(lambda t: t.cpu(), tensors) if self.context.is_output else None
            received = self.broadcast(host)
        return tree_map(lambda t: t.to(self.context.device), received)

    def broadcast_tensors(self, make, span=null_span) -> dict[str, torch.Tensor]:
        """``make()`` on global rank 0 (a dict of tensors), broadcast, on this rank's device everywhere (traced as
        "encode" on rank 0 and "wait for text" on the others when ``span`` is a tracer's)."""
        made = None
        if self.context.is_output:
            with span("encode", CALL):
                made = make()
        with span("wait for text" if made is None else "broadcast text", CALL):
            return self.from_rank0(made)

    def same_everywhere(self, name: str, value) -> None:
        """Raise the same ValueError on every rank if ``value`` differs between ranks."""
        if self.context.world_size == 1:
            return
        values = [None] * self.context.world_size
        dist.all_gather_object(values, value, group=self.context.control_group)
        if any(v != values[0] for v in values):
            held = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"{name} must be the same on every rank ({held})")

    def cfg_exchange(self, noise: torch.Tensor, step: int, patch) -> torch.Tensor:
        """Swap noise-prediction rows with the other CFG group's rank at the same pipeline position."""
        peer = self.context.cfg_peer
        sends, recvs = self.context.cfg_channels.exchange(
            [Send(peer, "cfg", noise, step, patch)], [Recv(peer, "cfg", tuple(noise.shape), noise.dtype, step, patch)]
        )
        other = recvs[0].wait().clone()
        recvs[0].release()
        sends[0].wait()
        return other

    def shared_generator(self, generator):
        """Without a generator every rank (and both CFG groups) must still draw the same scheduler noise: rank 0
        draws a seed and broadcasts it."""
        if generator is not None:
            return generator
        seed = self.broadcast(int(torch.randint(0, 2**62, (1,))) if self.context.is_output else None)
        return torch.Generator().manual_seed(seed)

    def generator_of_rank0(self, generator) -> None:
        """Every rank's generator(s) take global rank 0's state (after rank 0 alone drew from them)."""
        if generator is None or self.context.world_size == 1:
            return
        generators = generator if isinstance(generator, list) else [generator]
        states = self.broadcast([g.get_state() for g in generators] if self.context.is_output else None)
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)

    def sync_generator(self, generator, observer: bool) -> None:
        """After the loop, every rank's generator(s) take the state of those of the rank that stepped the scheduler
        (``observer``: this rank is it): it alone drew the scheduler's noise, as serial diffusers draws it, so every
        rank ends where serial diffusers' generator ends and a second call with the same generator starts alike
        everywhere (the call's first check compares the ranks' states)."""
        if generator is None or self.context.world_size == 1:
            return
        generators = generator if isinstance(generator, list) else [generator]
        mine = [g.get_state() for g in generators] if observer else None
        states: list = [None] * self.context.world_size
        dist.all_gather_object(states, mine, group=self.context.control_group)
        (observed,) = [s for s in states if s is not None]
        for g, state in zip(generators, observed, strict=True):
            g.set_state(state)

    def shared_latents(self, prepare) -> torch.Tensor:
        """The initial latents: rank 0's ``prepare()`` (the diffusers pipeline's ``prepare_latents``), broadcast.

        Every rank runs ``prepare()``: drawing the latents advances the generator, and the rank that steps the
        scheduler (not rank 0 with linear placement) must continue from the same generator state as diffusers."""
        latents = prepare()
        return self.from_rank0(latents if self.context.is_output else None)
