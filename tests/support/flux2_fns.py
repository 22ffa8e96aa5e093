"""Rank functions for the FLUX.2 tests (importable by spawned ranks)."""


def loaded_share(folder, parallel, family):
    """What this rank's transformer holds after ``from_pretrained``: {parameter name: element count} and the
    blocks of its stage."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    params = {name: p.numel() for name, p in pipe.stage.transformer.named_parameters()}
    return params, sorted(pipe.stage.block_ids)


def from_pipe_call(parallel, call):
    """``from_pipe`` on the ``flux2-tiny`` preset (the same weights as its saved folder): rank 0's images, and the
    error ``from_pipe`` raises for a pipeline of another family (the FLUX.1 preset's)."""
    from tests.support.pipeline_fns import as_array, generators
    from xfuse import PipeFusionFlux2Pipeline
    from xfuse.families.registry import load_pipeline

    try:
        PipeFusionFlux2Pipeline.from_pipe(load_pipeline("flux-tiny"), parallel=parallel)
        refused = None
    except TypeError as err:
        refused = str(err)
    pipe = PipeFusionFlux2Pipeline.from_pipe(load_pipeline("flux2-tiny"), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call)
    out = pipe(**call, generator=generators(call))
    return refused, None if out is None else as_array(out)


def text_encoder_share(folder, parallel, family):
    """What this rank's device holds of the text encoder after ``from_pretrained``: (its parameters' elements, the
    layers it runs; ``None``: it runs the whole encoder or none of it) and the resolved placement."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    group = pipe.text_group
    if group is not None:
        split = group.encoders["text_encoder"]
        return sum(p.numel() for p in split.encoder.parameters()), list(split.owned), pipe.text_placement
    encoder = pipe.pipeline.text_encoder
    return (0 if encoder is None else sum(p.numel() for p in encoder.parameters())), None, pipe.text_placement
