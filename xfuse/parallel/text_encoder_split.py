"""A text encoder's layers split over the ranks of the text group (``parallel.text_encoder: split``), applied from
outside to the untouched transformers model, as the transformer's blocks are.

The text group is the pipeline group of global rank 0. Its index 0 (rank 0) keeps the model whole but for the other
ranks' layers; it runs diffusers' own ``encode_prompt`` as on one device. Every other rank keeps only its layers (and
the decoder's small modules that run after them: the final norm) and serves rank 0's calls:

1. rank 0's decoder (the module that holds the layer list, called with ``inputs_embeds`` or ``input_ids``) is about
   to run: it sends the call's keyword arguments (attention mask, position ids, flags: no weights) to the group;
2. each rank runs its layers on the hidden state the previous rank hands it (rank 0: its own embeddings) and hands
   its last layer's output on; another rank's layer is a pass-through shell of the same class, so the model's own
   forward (masks, rotary embeddings, the recorded ``hidden_states``) runs unchanged around it;
3. every rank sends rank 0 the hidden states of its layers where the call asked for them, the last rank the final
   (normed) output; rank 0 puts them in its decoder's output, which the model returns as it would on one device.

Exact: every layer runs once, on the hidden state it would see on one device. Which text encoders can be split:
those whose decoder takes ``input_ids`` and ``inputs_embeds`` and whose layers return a tensor (the decoder-only
language models of FLUX.2, Qwen-Image and Z-Image: Mistral, Qwen3, Qwen2.5-VL); the others (CLIP, T5) stay whole on
rank 0 (:func:`splittable`).
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from xfuse.comm.p2p import P2PChannels, Recv, Send

# What rank 0 sends to end the group's serving of one call's encodes.
_DONE = None
# Where the split's messages happen, for their reports (``xfuse.comm.errors.describe_place``).
ENCODING = "prompt encoding"


def decoder_layers(encoder: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(decoder, its layer list) of a transformers text encoder: the ``ModuleList`` of one layer class holding the
    most parameters (the language model's, not a vision tower's), where its parent takes ``input_ids`` and
    ``inputs_embeds`` and its layers return a tensor; ``None`` where the encoder has none such (it cannot be split)."""
    best, most = None, -1
    for parent in encoder.modules():
        for child in parent.children():
            if not isinstance(child, nn.ModuleList) or len(child) < 2 or len({type(m) for m in child}) != 1:
                continue
            count = sum(p.numel() for p in child.parameters())
            if count > most:
                best, most = (parent, child), count
    if best is None:
        return None
    parent, layers = best
    takes = inspect.signature(parent.forward).parameters
    returns = inspect.signature(type(layers[0]).forward).return_annotation
    if not {"input_ids", "inputs_embeds"} <= set(takes) or returns is not torch.Tensor:
        return None
    return best


def splittable(encoder: nn.Module) -> bool:
    """Whether ``parallel.text_encoder: split`` splits this text encoder (else it stays whole on rank 0)."""
    return decoder_layers(encoder) is not None


