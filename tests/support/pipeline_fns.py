"""Rank functions and callbacks for the pipeline tests (importable by spawned ranks and by diffusers runs)."""

import pickle

import numpy as np
import torch

CALLBACK_LOG = []


def log_callback(pipe, step, t, kwargs):
    """Observes the loop: records the step, timestep and the latents' norm; changes nothing."""
    CALLBACK_LOG.append((step, float(t), float(kwargs["latents"].float().norm())))
    return kwargs


def legacy_callback(step, t, latents):
    """The older ``callback(step, timestep, latents)`` of PixArt's pipelines: records like ``log_callback``."""
    CALLBACK_LOG.append((step, float(t), float(latents.float().norm())))


def changing_callback(pipe, step, t, kwargs):
    return {"latents": kwargs["latents"] * 0.5}


def interrupting_callback(pipe, step, t, kwargs):
    pipe._interrupt = True
    return kwargs


def as_array(out):
    """Images (a video pipeline's frames) of a pipeline output (dataclass or tuple) as one numpy array."""
    images = out.images if hasattr(out, "images") else out.frames if hasattr(out, "frames") else out[0]
    if isinstance(images, list) and images and isinstance(images[0], list):  # PIL frames of each video
        return np.stack([np.stack([np.asarray(im) for im in video]) for video in images])
    if isinstance(images, list):  # PIL images
        return np.stack([np.asarray(im) for im in images])
    return images.float().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)


def run_calls(
    folder,
    parallel,
    calls,
    comm=None,
    torch_dtype=None,
    scheduler=None,
    family="hunyuandit",
    one_generator=None,
    pipeline=None,
    cache=None,
    lora=None,
):
    """Load ``folder`` on every rank, run each call; rank 0 returns [(images, callback_log) or (error type, msg)].

    ``pipeline``: the xfuse class to load it with, where it is not the family's own pipeline (one of the family's
    ``pipeline_names``, e.g. ``PipeFusionWanImageToVideoPipeline``). ``cache``: the pipeline's step caching.
    ``lora``: a LoRA folder loaded (``load_lora_weights``) before the calls.

    Other ranks return their list of None / errors, so a test can check that every rank agrees. ``one_generator``
    (a seed): every call uses the same generator, made once, instead of its own; each result then has the
    generator's state after the call (``generator_state``).
    """
    from xfuse.families.registry import MODEL_SPECS

    spec = MODEL_SPECS[family]
    pipeline_class = spec.pipeline_class() if pipeline is None else spec.pipeline_class_named(pipeline)
    pipe = pipeline_class.from_pretrained(
        folder, parallel=parallel, comm=comm or {"timeout_s": 60}, torch_dtype=torch_dtype, cache=cache
    )
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    if scheduler is not None:
        from tests.support.schedulers import use_scheduler

        use_scheduler(pipe.pipeline, scheduler)
    results = []
    shared = None if one_generator is None else torch.Generator().manual_seed(one_generator)
    for call in calls:
        call = dict(call)
        CALLBACK_LOG.clear()
        try:
            generator = generators(call)  # pops seed/seeds from call
            generator = generator if shared is None else shared
            out = pipe(**call, generator=generator)
        except Exception as err:  # noqa: BLE001 - the test inspects every error
            results.append(dict(kind="error", type=type(err).__name__, message=str(err)))
            continue
        sent = {kind for kind, nbytes in pipe.local_stats()["sent"].items() if nbytes}
        state = None if shared is None else shared.get_state()
        if out is None:
            results.append(dict(kind="none", log=list(CALLBACK_LOG), decode_ranks=pipe.decode_ranks, sent=sent,
                                generator_state=state, cache_steps=pipe.local_stats()["cache_steps"]))  # fmt: skip
        else:
            results.append(dict(kind="ok", images=as_array(out), log=list(CALLBACK_LOG), type=type(out).__name__,
                                decode_ranks=pipe.decode_ranks, sent=sent, generator_state=state,
                                cache_steps=pipe.local_stats()["cache_steps"]))  # fmt: skip
    return results


