"""``ForwardPlan``: what xfuse needs to know of a diffusers transformer to run its own ``forward`` through PipeFusion.

The rest comes from the model itself: where its sequence is split and gathered is its context-parallel plan
(``_cp_plan``, the ``ContextParallelInput`` / ``ContextParallelOutput`` entries diffusers' ``enable_parallelism``
reads), and every attention it computes goes through ``diffusers.models.attention_dispatch.dispatch_attention_fn``.
A plan is facts only (no torch, no diffusers): a family's ``spec.py`` writes it beside its ``ModelSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass

LATENT_LAYOUTS = ("packed", "video")  # how the engine's (B, C, rows, W) grid is the transformer's latent input


@dataclass(frozen=True)
class ForwardPlan:
    """How the transformer's ``forward`` runs one pass of PipeFusion (``xfuse.families.generic.stage``).

    Attributes:
        blocks: the ``nn.ModuleList`` attributes of the transformer holding its blocks, in the order its forward
            runs them (indexed as one chain, as ``ModelSpec.num_blocks`` counts them).
        block_returns: what a block returns, as the names of the inputs of the next block those outputs are, in
            return order (FLUX.1: ``("encoder_hidden_states", "hidden_states")``; one name: a block returns a tensor).
        context: the context-parallel plan's split inputs that are not the image's tokens, as ``"module:name"``
            (``":encoder_hidden_states"``: the forward's own input) or ``"module:index"`` (an output): the step's
            first patch (and a whole-image pass) carries all of them, the other patches none, so the text a block
            updates is computed once a step and its K/V are the ones every later patch attends to.
        uncut: the context-parallel plan's split inputs the generic family leaves whole on every pass, as
            ``"module:name"``: a context the blocks only read, through cross-attention (LTX's text and its mask:
            diffusers splits them over ranks and its attention gathers them back; a patch's queries need all of it).
        hidden: the block input that is the image's hidden states (the hand-off between ranks).
        text_stream: the block input that is a text stream the blocks update (an MMDiT's; the plan's ``"text"``
            stream, handed on with a step's first patch); ``None``: the blocks only read their context.
        text_first: the joint attention's sequence is [text, image] (FLUX.1, Qwen-Image) or [image, text].
        latent_input: the forward's argument that takes the latent.
        joined: the block lists whose blocks take the text stream joined in front of the image's hidden states, in
            ``hidden`` (B, text + image tokens, D), and return that one tensor (FLUX.2's single-stream blocks, after
            its forward's ``torch.cat([encoder_hidden_states, hidden_states])``): the pass splits and joins them at the
            hand-offs, so a rank hands on the text stream and the image's hidden states as with the other lists.
        latent_layout: the transformer's latent input as the engine's grid: ``packed`` (B, rows * cols, C), one
            token per grid cell, row-major (FLUX.1's packed latents); ``video`` (B, C, frames, H, W), the frames
            stacked as the grid's rows (``xfuse.parallel.video_layout``).
    """

    blocks: tuple[str, ...]
    block_returns: tuple[str, ...]
    latent_layout: str
    context: tuple[str, ...] = ()
    uncut: tuple[str, ...] = ()
    hidden: str = "hidden_states"
    text_stream: str | None = None
    text_first: bool = True
    latent_input: str = "hidden_states"
    joined: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.latent_layout not in LATENT_LAYOUTS:
            raise ValueError(f"latent_layout must be one of {', '.join(LATENT_LAYOUTS)} (got {self.latent_layout!r})")
        for name in (self.hidden, self.text_stream):
            if name is not None and name not in self.block_returns:
                raise ValueError(f"{name!r} is not among the block's returns {self.block_returns}")
        if self.joined and self.text_stream is None:
            raise ValueError("joined block lists need the text stream they join (text_stream)")
        for name in self.joined:
            if name not in self.blocks:
                raise ValueError(f"joined block list {name!r} is not among the blocks {self.blocks}")
        for entry in (*self.context, *self.uncut):
            if ":" not in entry:
                raise ValueError(f"context entry {entry!r} must be 'module:input' (':name' for the forward's own)")