def layer_share(num_layers: int, index: int, count: int) -> range:
    """The layers rank ``index`` of ``count`` runs: consecutive, as even as they go, the first ranks one more."""
    base, extra = divmod(num_layers, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def _shell(layer: nn.Module) -> nn.Module:
    """A weightless stand-in for another rank's ``layer``: the same class (the model's output recorder and its
    per-layer attributes, such as the attention type that picks the mask, see it as the layer), returning the hidden
    state it is given."""
    shell = type(layer).__new__(type(layer))
    nn.Module.__init__(shell)
    internal = set(vars(shell))
    for name, value in vars(layer).items():
        if name not in internal:
            setattr(shell, name, value)
    shell.training = layer.training
    shell.forward = types.MethodType(lambda self, hidden_states, *a, **k: hidden_states, shell)
    return shell


def shard_text_encoder(encoder: nn.Module, index: int, count: int) -> range:
    """Keep rank ``index``'s share of ``encoder`` (of ``count`` ranks), in place, and return its layers: the other
    ranks' layers become shells; a rank other than 0 also empties every parameter outside its layers and the
    decoder's own small modules (the embeddings, a language model head, a vision tower: it never runs them).
    Applied alike to a weightless (meta) model, it is what ``xfuse plan`` counts."""
    found = decoder_layers(encoder)
    if found is None:
        raise ValueError(f"{type(encoder).__name__} cannot be split by layers (xfuse.parallel.text_encoder_split)")
    decoder, layers = found
    if len(layers) < count:
        raise ValueError(
            f"{type(encoder).__name__} has {len(layers)} layers, fewer than the {count} ranks to split over"
        )
    owned = layer_share(len(layers), index, count)
    for i in range(len(layers)):
        if i not in owned:
            layers[i] = _shell(layers[i])
    if index > 0:
        embeddings: nn.Module = decoder.get_input_embeddings()  # type: ignore[operator]  # transformers' models
        dropped = {id(p) for p in embeddings.parameters()}
        kept = {id(p) for p in decoder.parameters()} - dropped
        for module in encoder.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in kept:
                    setattr(module, name, nn.Parameter(param.new_empty(0), requires_grad=False))
    return owned


class SplitTextEncoder:
    """One text encoder split over the text group; see the module docstring.

    ``ranks``: the group's global ranks by index (rank 0 first); ``channels``: this rank's pipeline channels (every
    pair of the group connected); ``group``: the group's gloo process group, for the calls' arguments.
    """

    def __init__(self, encoder: nn.Module, *, name: str, index: int, ranks: list[int], channels: P2PChannels,
                 group: dist.ProcessGroup, device: torch.device):  # fmt: skip
        self.encoder, self.name, self.index, self.ranks = encoder, name, index, ranks
        self.channels, self.group, self.device = channels, group, device
        self.owned = shard_text_encoder(encoder, index, len(ranks))
        self.decoder, layers = decoder_layers(encoder) or (encoder, nn.ModuleList())  # found: it was just sharded
        self.num_layers = len(layers)
        self.dtype = next(layers[self.owned.start].parameters()).dtype
        layers[self.owned[-1]].register_forward_hook(self._hand_on)
        self.first_layer = layers[self.owned.start]  # where a fault drill stops this rank (xfuse.runtime.faults)
        self._sends: list = []
        self._call: dict | None = None  # rank 0: the call in flight (its arguments as sent)
        # rank 0: whether the group serves its calls (inside a pipeline call's encoding: TextGroup.leading)
        self.serving = False
        if index == 0:
            self.decoder.register_forward_pre_hook(self._lead, with_kwargs=True)
            self.decoder.register_forward_hook(self._complete)

    @property
    def last(self) -> bool:
        return self.index == len(self.ranks) - 1

    # -------------------------------------------------------------------------------------------------- one call
    def _hand_on(self, module, args, output) -> None:
        """After this rank's last layer: its output to the next rank."""
        if not self.last:
            send = Send(self.ranks[self.index + 1], "text-encoder", output.contiguous(), ENCODING, None)
            self._sends += self.channels.exchange([send])[0]

    def _recv(self, peer: int, kind: str, shape: tuple) -> torch.Tensor:
        """A ``shape`` tensor of ``kind`` from global rank ``peer``, copied out of the pooled receive buffer."""
        (pending,) = self.channels.exchange([], [Recv(peer, kind, shape, self.dtype, ENCODING, None)])[1]
        with pending as tensor:
            return tensor.clone()

    def _finish_sends(self) -> None:
        for send in self._sends:
            send.wait()
        self._sends = []

    def _lead(self, module, args, kwargs):
        """Rank 0, before its decoder runs: the call's arguments to the group."""
        if not self.serving:  # the other ranks are not listening: sending would only time out
            raise RuntimeError(
                f"{self.name} is split over ranks {self.ranks} (parallel.text_encoder: split): it runs inside the "
                "pipeline's __call__ only, where every rank of the group runs its layers; call the pipeline, or use "
                "parallel.text_encoder: rank0 to encode prompts on rank 0 alone"
            )
        if args:
            raise ValueError(f"{self.name}: its decoder was called with positional arguments; split needs keywords")
        tokens = kwargs.get("inputs_embeds")  # (B, S, width), or input_ids (B, S) the decoder embeds itself
        shape = tuple(tokens.shape) if tokens is not None else (*kwargs["input_ids"].shape, self._width())
        arguments = {key: (value.cpu() if isinstance(value, torch.Tensor) else value) for key, value in kwargs.items()
                     if key not in ("input_ids", "inputs_embeds")}  # fmt: skip
        self._call = {"encoder": self.name, "shape": shape, "hidden_states": self._wants_hidden(kwargs),
                      "arguments": arguments}  # fmt: skip
        _broadcast(self._call, self.group)

    def _width(self) -> int:
        decoder: Any = self.decoder  # a transformers model
        return decoder.get_input_embeddings().embedding_dim

    def _wants_hidden(self, kwargs) -> bool:
        wanted, decoder = kwargs.get("output_hidden_states"), cast(Any, self.decoder)
        return bool(decoder.config.output_hidden_states if wanted is None else wanted)

    def _complete(self, module, args, output):
        """Rank 0, after its decoder ran: the other ranks' layer outputs and the final output put in its output."""
        call, self._call = self._call, None
        assert call is not None, "a decoder output without its call"  # _lead ran before this decoder forward
        self._finish_sends()
        shape = call["shape"]
        hidden = list(output.hidden_states) if call["hidden_states"] and output.hidden_states is not None else None
        for index in range(1, len(self.ranks)):
            layers = layer_share(self.num_layers, index, len(self.ranks))
            if hidden is not None:
                stacked = self._recv(self.ranks[index], "text-encoder-layers", (len(layers), *shape))
                for i, layer in enumerate(layers):
                    hidden[layer + 1] = stacked[i]  # hidden_states[0] are the embeddings
        final = self._recv(self.ranks[-1], "text-encoder-out", shape)
        output.last_hidden_state = final
        if hidden is not None:
            output.hidden_states = tuple(hidden)
        return output

    def serve_one(self, call: dict) -> None:
        """A rank other than 0: run its layers for one of rank 0's calls."""
        shape = call["shape"]
        hidden = self._recv(self.ranks[self.index - 1], "text-encoder", shape)
        arguments = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in call["arguments"].items()}
        with torch.no_grad():
            output = self.decoder(input_ids=None, inputs_embeds=hidden, **arguments)
        sends = []
        if call["hidden_states"]:
            # (own layers, B, S, width): hidden_states[i + 1] is layer i's output
            stacked = torch.stack([output.hidden_states[i + 1] for i in self.owned]).contiguous()
            sends.append(Send(self.ranks[0], "text-encoder-layers", stacked, ENCODING, None))
        if self.last:
            sends.append(Send(self.ranks[0], "text-encoder-out", output.last_hidden_state.contiguous(), ENCODING, None))
        self._sends += self.channels.exchange(sends)[0]
        self._finish_sends()


