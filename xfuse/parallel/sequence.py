"""Sequence parallelism inside a pipeline stage: Ulysses and Ring attention over the stage's SP group.

The ``ulysses × ring`` ranks of an SP group run the same blocks on the same pass; each holds one contiguous chunk of
the pass's tokens (``token_chunks``; SP index ``ring_index * ulysses + ulysses_index`` holds chunk number SP index).
Everything token-wise (projections, MLPs, norms, modulation, long skips) runs on the chunk as it is; only attention
reads other tokens:

* **Ulysses** (DeepSpeed-Ulysses; xDiT's USP): an all-to-all over the Ulysses group turns (my chunk's tokens, every
  head) into (the group's chunks' tokens, my ``heads / ulysses`` heads); attention runs whole on those heads; a
  second all-to-all brings the output back to (my tokens, every head). The K/V buffers hold every token of the
  image for the rank's heads, so PipeFusion's stale K/V work per patch as without SP.
* **Ring**: each ring rank keeps the K/V of its ring chunk (the chunks of its Ulysses group); the blocks travel
  around the ring while each rank attends to the one it holds, and the partial results merge exactly by their
  log-sum-exp (``xfuse.parallel.lse_attention``), in ring order on every rank.
* **Text in the same softmax** (SD3, FLUX) is replicated on every rank: its queries run on every rank, its K/V are
  one more block; Ulysses takes the rank's heads of it and gathers the heads of the text output, so every rank
  holds the same text afterwards.

Messages go over this rank's P2P channels to its SP peers: the same bounded buffers and waits, and on a failure the
same report (rank, peer, op, kind, step, patch) as the pipeline's hand-offs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xfuse.comm.p2p import P2PChannels, Recv, Send
from xfuse.errors import ConfigError
from xfuse.parallel.lse_attention import attention_with_lse, merge_partials
from xfuse.parallel.pass_attention import QKV, joint_sdpa
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.stale_kv import StaleKVCache


def _only_copy(received: dict[int, torch.Tensor]) -> torch.Tensor:
    """The one tensor received, copied out of its pooled buffer."""
    (tensor,) = received.values()
    return tensor.clone()


def check_sequence_chunks(grid: PatchGrid, ulysses: int, ring: int) -> None:
    """Every pass over ``grid`` (a patch, or the whole image) leaves each of the ``ulysses * ring`` ranks of an SP
    group at least one token; :class:`ConfigError` naming the degree otherwise (the same on every rank)."""
    degree, smallest = ulysses * ring, min(band.num_tokens for band in grid)
    if degree > 1 and smallest < degree:
        key = "parallel.ring_degree" if ulysses == 1 else "parallel.ulysses_degree"
        raise ConfigError(
            key,
            f"parallel.ulysses_degree ({ulysses}) x parallel.ring_degree ({ring}) = {degree} ranks share every "
            f"pass's tokens, but the smallest patch of this {grid.token_rows}x{grid.token_cols}-token image has "
            f"{smallest}: use fewer sequence-parallel ranks, fewer patches or a larger image",
        )


def token_chunks(tokens: slice, parts: int) -> list[slice]:
    """``tokens`` cut into ``parts`` contiguous chunks, the first ``len % parts`` one token longer
    (``torch.tensor_split``'s rule)."""
    base, extra = divmod(tokens.stop - tokens.start, parts)
    chunks, start = [], tokens.start
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        chunks.append(slice(start, stop))
        start = stop
    return chunks


class SequenceParallel:
    """One rank's place in its SP group and the attention it computes with the group (module docstring).

    Args:
        ulysses, ring: the degrees; the group has ``ulysses * ring`` ranks.
        index: this rank's SP index, ``ring_index * ulysses + ulysses_index``.
        group_ranks: global rank of each SP index.
        channels: P2P channels to the group's other ranks (``None`` only for a group of one).
    """

    def __init__(self, *, ulysses: int, ring: int, index: int, group_ranks: list[int], channels: P2PChannels | None):
        if ulysses < 1 or ring < 1 or len(group_ranks) != ulysses * ring or not 0 <= index < ulysses * ring:
            raise ValueError(f"SP group of {ulysses} x {ring} ranks: index {index}, group ranks {group_ranks}")
        if ulysses * ring > 1 and channels is None:
            raise ValueError("an SP group of more than one rank needs channels")
        self.ulysses, self.ring, self.index = ulysses, ring, index
        self.ring_index, self.ulysses_index = divmod(index, ulysses)
        self.group_ranks, self.channels = list(group_ranks), channels
        self.step: int = 0  # the task being computed: labels of the messages (set by begin_task)
        self.patch: int | None = None
        self._tokens = slice(0, 0)  # the current pass's token range (set by begin_pass)
        self._bands: list[slice] = []  # the request's patches' token ranges (set by begin_request)
        self._layout: list[list[slice]] = []  # ring rank -> where it keeps each patch's ring chunk (ring_layout)

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    def begin_task(self, step: int, patch: int | None) -> None:
        self.step, self.patch = step, patch

    def begin_pass(self, tokens: slice) -> None:
        """The pass about to run covers image tokens ``tokens`` (every rank of the group holds a chunk of them)."""
        self._tokens = tokens

    # --- layout ---------------------------------------------------------------------------------------------
    def local(self, tokens: slice) -> slice:
        """This rank's chunk of ``tokens``."""
        return token_chunks(tokens, self.degree)[self.index]

    def ring_chunk(self, tokens: slice, ring_index: int) -> slice:
        """The tokens ring rank ``ring_index``'s Ulysses group holds: its ranks' chunks, contiguous."""
        chunks = token_chunks(tokens, self.degree)
        return slice(chunks[ring_index * self.ulysses].start, chunks[(ring_index + 1) * self.ulysses - 1].stop)

    def begin_request(self, grid: PatchGrid) -> int:
        """Start a request on ``grid``; returns the tokens this rank's K/V buffers hold.

        Ulysses alone: every token of the image (for the rank's heads), at its own position. Under Ring a rank keeps
        its ring chunk of every patch, laid out patch after patch (``ring_layout``): a patch pass writes its ring
        chunk in place, and a whole-image pass that must be stored for the patches that follow hands each ring rank
        the tokens it keeps (``_store_by_patch``)."""
        self._bands = [band.tokens for band in grid]
        self._layout = [self.ring_layout(r) for r in range(self.ring)]
        return self._layout[self.ring_index][-1].stop

    def ring_layout(self, ring_index: int) -> list[slice]:
        """Where ring rank ``ring_index`` keeps each patch's ring chunk in its K/V buffers (patch after patch)."""
        ranges, start = [], 0
        for tokens in self._bands:
            chunk = self.ring_chunk(tokens, ring_index)
            ranges.append(slice(start, start + chunk.stop - chunk.start))
            start = ranges[-1].stop
        return ranges

    def cache_range(self, tokens: slice) -> slice:
        """The K/V buffer range a patch pass over ``tokens`` writes: the patch's own tokens (Ulysses), or where this
        ring rank keeps the patch's ring chunk (Ring)."""
        if self.ring == 1:
            return tokens
        return self._layout[self.ring_index][self._bands.index(tokens)]

    # --- attention ------------------------------------------------------------------------------------------
    def attend(self, cache: StaleKVCache, layer, image: QKV, text: QKV | None, text_first: bool):
        """The attention of this rank's chunk (and of the replicated text queries) over the whole pass's K/V (fresh
        for the pass's tokens, stale for the rest from ``cache``, where this rank keeps its share of ``layer``'s)
        and the text's. Returns (image output of my chunk, text output), each (B, heads, tokens, head_dim)."""
        query, key, value = image  # (B, heads, my tokens, head_dim)
        heads = query.shape[1]
        if self.ulysses > 1:
            query, key, value = self._to_heads(torch.stack((query, key, value)))  # (B, heads/U, ring chunk, d) each
            if text is not None:
                mine = self._my_heads(heads)
                text = (text[0][:, mine], text[1][:, mine], text[2][:, mine])  # (B, heads/U, T, d) each
        if self.ring == 1:
            key, value = cache.update(layer, key, value)
            image_out, text_out = joint_sdpa(query, key, value, text, text_first)
        else:
            if cache.tokens is None:  # a whole-image pass attends to its own K/V; the patches' layout is kept apart
                if cache.store_whole and len(self._bands) > 1:
                    self._store_by_patch(cache, layer, key, value)
                sizes = [self._size(self.ring_chunk(self._tokens, r)) for r in range(self.ring)]
            else:
                key, value = cache.update(layer, key, value)  # every patch's ring chunk kept so far, stale or fresh
                kept = len([r for r in self._layout[self.ring_index] if r.stop <= key.shape[2]])
                sizes = [layout[kept - 1].stop for layout in self._layout]  # every ring rank has kept as many
            image_out, text_out = self._ring_attention(query, key, value, sizes, text, text_first)
        if self.ulysses > 1:
            image_out = self._to_tokens(image_out, heads)
            if text_out is not None:  # a later patch's text has no queries: nothing to gather
                text_out = self._gather_heads(text_out) if text_out.shape[2] else text_out.repeat(1, self.ulysses, 1, 1)
        return image_out, text_out

    def _my_heads(self, heads: int) -> slice:
        size = heads // self.ulysses
        return slice(self.ulysses_index * size, (self.ulysses_index + 1) * size)

    def _ulysses_peer(self, ulysses_index: int) -> int:
        return self.ring_index * self.ulysses + ulysses_index

    def _chunk_sizes(self) -> list[int]:
        """Token counts of my Ulysses group's chunks of the current pass, by Ulysses index."""
        chunks = token_chunks(self._tokens, self.degree)
        return [chunks[self._ulysses_peer(u)].stop - chunks[self._ulysses_peer(u)].start for u in range(self.ulysses)]

    def _to_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """Ulysses all-to-all: (n, B, heads, my tokens, d) -> (n, B, heads/U, ring chunk tokens, d)."""
        n, batch, heads, _, head_dim = packed.shape
        size, sizes = heads // self.ulysses, self._chunk_sizes()
        sends = {
            self._ulysses_peer(u): packed[:, :, u * size : (u + 1) * size].contiguous()
            for u in range(self.ulysses)
            if u != self.ulysses_index
        }
        recvs = {
            self._ulysses_peer(u): (n, batch, size, sizes[u], head_dim)
            for u in range(self.ulysses)
            if u != self.ulysses_index
        }
        mine = packed[:, :, self._my_heads(heads)]

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            pieces = [mine if u == self.ulysses_index else received[self._ulysses_peer(u)] for u in range(self.ulysses)]
            return torch.cat(pieces, dim=3)  # chunks in token order -> (n, B, heads/U, ring chunk, d)

        return self._exchange("ulysses qkv", sends, recvs, packed.dtype, join)

    def _to_tokens(self, out: torch.Tensor, heads: int) -> torch.Tensor:
        """Ulysses all-to-all back: (B, heads/U, ring chunk tokens, d) -> (B, heads, my tokens, d)."""
        batch, size, _, head_dim = out.shape
        sizes = self._chunk_sizes()
        pieces = out.split(sizes, dim=2)  # by Ulysses index, each (B, heads/U, that rank's tokens, d)
        sends = {self._ulysses_peer(u): pieces[u].contiguous() for u in range(self.ulysses) if u != self.ulysses_index}
        mine_tokens = sizes[self.ulysses_index]
        recvs = {
            self._ulysses_peer(u): (batch, size, mine_tokens, head_dim)
            for u in range(self.ulysses)
            if u != self.ulysses_index
        }

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            by_heads = [
                pieces[u] if u == self.ulysses_index else received[self._ulysses_peer(u)] for u in range(self.ulysses)
            ]
            return torch.cat(by_heads, dim=1)  # head groups in order -> (B, heads, my tokens, d)

        return self._exchange("ulysses out", sends, recvs, out.dtype, join)

    def _gather_heads(self, out: torch.Tensor) -> torch.Tensor:
        """The replicated text's output: (B, heads/U, T, d) of my heads -> (B, heads, T, d) from the Ulysses group."""
        out = out.contiguous()
        peers = [self._ulysses_peer(u) for u in range(self.ulysses) if u != self.ulysses_index]

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            peers = range(self.ulysses)
            return torch.cat([out if u == self.ulysses_index else received[self._ulysses_peer(u)] for u in peers], 1)

        return self._exchange("ulysses text", dict.fromkeys(peers, out), dict.fromkeys(peers, tuple(out.shape)),
                              out.dtype, join)  # fmt: skip

    @staticmethod
    def _size(tokens: slice) -> int:
        return tokens.stop - tokens.start

    def _store_by_patch(self, cache: StaleKVCache, layer, key: torch.Tensor, value: torch.Tensor) -> None:
        """A whole-image pass's K/V (my ring chunk of the image, (B, heads, tokens, d)) into the ring ranks' layout by
        patch: each ring rank gets, for every patch, the part of its ring chunk of the patch that I computed."""
        mine = self.ring_chunk(self._tokens, self.ring_index)
        packed = torch.stack((key, value))  # (2, B, heads, my ring chunk, d)

        def pieces(holder: slice, keeper: int) -> list[tuple[slice, slice]]:
            """(range in the holder's whole-image chunk, range in the keeper's buffers) of every patch."""
            out = []
            for tokens, place in zip(self._bands, self._layout[keeper], strict=True):
                chunk = self.ring_chunk(tokens, keeper)
                start, stop = max(chunk.start, holder.start), min(chunk.stop, holder.stop)
                if start < stop:
                    offset = place.start - chunk.start
                    out.append((slice(start - holder.start, stop - holder.start), slice(start + offset, stop + offset)))
            return out

        def peer(r: int) -> int:
            return r * self.ulysses + self.ulysses_index

        sends, recvs, incoming = {}, {}, {}
        for r in range(self.ring):
            if r != self.ring_index:
                out = pieces(mine, r)
                if out:
                    sends[peer(r)] = torch.cat([packed[:, :, :, src] for src, _ in out], dim=3).contiguous()
                holder = self.ring_chunk(self._tokens, r)
                incoming[peer(r)] = pieces(holder, self.ring_index)
                if incoming[peer(r)]:
                    tokens = sum(self._size(src) for src, _ in incoming[peer(r)])
                    recvs[peer(r)] = (*packed.shape[:3], tokens, packed.shape[4])
        for src, dst in pieces(mine, self.ring_index):  # what I keep of my own
            cache.store(layer, packed[0][:, :, src], packed[1][:, :, src], dst)

        def store(received: dict[int, torch.Tensor]) -> None:
            for source, tensor in received.items():
                pieces_in = incoming[source]
                parts = tensor.split([self._size(src) for src, _ in pieces_in], dim=3)
                for part, (_, dst) in zip(parts, pieces_in, strict=True):
                    cache.store(layer, part[0], part[1], dst)

        self._finish(self._post("ring store", sends, recvs, packed.dtype), store)

    def _ring_attention(self, query, key, value, sizes: list[int], text: QKV | None, text_first: bool):
        """Ring: my queries (and the text's) over every ring rank's K/V block (ring rank r's has ``sizes[r]`` tokens),
        passed around the ring; the partial results merged by log-sum-exp in a fixed order (text, then ring rank 0,
        1, …) so every rank computes the replicated text's output bit for bit alike."""
        text_len = 0 if text is None else text[0].shape[2]
        if text_len:
            query = torch.cat((text[0], query) if text_first else (query, text[0]), dim=2)  # type: ignore[index]
        partials: list = [None] * self.ring
        text_partial = attention_with_lse(query, text[1], text[2]) if text is not None and text[1].shape[2] else None
        block = torch.stack((key, value))  # (2, B, heads, ring chunk tokens, d)
        batch, heads, _, head_dim = key.shape
        after, before = (self.ring_index + 1) % self.ring, (self.ring_index - 1) % self.ring
        for hop in range(self.ring):
            holder = (self.ring_index - hop) % self.ring  # whose block this rank holds at this hop
            if hop == self.ring - 1:
                partials[holder] = attention_with_lse(query, block[0], block[1])
                break
            source = (holder - 1) % self.ring  # the block arriving next: the one the previous rank holds now
            shape = (2, batch, heads, sizes[source], head_dim)
            peer_after = after * self.ulysses + self.ulysses_index
            peer_before = before * self.ulysses + self.ulysses_index
            # The next block travels while this one is attended to.
            pending = self._post("ring kv", {peer_after: block.contiguous()}, {peer_before: shape}, block.dtype)
            partials[holder] = attention_with_lse(query, block[0], block[1])
            block = self._finish(pending, _only_copy)  # a copy: the pooled buffer takes the next message
        ordered = ([text_partial] if text_partial is not None else []) + partials
        out = merge_partials(ordered)  # (B, heads, [text +] my queries, d)
        if not text_len:
            return out, (None if text is None else out[:, :, :0])
        if text_first:
            return out[:, :, text_len:], out[:, :, :text_len]
        return out[:, :, : out.shape[2] - text_len], out[:, :, out.shape[2] - text_len :]

    # --- messages -------------------------------------------------------------------------------------------
    def _post(self, kind: str, sends: dict[int, torch.Tensor], recvs: dict[int, tuple], dtype: torch.dtype):
        assert self.channels is not None
        ranks = self.group_ranks
        send_handles, recv_handles = self.channels.exchange(
            [Send(ranks[i], kind, tensor, self.step, self.patch) for i, tensor in sends.items()],
            [Recv(ranks[i], kind, shape, dtype, self.step, self.patch) for i, shape in recvs.items()],
        )
        return list(recvs), send_handles, recv_handles

    @staticmethod
    def _finish(pending, use: Callable[[dict[int, torch.Tensor]], Any]) -> Any:
        """Wait for a posted exchange, ``use`` the received tensors (SP index -> tensor) before their buffers go back
        to the pool, and wait for the sends (their tensors may be reused after)."""
        sources, send_handles, recv_handles = pending
        received = {source: handle.wait() for source, handle in zip(sources, recv_handles, strict=True)}
        try:
            result = use(received)
        finally:
            for handle in recv_handles:
                handle.release()
        for handle in send_handles:
            handle.wait()
        return result

    def _exchange(self, kind, sends, recvs, dtype, use) -> torch.Tensor:
        return self._finish(self._post(kind, sends, recvs, dtype), use)

    def gather_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, my tokens, D) -> (B, the pass's tokens, D): every rank's chunk, in token order (the output layer and
        unpatchify need whole rows)."""
        hidden = hidden.contiguous()
        batch, _, width = hidden.shape
        chunks = token_chunks(self._tokens, self.degree)
        peers = [i for i in range(self.degree) if i != self.index]
        recvs = {i: (batch, chunks[i].stop - chunks[i].start, width) for i in peers}

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            return torch.cat([hidden if i == self.index else received[i] for i in range(self.degree)], dim=1)

        return self._exchange("sp gather", dict.fromkeys(peers, hidden), recvs, hidden.dtype, join)
