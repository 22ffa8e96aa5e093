"""Rank functions for the regional-compile tests (importable by spawned ranks)."""


def compile_counts_over_requests(preset, parallel, sizes, third):
    """``compile.mode: regional`` (``aot_eager``, ``max_shapes`` = len(sizes)) on ``preset``: torch's own counters
    (``StageCompiler``'s ``compile_counts``: graphs dynamo made) after each phase of a served life: the warm-up of
    ``sizes[0]``, one 20-step request of it, ten requests alternating over ``sizes``, then one of ``third`` size;
    with the compiler's record of what it compiled and ran eagerly."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    from xfuse.build import image_call_kwargs, warm_up_compile
    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.pipelines.stage_compiler import compile_counts

    spec = model_spec(preset)
    section = {"mode": "regional", "backend": "aot_eager", "max_shapes": len(sizes)}
    pipe = spec.pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel, compile=section)
    pipe.set_progress_bar_config(disable=True)

    def call(size, steps):
        width, height = size
        return image_call_kwargs(prompt="a red house", negative_prompt=None, width=width, height=height,
                                 num_inference_steps=steps, guidance_scale=4.0, seed=3, spec=spec)  # fmt: skip

    graphs = {"start": compile_counts()["graphs"]}
    warm_up_compile(pipe, call(sizes[0], 1), [sizes[0]])
    graphs["warm-up"] = compile_counts()["graphs"]
    seen: set[float] = set()  # every channel's wait bound at each step of a request of a compiled shape

    def note_bounds(pipeline, step, timestep, kwargs):
        seen.update(c.timeout_s for c in pipe.context.all_channels)
        return {}

    pipe(**call(sizes[0], 20), output_type="latent", callback_on_step_end=note_bounds)
    graphs["20 steps"] = compile_counts()["graphs"]
    for index in range(10):
        pipe(**call(sizes[index % len(sizes)], 4), output_type="latent")
        if index == len(sizes) - 1:
            graphs["each size once"] = compile_counts()["graphs"]
    graphs["10 requests"] = compile_counts()["graphs"]
    out = pipe(**call(third, 4), output_type="latent")
    graphs["third size"] = compile_counts()["graphs"]
    compiled = {engine: len(shapes) for engine, shapes in pipe.compiler.shapes.items()}
    timeouts = (seen, pipe.config.comm.timeout_s)  # (seen on the rank that steps the scheduler; none elsewhere)
    frames = dict(dynamo_utils.counters["frames"])  # dynamo's own: frames it was asked to compile ("total", "ok")
    third_latents = None if out is None else torch.as_tensor(out.images).shape
    return graphs, compiled, pipe.compiler.eager_requests, frames, third_latents, timeouts


def graph_passes_over_requests(preset, parallel, size, other_size):
    """``compile.mode: graphs`` (``max_shapes`` 1) on ``preset`` beside an eager build of the same weights: the
    warm-up of ``size`` and two requests of it with other prompts (warm-up steps + 2 each), then one of
    ``other_size`` (past ``max_shapes``: eager); per request the graphs dynamo made, the passes ``CapturedStage`` ran
    eagerly and as graphs, and whether the final latents (rank 0's) equal the eager pipeline's bit for bit; with what
    the compiler wrote on stderr."""
    import contextlib
    import io

    import torch

    from xfuse.build import image_call_kwargs, warm_up_compile
    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.pipelines.stage_compiler import compile_counts

    spec = model_spec(preset)
    section = {"mode": "graphs", "backend": "aot_eager", "max_shapes": 1}
    eager = spec.pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel)
    graphs = spec.pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel, compile=section)
    for pipe in (eager, graphs):
        pipe.set_progress_bar_config(disable=True)
    captured = graphs.engine.stage

    def call(prompt, size_, steps=parallel["warmup_steps"] + 2):  # every pass kind twice
        width, height = size_
        return image_call_kwargs(prompt=prompt, negative_prompt=None, width=width, height=height,
                                 num_inference_steps=steps, guidance_scale=4.0, seed=3, spec=spec)  # fmt: skip

    stderr = io.StringIO()
    rows = []
    with contextlib.redirect_stderr(stderr):
        warm_up_compile(graphs, call("a red house", size), [size])
        for prompt, size_ in (("a red house", size), ("a blue boat on a lake", size), ("a red house", other_size)):
            made, passes = compile_counts()["graphs"], (captured.eager_passes, captured.graph_passes)
            out = graphs(**call(prompt, size_), output_type="latent")
            ran = (captured.eager_passes - passes[0], captured.graph_passes - passes[1])
            reference = eager(**call(prompt, size_), output_type="latent")
            equal = None if out is None else torch.equal(torch.as_tensor(out.images), torch.as_tensor(reference.images))
            rows.append({"graphs": compile_counts()["graphs"] - made, "passes": ran, "equal": equal})
    return rows, graphs.compiler.eager_requests, stderr.getvalue()


def a_pass_that_is_not_one_graph(preset, parallel, steps):
    """``compile.mode: graphs`` on ``preset`` with a branch on a tensor's value put before the family's stage pass
    (traced by the ``eager`` backend: dynamo's capture alone): what the call raises, or ``None``. Run on a world of
    its own: the failure ends this rank's world, as it would a served one."""
    import torch

    from benchmarks.bench_host import family_call, run
    from xfuse.families.registry import model_spec

    spec = model_spec(preset)
    pipe = spec.pipeline_class().from_pipe(spec.build_preset_pipeline(preset), parallel=parallel,
                                           compile={"mode": "graphs", "backend": "eager"})  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    captured = pipe.engine.stage
    family_pass = captured.inner.run_segment

    def branching(hidden, *args, **kwargs):
        if hidden.sum() > 0:
            hidden.add_(0)
        return family_pass(hidden, *args, **kwargs)

    captured.graph_pass = torch.compile(branching, fullgraph=True, backend="eager")
    try:
        run(pipe, family_call(spec), steps)
    except RuntimeError as exc:
        return str(exc)
    return None


def cached_graph_passes(preset, parallel, cache, prompts, steps):
    """``compile.mode: graphs`` (``aot_eager``) with step caching ``cache`` beside an eager build with the same
    caching: per prompt the graphs dynamo made, each build's per-step decisions (True: computed) and whether the
    final latents (rank 0's) are the eager build's bit for bit."""
    import torch

    from benchmarks.bench_host import family_call
    from xfuse.families.registry import model_spec
    from xfuse.pipelines.stage_compiler import compile_counts

    spec = model_spec(preset)
    builds = [
        spec.pipeline_class().from_pipe(spec.build_preset_pipeline(preset), parallel=parallel, cache=cache, **sections)
        for sections in ({}, {"compile": {"mode": "graphs", "backend": "aot_eager"}})
    ]
    for pipe in builds:
        pipe.set_progress_bar_config(disable=True)
    rows = []
    for prompt in prompts:
        call = dict(family_call(spec), prompt=prompt, num_inference_steps=steps, output_type="latent")
        made = compile_counts()["graphs"]
        eager, graphs = (pipe(**call, generator=torch.Generator().manual_seed(0)) for pipe in builds)
        rows.append({"graphs": compile_counts()["graphs"] - made,
                     "decisions": [list(pipe.engine.cache_decisions) for pipe in builds],
                     "equal": None if eager is None else torch.equal(eager.images, graphs.images)})  # fmt: skip
    return rows