def load_error(folder, parallel, family):
    """(type, message) of the error loading ``folder`` with ``family``'s xfuse class and ``parallel`` raises on this
    rank; an AssertionError where it loads."""
    from xfuse.families.registry import MODEL_SPECS

    try:
        MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    except Exception as err:  # noqa: BLE001 - the test inspects the error
        return type(err).__name__, str(err)
    raise AssertionError(f"{family} loaded {folder} with {parallel}")


def generators(call):
    """``seed`` (int) gives one generator, ``seeds`` (list) a list of them; both are removed from ``call``."""
    seeds = call.pop("seeds", None)
    seed = call.pop("seed", 0)
    if seed == "rank":  # a deliberately inconsistent seed: each rank its own
        import torch.distributed as dist

        seed = dist.get_rank()
    if seeds is not None:
        return [torch.Generator().manual_seed(s) for s in seeds]
    return torch.Generator().manual_seed(seed)


def with_generator(call):
    """``call`` with its ``seed`` (or ``seeds``) made into its ``generator`` (``generators``)."""
    call = dict(call)
    generator = generators(call)  # (pops the seed)
    return dict(call, generator=generator)


def reference_runner(pipe):
    """``run(call) -> (images, callback log)`` of a diffusers pipeline on a call dict (``seed``/``seeds`` become
    generators); ``run.pipe`` is the pipeline.

    A call is deterministic on the CPU (its seed makes its generators), so each distinct call runs once: the tests
    of a module compare the same calls on several layouts (the conformance suite a family's call on up to 9), and a
    repeat returns copies of the first run's images and log. The key is the call's bytes with the pipeline's
    components and scheduler (``swap_scheduler`` replaces it); a call that does not pickle runs every time."""
    pipe.set_progress_bar_config(disable=True)
    done: dict[bytes, tuple] = {}

    def key_of(call) -> bytes | None:
        state = (call, type(pipe.scheduler).__name__, dict(pipe.scheduler.config))
        try:
            return pickle.dumps(state) + repr([id(c) for c in pipe.components.values()]).encode()
        except (pickle.PicklingError, TypeError, AttributeError):  # a local callback, a lambda
            return None

    def run(call):
        key = key_of(call)
        if key is None or key not in done:
            call = dict(call)
            CALLBACK_LOG.clear()
            generator = generators(call)  # pops seed/seeds from call
            result = as_array(pipe(**call, generator=generator)), list(CALLBACK_LOG)
            if key is None:
                return result
            done[key] = result
        images, log = done[key]
        return images.copy(), list(log)

    run.pipe = pipe
    return run


def check_against_diffusers(per_rank, calls, reference, base, *, output_class, callback_steps):
    """Every call's images on rank 0 equal diffusers' (``reference``) on the same call (max abs <= 1e-4 on images;
    PIL: one 8-bit level; latents: 2e-6 of their largest value), the other ranks return ``None``, the output type is
    diffusers', and a call with a step callback logs the steps ``callback_steps`` with diffusers' latents norms."""
    for index, (name, call) in enumerate(calls.items()):
        result = per_rank[0][index]
        assert result["kind"] == "ok", (name, result)
        assert all(r[index]["kind"] == "none" for r in per_rank[1:]), name
        expected, expected_log = reference({**base, **call})
        images = result["images"]
        assert images.shape == expected.shape, name
        # PIL: one 8-bit level may flip. Floats: 1e-4, or 2e-6 of the largest value for outputs beyond 50 (latents:
        # PixArt's tiny model reaches ~600): whole-image steps run the [uncond, cond] halves as separate batch parts,
        # whose GEMMs round differently from diffusers' batched ones (observed 7e-7 of the largest value).
        tolerance = 1 if images.dtype == np.uint8 else max(1e-4, 2e-6 * float(np.abs(expected).max()))
        assert np.abs(images.astype(np.float64) - expected).max() <= tolerance, name
        assert result["type"] == ("tuple" if call.get("return_dict") is False else output_class), name
        if "callback" in call or "callback_on_step_end" in call:
            log = [entry for r in per_rank for entry in r[index]["log"]]
            assert [s for s, _, _ in log] == [s for s, _, _ in expected_log] == list(callback_steps)
            assert np.allclose([n for *_, n in log], [n for *_, n in expected_log], rtol=1e-5)


