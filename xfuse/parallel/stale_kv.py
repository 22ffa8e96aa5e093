"""Full-image self-attention K/V buffers refreshed one patch at a time (PipeFusion's "stale" K/V).

Each self-attention layer keeps K and V for every token of the image. A full-image pass (warm-up) overwrites them
whole; a patch pass overwrites only the patch's token range and attends to the whole buffer, whose other ranges
hold the previous diffusion step's K/V. Model-agnostic: tensors are (batch, heads, tokens, head_dim).

What a patch sees before the buffer was ever filled in this request (``warmup_steps == 0``): only the tokens
written so far in this request — patch p of the first step attends to patches 0 … p of that step. Never K/V of an
earlier request: ``reset()`` runs at the start of every request and marks every buffer empty.
"""

from __future__ import annotations

import torch

from xfuse.parallel.stage import BatchPart


class StaleKVCache:
    """K/V buffers of all self-attention layers one rank runs, keyed by global layer index."""

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._valid: dict[int, int] = {}  # tokens [0, valid) hold K/V of this request
        self.tokens: slice | None = None  # token range of the patch being computed; None = whole image
        self.store_whole = True  # whether a whole-image pass stores its K/V (only the last warm-up step must)
        self.part: BatchPart | None = None  # batch rows of the whole-image pass being computed; None = all
        self.num_tokens = 0  # tokens of the whole image in the current request

    def reset(self, num_tokens: int) -> None:
        """Start a request of ``num_tokens`` image tokens: forget every K/V (buffers are reused if shapes match)."""
        self._valid = dict.fromkeys(self._valid, 0)
        self.tokens, self.num_tokens = None, num_tokens

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def _buffers(self, layer: int, like: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, like.shape[1], self.num_tokens, like.shape[3])  # (B, heads, tokens, head_dim)
        k = self._k.get(layer)
        if k is None or k.shape != shape or k.dtype != like.dtype or k.device != like.device:
            # Allocated once per (request shape, dtype): the hot path only copies into it.
            self._k[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._v[layer] = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._valid[layer] = 0
        return self._k[layer], self._v[layer]

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
