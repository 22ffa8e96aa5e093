"""Full-image self-attention K/V buffers refreshed one patch at a time (PipeFusion's "stale" K/V).

Each self-attention layer keeps K and V for every token of the image. A full-image pass (warm-up) overwrites them
whole; a patch pass overwrites only the patch's token range and attends to the whole buffer, whose other ranges
hold the previous diffusion step's K/V. Model-agnostic: tensors are (batch, heads, tokens, head_dim).

What a patch sees before the buffer was ever filled in this request (``warmup_steps == 0``): only the tokens
written so far in this request — patch p of the first step attends to patches 0 … p of that step. Never K/V of an
earlier request: ``reset()`` runs at the start of every request and marks every buffer empty.

Text slots (the joint-attention families, SD3 and FLUX, whose text shares the image's softmax): with ``text_slots``
set, each layer's buffer also holds that many text tokens beside the image's, in the family's order (FLUX [text,
image], SD3 [image, text]). The step's first patch writes its text K/V there and every patch of the step attends to
the one buffer, which then *is* the joint K/V: no per-pass concatenation of the whole image's K/V with the text's.
"""

from __future__ import annotations

import sys

import torch

from xfuse.parallel.stage import BatchPart


def static_slot(*buffers: torch.Tensor) -> None:
    """Say that ``buffers`` are written in place and read across steps and requests at one address (K/V buffers, text
    slots): a captured stage pass (``xfuse.parallel.pass_graphs``) reads and writes them where they are instead of
    copying them into the graph's own inputs each replay (a buffer met at a new address is captured again). Marked
    when they are made, outside any traced pass (``CapturedStage`` runs a request's first pass of each kind eagerly).
    Only where dynamo is loaded: a process that compiles nothing never imports it (seconds), and one that compiles
    imports it before its first pass (``StageCompiler.compile``)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or torch.compiler.is_compiling():
        return
    for buffer in buffers:
        dynamo.mark_static_address(buffer)


class StaleKVCache:
    """K/V buffers of all self-attention layers one rank runs, keyed by global layer index."""

    # one request's (``xfuse.parallel.request_state``): every attribute but the family's text order
    REQUEST_STATE = ("_valid", "tokens", "store_whole", "part", "num_tokens", "text_slots", "_joint_k", "_joint_v",
                     "_text_written")  # fmt: skip

    def __init__(self) -> None:
        self._valid: dict[int, int] = {}  # tokens [0, valid) hold K/V of this request
        self.tokens: slice | None = None  # token range of the patch being computed; None = whole image
        self.store_whole = True  # whether a whole-image pass stores its K/V (only the last warm-up step must)
        self.part: BatchPart | None = None  # batch rows of the whole-image pass being computed; None = all
        self.num_tokens = 0  # tokens of the whole image in the current request
        self.text_slots = 0  # text tokens each buffer keeps beside the image's (0: none)
        self.text_first = False  # where the text slots are: before the image tokens (FLUX) or after them (SD3)
        self._joint_k: dict[int, torch.Tensor] = {}  # layer -> (B, heads, text_slots + tokens, head_dim)
        self._joint_v: dict[int, torch.Tensor] = {}
        self._text_written: dict[int, bool] = {}  # the text slots hold this request's text K/V

    def reset(self, num_tokens: int) -> None:
        """Start a request of ``num_tokens`` image tokens: forget every K/V (buffers are reused if shapes match)."""
        self._valid = dict.fromkeys(self._valid, 0)
        self._text_written = dict.fromkeys(self._text_written, False)
        self.tokens, self.num_tokens = None, num_tokens

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._joint_k.values(), *self._joint_v.values()))

    def _text_range(self) -> slice:
        return slice(0, self.text_slots) if self.text_first else slice(self.num_tokens, None)

    def _buffers(self, layer: int, like: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s image K/V buffers, (B, heads, tokens, head_dim) each: views of its joint buffers
        (B, heads, text_slots + tokens, head_dim), which are the image buffers themselves without text slots. Made
        per pass, not kept: a pass then reads only the joint buffers, so a traced pass has no two inputs that share
        memory (AOT autograd would merge them and forget that they have static addresses)."""
        shape = (batch, like.shape[1], self.text_slots + self.num_tokens, like.shape[3])
        k = self._joint_k.get(layer)
        if k is None or k.shape != shape or k.dtype != like.dtype or k.device != like.device:
            # Allocated once per (request shape, dtype): the hot path only copies into it.
            self._joint_k[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._joint_v[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
            static_slot(self._joint_k[layer], self._joint_v[layer])
            self._valid[layer], self._text_written[layer] = 0, False
        image = slice(self.text_slots, None) if self.text_first else slice(0, self.num_tokens)
        return self._joint_k[layer][:, :, image], self._joint_v[layer][:, :, image]

    def joint(
        self, layer: int, text_key: torch.Tensor, text_value: torch.Tensor, fresh: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The joint K/V of a patch pass, each (B, heads, text_slots + tokens, head_dim) in the family's order, after
        ``update`` stored the pass's image K/V: with ``fresh`` (the step's first patch) ``text_key``/``text_value``
        (B, heads, text_slots, head_dim) are written into the text slots first; a later patch attends to what its
        step's first patch wrote. ``None`` where the buffers cannot serve (no text slots, a whole-image pass, image
        tokens not yet written in this request): the caller joins the text itself."""
        if not self.text_slots or self.tokens is None or self._valid.get(layer, 0) < self.num_tokens:
            return None
        text = self._text_range()
        if fresh:
            if text_key.shape[2] != self.text_slots:
                raise RuntimeError(
                    f"stale K/V of layer {layer}: {text_key.shape[2]} text tokens for {self.text_slots} text slots"
                )
            self._joint_k[layer][:, :, text].copy_(text_key)
            self._joint_v[layer][:, :, text].copy_(text_value)
            self._text_written[layer] = True
        elif not self._text_written[layer]:
            return None
        return self._joint_k[layer], self._joint_v[layer]

    def text_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer ``layer``'s text slots, each (B, heads, text_slots, head_dim): what ``joint`` last wrote."""
        text = self._text_range()
        return self._joint_k[layer][:, :, text], self._joint_v[layer][:, :, text]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, tokens: slice) -> None:
        """Write ``key``/``value`` (B, heads, S, D) into ``tokens`` of the buffers without attending (a whole-image
        pass whose K/V are kept in another layout: sequence parallelism's Ring); a batch part into its rows. Every
        range of a whole-image pass is written before any patch reads the buffers."""
        part = self.part
        k_buf, v_buf = self._buffers(layer, key, key.shape[0] if part is None else part.model_batch)
        rows = slice(None) if part is None else part.rows
        k_buf[rows, :, tokens].copy_(key)
        v_buf[rows, :, tokens].copy_(value)
        self._valid[layer] = self.num_tokens

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Store this pass's ``key``/``value`` (B, heads, S, D) and return the K/V to attend to.

        Whole-image pass (``self.tokens is None``): store all (if ``store_whole``; a batch part into its rows) and
        attend to ``key``/``value`` themselves. Only the last warm-up step before pipelined steps needs to store:
        exact mode never allocates. Patch pass (the whole batch): store into the patch's token range and attend to
        every valid token of the buffer.
        """
        num_tokens = self.num_tokens
        if self.tokens is None and key.shape[2] != num_tokens:
            raise RuntimeError(
                f"stale K/V of layer {layer}: whole-image pass of {key.shape[2]} tokens, "
                f"but the request has {num_tokens} (reset() not called for this request?)"
            )
        if self.tokens is None and not self.store_whole:
            return key, value
        part = self.part
        if self.tokens is None:
            # Every part of a step is stored before any patch reads the buffer: the next step needs all of them.
            self.store(layer, key, value, slice(None))
            return key, value
        if part is not None:
            raise RuntimeError(f"stale K/V of layer {layer}: a patch pass runs on the whole batch, not {part}")
        k_buf, v_buf = self._buffers(layer, key, key.shape[0])
        start, stop = self.tokens.start, self.tokens.stop
        valid = self._valid[layer]
        if start > valid:
            raise RuntimeError(
                f"stale K/V of layer {layer}: patch tokens [{start}, {stop}) leave a gap after the {valid} tokens "
                "written in this request (patches of the first pipelined step must run in order)"
            )
        k_buf[:, :, start:stop].copy_(key)
        v_buf[:, :, start:stop].copy_(value)
        valid = self._valid[layer] = max(valid, stop)
        return k_buf[:, :, :valid], v_buf[:, :, :valid]
