"""Rank functions for the memory tests (importable by spawned ranks)."""


def held_peaks(model, parallel, call, cache=None):
    """What this rank holds while it runs ``call`` on preset ``model`` under ``parallel`` (and step caching
    ``cache``): the peaks of ``xfuse.perf.activations.call_peaks`` (the second of two calls, on real CPU tensors)."""
    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.perf.activations import call_peaks

    pipe = model_spec(model).pipeline_class().from_pipe(load_pipeline(model), parallel=parallel, cache=cache)
    pipe.set_progress_bar_config(disable=True)
    return call_peaks(pipe, call)


def stale_kv_held(model, parallel, call):
    """Bytes of stale K/V this rank's engine holds after ``call`` (every ``StaleKVCache`` of its stage's blocks)."""
    import gc

    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.parallel.stale_kv import StaleKVCache

    pipe = model_spec(model).pipeline_class().from_pipe(load_pipeline(model), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    pipe(**call)
    gc.collect()  # an earlier test's stage left unreachable in a cycle (hooks hold their modules) holds nothing
    return sum(cache.nbytes() for cache in gc.get_objects() if isinstance(cache, StaleKVCache))
