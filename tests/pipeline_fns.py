"""Rank functions for the pipeline tests (importable by spawned ranks)."""

import numpy as np
import torch


def generate(folder, parallel, call, comm=None, torch_dtype=None):
    """Load the folder with PipeFusionHunyuanDiTPipeline on every rank and call it; rank 0 returns the images."""
    from xfuse import PipeFusionHunyuanDiTPipeline

    pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(folder, parallel=parallel, comm=comm or {"timeout_s": 60},
                                                        torch_dtype=torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call)
    seed = call.pop("seed", 0)
    out = pipe(**call, generator=torch.Generator().manual_seed(seed))
    if out is None:
        return None
    images = out.images if hasattr(out, "images") else out[0]
    return np.asarray(images) if not isinstance(images, list) else images


def generate_errors(folder, parallel, calls):
    """Each call's exception (type name, message) or None, on every rank."""
    from xfuse import PipeFusionHunyuanDiTPipeline

    pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(folder, parallel=parallel, comm={"timeout_s": 20})
    pipe.set_progress_bar_config(disable=True)
    results = []
    for call in calls:
        try:
            pipe(**call)
            results.append(None)
        except Exception as err:  # noqa: BLE001 - the test inspects every error
            results.append((type(err).__name__, str(err)))
    return results
