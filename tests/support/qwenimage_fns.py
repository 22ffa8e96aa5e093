"""Rank functions for the Qwen-Image tests (importable by spawned ranks)."""


def pipelined_forgetting_the_padding(folder, parallel, calls):
    """``run_calls`` with an injected bug: a patch pass attends over the joint K/V buffers without the text's padding
    mask (whole-image passes keep it), so a shorter prompt's padding leaks into every pipelined step."""
    from tests.support.pipeline_fns import run_calls
    from xfuse.parallel.joint_sdpa import TextAttention
    from xfuse.parallel.pass_attention import PassAttention

    original = PassAttention._joint_attention

    def unmasked(self, layer, query, key, value, text: TextAttention):
        if self.cache.tokens is not None:  # a patch pass
            text = TextAttention(text.query, text.key, text.value, text.tokens, text.fresh, text.text_first,
                                 text.record)  # fmt: skip
        return original(self, layer, query, key, value, text)

    PassAttention._joint_attention = unmasked
    try:
        return run_calls(folder, parallel, calls, family="qwen-image")
    finally:
        PassAttention._joint_attention = original


def from_pipe_call(parallel, call):
    """``from_pipe`` on the ``qwen-image-tiny`` preset (the same weights as its saved folder): rank 0's images, and
    the error ``from_pipe`` raises for a pipeline of another family (the FLUX.2 preset's)."""
    from tests.support.pipeline_fns import as_array, generators
    from xfuse import PipeFusionQwenImagePipeline
    from xfuse.families.registry import load_pipeline

    try:
        PipeFusionQwenImagePipeline.from_pipe(load_pipeline("flux2-tiny"), parallel=parallel)
        refused = None
    except TypeError as err:
        refused = str(err)
    pipe = PipeFusionQwenImagePipeline.from_pipe(load_pipeline("qwen-image-tiny"), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call)
    out = pipe(**call, generator=generators(call))
    return refused, None if out is None else as_array(out)


def holds_vae(folder, parallel):
    """Whether this rank holds the VAE after ``from_pretrained`` (``parallel.vae_parallel`` auto or on: every rank,
    for a VAE the band decode runs)."""
    from xfuse import PipeFusionQwenImagePipeline

    pipe = PipeFusionQwenImagePipeline.from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    return pipe.pipeline.vae is not None
