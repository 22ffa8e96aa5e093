"""Rank functions for the Z-Image tests (importable by spawned ranks)."""


def pipelined_with_band_positions(folder, parallel, calls):
    """``run_calls`` with an injected bug: a patch pass takes the first rows of the image's RoPE table (the band's
    positions counted from its own first row) instead of its own rows of the whole image's (whole-image passes are
    unaffected)."""
    import dataclasses

    from tests.support.pipeline_fns import run_calls
    from xfuse.families.zimage.stage import ZImageStage

    original = ZImageStage.block_kwargs

    def from_row_zero(self, cond, band, owner):
        if band is not None:
            tokens = self.hidden_tokens(band)
            shifted = cond.image_freqs.roll(tokens.start, dims=1)  # row 0's positions where the band's rows are
            cond = dataclasses.replace(cond, image_freqs=shifted)
        return original(self, cond, band, owner)

    ZImageStage.block_kwargs = from_row_zero
    try:
        return run_calls(folder, parallel, calls, family="z-image")
    finally:
        ZImageStage.block_kwargs = original


def from_pipe_call(parallel, call):
    """``from_pipe`` on the ``z-image-tiny`` preset (the same weights as its saved folder): rank 0's images, and the
    error ``from_pipe`` raises for a pipeline of another family (Qwen-Image's preset)."""
    from tests.support.pipeline_fns import as_array, generators
    from xfuse import PipeFusionZImagePipeline
    from xfuse.families.registry import load_pipeline

    try:
        PipeFusionZImagePipeline.from_pipe(load_pipeline("qwen-image-tiny"), parallel=parallel)
        refused = None
    except TypeError as err:
        refused = str(err)
    pipe = PipeFusionZImagePipeline.from_pipe(load_pipeline("z-image-tiny"), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call)
    out = pipe(**call, generator=generators(call))
    return refused, None if out is None else as_array(out)