def _broadcast(payload, group: dist.ProcessGroup):
    box = [payload]
    dist.broadcast_object_list(box, src=0, group=group)  # global rank 0 leads every text group
    return box[0]


class TextGroup:
    """Every split text encoder of a pipeline on one rank of the text group: rank 0 leads (its encoders' hooks send
    each call inside :meth:`leading`, which ends a request's encoding), the others :meth:`serve` until it ends."""

    def __init__(self, encoders: dict[str, SplitTextEncoder], group: dist.ProcessGroup):
        self.encoders, self.group = encoders, group

    @contextmanager
    def leading(self):
        """Rank 0, around a request's encoding: its encoders' calls are sent to the group, which is released after.
        Where the encoding fails nothing more is sent (a peer may be the cause: lost, or stalled in its layers); the
        error goes on to the failure monitor, which stops the others."""
        for encoder in self.encoders.values():
            encoder.serving = True
        try:
            yield
        finally:
            for encoder in self.encoders.values():
                encoder.serving = False
        _broadcast(_DONE, self.group)

    def serve(self) -> None:
        """A rank other than 0: run rank 0's text-encoder calls until it is done encoding this request."""
        while (call := _broadcast(None, self.group)) is not _DONE:
            self.encoders[call["encoder"]].serve_one(call)