def heap_after_build_pipeline(config_path):
    """``xfuse.build.build_pipeline`` on this rank; returns (objects it froze, objects the collector still tracks,
    the page faults of block passes after it: ``tests.support.heap_child.block_pass_faults``) and unfreezes the objects
    again (the world serves other tests). What the fork server froze (``tests.support.rank_preload``) is unfrozen
    first, so the count is ``build_pipeline``'s own, as in a rank that imported everything itself."""
    import gc

    from tests.support.heap_child import block_pass_faults
    from xfuse.build import build_pipeline
    from xfuse.config.io import load_config
    from xfuse.families.registry import resolve

    config = load_config(config_path, [])
    gc.unfreeze()
    build_pipeline(config, resolve(config.model))
    frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
    faults = block_pass_faults()  # with the start-up heap still frozen, as in xfuse's own ranks
    gc.unfreeze()
    return frozen, tracked, faults


def run_with_a_cancel(folder, parallel, call, stop_before, family="hunyuandit", cache=None, repeat_call=None):
    """Every rank: ``call`` run whole, then cancelled before step ``stop_before`` (rank 0's ``cancel_if`` condition
    turns true at its ``stop_before``-th ask: asked once per step, from step 1), then ``repeat_call`` (default:
    ``call``) whole. Returns this rank's ``whole`` and ``again`` images (rank 0; ``None`` elsewhere), the
    ``RequestCancelled`` it got (``stopped_at`` and message), the steps of every task it computed in the cancelled
    call (from the trace) and, on rank 0, how often the condition was asked."""
    import torch.distributed as dist

    from xfuse.errors import RequestCancelled
    from xfuse.families.registry import MODEL_SPECS
    from xfuse.parallel.trace import COMPUTE

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60},
                                                                cache=cache)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_cancellation()

    def whole(kwargs):
        kwargs = dict(kwargs)
        generator = generators(kwargs)  # (pops the seed)
        out = pipe(**kwargs, generator=generator)
        return None if out is None else as_array(out)

    first = whole(call)
    asks = []
    pipe.enable_trace()
    try:
        with pipe.cancel_if(lambda: asks.append(len(asks)) or len(asks) >= stop_before):
            whole(call)
        cancelled = None
    except RequestCancelled as err:
        cancelled = dict(stopped_at=err.stopped_at, num_steps=err.num_steps, message=str(err))
    computed = sorted({e["args"]["step"] for e in pipe.trace_events() if e["tid"] == COMPUTE and "step" in e["args"]})
    pipe.enable_trace(False)
    again = whole(repeat_call or call)
    return dict(rank=dist.get_rank() if dist.is_initialized() else 0, whole=first, again=again, cancelled=cancelled,
                computed_steps=computed, asks=len(asks))  # fmt: skip


