"""Sequence parallelism inside a pipeline stage: Ulysses and Ring attention over the stage's SP group.

The ``ulysses × ring`` ranks of an SP group run the same blocks on the same pass; each holds one contiguous chunk of
the pass's tokens (``token_chunks``; SP index ``ring_index * ulysses + ulysses_index`` holds chunk number SP index).
Everything token-wise (projections, MLPs, norms, modulation, long skips) runs on the chunk as it is; only attention
reads other tokens:

* **Ulysses** (DeepSpeed-Ulysses; xDiT's USP): an all-to-all over the Ulysses group turns (my chunk's tokens, every
  head) into (the group's chunks' tokens, my group of heads: as even as the head count allows, so the degree need
  not divide it, xDiT's "Ulysses anything"); attention runs whole on those heads; a
  second all-to-all brings the output back to (my tokens, every head). The K/V buffers hold every token of the
  image for the rank's heads, so PipeFusion's stale K/V work per patch as without SP.
* **Ring**: each ring rank keeps the K/V of its ring chunk (the chunks of its Ulysses group); the blocks travel
  around the ring while each rank attends to the one it holds, and the partial results merge exactly by their
  log-sum-exp (``xfuse.parallel.lse_attention``), in ring order on every rank.
* **Text in the same softmax** (SD3, FLUX) is chunked like the image: each rank runs its chunk of the text stream
  through the blocks; Ulysses sends the text chunks behind the image's (and the output back the same way), Ring
  puts each rank's text chunk at the head of its K/V block. The text K/V a step's first patch recorded are the
  exchanged ones, so later patches reuse them without messages.

Messages go over this rank's P2P channels to its SP peers: the same bounded buffers and waits, and on a failure the
same report (rank, peer, op, kind, step, patch) as the pipeline's hand-offs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from xfuse.comm.p2p import P2PChannels, Recv, Send
from xfuse.parallel.joint_sdpa import QKV, TextAttention, join_text, joint_sdpa, split_text
from xfuse.parallel.lse_attention import attention_with_lse, merge_partials
from xfuse.parallel.patch_grid import PatchGrid, even_split
from xfuse.parallel.stale_kv import StaleKVCache


def _only_copy(received: dict[int, torch.Tensor]) -> torch.Tensor:
    """The one tensor received, copied out of its pooled buffer."""
    (tensor,) = received.values()
    return tensor.clone()


def token_chunks(tokens: slice, parts: int) -> tuple[slice, ...]:
    """``tokens`` cut into ``parts`` contiguous chunks, the first ``len % parts`` one token longer
    (``torch.tensor_split``'s rule)."""
    return _chunks(tokens.start, tokens.stop, parts)


@functools.lru_cache(maxsize=256)  # asked per layer and per message of every pass: a request has few distinct ranges
def _chunks(start: int, stop: int, parts: int) -> tuple[slice, ...]:
    chunks = []
    for size in even_split(stop - start, parts):
        chunks.append(slice(start, start + size))
        start += size
    return tuple(chunks)


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
        # Ulysses posts a message's receives before the peers send it where it knows the shapes early: the output's
        # before the attention, and the next attention's q/k/v after this one, from the shapes an earlier pass of the
        # same blocks, tokens and first exchange made (SD3.5's dual-attention blocks alternate two). A send then
        # lands in a posted buffer instead of waiting in the socket for the peer to post it (gloo), which is what
        # kept the ranks waiting in each other's exchanges.
        self._pass: tuple = ()  # (blocks, tokens) of the current pass
        self._qkv_shapes: list[tuple] = []  # its q/k/v exchanges' receive shapes so far, by SP index
        self._passes: dict[tuple, list[tuple]] = {}  # (blocks, tokens, first exchange) -> every exchange's shapes
        self._next_qkv: tuple[tuple, Any] | None = None  # the next q/k/v exchange's posted receives (shapes, ops)

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    def begin_task(self, step: int, patch: int | None) -> None:
        self.step, self.patch = step, patch

    def begin_pass(self, tokens: slice, blocks: tuple[int, ...] = ()) -> None:
        """The pass about to run covers image tokens ``tokens`` (every rank of the group holds a chunk of them) through
        ``blocks`` (a route segment, or with step caching part of one: block 0 runs as a pass of its own)."""
        if self._next_qkv is not None:
            raise RuntimeError("SequenceParallel: q/k/v receives posted for an attention the last pass did not make")
        self._tokens, self._pass, self._qkv_shapes = tokens, (blocks, tokens.start, tokens.stop), []

    def end_pass(self) -> None:
        """Remember the pass's q/k/v exchanges for the next pass of the same blocks, tokens and first exchange."""
        if self._next_qkv is not None:
            raise RuntimeError("SequenceParallel: q/k/v receives posted for an attention the pass did not make")
        if self._qkv_shapes:
            self._passes[self._pass + (self._qkv_shapes[0],)] = self._qkv_shapes

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a few elements) summed over the group, in SP index order: every rank gets the same bits."""
        if self.degree == 1:
            return values
        values = values.contiguous()
        peers = [i for i in range(self.degree) if i != self.index]

        def total(received: dict[int, torch.Tensor]) -> torch.Tensor:
            out = torch.zeros_like(values)
            for i in range(self.degree):
                out += values if i == self.index else received[i]
            return out

        shapes = dict.fromkeys(peers, tuple(values.shape))
        return self._exchange("sp sum", dict.fromkeys(peers, values), shapes, values.dtype, total)

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
        self._passes.clear()  # shapes are learnt per request (a server's requests come in many sizes)
        return self._layout[self.ring_index][-1].stop

    def ring_layout(self, ring_index: int) -> list[slice]:
        """Where ring rank ``ring_index`` keeps each patch's ring chunk in its K/V buffers (patch after patch)."""
        ranges, start = [], 0
        for tokens in self._bands:
            ranges.append(slice(start, start + self._size(self.ring_chunk(tokens, ring_index))))
            start = ranges[-1].stop
        return ranges

    def cache_range(self, tokens: slice) -> slice:
        """The K/V buffer range a patch pass over ``tokens`` writes: the patch's own tokens (Ulysses), or where this
        ring rank keeps the patch's ring chunk (Ring)."""
        if self.ring == 1:
            return tokens
        return self._layout[self.ring_index][self._bands.index(tokens)]

    # --- attention ------------------------------------------------------------------------------------------
    def attend(self, cache: StaleKVCache, layer, image: QKV, text: TextAttention | None):
        """The attention of this rank's chunk (and of its chunk of the text's queries) over the whole pass's K/V
        (fresh for the pass's tokens, stale for the rest from ``cache``, where this rank keeps its share of
        ``layer``'s) and the whole text's. Returns (image output of my chunk, text output of my text chunk or
        None), each (B, heads, tokens, head_dim)."""
        query, key, value = image  # (B, heads, my tokens, head_dim)
        heads, batch, head_dim = query.shape[1], query.shape[0], query.shape[3]
        image_sizes = self._chunk_sizes(self._tokens)
        fresh_text = text is not None and text.fresh  # this pass's text tokens travel (else: recorded K/V only)
        text_sizes = [0] * self.ulysses
        if text is not None and text.fresh:
            text_sizes = self._chunk_sizes(slice(0, text.tokens))
        text_qkv = None if text is None else (text.query, text.key, text.value)
        if self.ulysses > 1:  # (B, heads, my tokens, d) -> (B, my heads, my Ulysses group's tokens, d)
            # the text's chunks travel behind the image's: [image, text] per rank
            parts = (image, text_qkv) if fresh_text else (image,)
            image_qkv, joined = self._to_heads(parts, image_sizes, text_sizes)  # type: ignore[arg-type]
            query, key, value = image_qkv[0], image_qkv[1], image_qkv[2]
            if text is not None:
                if text.fresh:
                    text_qkv = (joined[0], joined[1], joined[2])
                else:  # a later patch: no text tokens to send, its K/V are the recorded ones
                    mine = self._my_heads(heads)
                    text_qkv = (text.query[:, mine], text.key[:, mine], text.value[:, mine])
        if text is not None:
            assert text_qkv is not None
            text_qkv = (text_qkv[0], *text.record(text_qkv[1], text_qkv[2]))  # recorded by the owner, else reused
        out_recvs = None
        if self.ulysses > 1:  # the output's receives, posted before the attention (see __init__)
            held = image_sizes[self.ulysses_index] + text_sizes[self.ulysses_index]
            # rank u sends me its heads' output for my tokens: (B, rank u's heads, my tokens, d)
            groups = self._head_groups(heads)
            shapes = {self._ulysses_peer(u): (batch, self._size(groups[u]), held, head_dim)
                      for u in range(self.ulysses) if u != self.ulysses_index}  # fmt: skip
            out_recvs = self._post("ulysses out", {}, shapes, query.dtype)
        if self.ring == 1:
            key, value = cache.update(layer, key, value)
            image_out, text_out = joint_sdpa(query, key, value, text_qkv, text is not None and text.text_first,
                                             None if text is None else text.key_mask)  # fmt: skip
        else:
            if cache.tokens is None:  # a whole-image pass attends to its own K/V; the patches' layout is kept apart
                if cache.store_whole and len(self._bands) > 1:
                    self._store_by_patch(cache, layer, key, value)
                sizes = [self._size(self.ring_chunk(self._tokens, r)) for r in range(self.ring)]
            else:
                key, value = cache.update(layer, key, value)  # every patch's ring chunk kept so far, stale or fresh
                kept = len([r for r in self._layout[self.ring_index] if r.stop <= key.shape[2]])
                sizes = [layout[kept - 1].stop for layout in self._layout]  # every ring rank has kept as many
            masks = None
            if text is not None:  # every ring rank's block leads with its ring chunk of the text
                chunks = [self.ring_chunk(slice(0, text.tokens), r) for r in range(self.ring)]
                if text.key_mask is not None:  # the attended keys of each ring rank's block: its text chunk's, then all
                    masks = [torch.cat((text.key_mask[:, chunk], text.key_mask.new_ones((batch, n))), dim=1)
                             for chunk, n in zip(chunks, sizes, strict=True)]  # fmt: skip
                sizes = [n + self._size(chunk) for chunk, n in zip(chunks, sizes, strict=True)]
            image_out, text_out = self._ring_attention(query, key, value, sizes, text_qkv,
                                                       text is not None and text.text_first, masks)  # fmt: skip
        if self.ulysses > 1:  # back to (B, heads, my tokens, d)
            outs = image_out.split(image_sizes, dim=2)
            if fresh_text:  # each rank's text output travels behind its image output
                assert text_out is not None
                outs = [torch.cat(pair, dim=2) for pair in zip(outs, text_out.split(text_sizes, dim=2), strict=True)]
            held = image_sizes[self.ulysses_index] + text_sizes[self.ulysses_index]
            assert out_recvs is not None
            image_out = self._to_tokens(list(outs), heads, held, out_recvs)
            if text_out is not None:
                n = image_sizes[self.ulysses_index]
                image_out, text_out = image_out[:, :, :n], image_out[:, :, n:]
            known = self._passes.get(self._pass + (self._qkv_shapes[0],), [])
            if len(known) > len(self._qkv_shapes):  # the pass's next attention, as an earlier pass made it
                upcoming = known[len(self._qkv_shapes)]
                self._next_qkv = (upcoming, self._post("ulysses qkv", {}, dict(upcoming), query.dtype))
        return image_out, text_out

    def _head_groups(self, heads: int) -> tuple[slice, ...]:
        """The heads each Ulysses rank attends with, by Ulysses index: contiguous groups as even as ``heads`` allows
        (the first ``heads % ulysses`` one head larger), so a degree need not divide the head count (Z-Image's 30
        heads over 4 ranks: 8, 8, 7, 7)."""
        return _chunks(0, heads, self.ulysses)

    def _my_heads(self, heads: int) -> slice:
        return self._head_groups(heads)[self.ulysses_index]

    def _ulysses_peers(self) -> list[int]:
        """SP indices of my Ulysses group's other ranks."""
        return [self._ulysses_peer(u) for u in range(self.ulysses) if u != self.ulysses_index]

    def _ulysses_peer(self, ulysses_index: int) -> int:
        """SP index of my Ulysses group's rank ``ulysses_index``."""
        return self.ring_index * self.ulysses + ulysses_index

    def _ring_peer(self, ring_index: int) -> int:
        """SP index of my ring's rank ``ring_index`` (the ranks with my Ulysses index)."""
        return ring_index * self.ulysses + self.ulysses_index

    def _chunk_sizes(self, tokens: slice) -> list[int]:
        """Token counts of my Ulysses group's chunks of ``tokens``, by Ulysses index."""
        chunks = token_chunks(tokens, self.degree)
        return [self._size(chunks[self._ulysses_peer(u)]) for u in range(self.ulysses)]

    def _to_heads(self, parts: tuple[QKV, ...], image_sizes: list[int], text_sizes: list[int]):
        """Ulysses all-to-all: my (image, then text) q/k/v chunks, (B, heads, my tokens, d) each, -> my Ulysses
        group's image tokens and text tokens for my heads, (3, B, heads/U, tokens, d) each, in token order (rank u
        sends ``image_sizes[u]`` then ``text_sizes[u]`` tokens). Rank u's heads are ``_head_groups``' u-th."""
        batch, heads, _, head_dim = parts[0][0].shape
        groups = self._head_groups(heads)
        mine = groups[self.ulysses_index]
        peers = [u for u in range(self.ulysses) if u != self.ulysses_index]
        held = image_sizes[self.ulysses_index] + text_sizes[self.ulysses_index]

        def pack(u: int) -> torch.Tensor:  # one copy of what rank u gets: (3, B, rank u's heads, my tokens, d)
            out = parts[0][0].new_empty((3, batch, self._size(groups[u]), held, head_dim))
            start = 0
            for qkv in parts:
                stop = start + qkv[0].shape[2]
                for i, tensor in enumerate(qkv):
                    out[i, :, :, start:stop].copy_(tensor[:, groups[u]])
                start = stop
            return out

        sends = {self._ulysses_peer(u): pack(u) for u in peers}
        recvs = {self._ulysses_peer(u): (3, batch, self._size(mine), image_sizes[u] + text_sizes[u], head_dim)
                 for u in peers}  # fmt: skip

        def join(received: dict[int, torch.Tensor]):
            def gather(which: int, sizes: list[int]) -> torch.Tensor:  # (3, B, my heads, the group's tokens, d)
                out = parts[0][0].new_empty((3, batch, self._size(mine), sum(sizes), head_dim))
                start = 0
                for u, count in enumerate(sizes):
                    slot = out[:, :, :, start : start + count]
                    if u == self.ulysses_index:  # my own chunk: my heads of it, no message
                        for i, tensor in enumerate(parts[which]):
                            slot[i].copy_(tensor[:, mine])
                    else:  # rank u's message: [image, text] tokens
                        first = 0 if which == 0 else image_sizes[u]
                        slot.copy_(received[self._ulysses_peer(u)][:, :, :, first : first + count])
                    start += count
                return out

            return gather(0, image_sizes), (gather(1, text_sizes) if len(parts) > 1 else None)

        self._qkv_shapes.append(tuple(sorted(recvs.items())))
        if self._next_qkv is None:
            return self._exchange("ulysses qkv", sends, recvs, parts[0][0].dtype, join)
        (posted_shapes, posted), self._next_qkv = self._next_qkv, None
        if posted_shapes != self._qkv_shapes[-1]:  # a pass unlike the one it was taken for: a bug, not a retry
            raise RuntimeError(f"SequenceParallel: q/k/v receives posted as {posted_shapes}, the exchange is {recvs}")
        return self._send_after(posted, "ulysses qkv", sends, parts[0][0].dtype, join)

    def _to_tokens(self, pieces: list[torch.Tensor], heads: int, tokens: int, posted) -> torch.Tensor:
        """Ulysses all-to-all back: ``pieces[u]`` (B, my heads, rank u's tokens, d) goes to rank u; returns my
        ``tokens`` for all ``heads``, (B, heads, my tokens, d), as a view of a (B, my tokens, heads, d) tensor
        (merging heads is then free); rank u's (B, its heads, my tokens, d) receives are ``posted`` already."""
        peers = [u for u in range(self.ulysses) if u != self.ulysses_index]
        sends = {self._ulysses_peer(u): pieces[u].contiguous() for u in peers}
        batch, head_dim, groups = pieces[0].shape[0], pieces[0].shape[3], self._head_groups(heads)

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            out = pieces[0].new_empty((batch, tokens, heads, head_dim))  # (B, my tokens, heads, d)
            for u in range(self.ulysses):
                piece = pieces[u] if u == self.ulysses_index else received[self._ulysses_peer(u)]
                out[:, :, groups[u]].copy_(piece.transpose(1, 2))  # head group u
            return out.transpose(1, 2)  # -> (B, heads, my tokens, d)

        return self._send_after(posted, "ulysses out", sends, pieces[0].dtype, join)

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

        sends, recvs, incoming = {}, {}, {}
        for r in range(self.ring):
            if r != self.ring_index:
                peer, out = self._ring_peer(r), pieces(mine, r)
                if out:
                    sends[peer] = torch.cat([packed[:, :, :, src] for src, _ in out], dim=3)  # cat: contiguous
                incoming[peer] = pieces(self.ring_chunk(self._tokens, r), self.ring_index)
                if incoming[peer]:
                    tokens = sum(self._size(src) for src, _ in incoming[peer])
                    recvs[peer] = (*packed.shape[:3], tokens, packed.shape[4])
        for src, dst in pieces(mine, self.ring_index):  # what I keep of my own
            cache.store(layer, packed[0][:, :, src], packed[1][:, :, src], dst)

        def store(received: dict[int, torch.Tensor]) -> None:
            for source, tensor in received.items():
                pieces_in = incoming[source]
                parts = tensor.split([self._size(src) for src, _ in pieces_in], dim=3)
                for part, (_, dst) in zip(parts, pieces_in, strict=True):
                    cache.store(layer, part[0], part[1], dst)

        self._finish(self._post("ring store", sends, recvs, packed.dtype), store)

    def _ring_attention(self, query, key, value, sizes: list[int], text: QKV | None, text_first: bool,
                        masks: list[torch.Tensor] | None = None):  # fmt: skip
        """Ring: my queries (and my text queries) over every ring rank's K/V block (ring rank r's: its ring chunk of
        the text, then of the image, ``sizes[r]`` tokens), passed around the ring while the block held is attended
        to; the partial results merged by log-sum-exp in ring order. ``masks[r]``: (B, sizes[r]) bool, the keys of
        ring rank r's block attended to (a padded text's), ``None``: all."""
        if text is not None:
            query = join_text(query, text[0], text_first)
            key, value = torch.cat((text[1], key), dim=2), torch.cat((text[2], value), dim=2)
        partials: list = [None] * self.ring
        block = torch.stack((key, value))  # (2, B, heads, block tokens, d)
        batch, heads, _, head_dim = key.shape
        peer_after = self._ring_peer((self.ring_index + 1) % self.ring)
        peer_before = self._ring_peer((self.ring_index - 1) % self.ring)
        for hop in range(self.ring):
            holder = (self.ring_index - hop) % self.ring  # whose block this rank holds at this hop
            mask = None if masks is None else masks[holder]
            if hop == self.ring - 1:
                partials[holder] = attention_with_lse(query, block[0], block[1], mask)
                break
            source = (holder - 1) % self.ring  # the block arriving next: the one the previous rank holds now
            shape = (2, batch, heads, sizes[source], head_dim)
            # The next block travels while this one is attended to.
            pending = self._post("ring kv", {peer_after: block.contiguous()}, {peer_before: shape}, block.dtype)
            partials[holder] = attention_with_lse(query, block[0], block[1], mask)
            block = self._finish(pending, _only_copy)  # a copy: the pooled buffer takes the next message
        out = merge_partials(partials)  # (B, heads, [text +] my queries, d)
        return (out, None) if text is None else split_text(out, text[0].shape[2], text_first)

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

    def _send_after(self, posted, kind, sends, dtype, use) -> torch.Tensor:
        """An exchange whose receives were ``posted`` earlier (``_post`` with no sends): send, then finish both."""
        sources, _, recv_handles = posted
        _, send_handles, _ = self._post(kind, sends, {}, dtype)
        return self._finish((sources, send_handles, recv_handles), use)

    def gather_tokens(self, hidden: torch.Tensor, tokens: slice) -> torch.Tensor:
        """(B, my chunk of ``tokens``, D) -> (B, ``tokens``, D): every rank's chunk, in token order (the output layer
        and unpatchify need whole rows). ``tokens`` is named: with step caching the task's last pass may have been
        skipped, and the last pass this rank made another patch's."""
        hidden = hidden.contiguous()
        batch, _, width = hidden.shape
        chunks = token_chunks(tokens, self.degree)
        peers = [i for i in range(self.degree) if i != self.index]
        recvs = {i: (batch, self._size(chunks[i]), width) for i in peers}

        def join(received: dict[int, torch.Tensor]) -> torch.Tensor:
            return torch.cat([hidden if i == self.index else received[i] for i in range(self.degree)], dim=1)

        return self._exchange("sp gather", dict.fromkeys(peers, hidden), recvs, hidden.dtype, join)