def run_streamed_and_alone(folder, parallel, calls, family="hunyuandit", cache=None):
    """Every rank: ``calls`` run one at a time, then as one stream (``run_stream``), then alone again. Returns
    rank 0's images of each (``None`` elsewhere) and, from this rank's trace of the stream, every task it computed
    as (request, start, end) in microseconds (``tasks``), and every span of a request, its communication waits as
    well, in the order this rank ran them (``spans``, same form). ``cache``: the pipeline's step caching; then also
    each call's (computed, skipped) steps alone and in the stream."""
    import torch.distributed as dist

    from xfuse.families.registry import MODEL_SPECS
    from xfuse.parallel.trace import COMM, COMPUTE

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60},
                                                                cache=cache)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)

    def images(outputs):
        return [None if out is None else as_array(out) for out in outputs]

    alone, steps_alone = [], []
    for call in calls:
        alone += images([pipe(**with_generator(call))])
        steps_alone.append(pipe.local_stats()["cache_steps"])
    pipe.enable_trace()
    streamed = images(pipe.run_stream([with_generator(call) for call in calls]))
    steps_streamed = pipe.local_stats()["cache_steps"]  # the stream's, summed over its calls
    decode_ranks = pipe.decode_ranks  # the ranks the stream's last decode ran on
    # one thread runs a rank's spans: by start is the order its program ran them
    spans = sorted(
        (
            (e["args"]["request"], e["ts"], e["ts"] + e["dur"], e["tid"])
            for e in pipe.trace_events()
            if e["tid"] in (COMPUTE, COMM) and "request" in e.get("args", {})
        ),
        key=lambda span: span[1],
    )
    pipe.enable_trace(False)
    again = images([pipe(**with_generator(call)) for call in calls])
    return dict(rank=dist.get_rank(), alone=alone, streamed=streamed, again=again,
                tasks=[span[:3] for span in spans if span[3] == COMPUTE], spans=[span[:3] for span in spans],
                cache_steps_alone=steps_alone, cache_steps_streamed=steps_streamed,
                decode_ranks=decode_ranks)  # fmt: skip


def entered_in_flight(results, call: int) -> bool:
    """Whether, on some rank of a stream (``run_streamed_and_alone``), call ``call``'s first span (a task, or a wait
    for its messages) came before that rank's last span of an earlier call: the call entered the pipeline while an
    earlier one was still in it (one call at a time, every rank finishes a call before it starts the next). Spans of
    one rank run on one thread in its program's order, so this compares no clocks across processes (which a loaded
    machine reorders: a rank may finish the earlier call's last task before its neighbour starts the next call)."""
    for r in results:
        order = [request for request, _, _ in r["spans"]]
        if call in order and any(request < call for request in order[order.index(call) :]):
            return True
    return False


def stream_refusal(folder, parallel, calls, family="hunyuandit"):
    """Every rank: the error ``run_stream(calls)`` raises on this layout, then whether a call alone still runs."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    try:
        pipe.run_stream([with_generator(call) for call in calls])
        error = None
    except ValueError as err:
        error = str(err)
    out = pipe(**with_generator(calls[0]))
    return dict(error=error, after=None if out is None else as_array(out).shape)


def run_stream_with_a_stop(folder, parallel, calls, stop_call, stop_before, family="hunyuandit"):
    """Every rank: ``calls`` alone, then as one stream in which call ``stop_call`` is stopped before its step
    ``stop_before`` (rank 0's condition for it turns true at its ``stop_before``-th ask: asked once per step, from
    step 1; the other calls have none), then alone again. Returns rank 0's images (``None`` elsewhere), the stream's
    entries (an image, or the stop's ``stopped_at`` and message), the steps of every task of the stopped call this
    rank computed (from the trace), and on rank 0 how often the condition was asked."""
    import torch.distributed as dist

    from xfuse.errors import RequestCancelled
    from xfuse.families.registry import MODEL_SPECS
    from xfuse.parallel.trace import COMPUTE

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_cancellation()

    def images(outputs):
        return [None if out is None else as_array(out) for out in outputs]

    alone = images([pipe(**with_generator(call)) for call in calls])
    asks: list[int] = []
    stop_if = [None] * len(calls)
    stop_if[stop_call] = lambda: asks.append(len(asks)) or len(asks) >= stop_before
    pipe.enable_trace()
    outputs = pipe.run_stream([with_generator(call) for call in calls], stop_if=stop_if)
    streamed = [
        dict(stopped_at=out.stopped_at, message=str(out)) if isinstance(out, RequestCancelled)
        else None if out is None else as_array(out)
        for out in outputs
    ]  # fmt: skip
    computed = sorted({e["args"]["step"] for e in pipe.trace_events()
                       if e["tid"] == COMPUTE and e["args"].get("request") == stop_call})  # fmt: skip
    pipe.enable_trace(False)
    again = images([pipe(**with_generator(call)) for call in calls])
    return dict(rank=dist.get_rank(), alone=alone, streamed=streamed, again=again, computed_steps=computed,
                asks=len(asks))  # fmt: skip
